package throttle

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// githubLike returns a route's policy: its own limit per token, and the
// secondary limit of 3 in flight per token, shared with every route.
func githubLike(perHour int) policies.Policy {
	return policies.All(
		policies.PerKey{Policy: policies.SlidingLog{Limit: perHour, Window: time.Hour}},
		policies.Shared{Name: "gh", Policy: policies.PerKey{Policy: policies.Concurrency{Max: 3, Lease: time.Minute}}},
	)
}

// newRoute returns the limiter of a route's quota, named after the test.
func newRoute(t *testing.T, rdb redis.UniversalClient, route string, p policies.Policy, opts ...Options) *Limiter {
	t.Helper()
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, route+"-"+strings.NewReplacer("/", "-", " ", "-").Replace(t.Name()), p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// sharedRoutes checks that two quotas hold one Concurrency of a token
// between them, each deciding in one script call: 2 calls of core and 1
// of search take the token's 3; a fourth, on either, is refused; a call of
// another token is not; a slot core frees goes to search.
func sharedRoutes(t *testing.T, rdb redis.UniversalClient) {
	ctx := context.Background()
	core := newRoute(t, rdb, "core", githubLike(5000), Options{Mode: FailFast})
	search := newRoute(t, rdb, "search", githubLike(30), Options{Mode: FailFast})
	var held []*Permit
	for _, lim := range []*Limiter{core, core, search} {
		p, err := lim.Acquire(ctx, Key("token-a"))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
	}
	for _, lim := range []*Limiter{core, search} {
		if _, err := lim.Acquire(ctx, Key("token-a")); !errors.Is(err, ErrLimited) {
			t.Fatalf("a fourth call of token-a on %s: %v; want ErrLimited: the token's 3 in flight are taken on both routes", lim.Name(), err)
		}
	}
	if _, err := search.Acquire(ctx, Key("token-b")); err != nil {
		t.Fatalf("token-b, whose slots are free: %v", err)
	}
	held[0].Release()
	if _, err := search.Acquire(ctx, Key("token-a")); err != nil {
		t.Fatalf("a slot core freed, taken by search: %v", err)
	}
	u, err := core.Usage(ctx, Key("token-a"))
	if err != nil {
		t.Fatal(err)
	}
	if used := u.Rules[1].Used; used != 3 {
		t.Errorf("core's Usage shows %d of token-a's shared slots in use, want 3 (1 of core's, 2 of search's)", used)
	}
}

func TestShared_OneConcurrencyAcrossTwoQuotas(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		sharedRoutes(t, s.Client(t))
	})
}

// On Redis Cluster, every key of both quotas carries the group's hash
// tag: one script call reaches the shared rule and each quota's own.
func TestShared_OneConcurrencyAcrossTwoQuotasOnCluster(t *testing.T) {
	t.Parallel() // a Cluster of its own
	c := redistest.StartCluster(t)
	sharedRoutes(t, c.Client(t))
}

// Both quotas name the shared rule's key alike, and each keeps its own
// keys apart from the other's, all under the group's hash tag.
func TestShared_KeysCarryTheGroupsHashTag(t *testing.T) {
	s := redistest.Mini(t)
	core := newRoute(t, s.Client(t), "core", githubLike(5000))
	search := newRoute(t, s.Client(t), "search", githubLike(30))
	for _, lim := range []*Limiter{core, search} {
		for _, k := range lim.cfg.shared {
			if !strings.HasPrefix(k, "throttle:{gh}/") {
				t.Errorf("%s: key %q, want the hash tag {gh} and a slash after it", lim.Name(), k)
			}
		}
	}
	if core.cfg.shared[3] != search.cfg.shared[3] || core.cfg.shared[2] == search.cfg.shared[2] || core.cfg.shared[0] == search.cfg.shared[0] {
		t.Errorf("keys core %q, search %q: want the shared rule's alike, the others apart", core.cfg.shared, search.cfg.shared)
	}
}

func TestShared_BadConfigurationsAreErrors(t *testing.T) {
	rdb := redistest.Mini(t).Client(t)
	conc := policies.Concurrency{Max: 8}
	for _, tc := range []struct {
		name   string
		policy policies.Policy
		opts   Options
		want   string
	}{
		{"empty name", policies.Shared{Policy: conc}, Options{}, `Shared.Name`},
		{"a brace in the name", policies.Shared{Name: "g{h}", Policy: conc}, Options{}, `"g{h}"`},
		{"no policy", policies.Shared{Name: "gh"}, Options{}, `Shared "gh": Policy is nil`},
		{"nested", policies.Shared{Name: "gh", Policy: policies.Shared{Name: "x", Policy: conc}}, Options{}, "another Shared"},
		{"two names", policies.All(policies.Shared{Name: "a", Policy: conc}, policies.Shared{Name: "b", Policy: policies.SlidingLog{Limit: 1, Window: time.Second}}), Options{}, `"a" and "b"`},
		{"a bad policy", policies.Shared{Name: "gh", Policy: policies.Concurrency{Max: -1}}, Options{}, `Shared "gh"`},
		{"the Local fallback", policies.Shared{Name: "gh", Policy: conc}, Options{OnRedisError: Local, ExpectedReplicas: 2}, "Local"},
	} {
		_, err := New(rdb, "q", tc.policy, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New = %v, want an error naming %s", tc.name, err, tc.want)
		}
	}
}

// sharedLog returns the quotas a and b of a group that shares a log of
// limit a second, each FailFast on clock.
func sharedLog(t *testing.T, s *redistest.Server, clock *fixedClock, limit int, opts Options) (a, b *Limiter) {
	t.Helper()
	p := policies.Shared{Name: "v", Policy: policies.SlidingLog{Limit: limit, Window: time.Second}}
	opts.Mode, opts.Clock = FailFast, clock.Now
	return newRoute(t, s.Client(t), "a", p, opts), newRoute(t, s.Client(t), "b", p, opts)
}

// A cap that one quota of a group learns from a refusal is the limit in
// force of the shared rule in every quota of the group: the other quota
// admits no more than it in a window, and a refusal of the other quota's
// lowers it from there, as a refusal of the first quota's would.
func TestShared_ACapLearnedHoldsInEveryQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		clock := newClock()
		a, b := sharedLog(t, s, clock, 40, Options{})
		ps := admit(t, a, clock, 10, 10*time.Millisecond)
		for _, p := range ps[8:] {
			if err := p.refused(ctx, 0); err != nil {
				t.Fatal(err)
			}
		}
		if got, want := limitInForce(t, a), []int{20}; !slices.Equal(got, want) {
			t.Fatalf("a's limit in force %v after two refusals, want %v: a first refusal halves it", got, want)
		}
		if got, want := limitInForce(t, b), []int{20}; !slices.Equal(got, want) {
			t.Errorf("b's limit in force %v, want a's %v: the rule is one for both", got, want)
		}
		clock.Add(2 * time.Second)
		if n := admittedIn(b, clock, time.Second, 10*time.Millisecond); n > 20 {
			t.Errorf("b admitted %d calls in a window of the shared rule whose cap is 20", n)
		}
		// b's 12th call of the next window is refused: the cap drops to
		// the 11 the vendor accepted before it, in both quotas.
		clock.Add(2 * time.Second)
		ps = admit(t, b, clock, 12, 10*time.Millisecond)
		if err := ps[11].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		for _, lim := range []*Limiter{a, b} {
			if got, want := limitInForce(t, lim), []int{11}; !slices.Equal(got, want) {
				t.Errorf("%s's limit in force %v after b's refusal, want %v: what the vendor accepted before it", lim.Name(), got, want)
			}
		}
	})
}

// The share of the vendor's key that other consumers spend, as one quota
// of a group measured it, is left to them by every quota of the group;
// and a later count the other quota gives, which measures them lower in
// the same period, keeps the largest measure, as it does within a quota.
func TestShared_OthersShareKeptAcrossTheGroup(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		clock := newClock()
		a, b := sharedLog(t, s, clock, 10, Options{WithoutLearning: true})
		ps := admit(t, a, clock, 4, time.Millisecond)
		a.dropAllSpares(ctx) // a's 4 calls alone in the log
		// The vendor counted a's 4 and 2 of another consumer's.
		if _, _, err := ps[3].Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 4, Limit: 10}}); err != nil {
			t.Fatal(err)
		}
		// 2 units, and the spare of one (others_reserve).
		for _, lim := range []*Limiter{a, b} {
			if u := usageOf(t, lim); u.Rules[0].Others != 3 || u.Rules[0].Limit != 7 {
				t.Errorf("%s leaves others %d, limit in force %d; want 3 and 7", lim.Name(), u.Rules[0].Others, u.Rules[0].Limit)
			}
		}
		// b's call, and a count that measures the others at 1: the
		// largest measure of the period stays.
		p := admit(t, b, clock, 1, time.Millisecond)[0]
		if _, _, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 4, Limit: 10}}); err != nil {
			t.Fatal(err)
		}
		for _, lim := range []*Limiter{a, b} {
			if u := usageOf(t, lim); u.Rules[0].Others != 3 {
				t.Errorf("after b's count, %s leaves others %d, want 3: the largest measure of the period", lim.Name(), u.Rules[0].Others)
			}
		}
	})
}

func usageOf(t *testing.T, lim *Limiter, opts ...CallOption) Usage {
	t.Helper()
	u, err := lim.Usage(context.Background(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// A quota of a group whose calls reach the vendor late widens the shared
// log's margin for every quota of the group: each searches the log with
// the same window, so that a quota whose own calls are on time does not
// book beside the late ones' window. a's calls start 40ms late (a spread
// of 45ms), or its process is 40ms further from Redis than b's (calls
// start later by that much); a fills the shared log of 10, and b's call
// 1.05 s later would reach the vendor in the window of a's last calls.
func TestShared_ALateQuotaWidensTheMarginOfEveryQuota(t *testing.T) {
	for _, tc := range []struct {
		name string
		late func(t *testing.T, a, b *Limiter)
	}{
		{"its calls start late", func(t *testing.T, a, _ *Limiter) { reportLates(t, a, 60, 40*ms) }},
		{"its process is further from Redis", func(t *testing.T, a, b *Limiter) {
			setUsualDelay(a, 40*ms)
			reportLates(t, a, 50, 0) // enough calls for the period to count
			setUsualDelay(b, 0)
			reportLates(t, b, 0, 0)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				clock := newClock()
				a, b := sharedLog(t, s, clock, 10, Options{})
				warmUp(t, clock, 2*time.Second, a, b)
				tc.late(t, a, b)
				clock.Add(2 * time.Second) // the period after carries the spread
				if n := fillUp(t, a, 11); n > 10 {
					t.Fatalf("a admitted %d calls in the shared log of 10", n)
				}
				ua, ub := usageOf(t, a), usageOf(t, b)
				if ua.Rules[0].Margin < 80*ms || ub.Rules[0].Margin != ua.Rules[0].Margin {
					t.Errorf("margins in force: a %v, b %v; want both a's, 80ms or more", ua.Rules[0].Margin, ub.Rules[0].Margin)
				}
				clock.Add(time.Second + 50*ms)
				if d := mustAllow(t, b); d.OK {
					t.Errorf("b's call 1.05 s after a's 10, which may reach the vendor 80ms late, admitted: %+v", d)
				}
			})
		})
	}
}

// The calls a late quota of a group booked ahead keep their margin in
// every quota of the group while they may start, as they keep it in their
// own (see TestMargin_FollowsTheFleetsSpread): here once the group's spread
// is forgotten (no call for two timing periods) and a's calls, booked a
// window apart up to 3.3 s ahead with a margin of 90ms, are still ahead.
func TestShared_ALateQuotasBookingsKeepTheirMarginInEveryQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		clock := newClock()
		a, b := sharedLog(t, s, clock, 10, Options{})
		warmUp(t, clock, 2*time.Second, a, b)
		reportLates(t, a, 60, 40*ms)
		clock.Add(2 * time.Second)
		var last result
		for range 4 {
			r, err := a.acquire(ctx, call{cost: 10}, 10*time.Second, nil)
			if err != nil || !r.admitted {
				t.Fatalf("a's booking of the whole log: %+v, %v", r, err)
			}
			last = r
		}
		clock.Add(last.slot() - time.Duration(clock.Now().UnixMicro())*time.Microsecond - 100*ms)
		// The held spread alone: half the wide margin, half the own one.
		ua, ub := usageOf(t, a), usageOf(t, b)
		if m := ua.Rules[0].Margin; m <= 50*ms || m >= 90*ms || ub.Rules[0].Margin != m {
			t.Errorf("100ms before a's last booking: margins in force a %v, b %v; want both a's, over 50ms and under 90ms",
				ua.Rules[0].Margin, ub.Rules[0].Margin)
		}
		clock.Add(100*ms + time.Second + 45*ms)
		if d := mustAllow(t, b); d.OK {
			t.Errorf("b's call 1.045 s after a's last booking, which may start 45ms late, admitted: %+v", d)
		}
	})
}

// A quota that joins a group warms up: its first calls, admitted at once,
// may reach the vendor late (each opens a connection), and every quota of
// the group keeps the warm-up's margin from them in the shared log.
func TestShared_AQuotaWarmingUpWidensTheMarginOfEveryQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		a, b := sharedLog(t, s, clock, 10, Options{})
		warmUp(t, clock, 2*time.Second, b)
		if u := usageOf(t, b); u.Rules[0].Margin != policies.DefaultMargin {
			t.Fatalf("b, warm, alone: margin in force %v, want %v", u.Rules[0].Margin, policies.DefaultMargin)
		}
		mustAllow(t, a) // a's first call: a new quota warms up
		ua, ub := usageOf(t, a), usageOf(t, b)
		if ua.Rules[0].Margin <= policies.DefaultMargin || ub.Rules[0].Margin != ua.Rules[0].Margin {
			t.Errorf("margins in force: a %v, b %v; want both a's warm-up margin, over %v",
				ua.Rules[0].Margin, ub.Rules[0].Margin, policies.DefaultMargin)
		}
	})
}

// A cap one quota of a group learns reaches the calls another quota
// booked ahead in the shared rule: they book again when they wake, and
// at most the cap of them start in the window after a's calls.
func sharedCallsOfEveryQuotaBookedBeforeADropBookAgain(t *testing.T) {
	eachSideBySide(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		// A window of a second: the 20 units are in the quota for a
		// window, and beside the race run, b's ten calls took longer than
		// half a second to book (waitBooked saw none of them).
		const window = time.Second
		p := policies.Shared{Name: "v", Policy: policies.SlidingLog{Limit: 10, Window: window}}
		a := newRoute(t, s.Client(t), "a", p, Options{MaxWait: 10 * window})
		b := newRoute(t, s.Client(t), "b", p, Options{MaxWait: 10 * window})
		start := time.Now()
		first := make([]*Permit, 10)
		for i := range first {
			var err error
			if first[i], err = a.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var starts []time.Duration
		for range 10 {
			wg.Go(func() {
				p, err := b.Acquire(ctx)
				// Under -race beside CI's other steps, a call whose every
				// slot came too late (lateReason, the late-start guard's
				// refusal) asks again, as its caller would: it still books
				// against the cap a learned.
				for le := (*LimitedError)(nil); errors.As(err, &le) && le.Reason == lateReason; {
					p, err = b.Acquire(ctx)
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				starts = append(starts, time.Since(start))
				mu.Unlock()
				p.Release()
			})
		}
		waitBooked(t, b, 20)
		waitSubscribedTo(t, s.Client(t), b.cfg.groupKey, 2) // a's client and b's
		if err := first[9].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		early := 0
		for _, at := range starts {
			if at < window*17/10 {
				early++
			}
		}
		if early > 5 {
			t.Errorf("%d of b's calls booked before a's refusal started within the window after a's ten (at %v), want 5 at most", early, starts)
		}
	})
}

// Units one quota of a group gives back move the calls another quota
// booked behind them in the shared rule: the window is 30 s, so without
// the move b's call sleeps 30 s, and the test's bound of 15 s is far
// from both.
func TestShared_RoomGivenBackMovesTheCallsOfEveryQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		p := policies.Shared{Name: "v", Policy: policies.SlidingLog{Limit: 100, Window: 30 * time.Second}}
		a := newRoute(t, s.Client(t), "a", p)
		b := newRoute(t, s.Client(t), "b", p)
		first, err := a.Acquire(ctx, Cost(80))
		if err != nil {
			t.Fatal(err)
		}
		waited := make(chan time.Duration, 1)
		bctx, stop := context.WithCancel(ctx)
		defer func() { stop(); <-waited }()
		go func() {
			start := time.Now()
			if p, err := b.Acquire(bctx, Cost(50)); err == nil {
				p.Release()
			}
			waited <- time.Since(start)
		}()
		waitBooked(t, a, 130)
		waitSubscribedTo(t, s.Client(t), b.cfg.groupKey, 2)
		if err := first.Settle(ctx, Cost(30)); err != nil {
			t.Fatal(err)
		}
		select {
		case d := <-waited:
			waited <- d
			t.Logf("b's call went after %v", d.Round(time.Millisecond))
		case <-time.After(15 * time.Second):
			t.Fatal("b's call, booked 30 s ahead, still waits 15 s after a's refund made room for it")
		}
	})
}

// A class of one quota of a group finds its share of the shared rule held
// against the calls of another quota: a's interactive calls, one at each
// step of 100ms, beside b's batch, which fills the shared log at every
// step, are all admitted from the second window on.
func TestShared_AClassOfOneQuotaFindsItsShareAgainstAnother(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		a, b := sharedLog(t, s, clock, 100, Options{})
		ca, cb := &classRun{t: t, lim: a, clock: clock}, &classRun{t: t, lim: b, clock: clock}
		refused := 0
		for step := range 31 {
			if !ca.try(Priority(10)) && step > 10 {
				t.Logf("step %d: a's interactive call refused", step)
				refused++
			}
			cb.fill()
			clock.Add(100 * time.Millisecond)
		}
		if refused > 0 {
			t.Errorf("%d of a's interactive calls refused after the first window, want none", refused)
		}
	})
}

// TestShared_AGroupsSignalIsItsClients: a slot freed wakes the waiting
// calls of the quotas of its group on the same Redis client only, and the
// last limiter of a group to close forgets its signal. A process-wide
// signal per name woke a fleet's calls on another Redis, and closed a
// channel made inside another test's synctest bubble.
func TestShared_AGroupsSignalIsItsClients(t *testing.T) {
	s, other := redistest.Mini(t), redistest.Mini(t)
	rdb := s.Client(t)
	core := newRoute(t, rdb, "core", githubLike(5000))
	search := newRoute(t, rdb, "search", githubLike(30))
	elsewhere := newRoute(t, other.Client(t), "core", githubLike(5000))
	if core.freed != search.freed {
		t.Error("two quotas of one group on one client wait on two signals")
	}
	if core.freed == elsewhere.freed {
		t.Error("a group of the same name on another client shares its signal")
	}
	for _, lim := range []*Limiter{core, search, elsewhere} {
		if err := lim.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	groups.mu.Lock()
	defer groups.mu.Unlock()
	for key := range groups.m {
		if key.group == "gh" && (key.rdb == core.rdb || key.rdb == elsewhere.rdb) {
			t.Errorf("group %q of a closed fleet still held", key.group)
		}
	}
}

// A clock that steps back is met by each quota of a group at its own next
// script, and the shared rule's data is of the old clock only until the
// first meets it: that one drops what the rule held ahead, and books its
// calls after the window it then counts as full. The next quota to meet
// the step keeps those bookings; dropped, it would book their window again
// (the simulation's seed 306079: 8 calls in a window of 7).
func TestShared_AClockStepKeepsWhatTheFirstQuotaBooked(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		clock := newClock()
		p := policies.Shared{Name: "v", Policy: policies.SlidingLog{Limit: 4, Window: 10 * time.Second}}
		opts := Options{Clock: clock.Now, Logger: quiet()}
		a, b := newRoute(t, s.Client(t), "a", p, opts), newRoute(t, s.Client(t), "b", p, opts)
		for _, lim := range []*Limiter{a, b} {
			if d, err := lim.Allow(ctx); err != nil || !d.OK {
				t.Fatalf("%s before the step: %+v, %v", lim.Name(), d, err)
			}
		}
		clock.Add(-time.Hour)
		done := make(chan error, 1)
		go func() {
			_, err := a.Acquire(ctx)
			done <- err
		}()
		// a meets the step, books after the window, and sleeps to it.
		for deadline := time.Now().Add(5 * time.Second); usageOf(t, a).Rules[0].Booked != 1; {
			if time.Now().After(deadline) {
				t.Fatal("a's call was not booked ahead within 5 s")
			}
			time.Sleep(time.Millisecond)
		}
		if d, err := b.Allow(ctx); err != nil || d.OK {
			t.Fatalf("b after the step: %+v, %v; want refused, the rule counting as full", d, err)
		}
		if got := usageOf(t, b).Rules[0].Booked; got != 1 {
			t.Errorf("the shared rule holds %d bookings after b met the step, want a's 1", got)
		}
		cancel()
		<-done
	})
}

// A loss of Redis's data found by one quota of a group is told to the
// group: the calls its other quotas booked before it book again at their
// slots, and find their own quota's loss, instead of starting unseen by
// the shared rule's new data, beside the calls the first quota admits once
// its loss's window has passed (seed 544962: 32 in a window of 30, the
// calls of a quota whose processes ran no script between the flush and
// their slots). It waits out a window on the wall clock and bounds only
// how early b's call starts: it runs beside the package's parallel tests.
func TestShared_ALossFoundByOneQuotaBooksTheOthersCallsAgain(t *testing.T) {
	if !raceEnabled {
		t.Parallel()
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		const window = time.Second
		p := policies.Shared{Name: "v", Policy: policies.SlidingLog{Limit: 1, Window: window}}
		a := newRoute(t, s.Client(t), "a", p, Options{Logger: quiet()})
		b := newRoute(t, s.Client(t), "b", p, Options{Logger: quiet()})
		first, err := a.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		first.Release()
		admitted := make(chan time.Time, 1)
		go func() {
			if p, err := b.Acquire(ctx); err == nil {
				p.Release()
			}
			admitted <- time.Now()
		}()
		waitBooked(t, a, 2)
		waitSubscribedTo(t, s.Client(t), b.cfg.groupKey, 2)
		time.Sleep(300 * time.Millisecond) // the flush comes well after the booking
		if err := s.Client(t).FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		flushed := time.Now()
		if err := a.Pause(ctx, time.Millisecond); err != nil { // finds the loss
			t.Fatal(err)
		}
		select {
		case at := <-admitted:
			// a counts the shared rule full for a window from the loss, and
			// admits again after it: b's call, in no data since the flush,
			// must not start within that window.
			if d := at.Sub(flushed); d < window {
				t.Errorf("b's call, booked before the flush, started %v after it, want a window (%v) or more: unseen by the shared rule's new data", d.Round(time.Millisecond), window)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("b's call not admitted 20 s after the flush")
		}
	})
}
