package throttle

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// anthropicLike is a quota of requests, input tokens and output tokens,
// each at its own limit, as Anthropic caps them.
var anthropicLike = policies.All(
	policies.PerCall{Policy: policies.SlidingLog{Limit: 5, Window: time.Minute}},
	policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 100, Window: time.Minute}},
	policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
)

// usedOf returns the units each rule of lim counts now, in its rules' order.
func usedOf(t *testing.T, lim *Limiter) []int {
	t.Helper()
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, r := range u.Rules {
		out = append(out, r.Used)
	}
	return out
}

// One quota counts requests, input tokens and output tokens at once, each
// rule its own unit: a call fits only when each of its units does, and
// settling gives each unit back on its own.
func TestUnits_EachRuleCountsItsOwnUnit(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), anthropicLike, Options{Mode: FailFast})
		ctx := context.Background()
		first, err := lim.Acquire(ctx, CostIn("input_tokens", 60), CostIn("output_tokens", 40))
		if err != nil {
			t.Fatal(err)
		}
		if got := usedOf(t, lim); got[0] != 1 || got[1] != 60 || got[2] != 40 {
			t.Fatalf("used %v, want [1 60 40]: a request, its input and its output tokens", got)
		}
		// Input fits (90 of 100), output does not (60 of 50).
		if _, err := lim.Acquire(ctx, CostIn("input_tokens", 30), CostIn("output_tokens", 20)); !errors.Is(err, ErrLimited) {
			t.Fatalf("a call over the output tokens' limit: %v, want ErrLimited", err)
		}
		if err := first.Settle(ctx, CostIn("output_tokens", 10)); err != nil {
			t.Fatal(err)
		}
		if got := usedOf(t, lim); got[1] != 60 || got[2] != 10 {
			t.Fatalf("used %v after settling the output at 10, want the input 60 and the output 10", got)
		}
		if _, err := lim.Acquire(ctx, CostIn("input_tokens", 30), CostIn("output_tokens", 20)); err != nil {
			t.Fatalf("the call fits once the output is settled: %v", err)
		}
		// Over the input tokens' limit now (90 + 20 > 100).
		if _, err := lim.Acquire(ctx, CostIn("input_tokens", 20), CostIn("output_tokens", 1)); !errors.Is(err, ErrLimited) {
			t.Fatalf("a call over the input tokens' limit: %v, want ErrLimited", err)
		}
	})
}

// A call that names a unit the quota does not count, leaves out one it
// does, or costs more than a unit's limit fails with an error that names
// the unit; so does a Settle of a unit the quota does not count.
func TestUnits_BadCostsAreErrorsNamingTheUnit(t *testing.T) {
	s := redistest.Mini(t)
	lim := newLimiter(t, s.Client(t), anthropicLike, Options{Mode: FailFast})
	ctx := context.Background()
	for _, tc := range []struct {
		opts []CallOption
		want string
	}{
		{[]CallOption{CostIn("input_tokens", 1)}, `the call needs CostIn("output_tokens", n)`},
		{[]CallOption{CostIn("input_tokens", 1), CostIn("output_tokens", 1), CostIn("cached", 1)}, `no policy counts unit "cached" (its units: input_tokens, output_tokens)`},
		{[]CallOption{CostIn("input_tokens", 101), CostIn("output_tokens", 1)}, `CostIn("input_tokens", 101) exceeds the limit 100`},
		{[]CallOption{CostIn("input_tokens", -1), CostIn("output_tokens", 1)}, `must not be negative`},
	} {
		if _, err := lim.Acquire(ctx, tc.opts...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want one saying %s", err, tc.want)
		}
	}
	p, err := lim.Acquire(ctx, CostIn("input_tokens", 1), CostIn("output_tokens", 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Settle(ctx, CostIn("cached", 1)); err == nil || !strings.Contains(err.Error(), `no policy counts unit "cached"`) {
		t.Fatalf("Settle of an unknown unit: %v", err)
	}
}

// A booking given back returns each unit to its own rule.
func TestUnits_CancelGivesEachUnitBack(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), anthropicLike, Options{MaxWait: 2 * time.Minute})
		ctx := context.Background()
		if _, err := lim.Acquire(ctx, CostIn("input_tokens", 90), CostIn("output_tokens", 10)); err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := lim.Acquire(cctx, CostIn("input_tokens", 20), CostIn("output_tokens", 10))
			done <- err
		}()
		waitBooked(t, lim, 2) // the request's rule: one admitted, one booked
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("the booked call: %v, want context.Canceled", err)
		}
		// A caller that left gives its booking back without holding the
		// lane (batch.go abandon): on a busy machine, after it returned.
		waitFor(t, func() bool {
			u, err := lim.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return u.Rules[0].Booked == 0 && u.Rules[1].Booked == 0 && u.Rules[2].Booked == 0
		}, "every rule to hold nothing booked after the cancel")
	})
}

// The transport routes Anthropic's counts of input and output tokens to
// the rules that count those units, each its own: the vendor says 5
// output tokens are left, and the output rule is charged up to that; the
// input rule, whose count says nothing new, keeps its own.
func TestUnits_EachFollowsItsOwnVendorCount(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), anthropicLike)
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h.Set("anthropic-ratelimit-input-tokens-limit", "100")
			h.Set("anthropic-ratelimit-input-tokens-remaining", "90")
			h.Set("anthropic-ratelimit-output-tokens-limit", "50")
			h.Set("anthropic-ratelimit-output-tokens-remaining", "5")
			h.Set("anthropic-ratelimit-output-tokens-reset", time.Now().Add(time.Minute).UTC().Format(time.RFC3339))
		}))
		defer vendor.Close()
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		ctx, _ := Track(context.Background(), CostIn("input_tokens", 10), CostIn("output_tokens", 10))
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, vendor.URL, nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		u, err := lim.Usage(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if got := usedOf(t, lim); got[0] != 1 || got[1] != 10 || u.Rules[2].Remaining != leftAfter(50, 10, 5) || u.Rules[1].Others != 0 {
			t.Fatalf("used %v, output tokens left %d, input tokens left to others %d; want [1 10 _], %d left "+
				"(the output rule follows the 5 the vendor says are left, less one for the others), and none: the input rule as it was",
				got, u.Rules[2].Remaining, u.Rules[1].Others, leftAfter(50, 10, 5))
		}
	})
}

// Settle takes the costs as the call's options gave them, and refuses an
// option that is not a cost.
func TestSettle_TakesCostsOnly(t *testing.T) {
	lim := newLimiter(t, redistest.Mini(t).Client(t), policies.SlidingLog{Limit: 10, Window: time.Second})
	ctx := context.Background()
	p, err := lim.Acquire(ctx, Cost(5))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	if err := p.Settle(ctx, Key("a")); err == nil || !strings.Contains(err.Error(), "Cost and CostIn only") {
		t.Errorf("Settle with a Key: %v, want refused", err)
	}
	if err := p.Settle(ctx, Cost(2)); err != nil || p.cost() != 2 {
		t.Errorf("Settle(Cost(2)): %v, cost %d", err, p.cost())
	}
	if err := p.Settle(ctx); err != nil || p.cost() != 2 {
		t.Errorf("Settle with nothing: %v, cost %d; want the cost kept", err, p.cost())
	}
}
