package throttle

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A call that wakes too late for its slot keeps its place among its
// limiter's calls: it takes the slot of the first call that asked after
// it, and that call books again behind the rest. Three calls book a
// window apart on a limit of one a second; the clock, which Redis's time
// follows here, goes 1.2 s on while they sleep, so that the first wakes
// 145 ms after its slot, far past the 27.5 ms its margin allows. It starts
// at the second's slot, before the third; the second books again after
// the third. Without keep_turn, the first books again after the third,
// behind two calls that asked after it.
func TestPlace_ALateCallTakesTheSlotOfACallThatAskedAfterIt(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		reasons, observe := bookedAgain()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: time.Second, Margin: 10 * ms},
			Options{Clock: clock.Now, Observer: observe, Logger: quiet()})
		ctx := context.Background()
		if _, err := lim.Allow(ctx); err != nil {
			t.Fatal(err)
		}
		permits := bookInTurn(t, lim, 1, 1, 1)
		clock.Add(1200 * ms)
		var slots [3]time.Duration
		for i, ch := range permits {
			p := <-ch
			if p == nil {
				t.FailNow()
			}
			slots[i] = p.r.slot()
			p.Release()
		}
		first, second, third := slots[0], slots[1], slots[2]
		if first >= third || second <= third {
			t.Errorf("slots after the Allow's: first %v, second %v, third %v; want the first before the third, the second after it",
				first-clockStart, second-clockStart, third-clockStart)
		}
		if got := reasons(); got[againLate] != 1 || got[againYielded] != 1 || len(got) != 2 {
			t.Errorf("booked again for %v, want once late (the first) and once yielded (the second)", got)
		}
	})
}

// clockStart is the Redis time of newClock's start.
var clockStart = time.Duration(newClock().Now().UnixNano())

// A late call that takes a booking of more units than its own gives the
// rest back at once: a call of 1 unit takes the booking of 2 of the call
// that asked after it, and the window holds its 1 unit at that slot.
// Without settleTaken, it would hold 2 for the 1 the vendor counts.
func TestPlace_ALateCallGivesBackWhatTheSlotItTookHoldsBeyondItsUnits(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 2, Window: time.Second, Margin: 10 * ms},
			Options{Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if _, err := lim.Allow(ctx, Cost(2)); err != nil {
			t.Fatal(err)
		}
		permits := bookInTurn(t, lim, 1, 2)
		clock.Add(1200 * ms)
		first := <-permits[0]
		if first == nil {
			t.FailNow()
		}
		defer first.Release()
		slot := strconv.FormatInt(first.r.slot().Microseconds(), 10)
		held, err := rdb.ZCount(ctx, lim.cfg.shared[len(lim.cfg.shared)-1], slot, slot).Result()
		if err != nil {
			t.Fatal(err)
		}
		if first.cost() != 1 || held != 1 {
			t.Errorf("the late call counts %d units, the window holds %d at its slot %v; want 1 and 1",
				first.cost(), held, first.r.slot()-clockStart)
		}
		if second := <-permits[1]; second != nil {
			if second.r.slot() <= first.r.slot() {
				t.Errorf("the second call's slot %v, want after the first's %v", second.r.slot()-clockStart, first.r.slot()-clockStart)
			}
			second.Release()
		}
	})
}

// bookInTurn starts a call of lim for each cost, each once the one before
// sleeps towards its slot, and returns where each one's permit comes (nil
// when it failed).
func bookInTurn(t *testing.T, lim *Limiter, costs ...int) []chan *Permit {
	permits := make([]chan *Permit, len(costs))
	for i, cost := range costs {
		permits[i] = make(chan *Permit, 1)
		go func() {
			p, err := lim.Acquire(context.Background(), Cost(cost))
			if err != nil {
				t.Error(err)
			}
			permits[i] <- p
		}()
		for lim.view.asleep.Load() < int64(i+1) {
			time.Sleep(ms)
		}
	}
	return permits
}
