package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

func TestSettle_RefundsAndChargesInTheSameWindow(t *testing.T) {
	for _, p := range []policies.Policy{
		policies.SlidingLog{Limit: 10, Window: time.Second},
		policies.SlidingCounter{Limit: 10, Window: time.Second},
	} {
		t.Run(fmt.Sprintf("%T", p), func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				clock := newClock()
				lim := newLimiter(t, s.Client(t), p, Options{Clock: clock.Now})
				ctx := context.Background()
				permit, err := lim.Acquire(ctx, Cost(6))
				if err != nil {
					t.Fatal(err)
				}
				if err := permit.Settle(ctx, Cost(2)); err != nil {
					t.Fatal(err)
				}
				if got := rdbUnits(t, lim); got != 2 {
					t.Errorf("after a refund to 2, the quota holds %d units", got)
				}
				if err := permit.Settle(ctx, Cost(9)); err != nil {
					t.Fatal(err)
				}
				if got := rdbUnits(t, lim); got != 9 || permit.cost() != 9 {
					t.Errorf("after a charge to 9, the quota holds %d units, the permit %d", got, permit.cost())
				}
				if d, _ := lim.Allow(ctx, Cost(2)); d.OK {
					t.Errorf("2 units admitted after a charge to 9 of 10")
				}
				if err := permit.Settle(ctx, Cost(-1)); err == nil || !strings.Contains(err.Error(), "must not be negative, got -1") {
					t.Errorf("Settle(-1): %v", err)
				}
				// The vendor counted 11: the window is full, and no more.
				if err := permit.Settle(ctx, Cost(11)); err != nil {
					t.Fatal(err)
				}
				if got := rdbUnits(t, lim); got != 10 || permit.cost() != 10 {
					t.Errorf("after a charge to 11 on a limit of 10, the quota holds %d units, the permit %d", got, permit.cost())
				}
				// The charge leaves with the call's window.
				clock.Add(2 * time.Second)
				if d, _ := lim.Allow(ctx, Cost(10)); !d.OK {
					t.Errorf("a window later, a full-cost call was refused: %+v", d)
				}
			})
		})
	}
}

// rdbUnits reads the units the limiter's first rule holds, straight from Redis.
func rdbUnits(t *testing.T, lim *Limiter) int {
	t.Helper()
	rdb := lim.rdb
	key := lim.cfg.shared[2]
	ctx := context.Background()
	if lim.cfg.rules[0].Kind == policies.KindSlidingLog {
		return int(rdb.ZCard(ctx, key).Val())
	}
	n := 0
	for _, v := range rdb.HVals(ctx, key).Val() {
		x, err := strconv.Atoi(v)
		if err != nil {
			t.Fatal(err)
		}
		n += x
	}
	return n
}

func TestTokenBucket_RefundsOnlyItsLatestCall(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.TokenBucket{Rate: 10, Per: time.Second, Burst: 4}, Options{Clock: clock.Now})
		ctx := context.Background()
		first, err := lim.Acquire(ctx, Cost(2))
		if err != nil {
			t.Fatal(err)
		}
		last, err := lim.Acquire(ctx, Cost(2))
		if err != nil {
			t.Fatal(err)
		}
		if d, _ := lim.Allow(ctx); d.OK {
			t.Fatalf("a burst of 4 admitted a fifth unit")
		}
		// An earlier call's refund would let a new call land on a later
		// booking: it is dropped.
		if err := first.Settle(ctx, Cost(0)); err != nil {
			t.Fatal(err)
		}
		if d, _ := lim.Allow(ctx); d.OK {
			t.Errorf("a refund of an earlier call freed room")
		}
		if err := last.Settle(ctx, Cost(0)); err != nil {
			t.Fatal(err)
		}
		if d, _ := lim.Allow(ctx, Cost(2)); !d.OK {
			t.Errorf("the latest call's refund freed no room: %+v", d)
		}
	})
}

func TestTokenBucket_PacesCalls(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.TokenBucket{Rate: 10, Per: time.Second}, Options{Clock: clock.Now})
		ctx := context.Background()
		if d, _ := lim.Allow(ctx); !d.OK {
			t.Fatal("first call refused")
		}
		d, _ := lim.Allow(ctx)
		if d.OK || d.RetryAfter != 100*time.Millisecond {
			t.Fatalf("second call at once: %+v, want RetryAfter 100ms", d)
		}
		clock.Add(100 * time.Millisecond)
		if d, _ := lim.Allow(ctx); !d.OK {
			t.Errorf("call one interval later refused: %+v", d)
		}
	})
}

func TestConcurrency_HoldsSlotsUntilRelease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.Concurrency{Max: 2, Lease: time.Minute})
		ctx := context.Background()
		a, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		b, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		d, err := lim.Allow(ctx)
		if err != nil || d.OK || d.RetryAfter < 59*time.Second {
			t.Fatalf("third call with 2 in flight: %+v, %v; want refused, first lease a minute away", d, err)
		}
		got := make(chan time.Time, 1)
		done := make(chan struct{})
		go func() {
			defer close(done)
			c, err := lim.Acquire(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			got <- time.Now()
			c.Release()
		}()
		time.Sleep(20 * time.Millisecond) // let the waiter find both slots taken
		released := time.Now()
		a.Release()
		a.Release() // harmless
		select {
		case at := <-got:
			if at.Sub(released) > 2*time.Second {
				t.Errorf("the waiter got the freed slot %v after the release", at.Sub(released))
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the waiter never got the freed slot")
		}
		b.Release()
		<-done
		if n := s.Client(t).ZCard(ctx, lim.cfg.shared[2]).Val(); n != 0 {
			t.Errorf("%d slots held after every release", n)
		}
	})
}

// A release wakes the calls of this process that wait for a concurrency
// slot at once, rather than at the end of their pause between tries (up to
// 250ms): Release and Cancel both signal them.
func TestConcurrency_ReleaseWakesThisProcesssWaiters(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.Concurrency{Max: 2, Lease: time.Minute})
		ctx := context.Background()
		freed := lim.freed.wait
		for _, end := range []struct {
			name string
			fn   func(*Permit) error
		}{
			{"Release", func(p *Permit) error { p.Release(); return nil }},
			{"Cancel", func(p *Permit) error { return p.Cancel(ctx) }},
		} {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			waiting := freed()
			if err := end.fn(p); err != nil {
				t.Fatal(err)
			}
			select {
			case <-waiting:
			default:
				t.Errorf("%s did not wake the calls waiting for a slot", end.name)
			}
		}
	})
}

func TestConcurrency_LeaseFreesACrashedHolder(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.Concurrency{Max: 1, Lease: time.Second}, Options{Clock: clock.Now, Mode: FailFast})
		ctx := context.Background()
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		clock.Add(900 * time.Millisecond)
		if err := p.Extend(ctx, 2*time.Second); err != nil {
			t.Fatal(err)
		}
		clock.Add(time.Second)
		if _, err := lim.Acquire(ctx); !errors.Is(err, ErrLimited) {
			t.Fatalf("slot free within its extended lease: %v", err)
		}
		// The holder "crashes": it never releases.
		clock.Add(2 * time.Second)
		if _, err := lim.Acquire(ctx); err != nil {
			t.Errorf("slot still taken after its lease ran out: %v", err)
		}
		if err := p.Extend(ctx, time.Second); err == nil {
			t.Errorf("Extend of a lease that ran out succeeded")
		}
	})
}

func TestPause_StopsEveryReplica(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		policy := policies.SlidingLog{Limit: 100, Window: time.Second}
		a := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		b := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		ctx := context.Background()
		if err := a.Pause(ctx, 2*time.Second); err != nil {
			t.Fatal(err)
		}
		if err := a.Pause(ctx, time.Second); err != nil {
			t.Fatal(err)
		}
		d, err := b.Allow(ctx)
		if err != nil || d.OK || d.RetryAfter != 2*time.Second {
			t.Fatalf("another replica during a 2s pause: %+v, %v; want RetryAfter 2s (a shorter pause never shortens)", d, err)
		}
		clock.Add(2 * time.Second)
		if d, _ := b.Allow(ctx); !d.OK {
			t.Errorf("refused after the pause: %+v", d)
		}
	})
}

func TestPause_AppliesToOneKeyOfPerKeyQuotas(t *testing.T) {
	s := redistest.Mini(t)
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Hour}}, Options{Clock: clock.Now})
	ctx := context.Background()
	if err := lim.Pause(ctx, time.Minute); err == nil {
		t.Errorf("Pause without a Key on a per-key quota succeeded")
	}
	if err := lim.Pause(ctx, time.Minute, Key("token-1")); err != nil {
		t.Fatal(err)
	}
	if d, _ := lim.Allow(ctx, Key("token-1")); d.OK {
		t.Errorf("paused key admitted a call")
	}
	if d, _ := lim.Allow(ctx, Key("token-2")); !d.OK {
		t.Errorf("another key was paused too")
	}
}

func TestPause_WakingWaiterBooksAgain(t *testing.T) {
	s := redistest.New(t)
	reasons, observe := bookedAgain()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: 100 * time.Millisecond, Margin: time.Nanosecond}, Options{Observer: observe})
	ctx := context.Background()
	if _, err := lim.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan *Permit, 1)
	go func() {
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Error(err)
		}
		done <- p
	}()
	waitFor(t, func() bool { return s.Client(t).ZCard(ctx, lim.cfg.shared[2]).Val() == 2 }, "the waiter's booking")
	if err := lim.Pause(ctx, 400*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	p := <-done
	if p != nil && p.waited < 390*time.Millisecond {
		t.Errorf("the waiter went after %v, inside a 400ms pause", p.waited)
	}
	if got := reasons(); got[againPaused] != 1 {
		t.Errorf("the waiter booked again for %v, want once for the pause", got)
	}
}

func TestSetRemaining_ClampsTheSharedCountDown(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, p := range []policies.Policy{
			policies.SlidingLog{Limit: 10, Window: time.Minute},
			policies.SlidingCounter{Limit: 10, Window: time.Minute},
			policies.TokenBucket{Rate: 10, Per: time.Minute, Burst: 10},
		} {
			clock := newClock()
			lim := newLimiter(t, s.Client(t), p, Options{Clock: clock.Now, Mode: FailFast})
			ctx := context.Background()
			if _, err := lim.Acquire(ctx, Cost(2)); err != nil {
				t.Fatal(err)
			}
			// We believe 8 are left; the vendor says 3.
			if err := lim.SetRemaining(ctx, 3, 30*time.Second); err != nil {
				t.Fatal(err)
			}
			if err := lim.SetRemaining(ctx, 7, 0); err != nil {
				t.Fatal(err) // a higher count than ours changes nothing
			}
			// A count of a window leaves the others what they spent, and a
			// unit more (Usage.Others); a token bucket's is charged.
			left := 3
			if _, bucket := p.(policies.TokenBucket); !bucket {
				left = leftAfter(10, 2, 3)
			}
			if d, _ := lim.Allow(ctx, Cost(left+1)); d.OK {
				t.Errorf("%T: %d units admitted after the vendor said 3 were left", p, left+1)
			}
			if d, _ := lim.Allow(ctx, Cost(left)); !d.OK {
				t.Errorf("%T: the %d units the vendor has left were refused: %+v", p, left, d)
			}
			if err := lim.SetRemaining(ctx, -1, 0); err == nil {
				t.Errorf("SetRemaining(-1) succeeded")
			}
			s.Client(t).FlushAll(ctx)
		}
	})
}
