package throttle

import (
	"bufio"
	"cmp"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Redis asks a script to name in KEYS every key it touches: Redis Cluster
// routes a script by those names alone, and Dragonfly refuses a key the
// script did not declare. This test takes the library through every path
// of every script on a real redis-server, watches with MONITOR each
// command the scripts run, asks the server which of its words are keys
// (COMMAND GETKEYS), and checks each against the KEYS of the script call
// that ran it.

// TestScripts_TouchOnlyDeclaredKeys names every kind of key a script
// touched without declaring it: the script, the command, and the key's
// role in the call ("<rule key>:next", a batch's "<another key's pause
// key, in ARGV>"), with one such key and how many times.
func TestScripts_TouchOnlyDeclaredKeys(t *testing.T) {
	t.Parallel()
	s := redistest.Real(t)
	mon := startMonitor(t, s.Addr)
	for _, p := range declaredPaths {
		t.Run(p.name, func(t *testing.T) { p.run(t, s) })
	}
	calls := scriptCalls(t, mon.stop(t, s.Client(t)))
	keys := commandKeys(t, s.Client(t), calls)
	checkCoverage(t, calls, keys)
	touches := undeclared(calls, keys)
	for _, u := range touches {
		t.Errorf("%s touched %s, not in KEYS: %s %s (%d times)", u.script, u.example, u.command, u.role, u.count)
	}
	t.Logf("%d script calls; %d kinds of undeclared key touched", len(calls), len(touches))
}

// declaredPaths take the library, through its public API, down every path
// of its scripts, between them every key a script builds.
var declaredPaths = []struct {
	name string
	run  func(*testing.T, *redistest.Server)
}{
	{"a long log's hint", driveHint},
	{"classes", driveClasses},
	{"a class's long log", driveClassHint},
	{"a class's bookings given back", driveClassGiveBack},
	{"a learned cap", driveLearnedCap},
	{"a count before any call", driveCharge},
	{"a rule rebuilt after a loss", driveRebuild},
	{"others' share", driveOthers},
	{"settled costs", driveSettle},
	{"named units", driveUnits},
	{"a wait given up", driveCancel},
	{"concurrency", driveConcurrency},
	{"a clock step back under a concurrency rule", driveConcurrencyStepBack},
	{"a batch of several keys", driveBatch},
	{"a rule shared by two quotas", driveShared},
	{"the Local fallback", driveLocal},
}

// declaredLimiter makes a limiter of quota name on rdb, closed when the
// test ends (giving back what it holds, while MONITOR still watches).
func declaredLimiter(t *testing.T, rdb redis.UniversalClient, name string, p policies.Policy, opts ...Options) *Limiter {
	t.Helper()
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, name, p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close(context.Background()) })
	return lim
}

// mustAllow asks lim for a call now and returns its decision.
func mustAllow(t *testing.T, lim *Limiter, opts ...CallOption) Decision {
	t.Helper()
	d, err := lim.Allow(context.Background(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// fillUp asks lim for calls now until one is refused, most at most, and
// returns how many it admitted.
func fillUp(t *testing.T, lim *Limiter, most int, opts ...CallOption) int {
	t.Helper()
	n := 0
	for n < most && mustAllow(t, lim, opts...).OK {
		n++
	}
	return n
}

// driveHint fills a log with more entries than a search reads whole, so
// that a call it cannot take reads and writes the log's hint; gives the
// entries back (Permit.Cancel), which lowers the hint; and steps Redis's
// clock back, which drops the hint with what lies ahead.
func driveHint(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "hint", policies.SlidingLog{Limit: 2000, Window: time.Second},
		Options{Mode: FailFast, Clock: clock.Now})
	big, err := lim.Acquire(ctx, Cost(2000))
	if err != nil {
		t.Fatal(err)
	}
	if d := mustAllow(t, lim); d.OK {
		t.Fatalf("a call admitted into a full log: %+v", d)
	}
	clock.Add(10 * time.Millisecond)
	if err := big.Cancel(ctx); err != nil {
		t.Fatal(err)
	}
	clock.Add(-10 * time.Second)
	mustAllow(t, lim)
}

// driveClasses has a class of priority 5 book first, under a shared log, a
// shared counter and a log per key, so that the calls of priority 0 after
// it book in their classes' own logs, with a share held for it.
func driveClasses(t *testing.T, s *redistest.Server) {
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "classes", policies.All(
		policies.SlidingLog{Limit: 20, Window: time.Second},
		policies.SlidingCounter{Limit: 20, Window: time.Second, Buckets: 10},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
	), Options{Mode: FailFast, Clock: clock.Now})
	for range 5 {
		for _, key := range []string{"light", "heavy"} {
			mustAllow(t, lim, Key(key), Priority(5))
		}
		fillUp(t, lim, 30, Key("heavy"))
		clock.Add(100 * time.Millisecond)
	}
}

// driveClassGiveBack books calls of a key's class in its own logs, under
// a log, a counter and a rule per key, then settles one, gives one back
// (cancel) and has one book again giving its booking back (acquire): each
// leaves its class's logs and demand.
func driveClassGiveBack(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "class-give-back", policies.All(
		policies.SlidingLog{Limit: 20, Window: time.Second},
		policies.SlidingCounter{Limit: 20, Window: time.Second, Buckets: 10},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
	), Options{Mode: FailFast, Clock: clock.Now})
	mustAllow(t, lim, Key("light"), Priority(5))
	fillUp(t, lim, 30, Key("heavy"))
	c := callOf([]CallOption{Key("heavy"), Cost(2)})
	var booked []result
	for range 3 {
		r, err := lim.acquire(ctx, c, 2*time.Second, nil)
		if err != nil || !r.admitted || r.noted == 0 {
			t.Fatalf("a call of the heavy key's class: %+v, %v; want it booked in its class", r, err)
		}
		booked = append(booked, r)
	}
	if err := lim.permit(c, booked[0], 0).Settle(ctx, Cost(1)); err != nil {
		t.Fatal(err)
	}
	lim.cancel(ctx, c, booked[1])
	if _, err := lim.acquire(ctx, c, 2*time.Second, &booked[2]); err != nil {
		t.Fatal(err)
	}
}

// driveClassHint has a class of priority 5 book first, and calls of
// priority 0 fill their class's own log with more entries than a search
// reads whole: the call it cannot take reads and writes that log's hint.
func driveClassHint(t *testing.T, s *redistest.Server) {
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "class-hint", policies.SlidingLog{Limit: 3000, Window: time.Second},
		Options{Mode: FailFast, Clock: clock.Now})
	for range 10 {
		mustAllow(t, lim, Priority(5))
	}
	clock.Add(time.Millisecond)
	if d := mustAllow(t, lim, Cost(1500)); !d.OK {
		t.Fatalf("a call of half the limit refused: %+v", d)
	}
	if d := mustAllow(t, lim, Cost(1500)); d.OK {
		t.Fatalf("a call admitted past the share held for priority 5: %+v", d)
	}
}

// driveLearnedCap has the vendor refuse a call, which teaches the quota a
// cap (and lists the refused call for the measure of the others); eight
// windows later the fleet fills the cap, which raises it.
func driveLearnedCap(t *testing.T, s *redistest.Server) {
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "cap", policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
		Options{Mode: FailFast, Clock: clock.Now})
	ps := admit(t, lim, clock, 10, time.Millisecond)
	if err := ps[9].refused(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	if got := limitInForce(t, lim); got[0] != 50 {
		t.Fatalf("limit in force %v after a first refusal, want 50", got)
	}
	clock.Add(9 * time.Second)
	fillUp(t, lim, 100)
	if got := limitInForce(t, lim); got[0] <= 50 {
		t.Errorf("limit in force %v once the fleet filled the cap of 50 after its hold, want it raised", got)
	}
}

// driveCharge tells a quota that has decided no call yet that the vendor
// has 60 of 100 units left (a restart, another consumer of the key): the
// gap is charged to a log and a counter, and listed as their charges.
func driveCharge(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "charge", policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.SlidingCounter{Limit: 100, Window: time.Second, Buckets: 10},
	), Options{Mode: FailFast, Clock: clock.Now})
	if err := lim.SetRemaining(ctx, 60, time.Second); err != nil {
		t.Fatal(err)
	}
	if u, err := lim.Usage(ctx); err != nil || u.Remaining != 60 {
		t.Errorf("Usage %+v, %v: want 60 remaining once the vendor said so", u, err)
	}
}

// driveRebuild loses a quota's keys, which makes every rule blind: a
// scout goes out once a bucket has refilled a unit, and its answer, which
// states the log's limit, rebuilds the log (:rb); acquire, feedback and
// usage read each rule's :rb.
func driveRebuild(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	rdb := s.Client(t)
	lim := declaredLimiter(t, rdb, "rebuild", policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Minute},
		policies.SlidingCounter{Limit: 1000, Window: time.Hour, Buckets: 60},
		policies.TokenBucket{Rate: 100, Per: time.Hour, Burst: 100},
	), Options{Mode: FailFast, Clock: clock.Now})
	count := Answer{Status: http.StatusOK, Requests: &Count{Remaining: 90, Reset: 30 * time.Second, Limit: 100}}
	p, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Heard(ctx, count); err != nil {
		t.Fatal(err)
	}
	keys, err := rdb.Keys(ctx, "*{rebuild}*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("the quota's keys: %v, %v", keys, err)
	}
	if err := rdb.Del(ctx, keys...).Err(); err != nil {
		t.Fatal(err)
	}
	if mustAllow(t, lim).OK {
		t.Fatal("a call right after the loss was admitted")
	}
	clock.Add(40 * time.Second)
	scout, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatalf("the scout: %v", err)
	}
	if _, _, err := scout.Heard(ctx, count); err != nil {
		t.Fatal(err)
	}
	if u, err := lim.Usage(ctx); err != nil || u.Rules[0].Remaining != 90 {
		t.Errorf("Usage %+v, %v: want the log rebuilt, the 90 the vendor left", u, err)
	}
}

// driveOthers calls through a Transport a vendor whose counts show
// another consumer spending 40 units beside the fleet: the quota's log
// and counter leave them their share. The vendor then states a higher
// limit, which leaves the fleet more room (a log's hint goes; a counter
// has none); once the other stops, a count measures no one, and the share
// goes.
func driveOthers(t *testing.T, s *redistest.Server) {
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "others", policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.SlidingCounter{Limit: 100, Window: time.Second, Buckets: 10},
	), Options{Clock: clock.Now})
	var sent, limit atomic.Int64
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("X-RateLimit-Limit", strconv.FormatInt(limit.Load(), 10))
		w.Header().Set("X-RateLimit-Remaining", strconv.FormatInt(limit.Load()-40-sent.Add(1), 10))
	}))
	t.Cleanup(vendor.Close)
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	client := &http.Client{Transport: &Transport{Base: base, Limiter: lim}}
	limit.Store(90)
	for i := range 6 {
		if i == 5 {
			limit.Store(100)
		}
		resp, err := client.Get(vendor.URL)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		clock.Add(10 * time.Millisecond)
	}
	ctx := context.Background()
	// 57: 100 stated, less 40 and 3 more left to the other consumer; 58
	// when the measure errs a unit low, as it did once beside CI's race
	// run ([58 58]; the measure errs only low, lua/lib.lua's Others' share).
	if got := limitInForce(t, lim); got[0] < 57 || got[0] > 58 || got[1] >= 100 {
		t.Fatalf("limits in force %v, want 57 or 58 for the log (100 stated, less 40 and a few units more left to the other consumer), and the counter's lowered", got)
	}
	// A count of one call, the fleet less busy than when it measured the
	// others: their share is held up to four windows (Others' share in
	// lua/lib.lua), and gone after.
	clock.Add(5 * time.Second)
	mustAllow(t, lim)
	if err := lim.SetRemaining(ctx, 99, time.Second); err != nil {
		t.Fatal(err)
	}
	if u, err := lim.Usage(ctx); err != nil || u.Rules[0].Others != 0 || u.Rules[1].Others != 0 {
		t.Errorf("Usage %+v, %v: want no share left once the other consumer stopped", u, err)
	}
}

// driveSettle settles a call's cost from Do's fn, lower (a refund, which
// lowers a log's hint and is listed for the measure of the others) and
// then higher, under every kind of counting rule; a vendor's count then
// reads the refunds, and a refusal lists the refused call.
func driveSettle(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "settle", policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.SlidingCounter{Limit: 100, Window: time.Second, Buckets: 10},
		policies.TokenBucket{Rate: 100, Per: time.Second, Burst: 100},
	), Options{Clock: clock.Now})
	_, err := Do(ctx, lim, func(ctx context.Context) (struct{}, error) {
		p := PermitFrom(ctx)
		if err := p.Settle(ctx, Cost(3)); err != nil {
			return struct{}{}, err
		}
		return struct{}{}, p.Settle(ctx, Cost(12))
	}, Cost(10))
	if err != nil {
		t.Fatal(err)
	}
	clock.Add(10 * time.Millisecond)
	if err := lim.SetRemaining(ctx, 50, time.Second); err != nil {
		t.Fatal(err)
	}
	p, err := lim.Acquire(ctx, Cost(2))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.refused(ctx, 0); err != nil {
		t.Fatal(err)
	}
	p.Release()
	if _, err := lim.Usage(ctx); err != nil {
		t.Fatal(err)
	}
}

// driveUnits takes a call of two named units and settles both; the
// vendor's answer counts requests and one of the units.
func driveUnits(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "units", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Second}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Second}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingCounter{Limit: 8_000, Window: time.Second, Buckets: 10}},
	), Options{Mode: FailFast, Clock: clock.Now})
	p, err := lim.Acquire(ctx, CostIn("input_tokens", 1000), CostIn("output_tokens", 500))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	if err := p.Settle(ctx, CostIn("input_tokens", 700), CostIn("output_tokens", 900)); err != nil {
		t.Fatal(err)
	}
	_, _, err = p.Heard(ctx, Answer{
		Status:   http.StatusOK,
		Requests: &Count{Remaining: 40, Limit: 50},
		Units:    map[string]*Count{"input_tokens": {Remaining: 20_000, Limit: 30_000}},
	})
	if err != nil {
		t.Fatal(err)
	}
}

// driveCancel has a call wait in Block mode for a full window, and gives
// its wait up through its context: the booking goes back.
func driveCancel(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	lim := declaredLimiter(t, s.Client(t), "cancel", policies.SlidingLog{Limit: 2, Window: time.Second})
	for range 2 {
		if d := mustAllow(t, lim); !d.OK {
			t.Fatalf("a call of an empty window refused: %+v", d)
		}
	}
	booked := func(n int) func() bool {
		return func() bool {
			u, err := lim.Usage(ctx)
			return err == nil && (u.Rules[0].Booked > 0) == (n > 0)
		}
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	waited := make(chan error, 1)
	go func() {
		_, err := lim.Acquire(wctx, Cost(2))
		waited <- err
	}()
	waitFor(t, booked(1), "the waiting call's booking")
	stop()
	if err := <-waited; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire given up while waiting: %v, want context.Canceled", err)
	}
	waitFor(t, booked(0), "the booking of the call that gave up to go back")
}

// driveConcurrency takes a slot, is refused a second, extends the first
// one's lease and releases it.
func driveConcurrency(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	lim := declaredLimiter(t, s.Client(t), "concurrency", policies.Concurrency{Max: 1, Lease: 10 * time.Second},
		Options{Mode: FailFast})
	p, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Acquire(ctx); !errors.Is(err, ErrLimited) {
		t.Errorf("a second Acquire while the slot is held: %v, want ErrLimited", err)
	}
	if err := p.Extend(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	p.Release()
}

// driveShared takes two quotas through a rule they share: their calls, a
// refusal that teaches both rules a cap, a vendor's count, their usage.
func driveShared(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	shared := policies.Shared{Name: "vendor", Policy: policies.SlidingLog{Limit: 50, Window: time.Second}}
	for _, name := range []string{"routes-a", "routes-b"} {
		lim := declaredLimiter(t, s.Client(t), name, policies.All(policies.SlidingLog{Limit: 20, Window: time.Second}, shared),
			Options{Mode: FailFast, Clock: clock.Now})
		ps := admit(t, lim, clock, 3, time.Millisecond, Priority(1))
		if err := ps[2].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if err := lim.SetRemaining(ctx, 10, time.Second); err != nil {
			t.Fatal(err)
		}
		if _, err := lim.Usage(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// driveConcurrencyStepBack holds a slot of a concurrency rule, then steps
// Redis's clock back: the script that finds the step drops what the rule
// holds ahead of the new clock, and counts the rule as taken for a lease.
// A concurrency rule keeps no hint to drop.
func driveConcurrencyStepBack(t *testing.T, s *redistest.Server) {
	clock := newClock()
	lim := declaredLimiter(t, s.Client(t), "concurrency-step-back", policies.Concurrency{Max: 2, Lease: 10 * time.Second},
		Options{Mode: FailFast, Clock: clock.Now})
	p, err := lim.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	clock.Add(-time.Minute)
	if d := mustAllow(t, lim); d.OK {
		t.Errorf("a call admitted right after a step back: %+v; want the rule taken for a lease", d)
	}
}

// errInjectedOutage is the failure a hook returns for a Redis gone away.
var errInjectedOutage = errors.New("injected: connection reset")

// driveLocal has Redis fail the script calls of a few calls, which the
// Local fallback then decides without it, and answer again: a call back
// on Redis first hands the fallback's turn back to it.
func driveLocal(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	var down, handedBack atomic.Bool
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	t.Cleanup(func() { _ = rdb.Close() })
	rdb.AddHook(scriptHook{
		before: func(string) error {
			if down.Load() {
				return errInjectedOutage
			}
			return nil
		},
		after: func(name string, err error) {
			if name == "handback" && err == nil {
				handedBack.Store(true)
			}
		},
	})
	lim := declaredLimiter(t, rdb, "local", policies.SlidingLog{Limit: 100, Window: time.Second},
		Options{OnRedisError: Local, ExpectedReplicas: 2, Logger: quiet()})
	mustAllow(t, lim)
	down.Store(true)
	for range 3 {
		mustAllow(t, lim)
	}
	down.Store(false)
	waitFor(t, func() bool { _, _ = lim.Allow(ctx); return handedBack.Load() }, "the hand-back")
}

// driveBatch has one script call decide the calls of four keys of a quota
// of per-key rules, in a known order: the first acquire script call is
// held until the others wait in the limiter's lane, one after another.
// Each key's priority 5 booked first, so the batch's calls book in their
// classes' logs; one key is paused; and Redis's clock goes back before
// the batch, which moves every key's pause and drops what each key's rules
// hold ahead.
func driveBatch(t *testing.T, s *redistest.Server) {
	ctx := context.Background()
	clock := newClock()
	var armed atomic.Bool
	entered, release := make(chan struct{}), make(chan struct{})
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	t.Cleanup(func() { _ = rdb.Close() })
	rdb.AddHook(scriptHook{before: func(name string) error {
		if name == "acquire" && armed.CompareAndSwap(true, false) {
			close(entered)
			<-release
		}
		return nil
	}})
	lim := declaredLimiter(t, rdb, "batch", policies.PerKey{Policy: policies.All(
		policies.SlidingLog{Limit: 5, Window: time.Second},
		policies.SlidingCounter{Limit: 5, Window: time.Second, Buckets: 10},
	)}, Options{Mode: FailFast, Clock: clock.Now, RedisTimeout: 10 * time.Second, Logger: quiet()})
	keys := []string{"k0", "k1", "k2", "k3"}
	for _, k := range keys {
		mustAllow(t, lim, Key(k), Priority(5))
	}
	if err := lim.Pause(ctx, 20*time.Second, Key("k1")); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	call := func(k string) { wg.Go(func() { _, _ = lim.Allow(ctx, Key(k)) }) }
	armed.Store(true)
	call("k0")
	<-entered
	for i, k := range keys {
		call(k)
		waitFor(t, func() bool { return lanePending(lim) == i+1 }, "the call of "+k+" in the lane")
	}
	clock.Add(-6 * time.Second)
	close(release)
	wg.Wait()
}

// lanePending returns how many calls of l wait in its lane for the next
// script call.
func lanePending(l *Limiter) int {
	l.batches.lanesMu.Lock()
	defer l.batches.lanesMu.Unlock()
	if l.batches.lane == nil {
		return 0
	}
	return len(l.batches.lane.pending)
}

// scriptHook is a go-redis hook that sees the library's script calls:
// before runs, when set, with the script's name before the call goes out,
// and an error it returns fails the call unsent, as a Redis gone away
// would; after, when set, with the call's outcome.
type scriptHook struct {
	before func(name string) error
	after  func(name string, err error)
}

func (scriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := scriptOf(cmd)
		if name == "" {
			return next(ctx, cmd)
		}
		if h.before != nil {
			if err := h.before(name); err != nil {
				cmd.SetErr(err)
				return err
			}
		}
		err := next(ctx, cmd)
		if h.after != nil {
			h.after(name, err)
		}
		return err
	}
}

// scriptOf returns the name of the library's script that cmd runs, or "".
func scriptOf(cmd redis.Cmder) string {
	args := cmd.Args()
	if len(args) < 2 {
		return ""
	}
	s, _ := args[1].(string)
	switch cmd.Name() {
	case "evalsha":
		return scriptNames()[strings.ToLower(s)]
	case "eval":
		return scriptNames()[sha1Hex(s)]
	}
	return ""
}

// scriptNames maps the SHA1 of each of the library's scripts to its name.
var scriptNames = sync.OnceValue(func() map[string]string {
	return map[string]string{
		scripts.acquire.Hash():  "acquire",
		scripts.cancel.Hash():   "cancel",
		scripts.settle.Hash():   "settle",
		scripts.release.Hash():  "release",
		scripts.feedback.Hash(): "feedback",
		scripts.usage.Hash():    "usage",
		scripts.handback.Hash(): "handback",
	}
})

// sha1Hex is the SHA1 of s in hex, as EVALSHA names a script.
func sha1Hex(s string) string {
	sum := sha1.Sum([]byte(s))
	return hex.EncodeToString(sum[:])
}

// monitor records the commands a redis-server runs, as MONITOR shows them,
// from its start until an ECHO of mark.
type monitor struct {
	conn  net.Conn
	mark  string
	seen  chan struct{} // closed once the ECHO of mark was read
	done  chan struct{} // closed when the reader stops
	lines []monitorLine // the reader's until done is closed
	err   error         // the reader's until done is closed
}

// monitorLine is one command MONITOR showed: who ran it ("lua" for a
// script) and its words.
type monitorLine struct {
	client string
	argv   []string
}

// startMonitor opens a MONITOR connection to addr, and reads it until the
// monitor is stopped.
func startMonitor(t *testing.T, addr string) *monitor {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	r := bufio.NewReaderSize(conn, 1<<20)
	if _, err := io.WriteString(conn, "MONITOR\r\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := r.ReadString('\n'); err != nil || line != "+OK\r\n" {
		t.Fatalf("MONITOR answered %q, %v", line, err)
	}
	m := &monitor{conn: conn, mark: "declared-test-end-" + newID(), seen: make(chan struct{}), done: make(chan struct{})}
	go m.read(r)
	return m
}

// read parses what MONITOR sends until the connection closes.
func (m *monitor) read(r *bufio.Reader) {
	defer close(m.done)
	marked := false
	for {
		raw, err := r.ReadString('\n')
		if err != nil {
			if !marked {
				m.err = err
			}
			return
		}
		line, err := parseMonitorLine(raw)
		switch {
		case err != nil:
			m.err = err
			return
		case line.client != "lua" && len(line.argv) == 2 && strings.EqualFold(line.argv[0], "echo") && line.argv[1] == m.mark:
			marked = true
			close(m.seen)
		case !marked:
			m.lines = append(m.lines, line)
		}
	}
}

// stop sends the ECHO that ends the recording through rdb, waits for
// MONITOR to show it, and returns the lines before it.
func (m *monitor) stop(t *testing.T, rdb *redis.Client) []monitorLine {
	t.Helper()
	if err := rdb.Echo(context.Background(), m.mark).Err(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-m.seen:
	case <-m.done:
	case <-time.After(10 * time.Second):
		t.Fatal("MONITOR did not show the end of the recording within 10s")
	}
	_ = m.conn.Close()
	<-m.done
	if m.err != nil {
		t.Fatalf("MONITOR: %v", m.err)
	}
	return m.lines
}

// parseMonitorLine reads a line such as
// +1700000000.123456 [0 127.0.0.1:5555] "get" "k".
func parseMonitorLine(raw string) (monitorLine, error) {
	s := strings.TrimSuffix(strings.TrimPrefix(raw, "+"), "\r\n")
	open, end := strings.IndexByte(s, '['), strings.Index(s, "] ")
	if open < 0 || end < open {
		return monitorLine{}, fmt.Errorf("unexpected MONITOR line %q", raw)
	}
	_, client, _ := strings.Cut(s[open+1:end], " ")
	argv, err := unquoteWords(s[end+2:])
	if err != nil || len(argv) == 0 {
		return monitorLine{}, fmt.Errorf("MONITOR line %q: %v", raw, err)
	}
	return monitorLine{client: client, argv: argv}, nil
}

// monitorEscapes are the bytes MONITOR writes as a backslash and a letter,
// by the letter; others but quotes and backslashes are written in hex.
var monitorEscapes = map[byte]byte{'n': '\n', 'r': '\r', 't': '\t', 'a': '\a', 'b': '\b'}

// unquoteWords splits MONITOR's quoted words ("get" "a\"b"), undoing the
// escapes Redis writes in them.
func unquoteWords(s string) ([]string, error) {
	var words []string
	for i := 0; i < len(s); {
		if s[i] == ' ' {
			i++
			continue
		}
		if s[i] != '"' {
			return nil, fmt.Errorf("a word starts with %q at %d", s[i], i)
		}
		var b strings.Builder
		for i++; ; i++ {
			if i >= len(s) {
				return nil, errors.New("an unterminated word")
			}
			if s[i] == '"' {
				i++
				break
			}
			if s[i] != '\\' || i+1 >= len(s) {
				b.WriteByte(s[i])
				continue
			}
			i++
			switch c := s[i]; {
			case monitorEscapes[c] != 0:
				b.WriteByte(monitorEscapes[c])
			case c == 'x':
				v, err := strconv.ParseUint(s[i+1:min(i+3, len(s))], 16, 8)
				if err != nil {
					return nil, fmt.Errorf("a bad escape at %d: %v", i, err)
				}
				b.WriteByte(byte(v))
				i += 2
			default:
				b.WriteByte(c)
			}
		}
		words = append(words, b.String())
	}
	return words, nil
}

// A MONITOR line comes apart into who ran the command and its words, the
// escapes Redis writes in them undone.
func TestParseMonitorLine_UndoesRedisEscapes(t *testing.T) {
	for _, c := range []struct {
		raw, client string
		argv        []string
	}{
		{"+1700000000.123456 [0 127.0.0.1:5555] \"evalsha\" \"ab\" \"1\" \"k\"\r\n", "127.0.0.1:5555", []string{"evalsha", "ab", "1", "k"}},
		{`+1700000000.123456 [0 lua] "get" "we\"ird\\key"` + "\r\n", "lua", []string{"get", `we"ird\key`}},
		{`+1700000000.123456 [0 lua] "set" "a\nb\x00\xffc" ""` + "\r\n", "lua", []string{"set", "a\nb\x00\xffc", ""}},
	} {
		got, err := parseMonitorLine(c.raw)
		if err != nil || got.client != c.client || !slices.Equal(got.argv, c.argv) {
			t.Errorf("parseMonitorLine(%q) = %q %q, %v; want %q %q", c.raw, got.client, got.argv, err, c.client, c.argv)
		}
	}
}

// scriptCall is one run of a script as MONITOR showed it: the script's
// name, the keys and arguments it was given, and the commands it ran.
type scriptCall struct {
	name     string
	keys     []string
	args     []string
	commands [][]string
}

// scriptCalls groups MONITOR's lines into script calls. A script is
// atomic: each command it runs follows the EVALSHA or EVAL that started it
// (go-redis sends EVAL after EVALSHA answered NOSCRIPT), with no other
// client's command before its own commands are done.
func scriptCalls(t *testing.T, lines []monitorLine) []*scriptCall {
	t.Helper()
	var calls []*scriptCall
	var cur *scriptCall
	for _, l := range lines {
		if l.client == "lua" {
			if cur == nil {
				t.Fatalf("MONITOR showed a script's command %q before any script", l.argv)
			}
			cur.commands = append(cur.commands, l.argv)
			continue
		}
		cmd := strings.ToLower(l.argv[0])
		if cmd != "eval" && cmd != "evalsha" {
			continue
		}
		if len(l.argv) < 3 {
			t.Fatalf("MONITOR showed a script call %q", l.argv)
		}
		n, err := strconv.Atoi(l.argv[2])
		if err != nil || 3+n > len(l.argv) {
			t.Fatalf("MONITOR showed a script call %q", l.argv)
		}
		sha := strings.ToLower(l.argv[1])
		if cmd == "eval" {
			sha = sha1Hex(l.argv[1])
		}
		name := cmp.Or(scriptNames()[sha], "script "+sha)
		cur = &scriptCall{name: name, keys: l.argv[3 : 3+n], args: l.argv[3+n:]}
		calls = append(calls, cur)
	}
	return calls
}

// commandID names a command by its words.
func commandID(argv []string) string { return strings.Join(argv, "\x00") }

// commandKeys asks the server which words of each command the scripts ran
// are keys (COMMAND GETKEYS), by commandID, a thousand commands a round
// trip. A command without arguments (TIME), and one whose words name no
// key (PUBLISH: a channel is no key), have none.
func commandKeys(t *testing.T, rdb *redis.Client, calls []*scriptCall) map[string][]string {
	t.Helper()
	ctx := context.Background()
	keys := map[string][]string{}
	var batch [][]string
	flush := func() {
		pipe := rdb.Pipeline()
		cmds := make([]*redis.Cmd, len(batch))
		for i, argv := range batch {
			args := []any{"COMMAND", "GETKEYS"}
			for _, a := range argv {
				args = append(args, a)
			}
			cmds[i] = pipe.Do(ctx, args...)
		}
		_, _ = pipe.Exec(ctx) // each command's error is its own
		for i, c := range cmds {
			ks, err := c.StringSlice()
			if err != nil && !strings.Contains(err.Error(), "no key arguments") {
				t.Fatalf("COMMAND GETKEYS %q: %v", batch[i], err)
			}
			keys[commandID(batch[i])] = ks
		}
		batch = batch[:0]
	}
	for _, c := range calls {
		for _, argv := range c.commands {
			id := commandID(argv)
			if _, ok := keys[id]; ok || len(argv) < 2 {
				continue
			}
			keys[id] = nil
			if batch = append(batch, argv); len(batch) == 1000 {
				flush()
			}
		}
	}
	flush()
	return keys
}

// touch is one kind of undeclared key some script touched: the script,
// the command, and the key's role, with one such key and how many times.
type touch struct {
	script, command, role, example string
	count                          int
}

// undeclared returns every kind of key a script call touched outside its
// KEYS, by script, role and command.
func undeclared(calls []*scriptCall, keys map[string][]string) []touch {
	found := map[[3]string]*touch{}
	for _, c := range calls {
		for _, argv := range c.commands {
			for _, k := range keys[commandID(argv)] {
				if slices.Contains(c.keys, k) {
					continue
				}
				u := touch{script: c.name, command: strings.ToUpper(argv[0]), role: roleOf(c, k), example: k}
				id := [3]string{u.script, u.role, u.command}
				if found[id] == nil {
					found[id] = &u
				}
				found[id].count++
			}
		}
	}
	var out []touch
	for _, u := range found {
		out = append(out, *u)
	}
	slices.SortFunc(out, func(a, b touch) int {
		return cmp.Or(cmp.Compare(a.script, b.script), cmp.Compare(a.role, b.role), cmp.Compare(a.command, b.command))
	})
	return out
}

// roleOf names what key is to script call c: a key the call names (its
// meta, its pause, a rule's key; in a batch, another key's pause or rule
// key passed in ARGV), or a key built from one of those, the longest
// ("<rule key>:next"), its class's name as <class>.
func roleOf(c *scriptCall, key string) string {
	named := map[string]string{}
	tag := "}" // the quota's keys' start, up to the end of their hash tag
	if len(c.keys) > 0 {
		before, _, _ := strings.Cut(c.keys[0], "}")
		tag = before + tag
	}
	for _, a := range c.args {
		switch {
		case !strings.HasPrefix(a, tag):
		case strings.Contains(a, ":pause:"):
			named[a] = "<another key's pause key, in ARGV>"
		default:
			named[a] = "<another key's rule key, in ARGV>"
		}
	}
	// Backwards, so that the meta names KEYS[2] too when it is the pause.
	for i, k := range slices.Backward(c.keys) {
		switch i {
		case 0:
			named[k] = "<meta key>"
		case 1:
			named[k] = "<pause key>"
		default:
			named[k] = "<rule key>"
		}
	}
	var describe func(k string) string
	describe = func(k string) string {
		base := ""
		for b := range named {
			if len(b) > len(base) && b != k && strings.HasPrefix(k, b+":") {
				base = b
			}
		}
		switch {
		case base != "":
			return describe(base) + classless(k[len(base):])
		case named[k] != "":
			return named[k]
		}
		return "<a key the call does not name>"
	}
	return describe(key)
}

// classless writes the class's name in a suffix of a class's log
// (":c:5/key") as <class>.
func classless(suffix string) string {
	rest, ok := strings.CutPrefix(suffix, ":c:")
	if !ok {
		return suffix
	}
	if i := strings.IndexByte(rest, ':'); i >= 0 {
		return ":c:<class>" + rest[i:]
	}
	return ":c:<class>"
}

// builtKeys match the keys the scripts build from a rule's key: a log's
// hint, a learned cap (and the others' share), charges, refunds, refused
// calls, classes, a class's log and its hint; and the group's key, built
// from the meta key. A path that reaches each must still run, or an
// undeclared key there would pass unseen.
var builtKeys = []*regexp.Regexp{
	regexp.MustCompile(`:next$`), regexp.MustCompile(`:cap$`), regexp.MustCompile(`:ch$`),
	regexp.MustCompile(`:rf$`), regexp.MustCompile(`:rj$`), regexp.MustCompile(`:cl$`),
	regexp.MustCompile(`:c:[^:]+$`), regexp.MustCompile(`:c:[^:]+:next$`), regexp.MustCompile(`}//group$`),
	regexp.MustCompile(`:rb$`), regexp.MustCompile(`}:ran$`),
}

// checkCoverage checks that the paths ran every script, touched every
// kind of key the scripts build, and had one script call decide the calls
// of several keys (it reads the pause of more than one).
func checkCoverage(t *testing.T, calls []*scriptCall, keys map[string][]string) {
	t.Helper()
	ran, touched, several := map[string]bool{}, map[string]bool{}, false
	for _, c := range calls {
		ran[c.name] = true
		pauses := map[string]bool{}
		for _, argv := range c.commands {
			for _, k := range keys[commandID(argv)] {
				touched[k] = true
				if strings.Contains(k, ":pause:") {
					pauses[k] = true
				}
			}
		}
		several = several || c.name == "acquire" && len(pauses) > 1
	}
	for _, n := range slices.Sorted(maps.Values(scriptNames())) {
		if !ran[n] {
			t.Errorf("no path ran %s.lua", n)
		}
	}
	all := slices.Collect(maps.Keys(touched))
	for _, built := range builtKeys {
		if !slices.ContainsFunc(all, built.MatchString) {
			t.Errorf("no script touched a key matching %s: no path reaches it any more", built)
		}
	}
	if !several {
		t.Error("no acquire script call decided the calls of several keys")
	}
}
