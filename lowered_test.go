package throttle

import (
	"context"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// Calls booked ahead against a limit that then drops (a cap learned from a
// refusal here; equally a larger share left to other consumers) book again
// when they wake at their slots, against the limit in force: they do not
// all go out into a window the vendor has just said is smaller.
func loweredCallsBookedBeforeADropBookAgain(t *testing.T) {
	testBookedBeforeADrop(t, false)
}

// A move that finds nothing earlier keeps the call's slot only if the call
// still fits there under the lowered limit (fits_behind in
// lua/acquire.lua); the others book again. Here a call given back after
// the drop sets every call booked ahead moving, and none fits earlier
// under the lowered limit.
func loweredAKeptMoveStillBooksAgain(t *testing.T) {
	testBookedBeforeADrop(t, true)
}

// testBookedBeforeADrop books ten calls a window ahead of ten admitted,
// lowers the limit to 5 with a refusal (and, with cancel, gives one of the
// first ten back after it), and checks that at most 5 of the ten booked
// ahead start in the window after the first ten.
func testBookedBeforeADrop(t *testing.T, cancel bool) {
	eachSideBySide(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		// A window of a second: the ten must still be booked ahead when
		// the limit drops, and beside the race run they took longer than
		// half a second to book (bookTen saw none of them booked).
		const window = time.Second
		reasons, observe := bookedAgain()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: window}, Options{MaxWait: 10 * window, Observer: observe})
		start := time.Now()
		first := admitTen(t, lim, 0)
		// Ten more, booked a window ahead while the limit is 10.
		started := bookTen(t, lim, start)
		// The vendor refuses a call of the first ten: the cap drops to 5.
		if err := first[9].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 5 {
			t.Fatalf("limit in force %v after the refusal, want 5", got)
		}
		if cancel {
			if err := first[0].Cancel(ctx); err != nil {
				t.Fatal(err)
			}
		}
		starts := started()
		early := 0
		for _, at := range starts {
			if at < window*17/10 {
				early++
			}
		}
		if early > 5 {
			t.Errorf("%d of the calls booked before the drop started within the window after the first ten (at %v), want 5 at most", early, starts)
		}
		if got := reasons(); got[againLowered] == 0 {
			t.Errorf("the calls booked again for %v, want for a lowered limit", got)
		}
	})
}

// admitTen acquires ten calls of lim, gap apart, and returns their permits.
func admitTen(t *testing.T, lim *Limiter, gap time.Duration) []*Permit {
	t.Helper()
	var first []*Permit
	for range 10 {
		p, err := lim.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first = append(first, p)
		time.Sleep(gap)
	}
	return first
}

// acquireEach starts n calls of lim, gap apart, each of which notes when it
// began after start in began, and releases its permit; wg waits for them.
func acquireEach(t *testing.T, lim *Limiter, n int, start time.Time, gap time.Duration) (began []time.Duration, wg *sync.WaitGroup) {
	began, wg = make([]time.Duration, n), &sync.WaitGroup{}
	for i := range began {
		wg.Go(func() {
			p, err := lim.Acquire(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			began[i] = time.Since(start)
			p.Release()
		})
		if gap > 0 {
			time.Sleep(gap)
		}
	}
	return began, wg
}

// tenASecond returns, in a synctest bubble, a limiter of a log of 10 a
// second on a simulated Redis latency away (closed as the test ends, in the
// bubble), and what returns its calls booked again by reason (bookedAgain).
func tenASecond(t *testing.T, latency time.Duration) (*sim.Redis, *Limiter, func() map[string]int) {
	r := sim.NewRedis(func(int) time.Duration { return latency })
	t.Cleanup(r.Close)
	reasons, observe := bookedAgain()
	lim := newLimiter(t, simClient(t, r, 0), policies.SlidingLog{Limit: 10, Window: time.Second}, Options{Logger: quiet(), Observer: observe, MaxWait: time.Minute})
	t.Cleanup(func() { closeInBubble(lim) })
	return r, lim, reasons
}

// bookedAgain returns an Observer that counts the calls booked again, and
// what returns the counts so far by reason (EventBookedAgain).
func bookedAgain() (func() map[string]int, func(Event)) {
	var mu sync.Mutex
	seen := map[string]int{}
	return func() map[string]int {
			mu.Lock()
			defer mu.Unlock()
			return maps.Clone(seen)
		}, func(e Event) {
			if e.Kind == EventBookedAgain {
				mu.Lock()
				seen[e.Reason]++
				mu.Unlock()
			}
		}
}

// bookTen starts ten calls of lim and returns once Redis holds their ten
// bookings. What it returns waits for the calls and gives when each
// started, from start.
func bookTen(t *testing.T, lim *Limiter, start time.Time) func() []time.Duration {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var starts []time.Duration
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := lim.Acquire(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			starts = append(starts, time.Since(start))
			mu.Unlock()
			p.Release()
		}()
	}
	// Until the ten are booked; a call that failed to book (t.Error above)
	// ends the wait, and so does a generous bound.
	deadline := time.Now().Add(30 * time.Second)
	for booked := 0; booked < 10; {
		if t.Failed() || time.Now().After(deadline) {
			t.Fatalf("%d of 10 calls booked", booked)
		}
		u, err := lim.Usage(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		booked = u.Rules[0].Booked
		time.Sleep(5 * time.Millisecond)
	}
	return func() []time.Duration {
		wg.Wait()
		return starts
	}
}

// A limit in force that drops while calls are booked windows ahead sends
// back only the calls it leaves no room for. Each call, woken at its slot
// after the drop, keeps it if its units still fit the window that ends
// there (fits_behind in lua/acquire.lua): the calls at the front keep
// their places, and a call behind them goes to the back of the queue only
// where the lower limit has no room. Before, each woken call booked again
// from its slot, and a queue booked several windows deep filled every
// window it could take, so nearly every call went to the back. Virtual
// time: 10 calls admitted and 30 booked up to three windows ahead, 10 ms
// apart; the limit halves (a refusal) 500 ms in.
func TestLowered_TheCallsAheadKeepTheirPlacesWhereTheLowerLimitLeavesRoom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const window = time.Second
		_, lim, reasons := tenASecond(t, time.Millisecond)
		ctx := context.Background()
		start := time.Now()
		first := admitTen(t, lim, 10*time.Millisecond)
		began, wg := acquireEach(t, lim, 30, start, 10*time.Millisecond)
		time.Sleep(time.Until(start.Add(window / 2)))
		if err := first[9].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 5 {
			t.Fatalf("limit in force %v after the refusal, want 5", got)
		}
		wg.Wait()
		// Every window after the drop holds 5 calls at most: the calls kept
		// at their slots and those booked again share the lower limit.
		w := window + policies.DefaultMargin
		if n := mostWithin(began, w); n > 5 {
			t.Fatalf("%d calls started within %v (%v), want 5 at most", n, w, began)
		}
		back := reasons()[againLowered]
		t.Logf("%d of the 30 calls booked ahead went to the back of the queue; they started from %v to %v", back, began[0], began[len(began)-1])
		if back == 0 || back > 20 {
			t.Errorf("%d of the 30 calls booked ahead booked again after the drop, want some, and 20 at most (each window ahead keeps about half)", back)
		}
	})
}

// On a Redis farther than half the margin, the calls booked ahead before a
// limit dropped still keep their places: each asks whether it keeps its
// place two round trips before its slot, not at it, where the answer came a
// round trip after the slot and every place kept was too late to start in,
// the call booking again, and again (seed 756327: a fleet 51 ms from Redis
// reached the vendor no more for 4 s).
func TestLowered_CallsOfADistantRedisKeepTheirPlaces(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const window = time.Second
		_, lim, reasons := tenASecond(t, 50*time.Millisecond)
		ctx := context.Background()
		first := admitTen(t, lim, 0)
		// 30 calls booked ahead at once, over the three windows after the
		// first ten's, then the limit drops to 5 while they sleep.
		start := time.Now()
		began, wg := acquireEach(t, lim, 30, start, 0)
		time.Sleep(300 * time.Millisecond)
		if err := first[9].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 5 {
			t.Fatalf("limit in force %v after the refusal, want 5", got)
		}
		wg.Wait()
		got := reasons()
		t.Logf("booked again: %v; the calls started from %v to %v", got, slices.Min(began), slices.Max(began))
		if got[againLate] > 0 {
			t.Errorf("%d calls booked again too late for their places (%v), want none: each asks whether it keeps its place before its slot", got[againLate], got)
		}
		if got[againLowered] == 0 || got[againLowered] > 20 {
			t.Errorf("%d of the 30 calls booked ahead went to the back of the queue, want some, and 20 at most (each window ahead keeps about half)", got[againLowered])
		}
		if w := window + policies.DefaultMargin; mostWithin(began, w) > 5 {
			t.Errorf("%d calls started within %v (%v), want 5 at most", mostWithin(began, w), w, began)
		}
	})
}

// A limit lowered before Redis's clock went back holds no booking decided
// after the step: the step counts as a loss, and a loss's new epoch is by
// the new clock, behind the time the limit dropped at by the step's length.
// Kept as it was, that time overtook every booking of the new epoch, and
// each call woken at its slot booked again, for as long as the step.
func TestLowered_ALimitLoweredBeforeAClockStepBackOvertakesNoLaterBooking(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r, lim, reasons := tenASecond(t, time.Millisecond)
		first := admitTen(t, lim, 10*time.Millisecond)
		if err := first[9].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 5 {
			t.Fatalf("limit in force %v after the refusal, want 5", got)
		}
		r.Step(-time.Hour)
		// The step holds the quota full for a window: these calls are booked
		// ahead, and wake at their slots.
		start := time.Now()
		var wg sync.WaitGroup
		var failed atomic.Int32
		for range 10 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				p, err := lim.Acquire(ctx)
				if err != nil {
					failed.Add(1)
					return
				}
				p.Release()
			})
		}
		wg.Wait()
		if n := failed.Load(); n > 0 {
			t.Errorf("%d of 10 calls made after the step were not admitted within 10 s (%v of them booked again for a limit lowered before the step)", n, reasons()[againLowered])
		}
		took := time.Since(start)
		t.Logf("10 calls after the step: %v, %d booked again for a lower limit", took, reasons()[againLowered])
		if n := reasons()[againLowered]; n > 0 {
			// Each call, booked after the step, looks ahead of its slot
			// and keeps its place or books again: all are admitted, but
			// none should have been overtaken at all.
			t.Errorf("%d bookings made after the step overtaken by the limit lowered before it, want none", n)
		}
		if took > 5*time.Second {
			t.Errorf("10 calls at 5 a second after a window's hold took %v, want under 5 s", took)
		}
	})
}
