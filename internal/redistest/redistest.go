// Package redistest hands a test a Redis: a throwaway redis-server process
// when the binary is installed, miniredis otherwise, and a small Redis
// Cluster built from the same binary.
//
// Every real server gets its own free 127.0.0.1 port (never 6379, which
// belongs to the machine's shared Redis), its own temp dir, no persistence,
// and is killed and reaped at test cleanup.
//
// Setting CI=true turns a missing redis-server from a skip into a failure,
// so CI cannot silently fall back to miniredis-only coverage.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

const (
	serverBin = "redis-server"
	cliBin    = "redis-cli"

	// startTimeout bounds every wait for a server or cluster to come up:
	// generous, since a start returns as soon as it is up, and a cluster's
	// nodes gossip slowly on a machine busy with other tests (a join took
	// more than 10 s beside two compiles).
	startTimeout = 30 * time.Second
	// stopTimeout bounds a graceful shutdown before escalating to SIGKILL,
	// and the wait for a killed process to be reaped.
	stopTimeout = 5 * time.Second
	// startAttempts covers the window between picking a free port and the
	// server binding it, during which something else may take the port.
	startAttempts = 5
	// reservedPort is the machine's shared Redis; tests must never touch it.
	reservedPort = 6379
)

// Available reports whether redis-server is on PATH.
func Available() bool {
	_, err := exec.LookPath(serverBin)
	return err == nil
}

// RequireReal reports whether a missing redis-server must fail tests instead
// of skipping them, which is the case when CI=true.
func RequireReal() bool {
	return os.Getenv("CI") == "true"
}

// serverPath returns the redis-server binary, or skips the test (fails it
// under CI=true) when there is none.
func serverPath(tb testing.TB) string {
	tb.Helper()
	p, err := exec.LookPath(serverBin)
	if err == nil {
		return p
	}
	if RequireReal() {
		tb.Fatalf("redistest: %s not found on PATH, and CI=true requires a real Redis: %v", serverBin, err)
	}
	tb.Skipf("redistest: %s not found on PATH; skipping (install Redis to run this test; with CI=true this is a failure)", serverBin)
	return ""
}

// Server is a Redis a test can use.
type Server struct {
	// Addr is the server's host:port.
	Addr string
	// Real is true for a spawned redis-server, false for miniredis.
	Real bool
	// Mini is the miniredis instance; nil for a real server.
	Mini *miniredis.Miniredis

	mu   sync.Mutex // guards proc, and serialises start/stop
	bin  string
	dir  string
	port int
	args []string // extra config flags, e.g. cluster mode
	proc *proc    // nil while the server is down

	clock miniClock // miniredis's running clock, once SetClock set it
}

// miniClock is a miniredis clock that runs: the real clock plus a shift,
// set on the server as each command of s.Client's clients is sent.
type miniClock struct {
	mu    sync.Mutex
	on    bool
	shift time.Duration
	last  time.Time // the latest time set: the clock never goes back by a race of two senders
}

// SetClock makes miniredis's clock the real one plus shift, read as each
// command of a client from s.Client is sent: a server whose clock stepped
// by shift and still runs. miniredis.SetTime stops the clock instead, so
// that a process whose calls come a millisecond apart (a machine busy with
// a race run) reads Redis's clock as gone back. shift may be negative.
func (s *Server) SetClock(shift time.Duration) {
	if s.Mini == nil {
		panic("redistest: SetClock on a real server")
	}
	s.clock.mu.Lock()
	defer s.clock.mu.Unlock()
	s.clock.on, s.clock.shift, s.clock.last = true, shift, time.Time{}
	s.clock.setLocked(s.Mini)
}

// setLocked sets m's time by the clock; c.mu is held.
func (c *miniClock) setLocked(m *miniredis.Miniredis) {
	if !c.on {
		return
	}
	t := time.Now().Add(c.shift)
	if t.Before(c.last) {
		t = c.last
	}
	c.last = t
	m.SetTime(t)
}

// tick sets m's time by the clock, if SetClock set one.
func (c *miniClock) tick(m *miniredis.Miniredis) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setLocked(m)
}

// clockHook sets a miniredis's running clock before each command is sent.
type clockHook struct{ s *Server }

func (h clockHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h clockHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.s.clock.tick(h.s.Mini)
		return next(ctx, cmd)
	}
}

func (h clockHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.s.clock.tick(h.s.Mini)
		return next(ctx, cmds)
	}
}

// LongRun reports whether the long tests run: THROTTLE_LONG=1, as .ci/run
// sets it.
func LongRun() bool {
	on, _ := strconv.ParseBool(os.Getenv("THROTTLE_LONG"))
	return on
}

// Heavy skips a test that takes seconds of both cores (what says why: a
// program built, a browser started, clusters started and stopped) unless
// CI=true or THROTTLE_LONG=1: .ci/run runs it, and a plain go test ./...
// leaves it out.
func Heavy(tb testing.TB, what string) {
	tb.Helper()
	if !LongRun() && os.Getenv("CI") != "true" {
		tb.Skipf("heavy test (%s): run it with THROTTLE_LONG=1 or CI=true (as .ci/run does)", what)
	}
}

// Real starts a fresh redis-server on a free 127.0.0.1 port with no
// persistence and its own temp dir, waits until it answers PING, and kills
// and reaps it at tb.Cleanup. It skips the test when redis-server is not on
// PATH, or fails it when CI=true.
func Real(tb testing.TB) *Server {
	tb.Helper()
	return startReal(tb, serverPath(tb), nil, false)
}

// Mini starts a miniredis that is closed at tb.Cleanup.
func Mini(tb testing.TB) *Server {
	tb.Helper()
	m := miniredis.RunT(tb)
	return &Server{Addr: m.Addr(), Mini: m}
}

// New returns a Real server when redis-server is on PATH and a Mini one
// otherwise; with CI=true a missing binary fails the test instead.
func New(tb testing.TB) *Server {
	tb.Helper()
	if Available() || RequireReal() {
		return Real(tb)
	}
	return Mini(tb)
}

// Each runs fn as a subtest once per backend: "miniredis" always, and
// "redis" against a real server. The "redis" subtest is skipped when the
// binary is missing (failed under CI=true), so the gap shows up in -v output.
func Each(t *testing.T, fn func(t *testing.T, s *Server)) {
	t.Helper()
	t.Run("miniredis", func(t *testing.T) { fn(t, Mini(t)) })
	t.Run("redis", func(t *testing.T) { fn(t, Real(t)) })
}

// Client returns a new go-redis client for s, closed at tb.Cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	if s.Mini != nil {
		c.AddHook(clockHook{s})
	}
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Pid returns the redis-server process id, or 0 for miniredis or a server
// that is down.
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.pid()
}

// Dir returns the real server's working directory (log, nodes.conf), or ""
// for miniredis.
func (s *Server) Dir() string { return s.dir }

// Stop shuts the server down gracefully (SIGTERM, escalating to SIGKILL after
// 5 s) and waits for the process to exit. Port and dir are kept, so Restart
// can bring it back. Stopping a server that is down does nothing.
func (s *Server) Stop() error {
	if s.Mini != nil {
		s.Mini.Close()
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return nil
	}
	err := s.proc.terminate(stopTimeout)
	if s.proc.exited() {
		s.proc = nil
	}
	return err
}

// Kill simulates a crash: SIGKILL, then wait for the process to be reaped.
// Port and dir are kept for Restart. Killing a server that is down does
// nothing. Should the process somehow outlive the kill, cleanup reports it.
func (s *Server) Kill() {
	if s.Mini != nil {
		s.Mini.Close()
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

func (s *Server) killLocked() error {
	if s.proc == nil {
		return nil
	}
	err := s.proc.kill(stopTimeout)
	if err == nil {
		s.proc = nil
	}
	return err
}

// Restart kills the server if it is still up and starts it again on the same
// address, waiting until it answers PING. The restarted server is empty, as
// a real one with persistence off would be; miniredis is flushed to match.
// Cluster nodes keep their nodes.conf and rejoin their cluster.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	if s.Mini != nil {
		s.Mini.Close()
		s.Mini.FlushAll()
		// Another test looking for a free port may hold this one for a
		// moment (it binds a port to learn that it is free): try again a
		// little later, as for a real server.
		var err error
		for attempt := 1; attempt <= 100; attempt++ {
			if err = s.Mini.Restart(); err == nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		tb.Fatalf("redistest: restart miniredis on %s: %v", s.Addr, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.killLocked(); err != nil {
		tb.Fatalf("redistest: restart %s: %v", s.Addr, err)
	}
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		// The address is fixed now, so all we can do about a port taken in
		// the meantime is wait a little for it to be freed.
		if err = s.launchLocked(s.port); err == nil || !errors.Is(err, errExited) {
			break
		}
		time.Sleep(time.Duration(attempt) * 100 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("redistest: restart: %v", err)
	}
}

// Freeze suspends the server with SIGSTOP: connections stay open but nothing
// is answered, as with a stalled or partitioned host. Thaw resumes it.
// miniredis cannot be frozen.
func (s *Server) Freeze() error { return s.signal(sigStop, "freeze") }

// Thaw resumes a server suspended by Freeze.
func (s *Server) Thaw() error { return s.signal(sigCont, "thaw") }

func (s *Server) signal(sig os.Signal, what string) error {
	if s.Mini != nil {
		return fmt.Errorf("redistest: cannot %s miniredis: %w", what, errors.ErrUnsupported)
	}
	if sig == nil {
		return fmt.Errorf("redistest: cannot %s on this OS: %w", what, errors.ErrUnsupported)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return fmt.Errorf("redistest: cannot %s %s: server is down", what, s.Addr)
	}
	return s.proc.cmd.Process.Signal(sig)
}

// startReal launches bin with the extra config args on a fresh port, moving
// to another port when the server dies before answering (usually a port
// grabbed by someone else after freePort released it). needBus also requires
// port+10000 to be free, for the cluster bus.
func startReal(tb testing.TB, bin string, args []string, needBus bool) *Server {
	tb.Helper()
	s := &Server{Real: true, bin: bin, dir: tb.TempDir(), args: args}
	// Registered after TempDir's own cleanup, so it runs first: the process
	// is gone before its dir is removed.
	tb.Cleanup(func() { s.cleanup(tb) })

	var err error
	tried := map[int]bool{}
	attempt := 1
	for ; ; attempt++ {
		port, perr := untriedPort(needBus, tried)
		if perr != nil {
			tb.Fatalf("redistest: %v", perr)
		}
		tried[port] = true
		s.mu.Lock()
		err = s.launchLocked(port)
		s.mu.Unlock()
		if err == nil {
			return s
		}
		// A server that hangs on one port would hang on the next too.
		if attempt == startAttempts || !errors.Is(err, errExited) {
			break
		}
	}
	tb.Fatalf("redistest: gave up after %d attempt(s): %v", attempt, err)
	return nil
}

// untriedPort returns a free port not in tried: the kernel may hand the same
// free port out twice in a row, and a port a server just failed on is the
// one most likely to fail again.
func untriedPort(needBus bool, tried map[int]bool) (int, error) {
	for i := 0; ; i++ {
		port, err := freePort(needBus)
		if err != nil || !tried[port] || i == 100 {
			return port, err
		}
	}
}

// launchLocked starts redis-server on port and waits until that very process
// answers. s.mu must be held.
func (s *Server) launchLocked(port int) error {
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	args := append([]string{
		"--port", strconv.Itoa(port),
		"--bind", "127.0.0.1",
		"--dir", s.dir,
		"--save", "",
		"--appendonly", "no",
		"--daemonize", "no",
	}, s.args...)
	p, err := startProc(s.bin, args, s.logPath())
	if err != nil {
		return fmt.Errorf("start %s on %s: %w", s.bin, addr, err)
	}
	if err := waitReady(p, addr, startTimeout); err != nil {
		kerr := p.kill(stopTimeout)
		return fmt.Errorf("%s on %s: %w%s\n%s", s.bin, addr, err, errSuffix(kerr), s.logTail())
	}
	s.proc = p
	// Written only once: a restart reuses the address, and rewriting it
	// would race with tests reading Addr while a fault goroutine restarts.
	if s.Addr == "" {
		s.port, s.Addr = port, addr
	}
	return nil
}

func errSuffix(err error) string {
	if err == nil {
		return ""
	}
	return " (and " + err.Error() + ")"
}

// cleanup kills the server and, if the test failed, logs the server's log
// tail, since the temp dir holding it is about to be removed.
func (s *Server) cleanup(tb testing.TB) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.killLocked(); err != nil {
		tb.Errorf("redistest: cleanup of %s: %v", s.Addr, err)
	}
	if tb.Failed() && s.Addr != "" {
		tb.Logf("redistest: redis-server %s %s", s.Addr, s.logTail())
	}
}

func (s *Server) logPath() string { return filepath.Join(s.dir, "redis.log") }

func (s *Server) logTail() string {
	return "log tail (" + s.logPath() + "):\n" + tail(s.logPath(), 30)
}
