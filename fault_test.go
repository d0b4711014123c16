package throttle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Fault tests: a small fleet (faultReplicas limiters, faultWorkers
// goroutines each) calls a strict vendor through real redis-server
// processes while Redis fails under it. Every test checks the promise
// end to end: no call over the vendor's cap, every call accounted for
// (it ran, or returned a clear error), nothing left running afterwards.

const (
	faultLimit    = 20
	faultWindow   = 500 * time.Millisecond
	faultReplicas = 2
	faultWorkers  = 4
	// errorPause is how long a worker waits after a Redis failure before
	// its next call, as a real caller backing off would.
	errorPause = 10 * time.Millisecond
)

var faultPolicy = policies.SlidingLog{Limit: faultLimit, Window: faultWindow}

// Phases of a fault run: a call is counted in the phase in which it ended.
const (
	phaseHealthy int32 = iota
	phaseFault
	phaseRecovery
)

// faultCall is the outcome of one call of the fleet.
type faultCall struct {
	replica    int
	began, end time.Time
	arrived    time.Time // when fn reached the vendor; zero if it did not run
	overCap    bool      // the vendor refused it
	phase      int32     // the phase it ended in
	beganIn    int32     // the phase it began in
	err        error
}

// faultFleet runs the fleet's workers and records every call.
type faultFleet struct {
	t       *testing.T
	lims    []*Limiter
	vendor  *fakevendor.Vendor
	ctx     context.Context
	stop    context.CancelFunc
	wg      sync.WaitGroup
	phase   atomic.Int32
	made    atomic.Int64
	mu      sync.Mutex
	calls   []faultCall
	stopped time.Time
	window  time.Duration // the vendor's
}

// startFaultFleet starts faultWorkers workers a limiter, calling a vendor
// that allows faultLimit calls in any window of length window.
func startFaultFleet(t *testing.T, lims []*Limiter, window time.Duration) *faultFleet {
	t.Helper()
	ctx, stop := context.WithCancel(context.Background())
	f := &faultFleet{t: t, lims: lims, ctx: ctx, stop: stop, window: window,
		vendor: fakevendor.NewInProcess(fakevendor.Config{Limit: faultLimit, Window: window})}
	for i, lim := range lims {
		for range faultWorkers {
			f.wg.Go(func() { f.work(i, lim) })
		}
	}
	// A test that stops early must not leave its fleet calling into the
	// next one.
	t.Cleanup(func() {
		stop()
		f.wg.Wait()
	})
	return f
}

func (f *faultFleet) work(replica int, lim *Limiter) {
	for f.ctx.Err() == nil {
		f.made.Add(1)
		c := faultCall{replica: replica, began: time.Now(), beganIn: f.phase.Load()}
		_, err := Do(f.ctx, lim, func(context.Context) (struct{}, error) {
			c.arrived = time.Now()
			c.overCap = !f.vendor.Arrive()
			return struct{}{}, nil
		})
		c.end, c.err, c.phase = time.Now(), err, f.phase.Load()
		f.mu.Lock()
		f.calls = append(f.calls, c)
		f.mu.Unlock()
		var pause time.Duration
		var le *LimitedError
		switch {
		case errors.Is(err, ErrUnavailable):
			pause = errorPause
		case errors.As(err, &le):
			pause = max(le.RetryAfter, errorPause)
		}
		if pause > 0 {
			select {
			case <-time.After(pause):
			case <-f.ctx.Done():
			}
		}
	}
}

// enter starts a phase and returns when it started.
func (f *faultFleet) enter(p int32) time.Time {
	f.phase.Store(p)
	return time.Now()
}

// snapshot returns the calls recorded so far.
func (f *faultFleet) snapshot() []faultCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// firstSuccess polls until a call of replica (or of any replica, for -1)
// that began at or after since has reached the vendor, and returns when the
// first did. It fails the test after within.
func (f *faultFleet) firstSuccess(since time.Time, replica int, within time.Duration) time.Time {
	f.t.Helper()
	for deadline := time.Now().Add(within); ; time.Sleep(5 * time.Millisecond) {
		var first time.Time
		for _, c := range f.snapshot() {
			if c.err == nil && !c.began.Before(since) && (replica < 0 || c.replica == replica) &&
				(first.IsZero() || c.arrived.Before(first)) {
				first = c.arrived
			}
		}
		if !first.IsZero() {
			return first
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("replica %d: no call succeeded within %v after %s", replica, within, since.Format("15:04:05.000"))
		}
	}
}

// faultTally counts the outcomes of a run.
type faultTally struct {
	ok, unavailable, limited, cancelled int
	byPhase                             [3][2]int      // [phase][0: ok, 1: unavailable]
	causes                              map[string]int // of ErrUnavailable
	calls                               []faultCall
	vendor                              fakevendor.Stats
}

func (s faultTally) String() string {
	return fmt.Sprintf("%d calls: %d ran, %d ErrUnavailable, %d ErrLimited, %d cancelled at the end; "+
		"by phase (ran/unavailable): healthy %d/%d, fault %d/%d, recovery %d/%d; vendor: %d arrivals, %d over cap, at most %d in a window",
		len(s.calls), s.ok, s.unavailable, s.limited, s.cancelled,
		s.byPhase[0][0], s.byPhase[0][1], s.byPhase[1][0], s.byPhase[1][1], s.byPhase[2][0], s.byPhase[2][1],
		s.vendor.Requests, s.vendor.OverCap, s.vendor.MaxInWindow) + s.causesString()
}

// causesString lists the most frequent causes of ErrUnavailable.
func (s faultTally) causesString() string {
	if len(s.causes) == 0 {
		return ""
	}
	keys := slices.Collect(maps.Keys(s.causes))
	slices.SortFunc(keys, func(a, b string) int { return s.causes[b] - s.causes[a] })
	var b strings.Builder
	b.WriteString("; ErrUnavailable causes:")
	for _, k := range keys[:min(len(keys), 4)] {
		fmt.Fprintf(&b, " %dx %q", s.causes[k], k)
	}
	return b.String()
}

// finish stops the fleet, waits a bounded time for every worker, and checks
// what every fault test promises: each call made has one outcome, each
// error is one a caller can act on, and (unless overCapAllowed) the vendor
// saw no call over its cap.
func (f *faultFleet) finish(overCapAllowed bool) faultTally {
	t := f.t
	t.Helper()
	// Set before the cancellation, so that no call can see the run end
	// earlier than stopped says.
	f.stopped = time.Now()
	f.stop()
	done := make(chan struct{})
	go func() {
		f.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("calls still running 10s after the run ended:\n%s", allStacks())
	}
	s := faultTally{calls: f.snapshot(), vendor: f.vendor.Stats(), causes: map[string]int{}}
	if int64(len(s.calls)) != f.made.Load() {
		t.Errorf("%d calls made, %d outcomes recorded", f.made.Load(), len(s.calls))
	}
	unexpected := 0
	for _, c := range s.calls {
		var ue *unavailableError
		switch {
		case c.err == nil:
			s.ok++
			s.byPhase[c.phase][0]++
		case errors.As(c.err, &ue) && errors.Is(c.err, ErrUnavailable):
			s.unavailable++
			s.byPhase[c.phase][1]++
			s.causes[ue.Err.Error()]++
			if ue.Quota != f.lims[c.replica].Name() {
				t.Errorf("ErrUnavailable names quota %q, want %q", ue.Quota, f.lims[c.replica].Name())
			}
		case errors.Is(c.err, ErrLimited):
			s.limited++
		case errors.Is(c.err, context.Canceled) && !c.end.Before(f.stopped):
			s.cancelled++
		default:
			if unexpected++; unexpected <= 5 {
				t.Errorf("replica %d, call at %s: unexpected error %v", c.replica, c.began.Format("15:04:05.000"), c.err)
			}
		}
	}
	if s.vendor.Requests != s.ok {
		t.Errorf("vendor saw %d calls, the fleet ran %d", s.vendor.Requests, s.ok)
	}
	if !overCapAllowed && (s.vendor.OverCap != 0 || s.vendor.MaxInWindow > faultLimit) {
		var when []string
		for _, c := range s.calls {
			if c.overCap {
				when = append(when, fmt.Sprintf("replica %d at %s (phase %d)", c.replica, c.arrived.Format("15:04:05.000"), c.phase))
			}
		}
		t.Errorf("vendor saw %d calls over its cap of %d per %v (at most %d in one window): %s",
			s.vendor.OverCap, faultLimit, f.window, s.vendor.MaxInWindow, strings.Join(when, ", "))
	}
	t.Logf("%v", s)
	return s
}

// lastAfter returns how long after t the calls matching keep went on: the
// last one's end, relative to t, or 0 when none did.
func (s faultTally) lastAfter(t time.Time, keep func(faultCall) bool) time.Duration {
	var last time.Duration
	for _, c := range s.calls {
		if keep(c) && c.end.After(t) {
			last = max(last, c.end.Sub(t))
		}
	}
	return last
}

// maxInWindow returns the most calls of replica that reached the vendor in
// one window (t-w, t] with t in [from, to).
func (s faultTally) maxInWindow(replica int, from, to time.Time, w time.Duration) int {
	var at []time.Time
	for _, c := range s.calls {
		if c.err == nil && c.replica == replica && !c.arrived.Before(from) && c.arrived.Before(to) {
			at = append(at, c.arrived)
		}
	}
	slices.SortFunc(at, time.Time.Compare)
	most := 0
	for i, lo := 0, 0; i < len(at); i++ {
		for !at[lo].After(at[i].Add(-w)) {
			lo++
		}
		most = max(most, i-lo+1)
	}
	return most
}

// allStacks returns the stacks of every goroutine, for a failure message.
func allStacks() string {
	buf := make([]byte, 1<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

// checkGoroutines fails t when, after a bounded settle, more goroutines run
// than before the fleet started. go-redis gives up redialling a closed
// pool's dead server only after its next attempt, so a little settling is
// expected.
func checkGoroutines(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%d goroutines still running 5s after the run, %d before it:\n%s", n, before, allStacks())
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// faultLimiters makes one limiter per replica of the quota, enforcing
// faultPolicy, each on its own client, and returns a func that closes the
// clients.
func faultLimiters(t *testing.T, name string, newClient func(replica int) redis.UniversalClient, opts ...Options) ([]*Limiter, func()) {
	t.Helper()
	return faultLimitersFor(t, name, faultPolicy, newClient, opts...)
}

func faultLimitersFor(t *testing.T, name string, policy policies.Policy, newClient func(replica int) redis.UniversalClient, opts ...Options) ([]*Limiter, func()) {
	t.Helper()
	var lims []*Limiter
	var clients []redis.UniversalClient
	closeAll := func() {
		for _, l := range lims {
			_ = l.Close(context.Background())
		}
		for _, c := range clients {
			_ = c.Close()
		}
	}
	for i := range faultReplicas {
		c := newClient(i)
		clients = append(clients, c)
		lim, err := New(c, name, policy, opts...)
		if err != nil {
			closeAll()
			t.Fatal(err)
		}
		lims = append(lims, lim)
	}
	t.Cleanup(closeAll) // in case the test stops early; closing twice is harmless
	return lims, closeAll
}

// adminClient returns a client for the test's own commands to Redis.
func adminClient(t *testing.T, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// faultLogger returns a logger whose output the test can read.
func faultLogger() (*syncBuffer, *slog.Logger) {
	var logs syncBuffer
	return &logs, slog.New(slog.NewTextHandler(&logs, nil))
}

// A crashed Redis comes back empty. While it is down, FailClosed refuses
// every call that was not booked before the crash; once it is back, the
// quota's epoch tells the fleet that Redis forgot the last window, so the
// first window after the restart counts as full.
func TestFault_KillAndRestart(t *testing.T) {
	long(t)
	t.Run("FailClosed", func(t *testing.T) { killAndRestart(t, FailClosed, true) })
	// Local keeps the fleet calling, at Limit/replicas a replica; the cap
	// across the switches is TestFault_LocalFallbackStaysUnderTheCap's.
	t.Run("Local", func(t *testing.T) { killAndRestart(t, Local, false) })
}

// The Local fallback and Redis hand the quota over without a call too
// many. When Redis fails, the fallback admits nothing until a window after
// the last slot the fleet booked; when Redis answers again, the calls it
// admitted are charged back to Redis before Redis decides any more, and
// while other replicas may still decide without Redis (their breakers probe
// it with backoff), Redis admits only the share none of them takes.
func TestFault_LocalFallbackStaysUnderTheCap(t *testing.T) {
	long(t)
	killAndRestart(t, Local, true)
}

// killAndRestart runs the fleet, kills Redis for 1.5 s and restarts it.
// strictCap asserts that the vendor saw no call over its cap.
func killAndRestart(t *testing.T, onErr OnRedisError, strictCap bool) {
	s := redistest.Real(t)
	before := runtime.NumGoroutine()
	logs, logger := faultLogger()
	lims, closeClients := faultLimiters(t, "fault-kill-"+string(onErr), func(int) redis.UniversalClient {
		return redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true})
	}, Options{Logger: logger, OnRedisError: onErr, ExpectedReplicas: faultReplicas, RedisTimeout: 200 * time.Millisecond})
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(2 * faultWindow)
	s.Kill()
	killed := f.enter(phaseFault)
	time.Sleep(1500 * time.Millisecond)
	s.Restart(t)
	restarted := f.enter(phaseRecovery)
	first := f.firstSuccess(restarted, -1, 10*time.Second)
	time.Sleep(2 * faultWindow)
	sum := f.finish(!strictCap)
	closeClients()
	checkGoroutines(t, before)

	t.Logf("first call after the restart reached the vendor %v after it; ErrUnavailable went on for %v after it",
		first.Sub(restarted).Round(time.Millisecond),
		sum.lastAfter(restarted, func(c faultCall) bool { return errors.Is(c.err, ErrUnavailable) }).Round(time.Millisecond))
	if !strings.Contains(logs.String(), "Redis lost the quota's data") {
		t.Errorf("no limiter noticed that Redis lost the quota's data:\n%s", logs.String())
	}
	switch onErr {
	case FailClosed:
		checkClosedWhileDown(t, sum, logs.String(), killed, restarted, first)
	case Local:
		checkLocalWhileDown(t, sum, lims[0], killed, restarted)
	}
}

// checkClosedWhileDown checks a FailClosed fleet's run over a Redis
// killed then restarted: the breaker opened and closed, calls failed while
// Redis was down and none ran, and the first call after the restart waited
// a whole window.
func checkClosedWhileDown(t *testing.T, sum faultTally, logs string, killed, restarted, first time.Time) {
	t.Helper()
	// Under Local, a worker's first failure books it a slot of the
	// fallback's, a window away: the breaker may never see three.
	for _, want := range []string{"Redis keeps failing", "Redis answers again"} {
		if !strings.Contains(logs, want) {
			t.Errorf("no log line %q:\n%s", want, logs)
		}
	}
	if sum.byPhase[phaseFault][1] == 0 {
		t.Error("no call failed with ErrUnavailable while Redis was down")
	}
	for _, c := range sum.calls {
		// A call may still run on a slot booked before the kill.
		if c.err == nil && c.began.After(killed) && c.end.Before(restarted) {
			t.Errorf("a call that began %v after the kill ran while Redis was down", c.began.Sub(killed))
			break
		}
	}
	// Redis forgot the window before the crash: the fleet must wait a
	// whole window from the restart.
	if first.Sub(restarted) < faultWindow {
		t.Errorf("first call after the restart ran %v after it, want at least one window (%v)",
			first.Sub(restarted), faultWindow)
	}
}

// checkLocalWhileDown checks a Local fleet's run over a Redis killed then
// restarted: no call failed, and each replica decided alone at its share.
func checkLocalWhileDown(t *testing.T, sum faultTally, lim *Limiter, killed, restarted time.Time) {
	t.Helper()
	if sum.unavailable != 0 {
		t.Errorf("%d calls failed with ErrUnavailable under the Local fallback", sum.unavailable)
	}
	// Past the slots booked in Redis before the kill, each replica
	// decides alone, at Limit/replicas.
	from := killed.Add(faultPolicy.EffectiveWindow() + lim.noticeWithin() + 50*time.Millisecond)
	for r := range faultReplicas {
		n := sum.maxInWindow(r, from, restarted, faultWindow)
		if n == 0 || n > faultLimit/faultReplicas {
			t.Errorf("replica %d: %d calls in one window while Redis was down, want 1..%d",
				r, n, faultLimit/faultReplicas)
		}
	}
}

// A Redis that stops answering (SIGSTOP: connections stay open, nothing
// comes back) must not hang the fleet: each call fails within the Redis
// timeout when go-redis honours context deadlines (ContextTimeoutEnabled),
// and within the client's ReadTimeout when it does not. After the thaw the
// fleet recovers by itself.
func TestFault_FreezeLongerThanRedisTimeout(t *testing.T) {
	long(t)
	const (
		redisTimeout = 200 * time.Millisecond
		readTimeout  = time.Second // go-redis's default is 3s; shorter keeps the test short
		freezeFor    = 2 * time.Second
		slack        = 800 * time.Millisecond
	)
	s := redistest.Real(t)
	before := runtime.NumGoroutine()
	logs, logger := faultLogger()
	// Replica 0 lets go-redis stop at the context's deadline, replica 1 not.
	lims, closeClients := faultLimiters(t, "fault-freeze", func(r int) redis.UniversalClient {
		return redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: r == 0, ReadTimeout: readTimeout})
	}, Options{Logger: logger, RedisTimeout: redisTimeout})
	bound := []time.Duration{redisTimeout + slack, readTimeout + slack}
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(2 * faultWindow)
	if err := s.Freeze(); err != nil {
		t.Fatal(err)
	}
	frozen := f.enter(phaseFault)
	time.Sleep(freezeFor)
	// Redis answers what waits in its sockets as soon as it is thawed,
	// before Thaw returns: a call that ended after thawing began did not
	// run while Redis was frozen.
	thawing := time.Now()
	if err := s.Thaw(); err != nil {
		t.Fatal(err)
	}
	thawed := f.enter(phaseRecovery)
	var recovered [faultReplicas]time.Time
	for r := range faultReplicas {
		recovered[r] = f.firstSuccess(thawed, r, 10*time.Second)
	}
	time.Sleep(2 * faultWindow)
	sum := f.finish(false)
	closeClients()
	checkGoroutines(t, before)

	slowest := checkFailedWithin(t, sum, frozen, bound)
	for r := range faultReplicas {
		t.Logf("replica %d (ContextTimeoutEnabled %v): slowest failed call %v; first call after the thaw ran %v after it",
			r, r == 0, slowest[r].Round(time.Millisecond), recovered[r].Sub(thawed).Round(time.Millisecond))
	}
	if sum.byPhase[phaseFault][1] == 0 {
		t.Error("no call failed while Redis was frozen")
	}
	for _, c := range sum.calls {
		if c.err == nil && c.began.After(frozen) && c.end.Before(thawing) {
			t.Errorf("a call that began %v into the freeze ran while Redis was frozen", c.began.Sub(frozen))
			break
		}
	}
	if !strings.Contains(logs.String(), "Redis answers again") {
		t.Errorf("the breaker did not close after the thaw:\n%s", logs.String())
	}
}

// checkFailedWithin checks that each call that failed with ErrUnavailable
// over a Redis frozen at frozen failed within its replica's bound, and
// returns the slowest of those that began during the freeze, by replica.
func checkFailedWithin(t *testing.T, sum faultTally, frozen time.Time, bound []time.Duration) [faultReplicas]time.Duration {
	t.Helper()
	// A call that began during the freeze cannot have been booked, so it
	// waits for Redis and nothing else. One booked before may first sleep
	// up to a window towards its slot, then give the slot back and ask
	// again: two waits for Redis.
	var slowest [faultReplicas]time.Duration
	for _, c := range sum.calls {
		if !errors.Is(c.err, ErrUnavailable) {
			continue
		}
		took, limit := c.end.Sub(c.began), bound[c.replica]
		if c.began.Before(frozen) {
			limit = faultPolicy.EffectiveWindow() + 2*bound[c.replica]
		} else {
			slowest[c.replica] = max(slowest[c.replica], took)
		}
		if took > limit {
			t.Errorf("replica %d: a call that began %v after the freeze failed after %v, want within %v",
				c.replica, c.began.Sub(frozen), took, limit)
		}
	}
	return slowest
}

// SCRIPT FLUSH while the fleet runs costs no call: go-redis answers
// NOSCRIPT with EVAL, and the quota's data stays.
func TestFault_ScriptFlushDuringRun(t *testing.T) {
	long(t)
	s := redistest.Real(t)
	before := runtime.NumGoroutine()
	var seen errorCounts
	lims, closeClients := faultLimiters(t, "fault-flush", func(int) redis.UniversalClient {
		c := redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true})
		c.AddHook(&seen)
		return c
	})
	admin := adminClient(t, s.Addr)
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(faultWindow)
	f.enter(phaseFault)
	flushes := 0
	for end := time.Now().Add(4 * faultWindow); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if err := admin.ScriptFlush(context.Background()).Err(); err != nil {
			t.Fatalf("SCRIPT FLUSH: %v", err)
		}
		flushes++
	}
	f.enter(phaseRecovery)
	time.Sleep(faultWindow)
	sum := f.finish(false)
	_ = admin.Close()
	closeClients()
	checkGoroutines(t, before)

	t.Logf("%d SCRIPT FLUSH; errors seen by go-redis: %v", flushes, seen.snapshot())
	if seen.get("NOSCRIPT") == 0 {
		t.Error("no script call met a flushed cache; the test did not test anything")
	}
	if sum.unavailable != 0 || sum.limited != 0 {
		t.Errorf("%d calls failed with ErrUnavailable and %d with ErrLimited during SCRIPT FLUSH, want none",
			sum.unavailable, sum.limited)
	}
	if sum.byPhase[phaseFault][0] == 0 {
		t.Error("no call ran during the flushes")
	}
}

// CLIENT KILL TYPE normal drops every connection of the fleet, again and
// again: go-redis reconnects and retries, so a call fails at most now and
// then, and a script that ran twice (its reply was lost with the
// connection) only books a slot nobody uses.
func TestFault_ClientKillDuringRun(t *testing.T) {
	long(t)
	// Kill for at least minFor, and on, up to maxFor, until commands in
	// flight have lost their connection a few times: most kills find the
	// fleet's connections idle, which go-redis notices before using them.
	const (
		minFor, maxFor = 2 * time.Second, 8 * time.Second
		inFlight       = 3
	)
	s := redistest.Real(t)
	before := runtime.NumGoroutine()
	var seen errorCounts
	lims, closeClients := faultLimiters(t, "fault-client-kill", func(int) redis.UniversalClient {
		c := redis.NewClient(&redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true})
		c.AddHook(&seen)
		return c
	}, Options{Logger: slog.New(slog.DiscardHandler)})
	admin := adminClient(t, s.Addr)
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(faultWindow)
	f.enter(phaseFault)
	killed, rounds := killClients(t, admin, func(since time.Duration) bool {
		return since < minFor || (seen.get("conn") < inFlight && since < maxFor)
	})
	recovery := f.enter(phaseRecovery)
	f.firstSuccess(recovery, -1, 5*time.Second)
	time.Sleep(faultWindow)
	sum := f.finish(false)
	_ = admin.Close()
	closeClients()
	checkGoroutines(t, before)

	t.Logf("%d rounds of CLIENT KILL closed %d connections; errors seen by go-redis (then retried): %v %q",
		rounds, killed, seen.snapshot(), seen.examples())
	if killed == 0 {
		t.Error("CLIENT KILL closed no connection; the test did not test anything")
	}
	if seen.get("conn") == 0 {
		t.Error("no command lost its connection in flight; the test did not test anything")
	}
	// go-redis tries each command four times; a call fails only when
	// every try meets a killed connection, which a kill every 2ms does now
	// and then on a slow machine.
	if sum.unavailable*10 > len(sum.calls) {
		t.Errorf("%d of %d calls failed with ErrUnavailable over %d rounds of CLIENT KILL, want at most one in ten",
			sum.unavailable, len(sum.calls), rounds)
	}
	// A call that began during the kills may fail after them, its last
	// retry having met a connection the last kill closed; one that began
	// after them may not.
	late := 0
	for _, c := range sum.calls {
		if c.beganIn == phaseRecovery && errors.Is(c.err, ErrUnavailable) {
			late++
		}
	}
	if late != 0 {
		t.Errorf("%d calls that began after the kills had stopped failed", late)
	}
}

// killClients kills every normal client connection every 2ms while more
// says to go on, given the time since the first kill, and returns how many
// connections it killed in how many rounds.
func killClients(t *testing.T, admin *redis.Client, more func(since time.Duration) bool) (killed, rounds int) {
	t.Helper()
	for start := time.Now(); more(time.Since(start)); rounds++ {
		// SKIPME yes (the default) spares the admin's own connection.
		n, err := admin.Do(context.Background(), "CLIENT", "KILL", "TYPE", "normal").Int()
		if err != nil {
			t.Fatalf("CLIENT KILL: %v", err)
		}
		killed += n
		time.Sleep(2 * time.Millisecond)
	}
	return killed, rounds
}

// The master holding the quota's slot crashes and its replica takes over:
// the fleet fails closed during the failover, then carries on with the
// promoted replica, under the cap all along. Replication is asynchronous,
// so the replica may lack the last bookings; when it lacks the quota's meta
// key the epoch counts the window full, as after a restart.
//
// go-redis's ClusterClient learns a new slot map from MOVED replies, which
// a dead master never sends, or every ClusterStateReloadInterval (60 s by
// default); the clients here reload every 500 ms.
func TestFault_ClusterFailover(t *testing.T) {
	long(t)
	clusterFailover(t, &redis.ClusterOptions{ContextTimeoutEnabled: true, ClusterStateReloadInterval: 500 * time.Millisecond})
}

// With a ClusterClient left at go-redis's defaults, the client reloads its
// slot map only on MOVED (which a dead node never answers) or once
// ClusterStateReloadInterval (60 s) has passed. The limiter asks it to
// reload when a decision fails for want of a node, so the fleet comes back
// soon after the promotion rather than a minute later.
func TestFault_ClusterFailoverWithDefaultClient(t *testing.T) {
	long(t)
	clusterFailover(t, &redis.ClusterOptions{ContextTimeoutEnabled: true})
}

func clusterFailover(t *testing.T, opt *redis.ClusterOptions) {
	c := redistest.StartClusterWithReplicas(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const name = "fault-failover"
	slot, master, replica := slotMasterAndReplica(ctx, t, c, name)
	before := runtime.NumGoroutine()
	logs, logger := faultLogger()
	lims, closeClients := faultLimiters(t, name, func(int) redis.UniversalClient {
		o := *opt
		o.Addrs = c.Addrs
		return redis.NewClusterClient(&o)
	}, Options{Logger: logger})
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(2 * faultWindow)
	master.Kill()
	killed := f.enter(phaseFault)
	promoted, err := c.WaitFailover(ctx, slot, master)
	if err != nil {
		t.Fatal(err)
	}
	failedOver := f.enter(phaseRecovery)
	first := f.firstSuccess(failedOver, -1, 15*time.Second)
	time.Sleep(2 * faultWindow)
	sum := f.finish(false)
	closeClients()
	checkGoroutines(t, before)

	failing := sum.lastAfter(killed, func(c faultCall) bool { return errors.Is(c.err, ErrUnavailable) })
	t.Logf("slot %d: master %s killed, replica %s promoted %v later; first call ran %v after the promotion; "+
		"calls failed until %v after the kill; lost data noticed: %v",
		slot, master.Addr, promoted.Addr, failedOver.Sub(killed).Round(time.Millisecond),
		first.Sub(failedOver).Round(time.Millisecond), failing.Round(time.Millisecond),
		strings.Contains(logs.String(), "Redis lost the quota's data"))
	if promoted != replica {
		t.Errorf("slot %d went to %s, want the master's replica %s", slot, promoted.Addr, replica.Addr)
	}
	for _, c := range sum.calls {
		if c.err != nil && c.end.Before(killed) {
			t.Errorf("a call failed before the kill: %v", c.err)
			break
		}
	}
	if sum.byPhase[phaseFault][1] == 0 {
		t.Error("no call failed while the slot had no master")
	}
	if limit := failedOver.Sub(killed) + 5*time.Second; failing > limit {
		t.Errorf("calls failed until %v after the kill, want them back within 5s of the promotion", failing)
	}
}

// slotMasterAndReplica returns the slot of quota name in c, its master, and
// the master's replica.
func slotMasterAndReplica(ctx context.Context, t *testing.T, c *redistest.ReplicatedCluster, name string) (int, *redistest.Server, *redistest.Server) {
	t.Helper()
	slot, err := c.KeySlot(ctx, "{"+name+"}")
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
	return slot, master, replica
}

// The master holding the quota's slot crashes, and the replica that takes
// over had fallen behind it: its replication link was cut just before the
// fleet started. The window (5 s) is longer than the failover (about 3 s),
// so what the replica missed still counts at the vendor afterwards.
func TestFault_ClusterFailoverToLaggingReplica(t *testing.T) {
	long(t)
	// The replica never got the quota's meta key: the epoch tells the fleet
	// that the quota's data was lost, and the window counts as full.
	t.Run("WithoutTheQuota", func(t *testing.T) { laggingFailover(t, false) })
	// The replica has the quota's meta key, from a call made before the
	// cut, but not the fleet's bookings after it. Its count of scripts run
	// is behind the one the fleet saw: the data counts as lost.
	t.Run("WithPartOfTheQuota", func(t *testing.T) { laggingFailover(t, true) })
}

func laggingFailover(t *testing.T, replicateFirst bool) {
	const window = 5 * time.Second
	c := redistest.StartClusterWithReplicas(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const name = "fault-lagging"
	slot, err := c.KeySlot(ctx, "{"+name+"}")
	if err != nil {
		t.Fatal(err)
	}
	master, err := c.Master(ctx, slot)
	if err != nil {
		t.Fatal(err)
	}
	before := runtime.NumGoroutine()
	logs, logger := faultLogger()
	lims, closeClients := faultLimitersFor(t, name, policies.SlidingLog{Limit: faultLimit, Window: window},
		func(int) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, ContextTimeoutEnabled: true,
				ClusterStateReloadInterval: 500 * time.Millisecond})
		}, Options{Logger: logger})
	if replicateFirst {
		// One call, which never reaches the vendor, writes the meta key.
		if d, err := lims[0].Allow(ctx); err != nil || !d.OK {
			t.Fatalf("first call: %+v, %v", d, err)
		}
		if err := c.WaitReplicated(ctx, master); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.DetachReplicas(ctx, master); err != nil {
		t.Fatal(err)
	}
	f := startFaultFleet(t, lims, window)

	time.Sleep(faultWindow) // the fleet fills the window, on the master alone
	master.Kill()
	killed := f.enter(phaseFault)
	promoted, err := c.WaitFailover(ctx, slot, master)
	if err != nil {
		t.Fatal(err)
	}
	failedOver := f.enter(phaseRecovery)
	// Past the window of the fleet's first calls, and the calls after it.
	time.Sleep(time.Until(killed.Add(window + time.Second)))
	f.finish(false)
	closeClients()
	checkGoroutines(t, before)

	lost := strings.Contains(logs.String(), "Redis lost the quota's data")
	t.Logf("slot %d: master %s killed, lagging replica %s promoted %v later; lost data noticed: %v",
		slot, master.Addr, promoted.Addr, failedOver.Sub(killed).Round(time.Millisecond), lost)
	if !lost {
		t.Errorf("no limiter noticed that the promoted replica lacks the quota's data:\n%s", logs.String())
	}
}

// The quota's slot moves to another master while the fleet runs, twice.
//
// First as a resharding moves a slot: MIGRATING/IMPORTING while the source
// still holds the keys, then ASK once one MIGRATE has moved them all, then
// MOVED once the slot is the target's. The cluster client follows ASK and
// MOVED. While the source holds the keys, a script that declares a key the
// source lacks (every key a script may touch is declared: a hint, a cap,
// charges not written yet) is answered TRYAGAIN, and calls fail closed;
// none fails once the slot is the target's and the breaker's next probe
// has found it.
//
// Then back, with the quota's keys moved by two MIGRATEs, as happens when
// a slot holds more keys than one batch: while they are split, the source
// answers every script TRYAGAIN, go-redis retries a few times within tens
// of milliseconds, and the calls fail closed until the keys are together
// again.
func TestFault_SlotMigration(t *testing.T) {
	long(t)
	c := redistest.StartCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := &slotMigration{t: t, ctx: ctx, cluster: c}
	m.findSlot("fault-migrate")
	before := runtime.NumGoroutine()
	lims, closeClients := faultLimiters(t, "fault-migrate", func(int) redis.UniversalClient {
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, ContextTimeoutEnabled: true})
		cc.OnNewNode(func(n *redis.Client) { n.AddHook(&m.seen) })
		return cc
	}, Options{Logger: slog.New(slog.DiscardHandler)})
	m.f = startFaultFleet(t, lims, faultWindow)

	time.Sleep(2 * faultWindow)
	m.moveWhole()
	m.moveBackSplit()
	time.Sleep(2 * faultWindow)
	sum := m.f.finish(false)
	closeClients()
	checkGoroutines(t, before)
	m.check(sum)
}

// slotMigration is a run of TestFault_SlotMigration: the quota's slot, the
// master it lives on and the one it moves to, the fleet, and when each
// step of the two moves happened.
type slotMigration struct {
	t          *testing.T
	ctx        context.Context
	cluster    *redistest.Cluster
	slot       int
	home, away *redistest.Server
	seen       errorCounts
	f          *faultFleet

	began, whole time.Time      // the first move: begun, and the slot the target's
	moved, asks  int            // keys it moved, and scripts redirected with ASK
	afterWhole   map[string]int // errors seen by go-redis when it ended

	split, joined, finished, first time.Time // the move back
}

// findSlot finds the slot of quota name, its master, and another.
func (m *slotMigration) findSlot(name string) {
	t, ctx, nodes := m.t, m.ctx, m.cluster.Nodes
	t.Helper()
	var err error
	if m.slot, err = redistest.KeySlot(ctx, nodes, "{"+name+"}"); err != nil {
		t.Fatal(err)
	}
	if m.home, err = redistest.SlotOwner(ctx, nodes, m.slot); err != nil {
		t.Fatal(err)
	}
	m.away = nodes[0]
	if m.away == m.home {
		m.away = nodes[1]
	}
}

// moveWhole moves the slot away as a resharding does, its keys in one
// MIGRATE, and waits for the fleet's first call on the new owner.
func (m *slotMigration) moveWhole() {
	t, ctx := m.t, m.ctx
	t.Helper()
	m.began = m.f.enter(phaseFault)
	out, err := redistest.StartMigration(ctx, m.cluster.Nodes, m.slot, m.away)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(faultWindow) // the source still serves the quota
	if m.moved, err = out.MoveKeys(ctx); err != nil {
		t.Fatal(err)
	}
	asks := m.seen.get("ASK")
	time.Sleep(faultWindow) // the source answers ASK for every script
	m.asks = m.seen.get("ASK") - asks
	if err := out.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	m.whole = time.Now()
	// The clients learn the new owner from its first MOVED, or a reload.
	m.f.firstSuccess(m.whole, -1, 5*time.Second)
	m.afterWhole = m.seen.snapshot()
}

// moveBackSplit moves the slot home with its keys in two MIGRATEs, a burst
// of the fleet apart, and waits for the fleet's first call after it.
func (m *slotMigration) moveBackSplit() {
	t, ctx := m.t, m.ctx
	t.Helper()
	back, err := redistest.StartMigration(ctx, m.cluster.Nodes, m.slot, m.home)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := redistest.KeysInSlot(ctx, m.away, m.slot)
	if err != nil || len(keys) < 2 {
		t.Fatalf("keys of the quota on %s: %v, %v; want at least 2", m.away.Addr, keys, err)
	}
	if _, err := back.MoveKeys(ctx, keys[0]); err != nil {
		t.Fatal(err)
	}
	m.split = time.Now()
	time.Sleep(faultWindow + 100*time.Millisecond) // long enough for the fleet's next burst
	if _, err := back.MoveKeys(ctx); err != nil {
		t.Fatal(err)
	}
	m.joined = time.Now()
	if err := back.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	m.finished = m.f.enter(phaseRecovery)
	m.first = m.f.firstSuccess(m.finished, -1, 5*time.Second)
}

// check counts the calls that failed during each move and checks that
// each move met what it should, and that calls ran soon after the keys
// were together again.
func (m *slotMigration) check(sum faultTally) {
	t := m.t
	t.Helper()
	var duringWhole, duringSplit int
	var lastSplitFailure time.Duration
	for _, c := range sum.calls {
		if !errors.Is(c.err, ErrUnavailable) {
			continue
		}
		switch {
		case c.end.Before(m.whole.Add(probeLongest + 200*time.Millisecond)):
			duringWhole++
		case c.end.After(m.split):
			duringSplit++
			lastSplitFailure = max(lastSplitFailure, c.end.Sub(m.joined))
		default:
			t.Errorf("a call failed between the two migrations: %v", c.err)
		}
	}
	t.Logf("slot %d: %d keys moved whole from %s to %s (%v); %d ASK while only the target held them; "+
		"then back with the keys split for %v; errors seen by go-redis in all: %v",
		m.slot, m.moved, m.home.Addr, m.away.Addr, m.whole.Sub(m.began).Round(time.Millisecond), m.asks,
		m.joined.Sub(m.split).Round(time.Millisecond), m.seen.snapshot())
	t.Logf("examples: %q", m.seen.examples())
	t.Logf("ErrUnavailable: %d while the slot moved whole, %d while the keys were split, the last %v after they were together again; first call after the migration ran %v after it",
		duringWhole, duringSplit, lastSplitFailure.Round(time.Millisecond), m.first.Sub(m.finished).Round(time.Millisecond))
	if m.moved < 2 {
		t.Errorf("MIGRATE moved %d keys, want the quota's 2 or more", m.moved)
	}
	if m.asks == 0 {
		t.Error("no script was redirected with ASK while only the target held the keys")
	}
	if m.afterWhole["MOVED"] == 0 {
		// go-redis learns the new owner from a MOVED, or from a reload of
		// the slots that a failed dial set going first (a CI run: 16 dial
		// errors, and its first MOVED only in the second migration);
		// either way the calls ran again on the new owner (firstSuccess).
		t.Log("the clients learned the slot's new owner without a MOVED")
	}
	if m.seen.get("TRYAGAIN") == 0 {
		t.Error("no script met TRYAGAIN while the quota's keys were split")
	}
	if lastSplitFailure > 2*time.Second {
		t.Errorf("calls failed until %v after the keys were together again, want within 2s", lastSplitFailure)
	}
}

// errorCounts counts, by kind, the errors go-redis met on the wire, before
// its own retries and redirections: the first word of a Redis error reply
// (NOSCRIPT, ASK, MOVED, TRYAGAIN), or "conn" for a broken connection;
// and new connections, as "dial".
type errorCounts struct {
	mu      sync.Mutex
	n       map[string]int
	example map[string]string
}

func (e *errorCounts) note(cmd redis.Cmder, err error) {
	// go-redis sends CLIENT SETINFO on each new connection, which Redis
	// before 7.2 refuses; that is no fault.
	if err == nil || errors.Is(err, redis.Nil) || cmd.Name() == "client" {
		return
	}
	kind := "conn"
	var re redis.Error
	if errors.As(err, &re) {
		kind, _, _ = strings.Cut(re.Error(), " ")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n, e.example = map[string]int{}, map[string]string{}
	}
	e.n[kind]++
	e.example[kind] = err.Error()
}

func (e *errorCounts) get(kind string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[kind]
}

func (e *errorCounts) examples() map[string]string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.example)
}

func (e *errorCounts) snapshot() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.n)
}

// DialHook counts new connections as "dial".
func (e *errorCounts) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		e.mu.Lock()
		if e.n == nil {
			e.n, e.example = map[string]int{}, map[string]string{}
		}
		e.n["dial"]++
		e.mu.Unlock()
		return next(ctx, network, addr)
	}
}

func (e *errorCounts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		e.note(cmd, err)
		return err
	}
}

func (e *errorCounts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			e.note(c, c.Err())
		}
		return err
	}
}
