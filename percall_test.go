package throttle

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// llmPolicy is an LLM API's quota in one All: requests and tokens.
func llmPolicy(requests, tokens int, window time.Duration) policies.Policy {
	return policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: requests, Window: window, Margin: time.Millisecond}},
		policies.SlidingLog{Limit: tokens, Window: window, Margin: time.Millisecond},
	)
}

func TestPerCall_CountsCallsBesideUnits(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), llmPolicy(5, 1000, time.Second), Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		// 300 tokens a call: the tokens bind, at the fourth call.
		var ps []*Permit
		for i := range 3 {
			p, err := lim.Acquire(ctx, Cost(300))
			if err != nil {
				t.Fatalf("call %d of 300 tokens: %v", i+1, err)
			}
			ps = append(ps, p)
		}
		if _, err := lim.Acquire(ctx, Cost(300)); !errors.Is(err, ErrLimited) {
			t.Fatalf("a fourth call of 300 tokens under 1000: %v, want ErrLimited", err)
		}
		// Settled at 100 tokens each: only the tokens come back, the calls
		// still count 3 of 5.
		for _, p := range ps {
			if err := p.Settle(ctx, Cost(100)); err != nil {
				t.Fatal(err)
			}
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Used != 3 || u.Rules[1].Used != 300 {
			t.Fatalf("usage %d calls, %d tokens; want 3 and 300", u.Rules[0].Used, u.Rules[1].Used)
		}
		// Now the requests bind: two more calls, then none, with tokens left.
		for i := range 2 {
			if _, err := lim.Acquire(ctx, Cost(10)); err != nil {
				t.Fatalf("call %d: %v", 4+i, err)
			}
		}
		_, err = lim.Acquire(ctx, Cost(10))
		var le *LimitedError
		if !errors.As(err, &le) {
			t.Fatalf("a sixth call under 5 requests: %v, want ErrLimited", err)
		}
		// A cost above the requests' limit is fine: it counts once there.
		clock.Add(2 * time.Second)
		if _, err := lim.Acquire(ctx, Cost(900)); err != nil {
			t.Fatalf("a call of 900 tokens under 1000 tokens and 5 requests: %v", err)
		}
		if _, err := lim.Acquire(ctx, Cost(1001)); err == nil {
			t.Fatal("a call of 1001 tokens under a limit of 1000 was accepted")
		}
	})
}

func TestPerCall_BookingsAndGivingBackCountEachRuleItsWay(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), llmPolicy(2, 1000, time.Minute))
		ctx := context.Background()
		for range 2 {
			if _, err := lim.Acquire(ctx, Cost(100)); err != nil {
				t.Fatal(err)
			}
		}
		// A third call books a slot a minute ahead; giving up gives back
		// one call and its 100 tokens.
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		if _, err := lim.Acquire(short, Cost(100)); err == nil {
			t.Fatal("a third call under 2 requests a minute was admitted at once")
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := []int{u.Rules[0].Used + u.Rules[0].Booked, u.Rules[1].Used + u.Rules[1].Booked}; got[0] != 2 || got[1] != 200 {
			t.Errorf("counts %v after a call gave up, want [2 200]", got)
		}
	})
}

func TestPerCall_RejectsNesting(t *testing.T) {
	_, err := policies.Rules(policies.PerCall{Policy: policies.PerCall{Policy: policies.SlidingLog{Limit: 1, Window: time.Second}}})
	if err == nil {
		t.Error("a PerCall inside a PerCall was accepted")
	}
	if _, err := policies.Rules(policies.PerCall{}); err == nil {
		t.Error("a PerCall without a policy was accepted")
	}
}

// An LLM API counts requests and tokens per window, strictly. A fleet
// whose calls cost 20 to 100 tokens runs from one All: neither cap is
// crossed, and the binding one is used.
func TestPerCall_FleetUnderRequestsAndTokens(t *testing.T) {
	long(t)
	const (
		replicas = 3
		workers  = 10
		requests = 40   // per window
		tokens   = 2000 // per window: about 33 calls of 60 tokens bind first
		window   = time.Second
		runFor   = 4 * window
	)
	s := redistest.Real(t)
	reqs := fakevendor.NewInProcess(fakevendor.Config{Limit: requests, Window: window})
	toks := fakevendor.NewInProcess(fakevendor.Config{Limit: tokens, Window: window})
	policy := policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: requests, Window: window}},
		policies.SlidingLog{Limit: tokens, Window: window},
	)
	f := &llmFleet{reqs: reqs, toks: toks}
	lims := f.run(t, s, policy, replicas, workers, runFor)
	rs, ts := reqs.Stats(), toks.Stats()
	span := f.last.Sub(f.first)
	util := float64(ts.Accepted) / (float64(tokens) * float64(span+window) / float64(window))
	t.Logf("%d calls: requests over cap %d (max %d in a window of %d), tokens over cap %d (max %d of %d), tokens used %.0f%%",
		f.admitted.Load(), rs.OverCap, rs.MaxInWindow, requests, ts.OverCap, ts.MaxInWindow, tokens, 100*util)
	if rs.OverCap != 0 || ts.OverCap != 0 {
		t.Errorf("over the cap: %d requests, %d tokens", rs.OverCap, ts.OverCap)
	}
	// As in runFleet: a busy machine widens the margin, and gives up that
	// much of the cap on purpose. At the configured margin the floor is 85%:
	// the calls cost 20 to 100 tokens and wait in order, so a costly call
	// waits for room that a cheaper one behind it could have used; runs
	// keep 91-95% of the tokens in use, and 87% was seen under -race on a
	// loaded 2-core machine.
	u, err := lims[0].Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := 0.85
	if m := u.Rules[1].Margin; m > policies.DefaultMargin {
		want *= float64(window+policies.DefaultMargin) / float64(window+m)
	}
	if util < want {
		t.Errorf("%.0f%% of the tokens used, want at least %.0f%% (margin %v)", 100*util, 100*want, u.Rules[1].Margin)
	}
}

// llmFleet is a fleet calling a vendor that counts requests and tokens:
// when its first and last calls came, and how many were admitted.
type llmFleet struct {
	reqs, toks  *fakevendor.Vendor
	mu          sync.Mutex
	first, last time.Time
	admitted    atomic.Int64
}

// run runs workers goroutines in each of replicas replicas of policy for
// runFor, each calling at a cost of 20 to 100 tokens, and returns the
// replicas' limiters.
func (f *llmFleet) run(t *testing.T, s *redistest.Server, policy policies.Policy, replicas, workers int, runFor time.Duration) []*Limiter {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), runFor)
	defer cancel()
	var wg sync.WaitGroup
	var lims []*Limiter
	for range replicas {
		lim, err := New(s.Client(t), "llm-fleet", policy)
		if err != nil {
			t.Fatal(err)
		}
		lims = append(lims, lim)
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					cost := 20 + rand.IntN(81)
					_, err := Do(ctx, lim, func(context.Context) (bool, error) {
						f.call(cost)
						return true, nil
					}, Cost(cost))
					if err != nil {
						return
					}
				}
			})
		}
	}
	wg.Wait()
	return lims
}

// call is an admitted call of cost tokens arriving at the vendor.
func (f *llmFleet) call(cost int) {
	now := time.Now()
	f.mu.Lock()
	if f.first.IsZero() {
		f.first = now
	}
	f.last = now
	f.mu.Unlock()
	f.reqs.ArriveN(1)
	f.toks.ArriveN(cost)
	f.admitted.Add(1)
}

func TestPermit_CancelGivesTheCallBack(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.All(
			policies.PerCall{Policy: policies.All(
				policies.SlidingLog{Limit: 5, Window: time.Minute},
				policies.Concurrency{Max: 2, Lease: time.Minute},
			)},
			policies.SlidingLog{Limit: 1000, Window: time.Minute},
		), Options{Mode: FailFast})
		ctx := context.Background()
		p, err := lim.Acquire(ctx, Cost(300))
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Settle(ctx, Cost(400)); err != nil {
			t.Fatal(err)
		}
		if err := p.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range u.Rules {
			if r.Used+r.Booked != 0 {
				t.Errorf("rule %d still counts %d after Cancel", i, r.Used+r.Booked)
			}
		}
		if err := p.Cancel(ctx); err != nil {
			t.Errorf("a second Cancel: %v", err)
		}
		p.Release()
	})
}

// Without Options.MaxWait, a call waits for any slot its deadline allows: the
// 31st call of 30 a minute, under a deadline of two minutes, books its slot
// a minute ahead instead of failing at once.
func TestBlock_DeadlineAloneBoundsTheWaitByDefault(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 30, Window: time.Minute})
		ctx := context.Background()
		for range 30 {
			if _, err := lim.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		r, err := lim.acquire(ctx, call{cost: 1}, 2*time.Minute, nil)
		if err != nil || !r.admitted {
			t.Fatalf("the 31st call with two minutes to wait: %+v, %v; want a slot a minute ahead", r, err)
		}
		lim.cancel(ctx, call{cost: 1}, r)
		short, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_, err = lim.Acquire(short)
		var le *LimitedError
		if !errors.As(err, &le) || !strings.Contains(le.Reason, "deadline") || le.RetryAfter < 50*time.Second {
			t.Fatalf("the 31st call with 10s to wait: %v, want refused at once, naming the deadline", err)
		}
	})
}
