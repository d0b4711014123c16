//go:build unix

package redistest

import (
	"context"
	"slices"
	"testing"
	"time"
)

func TestStartSentinel(t *testing.T) {
	harness(t)
	t.Parallel()
	checkSentinel(t, StartSentinel(t))
}

// Without redis-sentinel on PATH, redis-server --sentinel does the job.
func TestStartSentinelWithRedisServer(t *testing.T) {
	harness(t)
	t.Parallel()
	bin := serverPath(t)
	checkSentinel(t, startSentinel(t, bin, bin))
}

// checkSentinel writes through a failover client, kills the master, and
// reads the value back from the promoted replica through the same client.
func checkSentinel(t *testing.T, s *Sentinel) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if len(s.Nodes) != 2 || len(s.SentinelAddrs) != sentinelCount || s.MasterName == "" {
		t.Fatalf("%d nodes, %d sentinels, master name %q; want 2, %d, a name", len(s.Nodes), len(s.SentinelAddrs), s.MasterName, sentinelCount)
	}
	for _, addr := range append(slices.Clone(s.SentinelAddrs), s.Nodes[0].Addr, s.Nodes[1].Addr) {
		if p := portOf(t, addr); p == reservedPort || addr[:10] != "127.0.0.1:" {
			t.Fatalf("address %q: want 127.0.0.1 and a port other than %d", addr, reservedPort)
		}
	}
	master, err := s.Master(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if master != s.Nodes[0] {
		t.Fatalf("the sentinels name %s the master, want %s", master.Addr, s.Nodes[0].Addr)
	}
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	// The write must reach the replica before the master dies.
	if n, err := c.Do(ctx, "WAIT", 1, 2000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d, %v", n, err)
	}
	killed, err := s.KillMaster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if killed != master || killed.Pid() != 0 {
		t.Fatalf("KillMaster killed %s (pid %d), want %s dead", killed.Addr, killed.Pid(), master.Addr)
	}
	promoted, err := s.WaitFailover(ctx, killed)
	if err != nil {
		t.Fatalf("%v%s", err, s.logTails())
	}
	t.Logf("failover from %s to %s in %v", killed.Addr, promoted.Addr, time.Since(began).Round(time.Millisecond))
	if promoted != s.Nodes[1] {
		t.Errorf("promoted %s, want the replica %s", promoted.Addr, s.Nodes[1].Addr)
	}
	waitOK(t, func() error { return c.Get(ctx, "k").Err() })
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("GET after failover = %q, %v", got, err)
	}
	if err := c.Set(ctx, "k", "w", 0).Err(); err != nil {
		t.Errorf("SET after failover: %v", err)
	}
}
