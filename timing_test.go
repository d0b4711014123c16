package throttle

import (
	"context"
	"crypto/sha1"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

const ms = time.Millisecond

func TestTiming_LatenessIsBeyondTheFastestReply(t *testing.T) {
	k := newTiming(nil)
	// Redis's clock runs 5 s ahead of ours. Replies take 20 to 30 ms: a
	// distant Redis, with jitter.
	const offset = 5 * time.Second
	for i, delay := range []time.Duration{25 * ms, 20 * ms, 30 * ms} {
		asked := time.Duration(i) * time.Second
		redisNow := asked + 20*ms + offset
		k.observe(redisNow, redisNow, asked, redisNow-offset+delay)
	}
	// A call whose slot is Redis's now, starting now: as late as the
	// fastest reply would make it, so not late at all.
	slot := k.now() + offset
	late, ok := k.lateness(slot)
	if !ok || late < -20*ms || late > -20*ms+5*ms {
		t.Errorf("lateness %v, %v; want about -20ms (the slot is 20ms behind the fastest reply)", late, ok)
	}
	slot = k.now() + offset - 20*ms - 50*ms
	if late, _ := k.lateness(slot); late < 50*ms || late > 55*ms {
		t.Errorf("lateness %v, want about 50ms", late)
	}
}

func TestTiming_ForgetsWhatAClockStepContradicts(t *testing.T) {
	for _, step := range []time.Duration{-time.Second, time.Second} {
		k := newTiming(nil)
		k.observe(time.Second+2*ms, time.Second+2*ms, time.Second, time.Second+4*ms)
		// Redis's clock steps: the next reply cannot have come from the
		// clock the first one did.
		k.observe(2*time.Second+2*ms+step, 2*time.Second+2*ms+step, 2*time.Second, 2*time.Second+4*ms)
		k.mu.Lock()
		fast, _ := least(k.fast)
		k.mu.Unlock()
		if want := 2*ms - step; fast != want {
			t.Errorf("step %v: fastest reply offset %v, want %v (the readings before the step forgotten)", step, fast, want)
		}
	}
}

// Redis's clock steps an hour back, and a second forward, both after a
// process's last reply: its next reply shows an hour less a second back.
// The quota's epoch (the loss that counted the step back) lies further
// behind that reply's time than the process's own time since its last
// reply allows: the second forward is counted, as a step seen alone is.
// Seen alone, a step back counts no step; nor does a loss found between
// the two replies by a clock that did not step.
func TestTiming_AStepForwardHiddenByAStepBackIsCounted(t *testing.T) {
	for _, c := range []struct {
		name  string
		moved time.Duration // Redis's clock between the replies, beyond the second they are apart
		lost  time.Duration // the loss's time, by the new clock, after the first reply
		steps uint64
		by    time.Duration
	}{
		{"an hour back, then a second forward", -time.Hour + time.Second, 500 * ms, 1, time.Second - 500*ms},
		{"an hour back", -time.Hour, 500 * ms, 0, 0},
		{"a loss, no step", 0, 500 * ms, 0, 0},
	} {
		k := newTiming(nil)
		t0 := 2 * time.Hour // Redis's clock, and ours, at the first reply
		k.observe(t0+2*ms, t0+2*ms, t0, t0+4*ms)
		asked := t0 + time.Second
		redisNow := asked + 2*ms + c.moved
		back, prev := k.observe(redisNow, redisNow, asked, asked+4*ms)
		if back != (c.moved < 0) {
			t.Errorf("%s: observe reported a move back %v", c.name, back)
		}
		if back {
			// The loss counted the step back, by the new clock.
			lostAt := t0 - time.Hour + c.lost
			k.hiddenStep(redisNow, lostAt, prev, asked, asked+4*ms)
		}
		steps, by, _ := k.step()
		if steps != c.steps || by < c.by-10*ms || by > c.by {
			t.Errorf("%s: %d steps, the last of %v; want %d, of %v at most and 10 ms less at least", c.name, steps, by, c.steps, c.by)
		}
	}
}

func TestTiming_ReportsLatenessesOnceByBucket(t *testing.T) {
	var c lates
	if r := c.report(); len(r) != 0 {
		t.Fatalf("a limiter with no calls reported %v", r)
	}
	for _, late := range []time.Duration{-3 * ms, 0, 999 * time.Microsecond, ms, 1500 * ms / 1000, 3 * ms, time.Hour} {
		c.note(late)
	}
	// Under 1ms, then buckets up to 2^(k/2) ms: [1, 1.41), [1.41, 2),
	// [2, 2.83), [2.83, 4), ...; an hour goes in the last one.
	want := []protocol.Late{{Bucket: 0, N: 3}, {Bucket: 1, N: 1}, {Bucket: 2, N: 1}, {Bucket: 4, N: 1}, {Bucket: 21, N: 1}}
	if r := c.report(); !slices.Equal(r, want) {
		t.Errorf("report %v, want %v", r, want)
	}
	if r := c.report(); len(r) != 0 {
		t.Errorf("second report %v, want nothing: each lateness is reported once", r)
	}
}

// A process tells the fleet its usual delay once it has seen a few replies:
// half its shortest round trip, the script's own time left out.
func TestTiming_UsualDelay(t *testing.T) {
	k := newTiming(nil)
	for i := range minReadings {
		if d := k.delay(); d >= 0 {
			t.Fatalf("after %d replies: delay %v, want none yet", i, d)
		}
		asked := time.Duration(i) * time.Second
		// 10ms each way, 4ms of script; one reply slowed by 20ms more.
		extra := time.Duration(0)
		if i == 2 {
			extra = 20 * ms
		}
		k.observe(asked+10*ms, asked+14*ms, asked, asked+24*ms+extra)
	}
	if d := k.delay(); d != 10*ms {
		t.Errorf("delay %v, want 10ms", d)
	}
}

// reportLates notes n calls of l that started late, and tells the fleet
// with an Allow that must be admitted. On a clock that stands still, a
// spare admission would keep the report for the limiter's next script
// call: none is left.
func reportLates(t *testing.T, l *Limiter, n int, late time.Duration) {
	t.Helper()
	for range n {
		l.lates.note(late)
	}
	ctx := context.Background()
	l.dropAllSpares(ctx)
	if d, err := l.Allow(ctx); err != nil || !d.OK {
		t.Fatalf("Allow: %+v, %v", d, err)
	}
}

// setUsualDelay sets the usual one-way delay from Redis that l's process
// reports with its next script call.
func setUsualDelay(l *Limiter, d time.Duration) {
	l.timing.mu.Lock()
	l.timing.trip = [2]minimum{{v: 2 * d, set: true}}
	l.timing.readings = minReadings
	l.timing.mu.Unlock()
}

// The margin in force follows the spread of the fleet's calls, from the
// configured margin up to a tenth of the window, and narrows once the calls
// start on time again. A counter's margin, and a margin set under 2ms, stay
// as configured.
func TestMargin_FollowsTheFleetsSpread(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		policy := policies.All(
			policies.SlidingLog{Limit: 1000, Window: time.Second},
			policies.SlidingLog{Limit: 1000, Window: 2 * time.Second, Margin: time.Nanosecond},
			policies.SlidingCounter{Limit: 1000, Window: time.Second},
		)
		a := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		b, err := New(s.Client(t), a.Name(), policy, Options{Clock: clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		check := func(what string, want ...time.Duration) {
			t.Helper()
			u, err := a.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			got := []time.Duration{u.Spread, u.Rules[0].Margin, u.Rules[1].Margin, u.Rules[2].Margin}
			if !equalDurations(got, want) {
				t.Errorf("%s: spread and margins %v, want %v", what, got, want)
			}
		}
		report := func(l *Limiter, n int, late time.Duration) {
			t.Helper()
			reportLates(t, l, n, late)
		}
		warmUp(t, clock, 2*time.Second, a, b)
		report(a, 100, 0)
		check("on time", 0, policies.DefaultMargin, 0, policies.DefaultMargin)

		// 190 calls on time and 20 about 40ms late: more than 5% are, so
		// the spread is the top of their bucket, 45ms, and the margin twice
		// it.
		report(a, 90, 0)
		report(b, 20, 40*ms)
		check("some late", 45254*time.Microsecond, 90508*time.Microsecond, 0, policies.DefaultMargin)
		// A starved fleet: the margin stops at a tenth of the window.
		report(b, 100, 900*ms)
		check("starved", 1024*ms, 100*ms, 0, policies.DefaultMargin)

		// The calls of the period after still go by it: the calls booked
		// with the wide margin may start as late as it allows, and the
		// windows after them keep it.
		clock.Add(2 * time.Second)
		report(a, 100, 0)
		check("held", 1024*ms, 100*ms, 0, policies.DefaultMargin)
		// Once those calls have left the longest window, and a period went
		// by on time, it is back to the floor.
		clock.Add(3 * time.Second)
		report(a, 100, 0)
		check("calm again", 0, policies.DefaultMargin, 0, policies.DefaultMargin)
	})
}

// The calls of a cold quota's first moments are its start's burst, not how
// the fleet runs: the spread they show widens the margin while the quota
// warms up, but is not carried into the next timing period, which starts
// from nothing (a warm quota's carries, as TestMargin_FollowsTheFleetsSpread
// shows), and rises again as soon as enough of its calls are late.
func TestMargin_ForgetsTheSpreadOfAWarmUp(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Second}, Options{Clock: clock.Now})
		ctx := context.Background()
		report := func(n int, late time.Duration) {
			t.Helper()
			reportLates(t, lim, n, late)
		}
		check := func(what string, spread, margin time.Duration) {
			t.Helper()
			u, err := lim.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if u.Spread != spread || u.Rules[0].Margin != margin {
				t.Errorf("%s: spread %v, margin %v; want %v, %v", what, u.Spread, u.Rules[0].Margin, spread, margin)
			}
		}
		report(1, 0) // the quota's first call
		report(100, 300*ms)
		check("warming up, calls late", 362038*time.Microsecond, 100*ms)
		// The next period, once the calls admitted while warming up have
		// left their windows.
		clock.Add(2 * time.Second)
		report(100, 0)
		check("the period after the warm-up, calls on time", 0, policies.DefaultMargin)
		report(100, 40*ms)
		check("the period after the warm-up, calls late", 45254*time.Microsecond, 90508*time.Microsecond)
	})
}

// The usual delays the processes report while a quota warms up were read
// off the replies of the start's burst, held up in Redis's long turns: the
// period after the warm-up does not carry them (a process 40ms "away" then
// is 1ms away now), as it carries a warm period's until every process has
// reported again.
func TestMargin_ForgetsTheDelaysOfAWarmUp(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock() // at the start of a timing period
		policy := policies.SlidingLog{Limit: 1000, Window: time.Second}
		a := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		b, err := New(s.Client(t), a.Name(), policy, Options{Clock: clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		ctx := context.Background()
		check := func(what string, want time.Duration) {
			t.Helper()
			u, err := a.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if u.Spread != want {
				t.Errorf("%s: spread %v, want %v", what, u.Spread, want)
			}
		}
		reportLates(t, b, 0, 0) // the quota's first call: it warms up
		setUsualDelay(a, 40*ms)
		setUsualDelay(b, 0)
		reportLates(t, a, 0, 0)
		reportLates(t, b, 0, 0)
		check("warming up", 40*ms)
		clock.Add(2 * time.Second)
		setUsualDelay(a, ms)
		reportLates(t, b, 0, 0)
		reportLates(t, a, 50, 0) // enough calls for the period to count
		check("the period after the warm-up", ms)
		// A warm period's delays hold into the next one: a has not
		// reported in it yet.
		clock.Add(2 * time.Second)
		reportLates(t, b, 0, 0)
		check("the period after a warm one", ms)
	})
}

// A saturated fleet books every call a window ahead, with the margin in
// force. When its calls start on time again, the margin narrows within a
// few windows all the same: a booking keeps half the wide margin from the
// calls booked with it, and its own narrower margin from the rest.
func TestMargin_NarrowsWhileTheFleetBooksAhead(t *testing.T) {
	long(t)
	figureWithoutRace(t)
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, late := range []time.Duration{0, 5 * ms} {
			t.Run("then late "+late.String(), func(t *testing.T) { marginNarrows(t, s, late) })
		}
	})
}

// marginNarrows is TestMargin_NarrowsWhileTheFleetBooksAhead on s, with
// the calls late by late once the margin has widened.
func marginNarrows(t *testing.T, s *redistest.Server, late time.Duration) {
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second}, Options{Clock: clock.Now})
	ctx := context.Background()
	warmUp(t, clock, time.Second, lim)
	// The warm-up's calls leave every window.
	clock.Add(2 * time.Second)
	// 20 of 100 calls about 40ms late: the margin widens to 90ms.
	for i := range 100 {
		if i < 20 {
			lim.lates.note(40 * ms)
		} else {
			lim.lates.note(0)
		}
		if d, err := lim.Allow(ctx); err != nil || !d.OK {
			t.Fatalf("call %d: %+v, %v", i, d, err)
		}
	}
	if m := marginOf(t, lim); m != 90508*time.Microsecond {
		t.Fatalf("margin %v after the late calls, want 90.508ms", m)
	}
	seen, narrowed, ahead := bookAheadFor10s(t, clock, lim, late)
	if ahead < 600 {
		t.Fatalf("only %d of 1200 calls were booked more than 500ms ahead: the fleet was not saturated", ahead)
	}
	switch {
	case narrowed == 0:
		t.Errorf("the margin never came back to %v in 10s of calls on time", policies.DefaultMargin)
	case narrowed > 8*time.Second:
		t.Errorf("the margin came back to %v after %v of calls on time, want within 8s (two timing periods, and the windows of the calls booked meanwhile)", policies.DefaultMargin, narrowed)
	}
	// While the calls booked with the wide margin are in their windows,
	// a new booking keeps half of it from them, and half of its own.
	want := []time.Duration{90508 * time.Microsecond, 60254 * time.Microsecond, policies.DefaultMargin}
	if !equalDurations(seen, want) {
		t.Errorf("margins in force %v, want %v", seen, want)
	}
}

// marginOf returns the margin in force of lim's first rule.
func marginOf(t *testing.T, lim *Limiter) time.Duration {
	t.Helper()
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return u.Rules[0].Margin
}

// bookAheadFor10s has lim's fleet ask for 120 calls a second for 10s of
// clock, each call late by late, so that each is booked about a window
// ahead. It returns each margin in force in turn, when the margin came
// back to the default (0 if never), and how many calls were booked more
// than 500ms ahead.
func bookAheadFor10s(t *testing.T, clock *fixedClock, lim *Limiter, late time.Duration) (seen []time.Duration, narrowed time.Duration, ahead int) {
	t.Helper()
	seen = []time.Duration{marginOf(t, lim)}
	for step := range 200 {
		clock.Add(50 * ms)
		for range 6 {
			lim.lates.note(late)
			r, err := lim.acquire(context.Background(), call{cost: 1}, 5*time.Second, nil)
			if err != nil || !r.admitted {
				t.Fatalf("step %d: %+v, %v", step, r, err)
			}
			if r.wait > 500*ms {
				ahead++
			}
		}
		m := marginOf(t, lim)
		if m != seen[len(seen)-1] {
			seen = append(seen, m)
		}
		if m == policies.DefaultMargin && narrowed == 0 {
			narrowed = time.Duration(step+1) * 50 * ms
		}
	}
	return seen, narrowed, ahead
}

func equalDurations(a, b []time.Duration) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// slowReplies delays the reply of the next n script calls by d, as a
// congested network or a starved process would.
type slowReplies struct {
	d       time.Duration
	n       atomic.Int64
	scripts atomic.Int64
}

func (*slowReplies) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *slowReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			return err // go-redis sends the script again with EVAL: one script call
		}
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.scripts.Add(1)
			if h.n.Add(-1) >= 0 {
				time.Sleep(h.d)
			}
		}
		return err
	}
}
func (*slowReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// slowLimiter is a limiter of policy p on a client of s whose script
// replies the test can slow down by d (see slowReplies).
func slowLimiter(t *testing.T, s *redistest.Server, d time.Duration, p policies.Policy, opts ...Options) (*Limiter, *slowReplies, *redis.Client) {
	t.Helper()
	rdb := s.Client(t)
	slow := &slowReplies{d: d}
	rdb.AddHook(slow)
	return newLimiter(t, rdb, p, opts...), slow, rdb
}

// guardLimiter is one call per 100ms with a 10ms margin, per key, on a
// client whose replies the test can slow down, with the usual delay of the
// replies already known.
func guardLimiter(t *testing.T, s *redistest.Server, opts ...Options) (*Limiter, *slowReplies) {
	t.Helper()
	lim, slow, _ := slowLimiter(t, s, 60*ms, policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: 100 * ms, Margin: 30 * ms}}, opts...)
	for _, k := range []string{"w1", "w2", "w3"} {
		if _, err := lim.Allow(context.Background(), Key(k)); err != nil {
			t.Fatal(err)
		}
	}
	slow.scripts.Store(0)
	return lim, slow
}

// A reply that arrives 60ms late would have the call start 60ms after its
// slot, and the next call, a window after that slot, less than a window
// after it at the vendor. On every path, the call gives that slot back and
// books again in the same script call.
func TestGuard_LateReplyBooksAgainOnEveryPath(t *testing.T) {
	paths := []struct {
		name string
		opts []Options
		call func(*Limiter) error
	}{
		{"Block", nil, func(l *Limiter) error { _, err := l.Acquire(context.Background(), Key("a")); return err }},
		{"FailFast", []Options{{Mode: FailFast}}, func(l *Limiter) error { _, err := l.Acquire(context.Background(), Key("a")); return err }},
		{"Queue", []Options{{Mode: Queue}}, func(l *Limiter) error { _, err := l.Acquire(context.Background(), Key("a")); return err }},
		{"Shadow", []Options{{Shadow: true}}, func(l *Limiter) error { _, err := l.Acquire(context.Background(), Key("a")); return err }},
		{"Allow", nil, func(l *Limiter) error {
			d, err := l.Allow(context.Background(), Key("a"))
			if err == nil && !d.OK {
				err = errors.New("refused")
			}
			return err
		}},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, p := range paths {
			t.Run(p.name, func(t *testing.T) {
				lim, slow := guardLimiter(t, s, p.opts...)
				slow.n.Store(1)
				if err := p.call(lim); err != nil {
					t.Fatalf("first call: %v", err)
				}
				first := time.Now()
				// Block and Queue book the second slot ahead and sleep
				// towards it: a busy machine may wake them later than the
				// 15ms the margin allows, and they book once more; on every
				// path, it may read the second reply that late too (under
				// -race beside other work, FailFast made 3 script calls).
				// Never more than the rebooks allowed.
				most := int64(2 + maxRebooks - 1)
				if n := slow.scripts.Load(); n < 2 || n > most {
					t.Errorf("%d script calls, want 2 (at most %d): the late admission, then one that gives it back and books again", n, most)
				}
				// The next call of the key starts no earlier than a window
				// after the first one started.
				for {
					d, err := lim.Allow(context.Background(), Key("a"))
					if err != nil {
						t.Fatal(err)
					}
					if d.OK {
						break
					}
					time.Sleep(d.RetryAfter)
				}
				if gap := time.Since(first); gap < 100*ms {
					t.Errorf("the next call started %v after the first, inside the vendor's 100ms window", gap)
				}
			})
		}
	})
}

// In Block mode a reply that came back late books the call again that much
// ahead: the call waits for its new slot and starts on time in it. The late
// reply is noted for the fleet's spread: a busy process is late on its way
// to the vendor too.
func TestGuard_LateReplyWaitsForASlotAhead(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		// A margin of 100ms, so that a busy machine's wake-ups, which it
		// allows 50ms, do not book again; the first reply comes 300ms late.
		again, observe := bookedAgain()
		lim, slow, rdb := slowLimiter(t, s, 300*ms, policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: time.Second, Margin: 100 * ms}},
			Options{Observer: observe})
		reports := &lateReports{}
		rdb.AddHook(reports)
		for _, k := range []string{"w1", "w2", "w3"} {
			if _, err := lim.Allow(context.Background(), Key(k)); err != nil {
				t.Fatal(err)
			}
		}
		slow.scripts.Store(0)
		slow.n.Store(1)
		asked := time.Now()
		p, err := lim.Acquire(context.Background(), Key("a"))
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(asked)
		// A busy machine may wake the call late for its second slot too
		// (beside the race run, 100 ms late): each such wake books once
		// more, and says it was late. Nothing else books again.
		seen := again()
		if n := slow.scripts.Load(); n != 2+int64(seen[againLate]-1) || seen[againLate] < 1 || len(seen) != 1 {
			t.Errorf("%d script calls, booked again %v: want 2, the late admission, then one that gives it back and books again"+
				" (and one more for each wake a busy machine made late)", n, seen)
		}
		// The second slot lies about the first reply's lateness ahead of
		// the second script call: the call waited for it.
		if p.r.wait < 200*ms {
			t.Errorf("booked again %v ahead, want about 300ms: the next reply might be as late", p.r.wait)
		}
		if took < 500*ms {
			t.Errorf("Acquire took %v, want the 300ms late reply and about 300ms more for the slot ahead", took)
		}
		// The late reply was noted, and reported to the fleet with the
		// second script call: bucket 17 holds 256ms to 362ms.
		if !reports.has(16, 18) {
			t.Errorf("latenesses reported %q, want the 300ms reply among them", reports.all())
		}
	})
}

// A reply that comes back late, but with its slot still ahead, does not
// make the call late: the call sleeps until its slot by the clock of the
// fastest reply seen, not for the whole wait from the slow reply's arrival
// (which would start it the reply's delay after its slot, every call of a
// busy Redis's long turn as late as its reply). It never starts before its
// slot by Redis's clock either.
func TestGuard_SlowReplyStillStartsOnItsSlot(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		// A margin of 200ms: the late-start guard allows 100ms, so the
		// 60ms reply is not too late, and a busy machine's wake-ups do not
		// book again.
		lim, slow, rdb := slowLimiter(t, s, 60*ms, policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: 300 * ms, Margin: 200 * ms}})
		ctx := context.Background()
		for _, k := range []string{"w1", "w2", "w3", "a"} {
			if _, err := lim.Allow(ctx, Key(k)); err != nil {
				t.Fatal(err)
			}
		}
		slow.scripts.Store(0)
		slow.n.Store(1)
		p, err := lim.Acquire(ctx, Key("a"))
		if err != nil {
			t.Fatal(err)
		}
		late, ok := lim.timing.lateness(p.r.startsAt())
		redisNow, terr := rdb.Time(ctx).Result()
		if terr != nil {
			t.Fatal(terr)
		}
		if n := slow.scripts.Load(); n != 1 {
			t.Errorf("%d script calls, want 1: the slot lay ahead of the slow reply", n)
		}
		if p.r.wait < 200*ms {
			t.Errorf("booked %v ahead, want a window ahead, past the 60ms reply", p.r.wait)
		}
		if !ok || late >= 30*ms {
			t.Errorf("the call started %v after its slot (known %v), want well under the reply's 60ms: it wakes by the fastest reply's clock", late, ok)
		}
		if at := time.Duration(redisNow.UnixNano()); at < p.r.startsAt() {
			t.Errorf("the call started at Redis time %v, %v before its slot", at, p.r.startsAt()-at)
		}
	})
}

// A process's first replies may all be slow (a burst held up in Redis's
// long turns) and the faster ones come while its first calls sleep. A
// sleeping call looks at the fastest reply again shortly before its slot,
// and starts on time by it, instead of waking by the slow reply it knew
// when it went to sleep, late against the faster one, and booking again.
func TestGuard_SleepingCallFollowsAFasterReply(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		// A margin of 100ms: the guard allows 50ms, half the 100ms by
		// which the fastest reply gets faster.
		lim, slow, _ := slowLimiter(t, s, 100*ms, policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: 600 * ms, Margin: 100 * ms}})
		ctx := context.Background()
		slow.n.Store(2) // the process's first two replies
		if _, err := lim.Allow(ctx, Key("a")); err != nil {
			t.Fatal(err)
		}
		type acquired struct {
			late time.Duration // after its slot, by the faster reply, as it returned
			ok   bool
			err  error
		}
		done := make(chan acquired, 1)
		go func() {
			p, err := lim.Acquire(ctx, Key("a"))
			if err != nil {
				done <- acquired{err: err}
				return
			}
			// Read as Acquire returns: read after the hand-over to the
			// test's goroutine, a busy machine's delay counted (CI: 43 ms).
			late, ok := lim.timing.lateness(p.r.startsAt())
			done <- acquired{late: late, ok: ok}
		}()
		for slow.scripts.Load() < 2 {
			time.Sleep(ms)
		}
		// While the call sleeps towards its slot, a reply comes back 100ms
		// faster than every reply before it.
		time.Sleep(50 * ms)
		if _, err := lim.Allow(ctx, Key("b")); err != nil {
			t.Fatal(err)
		}
		a := <-done
		if a.err != nil {
			t.Fatal(a.err)
		}
		late, ok := a.late, a.ok
		// 3 at least: on a busy machine the call may wake late and book
		// once more.
		if n := slow.scripts.Load(); n < 3 {
			t.Errorf("%d script calls, want 3: the sleeping call was not booked again", n)
		}
		if !ok || late >= 40*ms {
			t.Errorf("the call started %v after its slot by the faster reply (known %v), want well under 50ms", late, ok)
		}
	})
}

// A Block call that sleeps towards its slot and wakes later after it than
// half the margin (a starved process) gives the slot back and books again,
// at once, rather than call into the windows after its slot.
func TestGuard_LateWakeBooksAgain(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		counter := &slowReplies{}
		rdb.AddHook(counter)
		clock := newClock()
		reasons, observe := bookedAgain()
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 1, Window: time.Second, Margin: 10 * ms}, Options{Clock: clock.Now, Observer: observe})
		ctx := context.Background()
		if _, err := lim.Allow(ctx); err != nil {
			t.Fatal(err)
		}
		counter.scripts.Store(0)
		// The call sleeps 1.055s towards its slot (the quota warms up: its
		// first call is held to a margin of 55ms). Well into that sleep,
		// long after the reply was read, the clock goes 1.2s on: the call
		// wakes 145ms after its slot, far past the 27.5ms the margin allows.
		go func() {
			for counter.scripts.Load() == 0 {
				time.Sleep(ms)
			}
			time.Sleep(200 * ms)
			clock.Add(1200 * ms)
		}()
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n := counter.scripts.Load(); n != 2 {
			t.Errorf("%d script calls, want 2: the booking, then one that gives it back and books again", n)
		}
		if p.r.wait != 0 || p.r.now != time.Duration(clock.Now().UnixNano()) {
			t.Errorf("booked again %v ahead at %v, want at once, at the late wake %v", p.r.wait, p.r.now, clock.Now())
		}
		if got := reasons(); got[againLate] != 1 || len(got) != 1 {
			t.Errorf("booked again for %v, want once for its late wake", got)
		}
	})
}

// lateReports records the lateness reports ("k:n,k:n") that script calls
// carry to Redis.
type lateReports struct {
	mu   sync.Mutex
	seen []string // each report, "k:n,k:n": n calls late by bucket k
}

func (*lateReports) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *lateReports) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if r, ok := lateReport(cmd.Args()); ok {
			h.mu.Lock()
			h.seen = append(h.seen, r)
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

// lateReport returns the lateness report of an acquire script call's
// arguments, read by their layout (protocol.Acquire, then protocol.Late).
func lateReport(args []any) (string, bool) {
	if len(args) < 3 {
		return "", false
	}
	sha := fmt.Sprint(args[1])
	if args[0] == "eval" {
		sha = fmt.Sprintf("%x", sha1.Sum([]byte(sha)))
	}
	if sha != scripts.acquire.Hash() {
		return "", false
	}
	num := func(a any) int {
		n, _ := strconv.Atoi(fmt.Sprint(a))
		return n
	}
	argv := args[3+num(args[2]):]
	head := 2 + len(layoutNamed("Rule").All())*num(argv[1])
	var parts []string
	at := head + len(layoutNamed("Acquire").All())
	for range num(argv[head+placeOf("Acquire", "lates")]) {
		parts = append(parts, fmt.Sprint(argv[at])+":"+fmt.Sprint(argv[at+1]))
		at += len(layoutNamed("Late").All())
	}
	return strings.Join(parts, ","), len(parts) > 0
}

// layoutNamed returns the layout of internal/protocol named name.
func layoutNamed(name string) protocol.Layout {
	for _, l := range protocol.Layouts {
		if l.Name == name {
			return l
		}
	}
	panic("no layout " + name)
}

// placeOf returns the place of field in layout name, from 0.
func placeOf(name, field string) int {
	for i, f := range layoutNamed(name).All() {
		if f.Name == field {
			return i
		}
	}
	panic("no field " + field + " in layout " + name)
}

func (*lateReports) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *lateReports) all() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.seen...)
}

// has reports whether some report holds a lateness in buckets lo..hi.
func (h *lateReports) has(lo, hi int) bool {
	for _, r := range h.all() {
		for _, kn := range strings.Split(r, ",") {
			k, _, _ := strings.Cut(kn, ":")
			if b, err := strconv.Atoi(k); err == nil && b >= lo && b <= hi {
				return true
			}
		}
	}
	return false
}

// A FailFast call, and Allow, whose every reply comes back 60ms late asks
// once more for its slot that much ahead, sleeps to it and starts on time:
// a busy process's slow replies do not refuse a call that fits. Without
// the lead, each reply was as late as the first, and the call failed.
func TestGuard_FailFastAsksAheadOfItsLateReplies(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, key := range []string{"acquire", "allow"} {
			lim, slow := guardLimiter(t, s, Options{Mode: FailFast})
			slow.n.Store(100)
			var err error
			if key == "acquire" {
				_, err = lim.Acquire(context.Background(), Key(key))
			} else if d, e := lim.Allow(context.Background(), Key(key)); e != nil || !d.OK {
				err = fmt.Errorf("Allow: %+v, %v", d, e)
			}
			if err != nil {
				t.Fatalf("%s, every reply 60ms late: %v; want admitted on a slot asked that much ahead", key, err)
			}
			// A busy machine may read a reply later still: it asks again,
			// within the rebooks allowed.
			if n := slow.scripts.Load(); n < 2 || n > 1+maxRebooks {
				t.Errorf("%s: %d script calls, want 2: the late admission, then one that gives it back and asks ahead", key, n)
			}
		}
	})
}

// A FailFast call whose replies come back later each time than it asked
// ahead books again three times, and then fails with ErrLimited saying
// why, holding nothing.
func TestGuard_BooksAgainABoundedNumberOfTimes(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := exhaustRebooks(t, s, 30*ms, []time.Duration{60 * ms, 180 * ms, 540 * ms, 1620 * ms}, Options{Mode: FailFast})
		u, err := lim.Usage(context.Background(), Key("a"))
		if err != nil {
			t.Fatal(err)
		}
		if r := u.Rules[0]; r.Used != 0 || r.Booked != 0 {
			t.Errorf("the failed call still holds %d used and %d booked units", r.Used, r.Booked)
		}
	})
}

// exhaustRebooks makes a call of key "a", on a limiter of one call per
// 100 ms with margin, whose script replies come back late by each of
// delays in turn (growing three-fold: each later than the call asked
// ahead), and checks that it fails with ErrLimited saying every slot came
// too late, after the first script call, maxRebooks more, and one giving
// the last slot back. It returns the limiter.
func exhaustRebooks(t *testing.T, s *redistest.Server, margin time.Duration, delays []time.Duration, opts ...Options) *Limiter {
	t.Helper()
	rdb := s.Client(t)
	h := &growingReplies{}
	rdb.AddHook(h)
	lim := newLimiter(t, rdb, policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: 100 * ms, Margin: margin}}, opts...)
	// The usual delay of the replies, the fastest of a dozen: on a machine
	// busy beside the race run, the fastest of three was once so slow that
	// a reply 40 ms late did not look late (CI: the call was admitted).
	for i := range 12 {
		if _, err := lim.Allow(context.Background(), Key("w"+strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	h.mu.Lock()
	h.scripts, h.delays = 0, delays
	h.mu.Unlock()
	_, err := lim.Acquire(context.Background(), Key("a"))
	var le *LimitedError
	if !errors.As(err, &le) || le.Reason != lateReason {
		t.Fatalf("err %v, want a LimitedError saying every slot came too late", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.scripts != 2+maxRebooks {
		t.Errorf("%d script calls, want %d: the first, %d more, and one giving the last slot back", h.scripts, 2+maxRebooks, maxRebooks)
	}
	return lim
}

// growingReplies delays the replies of script calls by each of its delays
// in turn, then not at all.
type growingReplies struct {
	mu      sync.Mutex
	delays  []time.Duration
	scripts int
}

func (*growingReplies) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *growingReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			return err // go-redis sends the script again with EVAL: one script call
		}
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.mu.Lock()
			h.scripts++
			var d time.Duration
			if len(h.delays) > 0 {
				d, h.delays = h.delays[0], h.delays[1:]
			}
			h.mu.Unlock()
			time.Sleep(d)
		}
		return err
	}
}
func (*growingReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// In Block mode a late reply books that much further ahead; replies that
// come back later each time than the last booking allows exhaust the
// re-bookings, and the call fails after exactly maxRebooks of them,
// giving its last slot back.
func TestGuard_BlockBooksAgainABoundedNumberOfTimes(t *testing.T) {
	long(t)
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		// Each booking lies as far ahead as the replies before it were
		// late; each reply comes back three times later than the last.
		exhaustRebooks(t, s, 10*ms, []time.Duration{60 * ms, 180 * ms, 540 * ms, 1620 * ms})
	})
}

// A token bucket's calls are held to its margin too: a call whose reply came
// back later than half of it gives its slot back and books again, or it
// would bunch with the calls after it at the vendor.
func TestGuard_TokenBucketLateReplyBooksAgain(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		slow := &slowReplies{d: 60 * ms}
		rdb.AddHook(slow)
		lim := newLimiter(t, rdb, policies.PerKey{Policy: policies.TokenBucket{Rate: 10, Per: time.Second}}, Options{Mode: FailFast})
		for _, k := range []string{"w1", "w2", "w3"} {
			if _, err := lim.Allow(context.Background(), Key(k)); err != nil {
				t.Fatal(err)
			}
		}
		slow.scripts.Store(0)
		slow.n.Store(1)
		if _, err := lim.Acquire(context.Background(), Key("a")); err != nil {
			t.Fatalf("call: %v", err)
		}
		if n := slow.scripts.Load(); n != 2 {
			t.Errorf("%d script calls, want 2: the late admission, then one that gives it back and books again", n)
		}
	})
}

// After a step of Redis's clock the readings begin anew. When the first of
// them all come slow (a stalled link, a starved process), the fastest of
// them is slower than the way to Redis by as much as their round trip
// exceeds the fastest one before the step, and a call that wakes by it
// starts that much late unseen; a reply as fast as before ends the doubt
// (seed 65003).
func TestTiming_UnsureAfterAStepWhileRepliesAreSlow(t *testing.T) {
	k := newTiming(nil)
	for i := range 5 {
		asked := time.Duration(i) * 100 * ms
		k.observe(asked+5*ms, asked+5*ms, asked, asked+10*ms)
	}
	if u := k.unsure(); u != 0 {
		t.Fatalf("unsure %v with replies as fast as ever, want 0", u)
	}
	// Redis's clock steps an hour back; the replies take 500 ms each way.
	asked := time.Second
	redisNow := asked + 500*ms - time.Hour
	k.observe(redisNow, redisNow, asked, asked+time.Second)
	if u := k.unsure(); u != 990*ms {
		t.Errorf("unsure %v after a step read by a reply 1 s round, want 990ms (its round trip beyond the 10 ms before)", u)
	}
	asked = 2 * time.Second
	redisNow = asked + 5*ms - time.Hour
	k.observe(redisNow, redisNow, asked, asked+10*ms)
	if u := k.unsure(); u != 0 {
		t.Errorf("unsure %v after a reply as fast as before the step, want 0", u)
	}
}

// A refusal never says to retry in the past. A FailFast call booked ahead
// after a late reply, and outdated each time it woke at its slot (a pause
// or a loss meanwhile), was refused as late with the lateness read while
// its slot still lay ahead: a negative RetryAfter (the simulation's
// client, retrying after it, panicked in rand.Int64N). Every refusal's
// wait, whatever its reason, comes out at 0 or more.
func TestGuard_ARefusalNeverSaysToRetryInThePast(t *testing.T) {
	l := &Limiter{name: "q"}
	for _, r := range []result{
		{reason: reasonLate, wait: -5 * time.Millisecond},
		{reason: reasonShare, wait: -time.Millisecond},
		{reason: reasonBusy, wait: -time.Millisecond},
		{reason: reasonBusy, wait: -time.Millisecond, pausedBy: PausedByLoss},
		{wait: -time.Millisecond, pausedBy: PausedByVendor},
		{wait: -time.Millisecond},
	} {
		var le *LimitedError
		if err := l.refused(r, "FailFast"); !errors.As(err, &le) || le.RetryAfter < 0 {
			t.Errorf("refused(%+v) = %v, want a LimitedError to retry at 0 or later", r, err)
		}
	}
}
