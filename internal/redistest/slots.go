package redistest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// pollEvery is how often the slot and failover helpers look again.
const pollEvery = 25 * time.Millisecond

// nodeView is one line of CLUSTER NODES.
type nodeView struct {
	id, addr string
	myself   bool
	master   bool
	failed   bool
	masterID string // for a replica, the id of its master
	slots    [][2]int
}

// withNode runs fn with a short-lived client of a live node. Fault helpers
// open a client per question rather than keep pools towards nodes that a
// test kills or freezes. A node that is down is an error.
func withNode(ctx context.Context, n *Server, fn func(*redis.Client) error) error {
	if n.Pid() == 0 {
		return fmt.Errorf("%s is down", n.Addr)
	}
	c := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1, DialTimeout: time.Second,
		ReadTimeout: 2 * time.Second, ContextTimeoutEnabled: true, PoolSize: 1})
	defer c.Close()
	return fn(c)
}

// clusterNodes reads CLUSTER NODES as n sees it.
func clusterNodes(ctx context.Context, n *Server) ([]nodeView, error) {
	var raw string
	err := withNode(ctx, n, func(c *redis.Client) (err error) {
		raw, err = c.ClusterNodes(ctx).Result()
		return err
	})
	if err != nil {
		return nil, err
	}
	var views []nodeView
	for l := range strings.Lines(raw) {
		f := strings.Fields(l)
		if len(f) < 8 {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@")
		v := nodeView{id: f[0], addr: addr, masterID: f[3]}
		for flag := range strings.SplitSeq(f[2], ",") {
			switch flag {
			case "myself":
				v.myself = true
			case "master":
				v.master = true
			case "fail":
				v.failed = true
			}
		}
		for _, s := range f[8:] {
			if strings.HasPrefix(s, "[") {
				continue // a slot being imported or migrated, not owned
			}
			first, last, ranged := strings.Cut(s, "-")
			a, err := strconv.Atoi(first)
			if err != nil {
				return nil, fmt.Errorf("%s: CLUSTER NODES slot %q: %w", n.Addr, s, err)
			}
			b := a
			if ranged {
				if b, err = strconv.Atoi(last); err != nil {
					return nil, fmt.Errorf("%s: CLUSTER NODES slot %q: %w", n.Addr, s, err)
				}
			}
			v.slots = append(v.slots, [2]int{a, b})
		}
		views = append(views, v)
	}
	return views, nil
}

func (v nodeView) owns(slot int) bool {
	for _, r := range v.slots {
		if r[0] <= slot && slot <= r[1] {
			return true
		}
	}
	return false
}

// myView returns the line of CLUSTER NODES in which n describes itself.
func myView(ctx context.Context, n *Server) (nodeView, error) {
	views, err := clusterNodes(ctx, n)
	if err != nil {
		return nodeView{}, err
	}
	for _, v := range views {
		if v.myself {
			return v, nil
		}
	}
	return nodeView{}, fmt.Errorf("%s: CLUSTER NODES has no myself line", n.Addr)
}

// KeySlot returns the hash slot of key, as the first live node of nodes
// computes it with CLUSTER KEYSLOT.
func KeySlot(ctx context.Context, nodes []*Server, key string) (int, error) {
	var last error = errors.New("no node is up")
	for _, n := range nodes {
		var slot int64
		last = withNode(ctx, n, func(c *redis.Client) (err error) {
			slot, err = c.ClusterKeySlot(ctx, key).Result()
			return err
		})
		if last == nil {
			return int(slot), nil
		}
	}
	return 0, fmt.Errorf("CLUSTER KEYSLOT %s: %w", key, last)
}

// SlotOwner returns the live node of nodes that claims slot as its own
// master: the node that serves the slot once the others agree.
func SlotOwner(ctx context.Context, nodes []*Server, slot int) (*Server, error) {
	for _, n := range nodes {
		v, err := myView(ctx, n)
		if err != nil {
			continue
		}
		if v.master && v.owns(slot) {
			return n, nil
		}
	}
	return nil, fmt.Errorf("no live node claims slot %d", slot)
}

// AgreeOnOwner reports nil once every live node of nodes reports
// cluster_state:ok and maps slot to owner in CLUSTER SLOTS, the map cluster
// clients load; otherwise it says who disagrees.
func AgreeOnOwner(ctx context.Context, nodes []*Server, slot int, owner *Server) error {
	for _, n := range nodes {
		if n.Pid() == 0 {
			continue
		}
		err := withNode(ctx, n, func(c *redis.Client) error {
			info, err := c.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			if st := parseInfo(info)["cluster_state"]; st != "ok" {
				return fmt.Errorf("cluster_state:%s", st)
			}
			//lint:ignore SA1019 CLUSTER SLOTS answers on Redis before 7.0 too, which CLUSTER SHARDS does not.
			slots, err := c.ClusterSlots(ctx).Result()
			if err != nil {
				return err
			}
			for _, s := range slots {
				if s.Start <= slot && slot <= s.End && len(s.Nodes) > 0 {
					if s.Nodes[0].Addr != owner.Addr {
						return fmt.Errorf("slot %d on %s", slot, s.Nodes[0].Addr)
					}
					return nil
				}
			}
			return fmt.Errorf("slot %d unassigned", slot)
		})
		if err != nil {
			return fmt.Errorf("%s: %w", n.Addr, err)
		}
	}
	return nil
}

// WaitOwner polls until a live node other than old claims slot and every
// live node agrees on it, as after a failover, and returns that node.
func WaitOwner(ctx context.Context, nodes []*Server, slot int, old *Server) (*Server, error) {
	var last error
	for {
		if n, err := SlotOwner(ctx, nodes, slot); err != nil {
			last = err
		} else if n == old {
			last = fmt.Errorf("slot %d still on %s", slot, old.Addr)
		} else if last = AgreeOnOwner(ctx, nodes, slot, n); last == nil {
			return n, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("slot %d: %w (last: %v)", slot, ctx.Err(), last)
		case <-time.After(pollEvery):
		}
	}
}

// Migration moves one slot from the master that owns it to another master,
// in the steps an operator's resharding takes, so that a test can let
// clients run between them: after Start the source still serves the slot's
// keys and sends ASK for the missing ones; after MoveKeys the target holds
// them all; after Finish the target owns the slot and the others answer
// MOVED.
type Migration struct {
	Slot     int     // the slot that moves
	From, To *Server // the master that owns it, and the one it moves to
	nodes    []*Server
	fromID   string
	toID     string
}

// StartMigration marks slot IMPORTING on to and MIGRATING on its current
// owner among nodes.
func StartMigration(ctx context.Context, nodes []*Server, slot int, to *Server) (*Migration, error) {
	from, err := SlotOwner(ctx, nodes, slot)
	if err != nil {
		return nil, err
	}
	if from == to {
		return nil, fmt.Errorf("slot %d is already on %s", slot, to.Addr)
	}
	m := &Migration{Slot: slot, From: from, To: to, nodes: nodes}
	fv, err := myView(ctx, from)
	if err != nil {
		return nil, err
	}
	tv, err := myView(ctx, to)
	if err != nil {
		return nil, err
	}
	m.fromID, m.toID = fv.id, tv.id
	// The target first: a source that redirects with ASK to a target not
	// yet importing would bounce clients back with MOVED.
	if err := setSlot(ctx, to, slot, "IMPORTING", m.fromID); err != nil {
		return nil, err
	}
	if err := setSlot(ctx, from, slot, "MIGRATING", m.toID); err != nil {
		return nil, err
	}
	return m, nil
}

func setSlot(ctx context.Context, n *Server, slot int, args ...any) error {
	return withNode(ctx, n, func(c *redis.Client) error {
		a := append([]any{"CLUSTER", "SETSLOT", slot}, args...)
		if err := c.Do(ctx, a...).Err(); err != nil {
			return fmt.Errorf("%s: CLUSTER SETSLOT %d %v: %w", n.Addr, slot, args, err)
		}
		return nil
	})
}

// MoveKeys migrates the keys of the slot to the target with MIGRATE ...
// KEYS, and returns how many it handed over. With no keys named it moves
// every key, a batch at a time, until the source holds none (keys written
// meanwhile go with the next batch); naming keys moves only those, in one
// MIGRATE, which lets a test split keys that scripts use together.
func (m *Migration) MoveKeys(ctx context.Context, only ...string) (int, error) {
	host, port, ok := strings.Cut(m.To.Addr, ":")
	if !ok {
		return 0, fmt.Errorf("bad address %q", m.To.Addr)
	}
	moved := 0
	err := withNode(ctx, m.From, func(c *redis.Client) error {
		for {
			keys := only
			if len(only) == 0 {
				var err error
				if keys, err = c.ClusterGetKeysInSlot(ctx, m.Slot, 100).Result(); err != nil {
					return fmt.Errorf("%s: CLUSTER GETKEYSINSLOT %d: %w", m.From.Addr, m.Slot, err)
				}
				if len(keys) == 0 {
					return nil
				}
			}
			args := []any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}
			for _, k := range keys {
				args = append(args, k)
			}
			// NOKEY, when none of the keys exists, is a status reply.
			if err := c.Do(ctx, args...).Err(); err != nil {
				return fmt.Errorf("%s: MIGRATE %d keys to %s: %w", m.From.Addr, len(keys), m.To.Addr, err)
			}
			moved += len(keys)
			if len(only) > 0 {
				return nil
			}
		}
	})
	return moved, err
}

// Finish gives the slot to the target on every live master, the target
// first and the source next as redis-cli does, and waits until every live
// node maps the slot to the target.
func (m *Migration) Finish(ctx context.Context) error {
	order := []*Server{m.To, m.From}
	for _, n := range m.nodes {
		if n == m.To || n == m.From || n.Pid() == 0 {
			continue
		}
		v, err := myView(ctx, n)
		if err != nil {
			return err
		}
		if v.master {
			order = append(order, n)
		}
	}
	for _, n := range order {
		if err := setSlot(ctx, n, m.Slot, "NODE", m.toID); err != nil {
			return err
		}
	}
	for {
		err := AgreeOnOwner(ctx, m.nodes, m.Slot, m.To)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("slot %d not on %s everywhere: %w (last: %v)", m.Slot, m.To.Addr, ctx.Err(), err)
		case <-time.After(pollEvery):
		}
	}
}

// KeysInSlot returns up to 100 keys of slot held by n.
func KeysInSlot(ctx context.Context, n *Server, slot int) ([]string, error) {
	var keys []string
	err := withNode(ctx, n, func(c *redis.Client) (err error) {
		keys, err = c.ClusterGetKeysInSlot(ctx, slot, 100).Result()
		return err
	})
	return keys, err
}
