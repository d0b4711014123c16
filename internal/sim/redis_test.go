package sim

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
)

// client returns a go-redis client of process i, closed at the end.
func client(t *testing.T, r *Redis, i int) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: "sim:6379", Dialer: r.Dialer(i), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// A round trip takes the process's latency each way, and the faults do
// what they say.
func TestRedis_LatencyAndFaults(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := NewRedis(func(i int) time.Duration { return time.Duration(i+1) * 10 * time.Millisecond })
		defer r.Close()
		ctx := context.Background()
		c0, c1 := client(t, r, 0), client(t, r, 1)
		if err := c0.Set(ctx, "k", "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
		if err := c1.Ping(ctx).Err(); err != nil { // connected: the handshake is behind
			t.Fatal(err)
		}
		checkRoundTrips(t, c0, c1)
		checkStepAndFreeze(t, r, c0)
		checkCut(t, r, c0, c1)
		checkFailoverAndKill(t, r, c0)
	})
}

// checkRoundTrips checks that a round trip of each process, c0 and c1,
// takes its latency each way: 10ms for process 0, 20ms for process 1.
func checkRoundTrips(t *testing.T, c0, c1 *redis.Client) {
	t.Helper()
	ctx := context.Background()
	for i, c := range []*redis.Client{c0, c1} {
		start := time.Now()
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if got, want := time.Since(start), time.Duration(i+1)*20*time.Millisecond; got != want {
			t.Errorf("process %d: a round trip took %v, want %v", i, got, want)
		}
	}
}

// checkStepAndFreeze steps the server's clock, and freezes it.
func checkStepAndFreeze(t *testing.T, r *Redis, c0 *redis.Client) {
	t.Helper()
	ctx := context.Background()
	// Step: the server's clock moves, the bubble's does not.
	before, _ := c0.Time(ctx).Result()
	r.Step(time.Hour)
	after, _ := c0.Time(ctx).Result()
	if d := after.Sub(before); d < time.Hour || d > time.Hour+time.Second {
		t.Errorf("TIME moved %v over a step of an hour", d)
	}
	r.Step(-time.Hour)

	// Freeze: a request waits for the thaw.
	r.Freeze()
	time.AfterFunc(time.Second, r.Thaw)
	start := time.Now()
	if err := c0.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("a request to a frozen server answered after %v, want after the thaw at 1s", d)
	}

}

// checkCut cuts process 1 off, then mends it.
func checkCut(t *testing.T, r *Redis, c0, c1 *redis.Client) {
	t.Helper()
	ctx := context.Background()
	// Cut: process 1 waits, process 0 does not.
	r.Cut(1)
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	if err := c1.Ping(short).Err(); err == nil {
		t.Error("a cut process reached the server")
	}
	cancel()
	if err := c0.Ping(ctx).Err(); err != nil {
		t.Errorf("process 0 while process 1 is cut: %v", err)
	}
	r.Mend(1)
	if err := c1.Ping(ctx).Err(); err != nil {
		t.Errorf("process 1 mended: %v", err)
	}

}

// checkFailoverAndKill fails over to a snapshot, then kills and restarts
// the server.
func checkFailoverAndKill(t *testing.T, r *Redis, c0 *redis.Client) {
	t.Helper()
	ctx := context.Background()
	// Failover to a snapshot taken before a write.
	r.Snapshot()
	if err := c0.Set(ctx, "later", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := r.Failover(); err != nil {
		t.Fatal(err)
	}
	_ = c0.Ping(ctx).Err() // the pooled connection was closed: the first call fails
	if v, err := c0.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Errorf("after the failover, k = %q, %v; want the snapshot's v", v, err)
	}
	if n, _ := c0.Exists(ctx, "later").Result(); n != 0 {
		t.Error("after the failover, a write after the snapshot is still there")
	}

	// Kill: refused until the restart, which is empty.
	r.Kill()
	_ = c0.Ping(ctx).Err()
	if err := c0.Ping(ctx).Err(); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("a killed server answered %v, want connection refused", err)
	}
	r.Restart()
	if n, err := c0.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("after the restart: %d, %v; want an empty server", n, err)
	}
}
