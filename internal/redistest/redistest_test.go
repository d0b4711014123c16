//go:build unix

package redistest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// alive reports whether a process with this pid exists (zombies included,
// so a missing reap shows up as alive).
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

func portOf(t *testing.T, addr string) int {
	t.Helper()
	i := strings.LastIndexByte(addr, ':')
	p, err := strconv.Atoi(addr[i+1:])
	if err != nil {
		t.Fatalf("bad addr %q: %v", addr, err)
	}
	return p
}

func TestReal(t *testing.T) {
	t.Parallel()
	s := Real(t)
	if !s.Real || s.Mini != nil {
		t.Fatalf("Real returned Real=%v Mini=%v", s.Real, s.Mini)
	}
	if p := portOf(t, s.Addr); p == reservedPort {
		t.Fatalf("Real picked the shared port %d", p)
	}
	if !strings.HasPrefix(s.Addr, "127.0.0.1:") {
		t.Fatalf("Addr %q is not on 127.0.0.1", s.Addr)
	}
	ctx := ctxT(t)
	c := s.Client(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	// It must be our own process, with persistence off.
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		t.Fatal(err)
	}
	if got := parseInfo(info)["process_id"]; got != strconv.Itoa(s.Pid()) {
		t.Fatalf("process_id %s, want %d", got, s.Pid())
	}
	cfg, err := c.ConfigGet(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if cfg["save"] != "" || cfg["appendonly"] != "no" || cfg["dir"] != s.Dir() {
		t.Fatalf("save=%q appendonly=%q dir=%q, want \"\", no, %q", cfg["save"], cfg["appendonly"], cfg["dir"], s.Dir())
	}
}

func TestMini(t *testing.T) {
	t.Parallel()
	s := Mini(t)
	if s.Real || s.Mini == nil || s.Pid() != 0 {
		t.Fatalf("Mini returned Real=%v Mini=%v Pid=%d", s.Real, s.Mini, s.Pid())
	}
	ctx := ctxT(t)
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Mini.Get("k"); got != "v" {
		t.Fatalf("miniredis has k=%q", got)
	}
	if err := s.Freeze(); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("Freeze on miniredis: %v, want ErrUnsupported", err)
	}
	s.Restart(t)
	if err := c.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("after Restart GET k: %v, want redis.Nil", err)
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	s := New(t)
	if s.Real != Available() {
		t.Fatalf("New gave Real=%v with Available()=%v", s.Real, Available())
	}
	if err := s.Client(t).Ping(ctxT(t)).Err(); err != nil {
		t.Fatal(err)
	}
}

func TestEach(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	ran := map[string]bool{}
	Each(t, func(t *testing.T, s *Server) {
		name := t.Name()[strings.LastIndexByte(t.Name(), '/')+1:]
		if want := name == "redis"; s.Real != want {
			t.Errorf("subtest %s got Real=%v", name, s.Real)
		}
		ctx := ctxT(t)
		c := s.Client(t)
		if err := c.Incr(ctx, "n").Err(); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		ran[name] = true
		mu.Unlock()
	})
	if !ran["miniredis"] {
		t.Error("miniredis subtest did not run")
	}
	if Available() && !ran["redis"] {
		t.Error("redis subtest did not run although redis-server is available")
	}
}

func TestStopReapsProcess(t *testing.T) {
	t.Parallel()
	s := Real(t)
	pid := s.Pid()
	if pid == 0 || !alive(pid) {
		t.Fatalf("pid %d not running", pid)
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if alive(pid) {
		t.Fatalf("pid %d still exists after Stop", pid)
	}
	if s.Pid() != 0 {
		t.Fatalf("Pid() = %d after Stop", s.Pid())
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
}

func TestCleanupReapsProcess(t *testing.T) {
	t.Parallel()
	if !Available() {
		t.Skip("redis-server not on PATH")
	}
	var pid int
	var dir string
	t.Run("inner", func(t *testing.T) {
		s := Real(t)
		pid, dir = s.Pid(), s.Dir()
		// Frozen servers must be cleaned up too.
		if err := s.Freeze(); err != nil {
			t.Fatal(err)
		}
	})
	if pid == 0 {
		t.Fatal("inner test did not start a server")
	}
	if alive(pid) {
		t.Fatalf("pid %d still exists after cleanup", pid)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("temp dir %s still there: %v", dir, err)
	}
}

func TestKillRestartFreeze(t *testing.T) {
	t.Parallel()
	s := Real(t)
	ctx := ctxT(t)
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}

	pid := s.Pid()
	s.Kill()
	if alive(pid) {
		t.Fatalf("pid %d still exists after Kill", pid)
	}
	// A raw probe, because the client would spend seconds retrying.
	if _, err := probe(s.Addr, 200*time.Millisecond); err == nil {
		t.Fatal("PING succeeded against a killed server")
	}

	addr := s.Addr
	s.Restart(t)
	if s.Addr != addr || s.Pid() == pid || s.Pid() == 0 {
		t.Fatalf("after Restart: addr %s pid %d, before: addr %s pid %d", s.Addr, s.Pid(), addr, pid)
	}
	if err := c.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("GET k after restart: %v, want redis.Nil (no persistence)", err)
	}

	if err := s.Freeze(); err != nil {
		t.Fatal(err)
	}
	// go-redis ignores context deadlines on reads unless told otherwise.
	impatient := redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true, MaxRetries: -1})
	defer impatient.Close()
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := impatient.Ping(short).Err()
	cancel()
	if err == nil {
		t.Fatal("PING answered by a frozen server")
	}
	if err := s.Thaw(); err != nil {
		t.Fatal(err)
	}
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Thaw: %v", err)
	}

	// Restart from a running state, and Stop after all this.
	s.Restart(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after second Restart: %v", err)
	}
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
}

func TestMissingBinary(t *testing.T) {
	// t.Setenv rules out t.Parallel; this test is quick anyway.
	t.Setenv("PATH", t.TempDir())
	if Available() {
		t.Fatal("Available() with an empty PATH")
	}
	for _, ci := range []string{"", "true"} {
		t.Setenv("CI", ci)
		ft := runFake(t, func(tb testing.TB) { Real(tb) })
		if ci == "true" && (!ft.fatal || ft.skipped) {
			t.Errorf("CI=true: Real should fail, got fatal=%v skipped=%v", ft.fatal, ft.skipped)
		}
		if ci == "" && (!ft.skipped || ft.fatal) {
			t.Errorf("CI unset: Real should skip, got fatal=%v skipped=%v", ft.fatal, ft.skipped)
		}
		if !strings.Contains(ft.msg, "redis-server not found on PATH") {
			t.Errorf("unclear message: %q", ft.msg)
		}

		ft = runFake(t, func(tb testing.TB) {
			if s := New(tb); s.Real {
				tb.Errorf("New returned a real server")
			}
		})
		if ci == "true" != ft.fatal {
			t.Errorf("CI=%q: New fatal=%v", ci, ft.fatal)
		}
		ft = runFake(t, func(tb testing.TB) { StartCluster(tb) })
		if ci == "true" != ft.fatal || ci == "" != ft.skipped {
			t.Errorf("CI=%q: StartCluster fatal=%v skipped=%v", ci, ft.fatal, ft.skipped)
		}
	}
}

func TestBrokenBinaryFailsWithLog(t *testing.T) {
	// A stand-in redis-server that dies at once, as a real one does on a
	// bad config or a taken port.
	dir := t.TempDir()
	script := "#!/bin/sh\necho 'fake redis-server: cannot start on' \"$2\" >&2\nexit 1\n"
	if err := os.WriteFile(dir+"/redis-server", []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir)
	ft := runFake(t, func(tb testing.TB) { Real(tb) })
	if !ft.fatal {
		t.Fatal("Real did not fail")
	}
	for _, want := range []string{"exited before answering PING", "log tail", "fake redis-server: cannot start on"} {
		if !strings.Contains(ft.msg, want) {
			t.Errorf("failure message lacks %q:\n%s", want, ft.msg)
		}
	}
	// Each attempt moves to a fresh port.
	ports := map[string]bool{}
	for l := range strings.Lines(ft.msg) {
		if p, ok := strings.CutPrefix(strings.TrimSpace(l), "fake redis-server: cannot start on "); ok {
			ports[p] = true
		}
	}
	if len(ports) != startAttempts {
		t.Errorf("attempts on %d distinct ports, want %d:\n%s", len(ports), startAttempts, ft.msg)
	}
}

func TestTakenPortIsDetected(t *testing.T) {
	t.Parallel()
	a := Real(t)
	// A second server pointed at a's port must not mistake a's PONG for
	// its own, and must report that it exited, so callers move on.
	b := &Server{Real: true, bin: a.bin, dir: t.TempDir()}
	t.Cleanup(func() { b.cleanup(t) })
	b.mu.Lock()
	err := b.launchLocked(portOf(t, a.Addr))
	b.mu.Unlock()
	if !errors.Is(err, errExited) {
		t.Fatalf("launch on a taken port: %v, want errExited", err)
	}
	if !strings.Contains(err.Error(), "Address already in use") {
		t.Errorf("error lacks the bind failure from the log:\n%v", err)
	}
	if b.Pid() != 0 {
		t.Errorf("failed server still has pid %d", b.Pid())
	}
}

// fakeTB records Fatal and Skip instead of ending the real test.
type fakeTB struct {
	testing.TB
	fatal, skipped bool
	msg            string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.fatal, f.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}
func (f *fakeTB) Skipf(format string, args ...any) {
	f.skipped, f.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func runFake(t *testing.T, fn func(tb testing.TB)) *fakeTB {
	f := &fakeTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	return f
}

// harness skips a test of the harness's own clusters and sentinels (5 s
// each of servers started and stopped) as Heavy does: the README's test
// command, whose tests use the same starts, leaves them out.
func harness(t *testing.T) {
	t.Helper()
	Heavy(t, "the harness's own clusters and sentinels")
}

func TestStartCluster(t *testing.T) {
	harness(t)
	t.Parallel()
	c := StartCluster(t)
	checkCluster(t, c)

	// A crashed node comes back on its port with its nodes.conf and
	// rejoins, so the whole cluster agrees again.
	n := c.Nodes[1]
	pid := n.Pid()
	n.Kill()
	if alive(pid) {
		t.Fatalf("cluster node pid %d still exists after Kill", pid)
	}
	n.Restart(t)
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	clients := make([]*redis.Client, len(c.Nodes))
	for i, node := range c.Nodes {
		clients[i] = node.Client(t)
	}
	if err := waitClusterReady(ctx, clients, c.Addrs); err != nil {
		t.Fatal(err)
	}
}

func TestStartClusterWithoutCLI(t *testing.T) {
	harness(t)
	t.Parallel()
	bin := serverPath(t)
	c := startCluster(t, bin, "")
	checkCluster(t, c)
}

func checkCluster(t *testing.T, c *Cluster) {
	t.Helper()
	ctx := ctxT(t)
	if len(c.Addrs) != 3 || len(c.Nodes) != 3 {
		t.Fatalf("%d addrs, %d nodes, want 3", len(c.Addrs), len(c.Nodes))
	}
	for _, a := range c.Addrs {
		if portOf(t, a) == reservedPort {
			t.Fatalf("cluster node on the shared port: %s", a)
		}
	}
	cc := c.Client(t)

	//lint:ignore SA1019 CLUSTER SLOTS answers on Redis before 7.0 too, which CLUSTER SHARDS does not.
	shards, err := cc.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	masters := map[string]bool{}
	covered := 0
	for _, s := range shards {
		masters[s.Nodes[0].ID] = true
		covered += s.End - s.Start + 1
	}
	if len(masters) != 3 || covered != clusterSlots {
		t.Fatalf("%d masters covering %d slots, want 3 covering %d", len(masters), covered, clusterSlots)
	}

	// Keys that hash to different slots, written and read through the
	// cluster client, which must follow the slot map to the right node.
	owners := map[string]string{}
	for _, k := range []string{"{a}x", "{b}y", "{c}z", "plain"} {
		if err := cc.Set(ctx, k, "v-"+k, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", k, err)
		}
		if got, err := cc.Get(ctx, k).Result(); err != nil || got != "v-"+k {
			t.Fatalf("GET %s = %q, %v", k, got, err)
		}
		slot, err := cc.ClusterKeySlot(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		owners[k] = ownerOf(shards, int(slot))
	}
	t.Logf("owners: %v", owners)
	// {a} (slot 15495) and {b} (slot 3300) sit in different thirds of the
	// slot space, so two different masters must hold them.
	if owners["{a}x"] == owners["{b}y"] {
		t.Errorf("{a}x and {b}y both on %s", owners["{a}x"])
	}

	// Scripts need all their keys in one slot; the hash tag guarantees it.
	n, err := cc.Eval(ctx, `redis.call("SET", KEYS[1], ARGV[1]); return redis.call("INCR", KEYS[2])`,
		[]string{"{a}script", "{a}counter"}, "x").Int()
	if err != nil || n != 1 {
		t.Fatalf("EVAL = %d, %v", n, err)
	}
	if got, err := cc.Get(ctx, "{a}script").Result(); err != nil || got != "x" {
		t.Fatalf("GET {a}script = %q, %v", got, err)
	}
}

func ownerOf(shards []redis.ClusterSlot, slot int) string {
	for _, s := range shards {
		if s.Start <= slot && slot <= s.End {
			return s.Nodes[0].Addr
		}
	}
	return ""
}

// SetClock shifts miniredis's clock and keeps it running: two commands a
// few milliseconds apart read two times as far apart, an hour ahead.
func TestMini_SetClockRuns(t *testing.T) {
	t.Parallel()
	s := Mini(t)
	c := s.Client(t)
	ctx := ctxT(t)
	s.SetClock(time.Hour)
	before := time.Now()
	first, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	second, err := c.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ahead := first.Sub(before); ahead < 59*time.Minute || ahead > 61*time.Minute {
		t.Errorf("TIME after SetClock(1h) is %v ahead of the real clock, want an hour", ahead)
	}
	if ran := second.Sub(first); ran < 20*time.Millisecond {
		t.Errorf("TIME moved %v between two commands 20 ms apart, want 20 ms at least: the clock stopped", ran)
	}
}
