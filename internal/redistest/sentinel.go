package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	sentinelBin = "redis-sentinel"
	// sentinelCount sentinels watch the master; sentinelQuorum of them must
	// agree that it is down before one of them, elected by a majority,
	// fails it over.
	sentinelCount  = 3
	sentinelQuorum = 2
)

// SentinelDownAfter is the down-after-milliseconds of the sentinels that
// StartSentinel starts: a master is taken for down this long after it stops
// answering, and its replica is promoted a second or two later.
const SentinelDownAfter = time.Second

// sentinelFailoverTimeout is the failover-timeout: a failover that stalls
// (a split vote) is tried again after twice this.
const sentinelFailoverTimeout = 3 * time.Second

// replicationArgs are the config flags of a master and its replica. A
// diskless sync with no delay lets the replica catch up at once instead of
// after Redis's default 5 s wait for more replicas.
var replicationArgs = []string{
	"--repl-diskless-sync", "yes",
	"--repl-diskless-sync-delay", "0",
	"--repl-ping-replica-period", "1",
}

// Sentinel is a Redis master with one replica, watched by three Redis
// Sentinels, for failover tests.
type Sentinel struct {
	// MasterName is the name the sentinels know the master by.
	MasterName string
	// SentinelAddrs are the sentinels' host:port addresses.
	SentinelAddrs []string
	// Nodes are the master and its replica, the first master at start.
	// Which of them is the master now is the sentinels' to say: ask Master.
	Nodes []*Server

	sentinels []*Server
}

// StartSentinel starts a master, its replica (replicaof the master) and
// three sentinels monitoring the master with a quorum of 2, each on a free
// 127.0.0.1 port with no persistence and its own temp dir. The sentinels
// are redis-sentinel when it is on PATH, and redis-server --sentinel
// otherwise, which is the same program. StartSentinel waits until the
// replica is in sync and every sentinel knows the replica and the other two
// sentinels, so that a failover can start as soon as the master fails; and
// it kills every process at tb.Cleanup. It skips the test when redis-server
// is not on PATH, or fails it when CI=true.
func StartSentinel(tb testing.TB) *Sentinel {
	tb.Helper()
	bin := serverPath(tb)
	sentinel, err := exec.LookPath(sentinelBin)
	if err != nil {
		sentinel = bin
	}
	return startSentinel(tb, bin, sentinel)
}

func startSentinel(tb testing.TB, bin, sentinelBin string) *Sentinel {
	tb.Helper()
	s := &Sentinel{MasterName: "redistest"}
	master := startReal(tb, bin, replicationArgs, false)
	replica := startReal(tb, bin, append(slices.Clone(replicationArgs), "--replicaof", "127.0.0.1", strconv.Itoa(master.port)), false)
	s.Nodes = []*Server{master, replica}
	// Registered after the nodes', so these cleanups run first: no sentinel
	// sees the nodes go down and starts a failover.
	for range sentinelCount {
		n := startSentinelNode(tb, sentinelBin, s.MasterName, master)
		s.sentinels = append(s.sentinels, n)
		s.SentinelAddrs = append(s.SentinelAddrs, n.Addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*startTimeout)
	defer cancel()
	if err := s.waitReady(ctx); err != nil {
		tb.Fatalf("redistest: start sentinel: %v%s", err, s.logTails())
	}
	return s
}

// startSentinelNode starts one sentinel monitoring master, moving to
// another port when the sentinel dies before answering.
func startSentinelNode(tb testing.TB, bin, name string, master *Server) *Server {
	tb.Helper()
	n := &Server{Real: true, bin: bin, dir: tb.TempDir()}
	tb.Cleanup(func() { n.cleanup(tb) })
	conf := filepath.Join(n.dir, "sentinel.conf")
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		var port int
		if port, err = freePort(false); err != nil {
			tb.Fatalf("redistest: %v", err)
		}
		// A sentinel keeps its state in its config file, so it needs one it
		// can rewrite; the monitor line must come before the master's
		// settings.
		text := strings.Join([]string{
			"port " + strconv.Itoa(port),
			"bind 127.0.0.1",
			"daemonize no",
			`logfile ""`,
			"dir " + strconv.Quote(n.dir),
			fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d %d", name, master.port, sentinelQuorum),
			fmt.Sprintf("sentinel down-after-milliseconds %s %d", name, SentinelDownAfter.Milliseconds()),
			fmt.Sprintf("sentinel failover-timeout %s %d", name, sentinelFailoverTimeout.Milliseconds()),
			fmt.Sprintf("sentinel parallel-syncs %s 1", name),
		}, "\n") + "\n"
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			tb.Fatalf("redistest: %v", err)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		var p *proc
		if p, err = startProc(bin, []string{conf, "--sentinel"}, n.logPath()); err != nil {
			tb.Fatalf("redistest: start %s --sentinel: %v", bin, err)
		}
		if err = waitReady(p, addr, startTimeout); err == nil {
			n.mu.Lock()
			n.proc, n.port, n.Addr = p, port, addr
			n.mu.Unlock()
			return n
		}
		kerr := p.kill(stopTimeout)
		err = fmt.Errorf("%s --sentinel on %s: %w%s\n%s", bin, addr, err, errSuffix(kerr), n.logTail())
		if !errors.Is(err, errExited) {
			break
		}
	}
	tb.Fatalf("redistest: sentinel: %v", err)
	return nil
}

// FailoverOptions returns the options of a go-redis failover client of the
// master: through the sentinels, with ContextTimeoutEnabled.
func (s *Sentinel) FailoverOptions() *redis.FailoverOptions {
	return &redis.FailoverOptions{
		MasterName:            s.MasterName,
		SentinelAddrs:         slices.Clone(s.SentinelAddrs),
		ContextTimeoutEnabled: true,
	}
}

// Client returns a new go-redis failover client of the master, which asks
// the sentinels where the master is and follows a failover; it is closed at
// tb.Cleanup.
func (s *Sentinel) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewFailoverClient(s.FailoverOptions())
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Master returns the node every live sentinel names as the master.
func (s *Sentinel) Master(ctx context.Context) (*Server, error) {
	var addr string
	for _, sn := range s.sentinels {
		if sn.Pid() == 0 {
			continue
		}
		var got string
		err := withSentinel(ctx, sn, func(c *redis.SentinelClient) error {
			hp, err := c.GetMasterAddrByName(ctx, s.MasterName).Result()
			if err != nil {
				return err
			}
			if len(hp) != 2 {
				return fmt.Errorf("SENTINEL GET-MASTER-ADDR-BY-NAME answered %q", hp)
			}
			got = net.JoinHostPort(hp[0], hp[1])
			return nil
		})
		switch {
		case err != nil:
			return nil, fmt.Errorf("sentinel %s: %w", sn.Addr, err)
		case addr == "":
			addr = got
		case got != addr:
			return nil, fmt.Errorf("sentinels disagree on the master: %s says %s, another %s", sn.Addr, got, addr)
		}
	}
	for _, n := range s.Nodes {
		if n.Addr == addr {
			return n, nil
		}
	}
	return nil, fmt.Errorf("sentinels name %q as the master, which is none of the nodes", addr)
}

// KillMaster kills the current master with SIGKILL, as a crash would, and
// returns it. The sentinels fail over to the replica about
// SentinelDownAfter later, and a second or two more: see WaitFailover.
func (s *Sentinel) KillMaster(ctx context.Context) (*Server, error) {
	m, err := s.Master(ctx)
	if err != nil {
		return nil, fmt.Errorf("redistest: kill master: %w", err)
	}
	m.Kill()
	return m, nil
}

// WaitFailover polls until every live sentinel names a master other than
// old, and that node answers as a master; and returns it.
func (s *Sentinel) WaitFailover(ctx context.Context, old *Server) (*Server, error) {
	for {
		m, err := s.Master(ctx)
		if err == nil && m == old {
			err = fmt.Errorf("the sentinels still name %s", old.Addr)
		}
		if err == nil {
			err = withNode(ctx, m, func(c *redis.Client) error {
				info, err := c.Info(ctx, "replication").Result()
				if err != nil {
					return err
				}
				if role := parseInfo(info)["role"]; role != "master" {
					return fmt.Errorf("%s is named master but answers role:%s", m.Addr, role)
				}
				return nil
			})
		}
		if err == nil {
			return m, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("redistest: sentinel failover from %s: %w (last: %v)", old.Addr, ctx.Err(), err)
		case <-time.After(pollEvery):
		}
	}
}

// waitReady polls until the replica is in sync and every sentinel knows
// the master up, the replica up, and the other sentinels.
func (s *Sentinel) waitReady(ctx context.Context) error {
	for {
		err := s.ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last: %v)", ctx.Err(), err)
		case <-time.After(pollEvery):
		}
	}
}

func (s *Sentinel) ready(ctx context.Context) error {
	master := s.Nodes[0]
	err := withNode(ctx, master, func(c *redis.Client) error {
		raw, err := c.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		info := parseInfo(raw)
		if info["connected_slaves"] != "1" || !strings.Contains(info["slave0"], "state=online") {
			return fmt.Errorf("replica not in sync: connected_slaves:%s slave0:%s", info["connected_slaves"], info["slave0"])
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("master %s: %w", master.Addr, err)
	}
	for _, sn := range s.sentinels {
		err := withSentinel(ctx, sn, func(c *redis.SentinelClient) error {
			m, err := c.Master(ctx, s.MasterName).Result()
			if err != nil {
				return err
			}
			if m["flags"] != "master" || m["num-slaves"] != "1" || m["num-other-sentinels"] != strconv.Itoa(sentinelCount-1) {
				return fmt.Errorf("master flags:%s num-slaves:%s num-other-sentinels:%s",
					m["flags"], m["num-slaves"], m["num-other-sentinels"])
			}
			rs, err := c.Replicas(ctx, s.MasterName).Result()
			if err != nil {
				return err
			}
			if len(rs) != 1 || rs[0]["flags"] != "slave" || rs[0]["master-link-status"] != "ok" {
				return fmt.Errorf("replicas %v", rs)
			}
			return c.CkQuorum(ctx, s.MasterName).Err()
		})
		if err != nil {
			return fmt.Errorf("sentinel %s: %w", sn.Addr, err)
		}
	}
	return nil
}

// withSentinel runs fn with a client of the sentinel n that does not retry.
func withSentinel(ctx context.Context, n *Server, fn func(*redis.SentinelClient) error) error {
	c := redis.NewSentinelClient(&redis.Options{Addr: n.Addr, MaxRetries: -1, DialTimeout: time.Second,
		ReadTimeout: 2 * time.Second, ContextTimeoutEnabled: true, PoolSize: 1})
	defer c.Close()
	return fn(c)
}

// logTails returns the log tail of every process, for a failure message.
func (s *Sentinel) logTails() string {
	var b strings.Builder
	for _, n := range append(slices.Clone(s.Nodes), s.sentinels...) {
		fmt.Fprintf(&b, "\n--- %s %s", n.Addr, n.logTail())
	}
	return b.String()
}
