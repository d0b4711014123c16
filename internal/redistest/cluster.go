package redistest

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	clusterMasters = 3
	clusterSlots   = 16384
)

// clusterArgs are the config flags every cluster node gets on top of the
// usual ones. Announcing 127.0.0.1 keeps every node's view of every address,
// its own included, identical and dialable. A short node timeout keeps
// failure detection quick for fault tests.
var clusterArgs = []string{
	"--cluster-enabled", "yes",
	"--cluster-config-file", "nodes.conf",
	"--cluster-node-timeout", "3000",
	"--cluster-announce-ip", "127.0.0.1",
}

// Cluster is a 3-master Redis Cluster started from the same redis-server
// binary as Real, without replicas.
type Cluster struct {
	// Addrs are the masters' host:port addresses, in start order.
	Addrs []string
	// Nodes are the masters, in the same order as Addrs. Each can be
	// stopped, killed, frozen or restarted on its own; a restarted node
	// keeps its nodes.conf and rejoins. Their Client talks to that node
	// alone and does not follow redirects.
	Nodes []*Server
}

// StartCluster starts 3 cluster-enabled redis-server processes, joins them
// into a cluster covering all 16384 slots, waits until every node reports
// cluster_state:ok with the same slot map, and stops every node at
// tb.Cleanup. It uses redis-cli --cluster create when redis-cli is on PATH
// and plain cluster commands otherwise. It skips the test when redis-server
// is not on PATH, or fails it when CI=true.
func StartCluster(tb testing.TB) *Cluster {
	tb.Helper()
	bin := serverPath(tb)
	cli, _ := exec.LookPath(cliBin)
	return startCluster(tb, bin, cli)
}

// Client returns a new cluster-aware go-redis client, closed at tb.Cleanup.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// startCluster does the work of StartCluster; an empty cli forces creation
// through cluster commands, so that path can be tested too.
func startCluster(tb testing.TB, bin, cli string) *Cluster {
	tb.Helper()
	c := &Cluster{}
	for range clusterMasters {
		n := startReal(tb, bin, clusterArgs, true)
		c.Nodes = append(c.Nodes, n)
		c.Addrs = append(c.Addrs, n.Addr)
	}

	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	// Plain per-node clients without retries: the readiness loop below
	// retries on its own schedule.
	clients := make([]*redis.Client, len(c.Addrs))
	for i, addr := range c.Addrs {
		clients[i] = redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		defer clients[i].Close()
	}

	var err error
	if cli != "" {
		err = createWithCLI(ctx, cli, c.Addrs)
	} else {
		err = createWithCommands(ctx, clients, c.Nodes)
	}
	if err == nil {
		err = waitClusterReady(ctx, clients, c.Addrs)
	}
	if err != nil {
		var logs strings.Builder
		for _, n := range c.Nodes {
			fmt.Fprintf(&logs, "\n--- node %s %s", n.Addr, n.logTail())
		}
		tb.Fatalf("redistest: start cluster: %v%s", err, logs.String())
	}
	return c
}

// createWithCLI lets redis-cli assign slots, set epochs and introduce the
// nodes, exactly as an operator would.
func createWithCLI(ctx context.Context, cli string, addrs []string) error {
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.WaitDelay = time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %v\n%s", cli, strings.Join(args, " "), err, out)
	}
	return nil
}

// createWithCommands does what redis-cli --cluster create does, for machines
// that have redis-server but not redis-cli.
func createWithCommands(ctx context.Context, clients []*redis.Client, nodes []*Server) error {
	n := len(clients)
	for i, c := range clients {
		first, last := i*clusterSlots/n, (i+1)*clusterSlots/n-1
		if err := c.ClusterAddSlotsRange(ctx, first, last).Err(); err != nil {
			return fmt.Errorf("%s: CLUSTER ADDSLOTS %d-%d: %w", nodes[i].Addr, first, last, err)
		}
		// Distinct epochs up front spare the nodes the slower collision
		// resolution they would otherwise go through.
		if err := c.Do(ctx, "CLUSTER", "SET-CONFIG-EPOCH", i+1).Err(); err != nil {
			return fmt.Errorf("%s: CLUSTER SET-CONFIG-EPOCH: %w", nodes[i].Addr, err)
		}
	}
	for _, node := range nodes[1:] {
		if err := clients[0].ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(node.port)).Err(); err != nil {
			return fmt.Errorf("%s: CLUSTER MEET %s: %w", nodes[0].Addr, node.Addr, err)
		}
	}
	return nil
}

// waitClusterReady polls until every node reports cluster_state:ok, knows
// all the others, and serves the same complete slot map naming exactly the
// expected addresses. Without that agreement a cluster client's first
// commands could be bounced around or refused.
func waitClusterReady(ctx context.Context, clients []*redis.Client, addrs []string) error {
	for {
		err := clusterReady(ctx, clients, addrs)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ready within %v: %w", startTimeout, err)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

func clusterReady(ctx context.Context, clients []*redis.Client, addrs []string) error {
	var want string
	for i, c := range clients {
		info, err := c.ClusterInfo(ctx).Result()
		if err != nil {
			return fmt.Errorf("%s: CLUSTER INFO: %w", addrs[i], err)
		}
		fields := parseInfo(info)
		if fields["cluster_state"] != "ok" ||
			fields["cluster_slots_assigned"] != strconv.Itoa(clusterSlots) ||
			fields["cluster_known_nodes"] != strconv.Itoa(len(addrs)) {
			return fmt.Errorf("%s: cluster_state:%s cluster_slots_assigned:%s cluster_known_nodes:%s",
				addrs[i], fields["cluster_state"], fields["cluster_slots_assigned"], fields["cluster_known_nodes"])
		}
		//lint:ignore SA1019 CLUSTER SLOTS answers on Redis before 7.0 too, which CLUSTER SHARDS does not.
		slots, err := c.ClusterSlots(ctx).Result()
		if err != nil {
			return fmt.Errorf("%s: CLUSTER SLOTS: %w", addrs[i], err)
		}
		got, err := slotMap(slots, addrs)
		if err != nil {
			return fmt.Errorf("%s: %w", addrs[i], err)
		}
		if i == 0 {
			want = got
		} else if got != want {
			return fmt.Errorf("%s disagrees on the slot map: %s vs %s on %s", addrs[i], got, want, addrs[0])
		}
	}
	return nil
}

// slotMap renders CLUSTER SLOTS canonically, after checking that it covers
// every slot exactly once and names only the cluster's own masters.
func slotMap(slots []redis.ClusterSlot, addrs []string) (string, error) {
	slots = slices.Clone(slots)
	slices.SortFunc(slots, func(a, b redis.ClusterSlot) int { return a.Start - b.Start })
	var b strings.Builder
	next := 0
	for _, s := range slots {
		if s.Start != next || s.End < s.Start || len(s.Nodes) == 0 {
			return "", fmt.Errorf("slot map has a gap or overlap at %d-%d", s.Start, s.End)
		}
		m := s.Nodes[0]
		if !slices.Contains(addrs, m.Addr) {
			return "", fmt.Errorf("slots %d-%d served by unexpected address %q", s.Start, s.End, m.Addr)
		}
		fmt.Fprintf(&b, "%d-%d=%s@%s ", s.Start, s.End, m.ID, m.Addr)
		next = s.End + 1
	}
	if next != clusterSlots {
		return "", errors.New("slot map does not cover all slots, next unassigned: " + strconv.Itoa(next))
	}
	return strings.TrimSpace(b.String()), nil
}

// parseInfo splits a CLUSTER INFO or INFO reply into its key:value fields.
func parseInfo(s string) map[string]string {
	m := map[string]string{}
	for l := range strings.Lines(s) {
		if k, v, ok := strings.Cut(strings.TrimSpace(l), ":"); ok {
			m[k] = v
		}
	}
	return m
}
