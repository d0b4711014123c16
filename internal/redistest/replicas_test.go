//go:build unix

package redistest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestStartClusterWithReplicas(t *testing.T) {
	harness(t)
	t.Parallel()
	c := StartClusterWithReplicas(t)
	checkReplicatedCluster(t, c)
}

func TestStartClusterWithReplicasWithoutCLI(t *testing.T) {
	harness(t)
	t.Parallel()
	c := startReplicatedCluster(t, serverPath(t), "")
	checkReplicatedCluster(t, c)
}

// checkReplicatedCluster writes through a cluster client, kills the master
// of the written slot, and reads the value back from the promoted replica.
func checkReplicatedCluster(t *testing.T, c *ReplicatedCluster) {
	t.Helper()
	ctx := ctxT(t)
	if len(c.Nodes) != 6 || len(c.Addrs) != 6 {
		t.Fatalf("%d nodes, %d addrs, want 6", len(c.Nodes), len(c.Addrs))
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, ClusterStateReloadInterval: 100 * time.Millisecond})
	defer cc.Close()
	if err := cc.Set(ctx, "{q}k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	slot, err := c.KeySlot(ctx, "{q}k")
	if err != nil {
		t.Fatal(err)
	}
	master, err := c.Master(ctx, slot)
	if err != nil {
		t.Fatal(err)
	}
	replica, err := c.ReplicaOf(ctx, master)
	if err != nil {
		t.Fatal(err)
	}
	if replica == master {
		t.Fatalf("%s replicates itself", master.Addr)
	}
	// The write must reach the replica before the master dies.
	if n, err := master.Client(t).Do(ctx, "WAIT", 1, 2000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d, %v", n, err)
	}
	master.Kill()
	began := time.Now()
	promoted, err := c.WaitFailover(ctx, slot, master)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("failover of slot %d from %s to %s in %v", slot, master.Addr, promoted.Addr, time.Since(began).Round(time.Millisecond))
	if promoted != replica {
		t.Errorf("slot %d moved to %s, want its replica %s", slot, promoted.Addr, replica.Addr)
	}
	waitOK(t, func() error {
		return cc.Get(ctx, "{q}k").Err()
	})
	if got, err := cc.Get(ctx, "{q}k").Result(); err != nil || got != "v" {
		t.Errorf("GET after failover = %q, %v", got, err)
	}
}

func TestMigration_MovesKeysAndOwnership(t *testing.T) {
	harness(t)
	t.Parallel()
	c := StartCluster(t)
	ctx := ctxT(t)
	cc := c.Client(t)
	keys := []string{"{m}a", "{m}b", "{m}c"}
	for _, k := range keys {
		if err := cc.Set(ctx, k, "v-"+k, time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
	}
	slot, from, to := slotAndTarget(ctx, t, c, keys[0])
	m, err := StartMigration(ctx, c.Nodes, slot, to)
	if err != nil {
		t.Fatal(err)
	}
	if m.From != from || m.To != to {
		t.Fatalf("migration from %s to %s, want %s to %s", m.From.Addr, m.To.Addr, from.Addr, to.Addr)
	}
	// Mid-migration, the source answers for the keys it still holds.
	if got, err := cc.Get(ctx, keys[0]).Result(); err != nil || got != "v-"+keys[0] {
		t.Fatalf("GET while migrating = %q, %v", got, err)
	}
	// Keys that a script uses together, split between the nodes: the
	// source can run the script neither alone nor by ASK.
	if n, err := m.MoveKeys(ctx, keys[0]); err != nil || n != 1 {
		t.Fatalf("MoveKeys(%s) moved %d keys, %v; want 1", keys[0], n, err)
	}
	err = from.Client(t).Eval(ctx, "return 1", []string{keys[0], keys[1]}).Err()
	if err == nil || !strings.HasPrefix(err.Error(), "TRYAGAIN") {
		t.Fatalf("EVAL over split keys: %v, want TRYAGAIN", err)
	}
	n, err := m.MoveKeys(ctx)
	if err != nil || n != len(keys)-1 {
		t.Fatalf("MoveKeys moved %d keys, %v; want %d", n, err, len(keys)-1)
	}
	// Now the source sends ASK, which the client follows.
	if got, err := cc.Get(ctx, keys[1]).Result(); err != nil || got != "v-"+keys[1] {
		t.Fatalf("GET after the keys moved = %q, %v", got, err)
	}
	if err := m.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	if owner, err := SlotOwner(ctx, c.Nodes, slot); err != nil || owner != to {
		t.Fatalf("slot %d owned by %v, %v; want %s", slot, owner, err, to.Addr)
	}
	for _, k := range keys {
		if got, err := cc.Get(ctx, k).Result(); err != nil || got != "v-"+k {
			t.Errorf("GET %s after the migration = %q, %v", k, got, err)
		}
		if ttl, err := to.Client(t).TTL(ctx, k).Result(); err != nil || ttl <= 0 {
			t.Errorf("TTL of %s on the target: %v, %v; MIGRATE must keep it", k, ttl, err)
		}
	}
}

// slotAndTarget returns the slot of key in c, its owner, and another node.
func slotAndTarget(ctx context.Context, t *testing.T, c *Cluster, key string) (int, *Server, *Server) {
	t.Helper()
	slot, err := KeySlot(ctx, c.Nodes, key)
	if err != nil {
		t.Fatal(err)
	}
	from, err := SlotOwner(ctx, c.Nodes, slot)
	if err != nil {
		t.Fatal(err)
	}
	to := c.Nodes[0]
	if to == from {
		to = c.Nodes[1]
	}
	return slot, from, to
}

// waitOK polls fn until it succeeds, for up to 10 seconds.
func waitOK(t *testing.T, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing after 10s: %v", err)
		}
		time.Sleep(pollEvery)
	}
}

// A detached replica keeps what it had at the cut and nothing after, and
// takes over with just that.
func TestDetachReplicas_PromotesAReplicaThatLags(t *testing.T) {
	harness(t)
	t.Parallel()
	c := StartClusterWithReplicas(t)
	ctx := ctxT(t)
	slot, err := c.KeySlot(ctx, "{lag}")
	if err != nil {
		t.Fatal(err)
	}
	master, err := c.Master(ctx, slot)
	if err != nil {
		t.Fatal(err)
	}
	mc := master.Client(t)
	if err := mc.Set(ctx, "{lag}before", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitReplicated(ctx, master); err != nil {
		t.Fatal(err)
	}
	if err := c.DetachReplicas(ctx, master); err != nil {
		t.Fatal(err)
	}
	if err := mc.Set(ctx, "{lag}after", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	master.Kill()
	promoted, err := c.WaitFailover(ctx, slot, master)
	if err != nil {
		t.Fatal(err)
	}
	pc := promoted.Client(t)
	if n, err := pc.Exists(ctx, "{lag}before").Result(); err != nil || n != 1 {
		t.Errorf("key written before the cut: EXISTS = %d, %v; want 1", n, err)
	}
	if n, err := pc.Exists(ctx, "{lag}after").Result(); err != nil || n != 0 {
		t.Errorf("key written after the cut: EXISTS = %d, %v; want 0", n, err)
	}
}
