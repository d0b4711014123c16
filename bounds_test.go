package throttle

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/model"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// The scripts read a long log by rank, a growing number of entries at a
// time, and sweep a counter's buckets in use rather than the span they
// cover. Large limits and costs, calls of many units in one microsecond, and
// counters cut into many buckets take those paths across their edges (reads
// that end inside a run of equal times, runs longer than a read), and every
// decision must still equal the brute-force model's, as long as no search
// reads more than its budget. Four histories of each: one by default,
// all four with THROTTLE_LONG=1.
func TestScript_MatchesModelOnLargeQuotas(t *testing.T) {
	skipLongModelUnderRace(t)
	t.Parallel()
	ms := func(rng *rand.Rand, lo, hi int) time.Duration {
		return time.Duration(lo+rng.IntN(hi-lo)) * time.Millisecond
	}
	gens := []struct {
		name    string
		maxCost int
		policy  func(*rand.Rand) policies.Policy
	}{
		{"log-reads", 20, func(rng *rand.Rand) policies.Policy {
			return policies.SlidingLog{Limit: 40 + rng.IntN(40), Window: ms(rng, 200, 400), Margin: time.Millisecond}
		}},
		{"log-runs", 60, func(rng *rand.Rand) policies.Policy {
			return policies.SlidingLog{Limit: 60 + rng.IntN(30), Window: ms(rng, 200, 400), Margin: time.Millisecond}
		}},
		{"counter-buckets", 40, func(rng *rand.Rand) policies.Policy {
			return policies.SlidingCounter{Limit: 50 + rng.IntN(350), Window: ms(rng, 150, 300), Buckets: 50 + rng.IntN(951), Margin: time.Millisecond}
		}},
		{"log-and-counter", 40, func(rng *rand.Rand) policies.Policy {
			return policies.All(
				policies.SlidingLog{Limit: 40 + rng.IntN(40), Window: ms(rng, 200, 400), Margin: time.Millisecond},
				policies.PerKey{Policy: policies.SlidingCounter{Limit: 100 + rng.IntN(200), Window: ms(rng, 150, 300), Buckets: 200, Margin: time.Millisecond}},
			)
		}},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, g := range gens {
			for seed := range modelSeeds(4) {
				rng := rand.New(rand.NewPCG(uint64(seed), uint64(len(g.name))))
				policy := g.policy(rng)
				rules, err := policies.Rules(policy)
				if err != nil {
					t.Fatal(err)
				}
				tc := modelCase{policy: policy}
				for _, r := range rules {
					tc.rules = append(tc.rules, toModel(r))
				}
				checkSeed(t, s.Client(t), s.Mini, rng, modelRun{name: g.name, tc: tc, steps: 150, maxCost: g.maxCost}, uint64(seed))
			}
		}
	})
}

// A log booked further ahead than one call may read (512 entries; a call's
// units at one time are stepped over at once, for about 10 of them)
// settles for the time after its last entries, even when a booking given
// back deep inside it left room earlier: a slot later than need be, never
// an overfilled window.
func TestScript_LongLogSettlesForItsTail(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		const limit, window = 100, 100 * time.Millisecond
		clock := newClock()
		// A script that reads a long log takes seconds under -race beside
		// other work: past go-redis's read timeout (3 s), not the limiter's.
		rdb := redis.NewClient(&redis.Options{Addr: s.Addr, ReadTimeout: time.Minute})
		t.Cleanup(func() { _ = rdb.Close() })
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: limit, Window: window, Margin: time.Nanosecond}, Options{Clock: clock.Now, RedisTimeout: time.Minute})
		ctx := context.Background()
		// A hundred windows booked ahead, more than one call reads.
		var deep result
		for i := range 100 {
			r, err := lim.acquire(ctx, call{cost: limit}, time.Minute, nil)
			if err != nil || !r.admitted || r.wait != time.Duration(i)*window {
				t.Fatalf("booking %d: %+v, %v", i, r, err)
			}
			if i == 80 {
				deep = r
			}
		}
		lim.cancel(ctx, call{cost: limit}, deep)
		// A call that could take the hole eighty windows ahead is booked
		// after the last window instead.
		r, err := lim.acquire(ctx, call{cost: 1}, time.Minute, nil)
		if err != nil || !r.admitted {
			t.Fatalf("acquire: %+v, %v", r, err)
		}
		if want := 100 * window; r.wait != want {
			t.Errorf("booked %v ahead, want %v (after the last booked window)", r.wait, want)
		}
		checkRedisWindows(t, s.Client(t), lim, []model.Rule{toModel(lim.cfg.rules[0])})
		// Within reach of one read, the hole is used.
		lim2 := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: limit, Window: window, Margin: time.Nanosecond}, Options{Clock: clock.Now, Prefix: "near"})
		var near result
		for i := range 5 {
			r, err := lim2.acquire(ctx, call{cost: limit}, time.Minute, nil)
			if err != nil || !r.admitted {
				t.Fatalf("booking %d: %+v, %v", i, r, err)
			}
			if i == 2 {
				near = r
			}
		}
		lim2.cancel(ctx, call{cost: limit}, near)
		r, err = lim2.acquire(ctx, call{cost: 1}, time.Minute, nil)
		if err != nil || !r.admitted || r.wait != 2*window {
			t.Errorf("near hole: %+v, %v; want booked %v ahead", r, err, 2*window)
		}
	})
}

// A call that books ahead of its late reply asks from later than now; the
// hint its search leaves still holds from the time the hint before it held
// from, so the next call asked from now does not read the log booked ahead
// again (counted in Redis's ZRANGE calls), and is booked where that search
// would have put it.
func TestScript_HintHoldsAfterACallThatBooksAhead(t *testing.T) {
	s := redistest.Real(t) // INFO commandstats
	const limit, window = 50, 100 * time.Millisecond
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: limit, Window: window, Margin: time.Nanosecond}, Options{Clock: clock.Now, RedisTimeout: time.Minute})
	admin := adminClient(t, s.Addr)
	ctx := context.Background()
	// Twenty windows booked ahead: 1,000 entries, more than one call reads.
	for i := range 20 {
		if r, err := lim.acquire(ctx, call{cost: limit}, time.Minute, nil); err != nil || !r.admitted {
			t.Fatalf("booking %d: %+v, %v", i, r, err)
		}
	}
	book := func(lead time.Duration) (result, int) {
		t.Helper()
		return acquireReads(t, admin, lim, call{cost: 1, lead: lead})
	}
	// A window's worth of calls of cost 1 after the last booked window.
	for i := range limit {
		if r, _ := book(0); r.wait != 20*window {
			t.Fatalf("call %d of cost 1 booked %v ahead, want %v", i, r.wait, 20*window)
		}
	}
	// The call asked 30ms ahead takes the next window, and moves the hint.
	want := 21 * window
	if r, _ := book(30 * ms); r.wait != want {
		t.Fatalf("a call asked 30ms ahead booked %v ahead, want %v", r.wait, want)
	}
	r, reads := book(0)
	if r.wait != want {
		t.Errorf("the call after it booked %v ahead, want %v", r.wait, want)
	}
	if reads > 4 {
		t.Errorf("the call after it read the log with %d ZRANGE calls, want 4 at most (from the hint)", reads)
	}
}

// A paced call that finds room inside a log booked far ahead (a booking
// given back) is paced past it, among the bookings, and settles for the
// log's tail; the search from the paced time leaves the hint where it was,
// so the call after it reads the log from there (counted in Redis's ZRANGE
// calls) instead of from the room left, to its end.
func TestScript_HintHoldsAfterAPacedCall(t *testing.T) {
	t.Parallel()
	s := redistest.Real(t) // INFO commandstats
	const limit, window, pace = 50, time.Second, 20 * time.Millisecond
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: limit, Window: window}, Options{Clock: clock.Now})
	admin := adminClient(t, s.Addr)
	ctx := context.Background()
	// The fleet's calls start later than the widest margin covers (told
	// with the second call, once the quota exists): the margin in force is
	// its ceiling, and a call that may wait is paced.
	if d, err := lim.Allow(ctx); err != nil || !d.OK {
		t.Fatalf("Allow: %+v, %v", d, err)
	}
	reportLates(t, lim, 60, 60*ms)
	const inForce = window + 100*ms
	// Twenty windows booked ahead, a window's calls at one slot each by
	// calls that may not wait as long as pacing would have them: 1,000
	// entries, more than one call reads.
	var deep result
	for k := range 20 {
		for i := range limit {
			want := time.Duration(k) * inForce
			if k == 0 && i < 2 {
				continue // the calls Allow admitted
			}
			r, err := lim.acquire(ctx, call{cost: 1}, want+ms, nil)
			if err != nil || !r.admitted || r.wait != want {
				t.Fatalf("window %d, booking %d: %+v, %v; want booked %v ahead", k, i, r, err, want)
			}
			if k == 10 && i == 0 {
				deep = r
			}
		}
	}
	lim.cancel(ctx, call{cost: 1}, deep)
	book := func() (result, int) {
		t.Helper()
		return acquireReads(t, admin, lim, call{cost: 1})
	}
	tail := 20 * inForce
	if r, _ := book(); r.wait != tail {
		t.Errorf("the call after a booking %v ahead was given back: booked %v ahead, want %v (the log's tail)", deep.wait, r.wait, tail)
	}
	r, reads := book()
	if r.wait != tail+pace {
		t.Errorf("the call after it booked %v ahead, want %v (paced after it)", r.wait, tail+pace)
	}
	if reads > 6 {
		t.Errorf("the call after it read the log with %d ZRANGE calls, want 6 at most (from the hint)", reads)
	}
	checkRedisWindows(t, s.Client(t), lim, []model.Rule{toModel(lim.cfg.rules[0])})
}

// A slot already past that is given back (a call that started too late)
// makes room only from now on, within a window of it. When the log's
// entries from now on forbid all of that anyway (a log booked ahead), the
// hint stays, and the next call reads the log from it (counted in Redis's
// ZRANGE calls) instead of from now to the end; when the slot given back
// does leave room, the hint is lowered and the next call takes it.
func TestScript_HintStaysWhenAPastSlotLeavesNoRoom(t *testing.T) {
	s := redistest.Real(t) // INFO commandstats
	const limit, window = 50, 100 * time.Millisecond
	admin := adminClient(t, s.Addr)
	ctx := context.Background()
	book := func(lim *Limiter, cost int) (result, int) {
		t.Helper()
		return acquireReads(t, admin, lim, call{cost: cost})
	}
	policy := policies.SlidingLog{Limit: limit, Window: window, Margin: time.Nanosecond}

	// A call admitted now, 49 a millisecond later, and nineteen windows
	// booked ahead: 1,000 entries, more than one call reads.
	clock := newClock()
	ahead := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now, Prefix: "ahead"})
	first, _ := book(ahead, 1)
	clock.Add(ms)
	for i := range 20 {
		cost := limit
		if i == 0 {
			cost = limit - 1
		}
		if r, _ := book(ahead, cost); i == 0 && r.wait != 0 {
			t.Fatalf("the 49 calls after the first booked %v ahead, want admitted now", r.wait)
		}
	}
	tail, _ := book(ahead, 1)
	// The first call started too late: its slot, already past, is given
	// back. The windows from now on are full of bookings: no room.
	clock.Add(9 * ms)
	ahead.cancel(ctx, call{cost: 1}, first)
	r, reads := book(ahead, 1)
	if r.slot() != tail.slot() {
		t.Errorf("after a past slot was given back, booked at %v, want %v (beside the call before it)", r.slot(), tail.slot())
	}
	if reads > 4 {
		t.Errorf("after a past slot was given back, the call read the log with %d ZRANGE calls, want 4 at most (from the hint)", reads)
	}
	checkRedisWindows(t, s.Client(t), ahead, []model.Rule{toModel(ahead.cfg.rules[0])})

	// A full window, and the next booked more than a window after now: the
	// slot given back is room now.
	clock = newClock()
	now := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now, Prefix: "now"})
	first, _ = book(now, limit)
	if r, err := now.acquire(ctx, call{cost: limit, lead: 150 * ms}, time.Minute, nil); err != nil || !r.admitted || r.wait != 150*ms {
		t.Fatalf("a window booked 150ms ahead: %+v, %v", r, err)
	}
	if r, _ := book(now, 1); r.wait != 250*ms {
		t.Fatalf("a call after them booked %v ahead, want %v", r.wait, 250*ms)
	}
	clock.Add(10 * ms)
	now.cancel(ctx, call{cost: limit}, first)
	if r, _ := book(now, 1); r.wait != 0 {
		t.Errorf("after the full window's slot was given back, booked %v ahead, want admitted now", r.wait)
	}
}

// acquireReads asks lim for call c, which may wait a minute and must be
// admitted, and returns its result and how many ZRANGE calls Redis ran for
// it (INFO commandstats, reset first through admin): how much of the log
// its script read.
func acquireReads(t *testing.T, admin *redis.Client, lim *Limiter, c call) (result, int) {
	t.Helper()
	ctx := context.Background()
	if err := admin.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := lim.acquire(ctx, c, time.Minute, nil)
	if err != nil || !r.admitted {
		t.Fatalf("acquire %+v: %+v, %v", c, r, err)
	}
	reads := 0
	if stats, ok := commandsRun(t, admin)["zrange"]; ok {
		calls, _, _ := strings.Cut(strings.TrimPrefix(stats, "calls="), ",")
		reads, _ = strconv.Atoi(calls)
	}
	return r, reads
}
