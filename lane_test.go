package throttle

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// The tests of the lane (batch.go): a call that waits in it behind the
// script call ahead of its own.

// laneRedis returns a simulated Redis 100 ms away from process 0 and next
// to every other, and a limiter of process i under a sliding log of limit
// calls a second.
func laneRedis(t *testing.T, limit int) (*sim.Redis, func(i int, o Options) *Limiter) {
	r := sim.NewRedis(func(proc int) time.Duration {
		if proc == 0 {
			return 100 * time.Millisecond
		}
		return 0
	})
	policy := policies.SlidingLog{Limit: limit, Window: time.Second}
	return r, func(i int, o Options) *Limiter {
		o.Logger = quiet()
		return newLimiter(t, simClient(t, r, i), policy, o)
	}
}

// A call's wait runs from when it asked, not from when the script call
// that decides it runs: a call that waited 190 ms in the lane, behind its
// process's script call on a Redis 100 ms away, is not booked past its
// deadline. Its deadline of 700 ms is 685 ms of wait, 495 ms left when its
// script runs, and the slot its script finds lies 665 ms after that: the
// script refuses it, and the window never holds it (virtual time: the
// same each run). Counted from the script, it would be booked there, hold
// the slot from other calls until its own process found it past the
// deadline and gave it back, and fail all the same (seed 548683: calls
// that waited 400 ms in the lane held a window's slots this way while
// calls that asked later were refused).
func TestLane_ACallsWaitRunsFromWhenItAsked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r, limiter := laneRedis(t, 2)
		defer r.Close()
		lim, look := limiter(0, Options{}), limiter(1, Options{})
		defer closeInBubble(lim)
		defer closeInBubble(look)
		ctx := context.Background()
		for range 2 { // the window is full for a second, from each
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			p.Release()
		}
		var wg sync.WaitGroup
		defer wg.Wait()
		wg.Go(func() { // asks first (t): its script call runs at t+100 ms
			if p, err := lim.Acquire(ctx); err == nil {
				p.Release()
			}
		})
		time.Sleep(10 * time.Millisecond)
		var err error
		wg.Go(func() { // waits in the lane until t+200 ms; its script runs at t+300 ms
			dctx, cancel := context.WithTimeout(ctx, 700*time.Millisecond)
			defer cancel()
			var p *Permit
			if p, err = lim.Acquire(dctx); err == nil {
				p.Release()
			}
		})
		time.Sleep(390 * time.Millisecond) // t+400 ms: after its script, before a give-back could reach Redis
		held := look.cfg.shared[2]
		if n := len(mustMembers(t, r, held)); n != 3 {
			t.Errorf("the window holds %d bookings after the late asker's script, want 3: it was booked past its deadline", n)
		}
		wg.Wait()
		if !errors.Is(err, ErrLimited) {
			t.Errorf("the call whose slot lies past its deadline: %v, want ErrLimited", err)
		}
	})
}

// mustMembers returns the members of the sorted set key of r's server.
func mustMembers(t *testing.T, r *sim.Redis, key string) []string {
	t.Helper()
	m, err := r.Server().ZMembers(key)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// A call sleeping towards its slot moves earlier into units given back
// only when the move can gain: its reply comes a round trip after it asks
// (200 ms here), later still when it waits in the lane behind its
// process's script call, and a move that finds nothing earlier keeps a
// slot that passed meanwhile, and makes the call late for it: it books
// again, behind the queue (seed 548683: ten calls of a window booked
// again, most then refused for their deadlines). Here a call C sleeps
// towards its slot 1 s ahead, and a call of another process gives back
// the slot before it (a Cancel), and the news reaches C's process when
// C's slot is 150 ms away (less than a round trip), or 250 ms away while
// C's process waits 180 ms more for the script call of another of its
// calls (virtual time: the same each run).
// C goes at its slot, not booked again.
func TestLane_AMoveThatCannotGainIsNotMade(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before time.Duration // how long before C wakes the units are given back
		busy   bool          // another call of C's process asks as the news reaches it
	}{
		{"less than a round trip before", 250 * time.Millisecond, false},
		{"behind a script call", 350 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { moveCannotGain(t, tc.before, tc.busy) })
		})
	}
}

// moveCannotGain is TestLane_AMoveThatCannotGainIsNotMade's case.
func moveCannotGain(t *testing.T, before time.Duration, busy bool) {
	r, limiter := laneRedis(t, 1)
	defer r.Close()
	var again sync.Map
	lim := limiter(0, Options{Observer: func(e Event) {
		if e.Kind == EventBookedAgain {
			again.Store(e.Reason, true)
		}
	}})
	other := limiter(1, Options{})
	defer closeInBubble(lim)
	defer closeInBubble(other)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	readTiming(t, lim)
	start := time.Now()
	given, err := other.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	var waited time.Duration
	wg.Go(func() { // booked a second ahead, behind the other process's call
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		waited = time.Since(start)
		p.Release()
	})
	time.Sleep(300 * time.Millisecond)
	// C wakes when its slot's time reaches this process, 100 ms after it.
	wake := latestSlot(t, r, lim.cfg.shared[2]).Add(100 * time.Millisecond)
	time.Sleep(time.Until(wake.Add(-before)))
	if err := given.Cancel(ctx); err != nil {
		t.Fatal(err)
	}
	if busy { // 20 ms before the news of the units given back reaches C's process
		time.Sleep(80 * time.Millisecond)
		wg.Go(func() { _, _ = lim.Acquire(ctx) }) // booked a second ahead, until the test ends
	}
	time.Sleep(time.Until(wake.Add(200 * time.Millisecond)))
	stop()
	wg.Wait()
	again.Range(func(why, _ any) bool {
		t.Errorf("C booked again (%v), want it to go at its slot", why)
		return true
	})
	if waited == 0 || waited > wake.Sub(start)+10*time.Millisecond {
		t.Errorf("C waited %v, want to its slot, %v", waited, wake.Sub(start))
	}
}

// readTiming makes minReadings round trips to lim's Redis, on a quota of
// their own, so that lim knows its delay (timing.delay).
func readTiming(t *testing.T, lim *Limiter) {
	t.Helper()
	w, err := New(lim.rdb, "timing", policies.SlidingLog{Limit: 100, Window: time.Second}, Options{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer closeInBubble(w)
	for range minReadings + 1 {
		p, err := w.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		p.Release()
	}
	if lim.timing.delay() <= 0 {
		t.Fatalf("after %d round trips, the delay is %v", minReadings+1, lim.timing.delay())
	}
}

// latestSlot returns the latest slot booked in the sliding log key of r.
func latestSlot(t *testing.T, r *sim.Redis, key string) time.Time {
	t.Helper()
	set, err := r.Server().SortedSet(key)
	if err != nil || len(set) == 0 {
		t.Fatalf("the log %s: %v, %v", key, set, err)
	}
	var last float64
	for _, score := range set {
		last = max(last, score)
	}
	return time.UnixMicro(int64(last))
}
