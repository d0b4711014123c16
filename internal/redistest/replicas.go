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

// ReplicaNodeTimeout is the cluster-node-timeout of a cluster with replicas:
// a master is declared failed about this long after it stops answering,
// and its replica takes over within about two more.
const ReplicaNodeTimeout = time.Second

// replicaClusterArgs are the config flags of a node of a cluster with
// replicas. The short node timeout keeps failovers quick; a diskless sync
// with no delay lets a replica catch up at once instead of after Redis's
// default 5 s wait for more replicas; and since CLUSTER SLOTS lists a
// replica only once its replication offset has moved, which on an idle
// master only the master's pings do, those come every second instead of
// every 10.
var replicaClusterArgs = []string{
	"--cluster-enabled", "yes",
	"--cluster-config-file", "nodes.conf",
	"--cluster-node-timeout", strconv.Itoa(int(ReplicaNodeTimeout / time.Millisecond)),
	"--cluster-announce-ip", "127.0.0.1",
	"--repl-diskless-sync", "yes",
	"--repl-diskless-sync-delay", "0",
	"--repl-ping-replica-period", "1",
}

// ReplicatedCluster is a Redis Cluster of 3 masters, each with one replica,
// started from the same redis-server binary as Real, for failover tests.
type ReplicatedCluster struct {
	// Addrs are every node's host:port address, in start order.
	Addrs []string
	// Nodes are every node, in the same order as Addrs. Which of them are
	// masters is up to the cluster: ask Master and ReplicaOf. Their Client
	// talks to that node alone and does not follow redirects.
	Nodes []*Server
}

// StartClusterWithReplicas starts 6 cluster-enabled redis-server processes
// and joins them into 3 masters covering all 16384 slots, each with one
// replica, with redis-cli --cluster create --cluster-replicas 1 when
// redis-cli is on PATH and plain cluster commands otherwise. It waits until
// every node reports cluster_state:ok with the same slot map, naming a
// replica for every slot range, and every replica is in sync with its
// master; and it stops every node at tb.Cleanup. It skips the test when
// redis-server is not on PATH, or fails it when CI=true.
func StartClusterWithReplicas(tb testing.TB) *ReplicatedCluster {
	tb.Helper()
	bin := serverPath(tb)
	cli, _ := exec.LookPath(cliBin)
	return startReplicatedCluster(tb, bin, cli)
}

func startReplicatedCluster(tb testing.TB, bin, cli string) *ReplicatedCluster {
	tb.Helper()
	c := &ReplicatedCluster{}
	for range 2 * clusterMasters {
		n := startReal(tb, bin, replicaClusterArgs, true)
		c.Nodes = append(c.Nodes, n)
		c.Addrs = append(c.Addrs, n.Addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*startTimeout)
	defer cancel()
	var err error
	if cli != "" {
		err = createReplicatedWithCLI(ctx, cli, c.Addrs)
	} else {
		err = createReplicatedWithCommands(ctx, c.Nodes)
	}
	if err == nil {
		err = c.waitReady(ctx)
	}
	if err != nil {
		var logs strings.Builder
		for _, n := range c.Nodes {
			fmt.Fprintf(&logs, "\n--- node %s %s", n.Addr, n.logTail())
		}
		tb.Fatalf("redistest: start cluster with replicas: %v%s", err, logs.String())
	}
	return c
}

func createReplicatedWithCLI(ctx context.Context, cli string, addrs []string) error {
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.WaitDelay = time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %v\n%s", cli, strings.Join(args, " "), err, out)
	}
	return nil
}

// createReplicatedWithCommands makes the first 3 nodes masters, as
// createWithCommands does, and each of the others the replica of one.
func createReplicatedWithCommands(ctx context.Context, nodes []*Server) error {
	masters, replicas := nodes[:clusterMasters], nodes[clusterMasters:]
	clients := make([]*redis.Client, len(nodes))
	for i, n := range nodes {
		clients[i] = redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1})
		defer clients[i].Close()
	}
	if err := createWithCommands(ctx, clients[:clusterMasters], masters); err != nil {
		return err
	}
	for _, r := range replicas {
		if err := clients[0].ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(r.port)).Err(); err != nil {
			return fmt.Errorf("%s: CLUSTER MEET %s: %w", masters[0].Addr, r.Addr, err)
		}
	}
	for i, r := range replicas {
		id, err := clients[i].ClusterMyID(ctx).Result()
		if err != nil {
			return fmt.Errorf("%s: CLUSTER MYID: %w", masters[i].Addr, err)
		}
		// A replica can follow its master only once it has heard of it.
		rc := clients[clusterMasters+i]
		for {
			err = rc.ClusterReplicate(ctx, id).Err()
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s: CLUSTER REPLICATE %s: %w", r.Addr, id, err)
			case <-time.After(pollEvery):
			}
		}
	}
	return nil
}

// waitReady polls until the cluster is whole and every replica in sync.
func (c *ReplicatedCluster) waitReady(ctx context.Context) error {
	for {
		err := c.ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ready: %w (last: %v)", ctx.Err(), err)
		case <-time.After(pollEvery):
		}
	}
}

func (c *ReplicatedCluster) ready(ctx context.Context) error {
	var want string
	for i, n := range c.Nodes {
		err := withNode(ctx, n, func(rc *redis.Client) error {
			info, err := rc.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			f := parseInfo(info)
			if f["cluster_state"] != "ok" || f["cluster_slots_assigned"] != strconv.Itoa(clusterSlots) ||
				f["cluster_known_nodes"] != strconv.Itoa(len(c.Nodes)) {
				return fmt.Errorf("cluster_state:%s cluster_slots_assigned:%s cluster_known_nodes:%s",
					f["cluster_state"], f["cluster_slots_assigned"], f["cluster_known_nodes"])
			}
			//lint:ignore SA1019 CLUSTER SLOTS answers on Redis before 7.0 too, which CLUSTER SHARDS does not.
			slots, err := rc.ClusterSlots(ctx).Result()
			if err != nil {
				return err
			}
			got, err := shardMap(slots, c.Addrs)
			if err != nil {
				return err
			}
			if i == 0 {
				want = got
			} else if got != want {
				return fmt.Errorf("disagrees on the slot map: %s vs %s on %s", got, want, c.Addrs[0])
			}
			repl, err := rc.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			r := parseInfo(repl)
			if r["role"] == "slave" && (r["master_link_status"] != "up" || r["master_sync_in_progress"] != "0") {
				return fmt.Errorf("replica not in sync: master_link_status:%s master_sync_in_progress:%s",
					r["master_link_status"], r["master_sync_in_progress"])
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("%s: %w", n.Addr, err)
		}
	}
	return nil
}

// shardMap renders CLUSTER SLOTS with each range's master and replica,
// after checking that the masters cover every slot and that every range
// has exactly one replica, all of them nodes of the cluster.
func shardMap(slots []redis.ClusterSlot, addrs []string) (string, error) {
	masters, err := slotMap(slots, addrs)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString(masters)
	for _, s := range slots {
		if len(s.Nodes) != 2 {
			return "", fmt.Errorf("slots %d-%d have %d replicas, want 1", s.Start, s.End, len(s.Nodes)-1)
		}
		if !slices.Contains(addrs, s.Nodes[1].Addr) {
			return "", fmt.Errorf("slots %d-%d replicated on unexpected address %q", s.Start, s.End, s.Nodes[1].Addr)
		}
		fmt.Fprintf(&b, " %d+%s", s.Start, s.Nodes[1].Addr)
	}
	return b.String(), nil
}

// Client returns a new cluster-aware go-redis client, closed at tb.Cleanup.
func (c *ReplicatedCluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// KeySlot returns the hash slot of key.
func (c *ReplicatedCluster) KeySlot(ctx context.Context, key string) (int, error) {
	return KeySlot(ctx, c.Nodes, key)
}

// Master returns the live node that serves slot as master.
func (c *ReplicatedCluster) Master(ctx context.Context, slot int) (*Server, error) {
	return SlotOwner(ctx, c.Nodes, slot)
}

// ReplicaOf returns the live node that replicates master, as master sees it.
func (c *ReplicatedCluster) ReplicaOf(ctx context.Context, master *Server) (*Server, error) {
	views, err := clusterNodes(ctx, master)
	if err != nil {
		return nil, err
	}
	var id string
	for _, v := range views {
		if v.myself {
			id = v.id
		}
	}
	for _, v := range views {
		if v.master || v.masterID != id || v.failed {
			continue
		}
		for _, n := range c.Nodes {
			if n.Addr == v.addr && n.Pid() != 0 {
				return n, nil
			}
		}
	}
	return nil, fmt.Errorf("%s has no live replica", master.Addr)
}

// WaitFailover polls until a node other than old has taken slot over and
// every live node agrees, and returns it. Kill old first.
func (c *ReplicatedCluster) WaitFailover(ctx context.Context, slot int, old *Server) (*Server, error) {
	n, err := WaitOwner(ctx, c.Nodes, slot, old)
	if err != nil {
		return nil, errors.Join(errors.New("redistest: failover"), err)
	}
	return n, nil
}

// WaitReplicated polls until every replica connected to master has
// acknowledged all that master had written when it was called.
func (c *ReplicatedCluster) WaitReplicated(ctx context.Context, master *Server) error {
	var target int64 = -1
	for {
		var lagging error
		err := withNode(ctx, master, func(rc *redis.Client) error {
			raw, err := rc.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			info := parseInfo(raw)
			if target < 0 {
				if target, err = strconv.ParseInt(info["master_repl_offset"], 10, 64); err != nil {
					return fmt.Errorf("master_repl_offset: %w", err)
				}
			}
			n, _ := strconv.Atoi(info["connected_slaves"])
			if n == 0 {
				lagging = errors.New("no replica connected")
			}
			for i := range n {
				// slave0:ip=127.0.0.1,port=7001,state=online,offset=1234,lag=0
				for f := range strings.SplitSeq(info["slave"+strconv.Itoa(i)], ",") {
					if v, ok := strings.CutPrefix(f, "offset="); ok {
						if off, _ := strconv.ParseInt(v, 10, 64); off < target {
							lagging = fmt.Errorf("replica %d at offset %d of %d", i, off, target)
						}
					}
				}
			}
			return nil
		})
		if err == nil && lagging == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: replicas not in sync: %w (last: %v)", master.Addr, ctx.Err(), errors.Join(err, lagging))
		case <-time.After(pollEvery):
		}
	}
}

// DetachReplicas cuts master's replication links and keeps them cut, so
// that its replicas fall behind while it goes on taking writes, as behind
// a slow or broken link: the master's default user may no longer run PSYNC
// or SYNC, and its replicas' connections are closed. A replica that
// fails over later has only what it had at the cut.
func (c *ReplicatedCluster) DetachReplicas(ctx context.Context, master *Server) error {
	return withNode(ctx, master, func(rc *redis.Client) error {
		if err := rc.Do(ctx, "ACL", "SETUSER", "default", "-psync", "-sync").Err(); err != nil {
			return fmt.Errorf("%s: ACL SETUSER: %w", master.Addr, err)
		}
		if err := rc.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
			return fmt.Errorf("%s: CLIENT KILL TYPE replica: %w", master.Addr, err)
		}
		return nil
	})
}
