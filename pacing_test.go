package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// While the fleet's calls start later than the widest margin covers, a
// log's calls that may wait are booked apart, the log's average gap between
// calls (here 1s / 20 = 50ms) after the one before, and
// the window after keeps that spread. Calls that may not wait are admitted
// as before, and so are all calls of a fleet whose margin widens enough.
func TestPacing_SpreadsTheCallsOfALateFleet(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 20, Window: time.Second}}, Options{Clock: clock.Now})
		ctx := context.Background()
		const pace = 50 * time.Millisecond
		reportLatesPerKey(t, lim, 60, 0)
		if ws := bookWaits(t, lim, "on-time", 40, 5*time.Second); ws[0] != 0 || ws[19] != 0 || ws[20] < time.Second || ws[39] != ws[20] {
			t.Errorf("on time, waits %v: want 20 admitted now, then 20 booked at one slot a window on", ws)
		}

		// 60 calls 40ms late: the margin widens to 90ms, which is enough.
		reportLatesPerKey(t, lim, 60, 40*ms)
		if ws := bookWaits(t, lim, "widened", 40, 5*time.Second); ws[19] != 0 || ws[39] != ws[20] {
			t.Errorf("margin widened, waits %v: want 20 admitted now, then 20 booked at one slot a window on", ws)
		}
		// 60 calls 60ms late: the margin stops at its ceiling, a tenth of
		// the window, and the calls of a log that may wait are paced.
		reportLatesPerKey(t, lim, 60, 60*ms)
		u, err := lim.Usage(ctx, Key("late"))
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Margin != 100*ms {
			t.Fatalf("margin %v after the late calls, want 100ms", u.Rules[0].Margin)
		}
		ws := bookWaits(t, lim, "late", 40, 5*time.Second)
		if ws[0] != 0 || !paceApart(ws[:20], pace) {
			t.Errorf("late fleet, first window's waits %v: want each %v or more after the one before", ws[:20], pace)
		}
		if ws[20] < time.Second || !paceApart(ws[20:], pace) {
			t.Errorf("late fleet, second window's waits %v: want a window on, each %v or more after the one before", ws[20:], pace)
		}
		if ws := bookWaits(t, lim, "now-only", 20, 0); ws[19] != 0 {
			t.Errorf("late fleet, calls that may not wait: waits %v, want all admitted now", ws)
		}
		// A call that may wait, but not as long as pacing would have it,
		// is admitted now all the same.
		bookWaits(t, lim, "short", 1, 5*time.Second)
		if ws := bookWaits(t, lim, "short", 1, pace/2); ws[0] != 0 {
			t.Errorf("a call that may wait %v was booked %v ahead, want admitted now", pace/2, ws[0])
		}
	})
}

// reportLatesPerKey notes n calls that started late, then has lim make a
// call of key "reports", which reports them to Redis (see reportLates).
func reportLatesPerKey(t *testing.T, lim *Limiter, n int, late time.Duration) {
	t.Helper()
	for range n {
		lim.lates.note(late)
	}
	if d, err := lim.Allow(context.Background(), Key("reports")); err != nil || !d.OK {
		t.Fatalf("Allow: %+v, %v", d, err)
	}
}

// bookWaits books n calls of key k at once, accepting a wait of maxWait,
// and returns their waits.
func bookWaits(t *testing.T, lim *Limiter, k string, n int, maxWait time.Duration) []time.Duration {
	t.Helper()
	var ws []time.Duration
	for i := range n {
		r, err := lim.acquire(context.Background(), callOf([]CallOption{Key(k)}), maxWait, nil)
		if err != nil || !r.admitted {
			t.Fatalf("key %s, call %d: %+v, %v", k, i, r, err)
		}
		ws = append(ws, r.wait)
	}
	return ws
}

// paceApart reports whether every wait is at least pace after the one
// before (and at most 2*pace, since the slots are the earliest).
func paceApart(ws []time.Duration, pace time.Duration) bool {
	for i := 1; i < len(ws); i++ {
		if d := ws[i] - ws[i-1]; d < pace || d > 2*pace {
			return false
		}
	}
	return true
}

// While a quota warms up, many small replicas that start together each ask
// for one call: once the log's latest 8 entries are the lone calls of as
// many limiters, their calls are paced, the log's average gap apart (here
// 1s / 40 = 25ms), instead of admitted in a burst that Redis and their cores
// would start late. A few replicas, a lone limiter's calls, a call that may
// not wait, and the same burst once the quota has warmed up are admitted
// at once.
func TestPacing_SpreadsTheLoneCallsOfManyReplicasWhileWarm(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		const pace = 25 * time.Millisecond
		policy := policies.SlidingLog{Limit: 40, Window: time.Second}
		clock := newClock()
		ctx := context.Background()
		replicas := func(prefix string, n int) []*Limiter {
			var lims []*Limiter
			for range n {
				lims = append(lims, newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now, Prefix: prefix}))
			}
			return lims
		}
		// book asks each limiter for one call in turn, all at the same
		// moment, and returns their waits.
		book := func(lims []*Limiter, maxWait time.Duration) []time.Duration {
			t.Helper()
			var ws []time.Duration
			for i, l := range lims {
				r, err := l.acquire(ctx, call{cost: 1}, maxWait, nil)
				if err != nil || !r.admitted {
					t.Fatalf("limiter %d: %+v, %v", i, r, err)
				}
				ws = append(ws, r.wait)
			}
			return ws
		}

		cold := replicas("cold", 12)
		ws := book(cold, 5*time.Second)
		if ws[7] != 0 || ws[8] != pace || ws[9] != 2*pace || ws[11] != 4*pace {
			t.Errorf("a burst of lone calls of 12 replicas on a cold quota: waits %v, want 8 admitted now, then each %v after the one before", ws, pace)
		}
		if ws := book(replicas("cold", 1), 0); ws[0] != 0 {
			t.Errorf("a call that may not wait was booked %v ahead, want admitted now", ws[0])
		}

		few := replicas("few", 3)
		if ws := book(append(append(append([]*Limiter{}, few...), few...), append(few, few...)...), 5*time.Second); ws[11] != 0 {
			t.Errorf("12 lone calls of 3 replicas on a cold quota: waits %v, want all admitted now", ws)
		}

		warm := replicas("warm", 12)
		warmUp(t, clock, time.Second, warm...)
		clock.Add(2 * time.Second)
		if ws := book(warm, 5*time.Second); ws[11] != 0 {
			t.Errorf("a burst of lone calls of 12 replicas on a warm quota: waits %v, want all admitted now", ws)
		}
	})
}
