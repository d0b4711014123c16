package throttle

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Calls booked ahead against a limit that then drops (a cap learned from a
// refusal here; equally a larger share left to other consumers) book again
// when they wake at their slots, against the limit in force: they do not
// all go out into a window the vendor has just said is smaller.
func TestLowered_CallsBookedBeforeADropBookAgain(t *testing.T) {
	testBookedBeforeADrop(t, false)
}

// A move that finds nothing earlier keeps the call's slot, and the booking
// it keeps is the one made before the drop: it books again all the same
// when it wakes. Here a call given back after the drop sets every call
// booked ahead moving, and none fits earlier under the lowered limit.
func TestLowered_AKeptMoveStillBooksAgain(t *testing.T) {
	testBookedBeforeADrop(t, true)
}

// testBookedBeforeADrop books ten calls a window ahead of ten admitted,
// lowers the limit to 5 with a refusal (and, with cancel, gives one of the
// first ten back after it), and checks that at most 5 of the ten booked
// ahead start in the window after the first ten.
func testBookedBeforeADrop(t *testing.T, cancel bool) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		// A window of a second: the ten must still be booked ahead when
		// the limit drops, and beside the race run they took longer than
		// half a second to book (bookTen saw none of them booked).
		const window = time.Second
		reasons, observe := bookedAgain()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: window}, Options{MaxWait: 10 * window, Observer: observe})
		start := time.Now()
		var first []*Permit
		for range 10 {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			first = append(first, p)
		}
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
