package throttle

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// admit takes n calls through a FailFast limiter, one per step of the
// clock, and returns their permits.
func admit(t *testing.T, lim *Limiter, clock *fixedClock, n int, step time.Duration, opts ...CallOption) []*Permit {
	t.Helper()
	var ps []*Permit
	for i := range n {
		p, err := lim.Acquire(context.Background(), opts...)
		if err != nil {
			t.Fatalf("call %d: %v", i+1, err)
		}
		p.Release()
		ps = append(ps, p)
		clock.Add(step)
	}
	return ps
}

func limitInForce(t *testing.T, lim *Limiter, opts ...CallOption) []int {
	t.Helper()
	u, err := lim.Usage(context.Background(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, r := range u.Rules {
		out = append(out, r.Limit)
	}
	return out
}

// admittedIn counts the calls a FailFast limiter admits when asked once per
// step over d.
func admittedIn(lim *Limiter, clock *fixedClock, d, step time.Duration, opts ...CallOption) int {
	n := 0
	for range int(d / step) {
		if d, err := lim.Allow(context.Background(), opts...); err == nil && d.OK {
			n++
		}
		clock.Add(step)
	}
	return n
}

func TestRefused_LearnsWhatTheVendorAccepted(t *testing.T) {
	long(t)
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		var learned []Event
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now, Observer: func(e Event) {
				if e.Kind == EventCapLearned {
					learned = append(learned, e)
				}
			}})
		ctx := context.Background()
		// A first refusal halves the limit: the calls before it may have
		// been counted under a cap the vendor has just lowered.
		ps := admit(t, lim, clock, 70, 5*time.Millisecond)
		if err := ps[69].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 50 {
			t.Fatalf("limit in force %v after a first refusal, want 50", got)
		}
		// The refusals of the other calls in flight then do not halve it
		// again, nor lower it below what the vendor accepted before them.
		for _, i := range []int{65, 60, 62} {
			if err := ps[i].refused(ctx, 0); err != nil {
				t.Fatal(err)
			}
		}
		if got := limitInForce(t, lim); got[0] != 50 {
			t.Fatalf("limit in force %v after the refusals of the calls in flight, want 50", got)
		}
		// The vendor's cap is 40: the calls decided under the cap of 50 are
		// refused from the 41st on, their answers back in any order. The
		// cap drops to what the vendor accepted before the first of them.
		clock.Add(2 * time.Second)
		ps = admit(t, lim, clock, 46, 5*time.Millisecond)
		for _, i := range []int{45, 42, 40, 43, 41} {
			if err := ps[i].refused(ctx, 0); err != nil {
				t.Fatal(err)
			}
		}
		if got := limitInForce(t, lim); got[0] != 40 {
			t.Fatalf("limit in force %v, want 40: the calls the vendor accepted before the first refused one", got)
		}
		if len(learned) == 0 || learned[len(learned)-1].Limit != 40 {
			t.Errorf("observer saw %+v, want EventCapLearned with Limit 40 last", learned)
		}
		// From now on the fleet decides against 40 calls a window.
		clock.Add(2 * time.Second)
		if n := admittedIn(lim, clock, 3*time.Second, 2*time.Millisecond); n > 3*40 || n < 3*40-2 {
			t.Errorf("admitted %d calls in 3 windows under a cap of 40", n)
		}
	})
}

func TestRefused_DropsByHalfAtMost(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		// A refusal about something else, after 3 calls: the quota does not
		// fall to 3, only by half.
		ps := admit(t, lim, clock, 4, time.Millisecond)
		if err := ps[3].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 50 {
			t.Fatalf("limit in force %v after a refusal with 3 calls before it, want 50", got)
		}
		// The refusal of another call in flight at that drop halves nothing
		// again: it drops from the limit before the drop.
		if err := ps[2].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 50 {
			t.Fatalf("limit in force %v after the refusal of a call in flight at the drop, want 50", got)
		}
		// A refusal of a call decided under the new cap halves it again.
		clock.Add(2 * time.Second)
		ps = admit(t, lim, clock, 2, time.Millisecond)
		if err := ps[1].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 25 {
			t.Fatalf("limit in force %v after a second refusal, want 25", got)
		}
	})
}

func TestRefused_CapRisesBackAfterItsHold(t *testing.T) {
	long(t)
	figureWithoutRace(t)
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		ps := admit(t, lim, clock, 51, time.Millisecond)
		if err := ps[50].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		// Through the hold, a fleet that fills the cap stays at it.
		for w := range 7 {
			if n := admittedIn(lim, clock, time.Second, 5*time.Millisecond); n > 50 {
				t.Fatalf("window %d of the hold admitted %d calls under a cap of 50", w, n)
			}
		}
		// Then it rises, by a step that doubles each window.
		var seen []int
		for len(seen) < 3 {
			admittedIn(lim, clock, time.Second, 5*time.Millisecond)
			if l := limitInForce(t, lim)[0]; l != 50 && (len(seen) == 0 || l != seen[len(seen)-1]) {
				seen = append(seen, l)
			}
		}
		if want := []int{53, 59, 71}; !slices.Equal(seen, want) {
			t.Fatalf("the cap rose through %v, want %v", seen, want)
		}
		// A refusal during a rise drops the cap to what the vendor accepted.
		clock.Add(2 * time.Second)
		ps = admit(t, lim, clock, 61, 5*time.Millisecond)
		if err := ps[60].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 60 {
			t.Fatalf("limit in force %v after a refusal at 60 during the rise, want 60", got)
		}
		// Left alone, the cap rises back to the configured limit, and goes.
		for range 8 + 6 {
			admittedIn(lim, clock, time.Second, 5*time.Millisecond)
		}
		if got := limitInForce(t, lim); got[0] != 100 {
			t.Fatalf("limit in force %v fourteen windows on, want 100", got)
		}
		if n, err := s.Client(t).Exists(ctx, "throttle:{"+lim.Name()+"}:log1000000:cap").Result(); err != nil || n != 0 {
			t.Errorf("the cap's key is still there (%d, %v)", n, err)
		}
	})
}

func TestRefused_CapDoesNotRiseWithoutDemand(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ps := admit(t, lim, clock, 51, time.Millisecond)
		if err := ps[50].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		// A fleet that calls at 10 a window learns nothing by a higher cap.
		for range 20 {
			admittedIn(lim, clock, time.Second, 100*time.Millisecond)
		}
		if got := limitInForce(t, lim); got[0] != 50 {
			t.Fatalf("limit in force %v after 20 quiet windows, want 50", got)
		}
	})
}

func TestRefused_EveryCountingPolicy(t *testing.T) {
	long(t)
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.All(
			policies.SlidingCounter{Limit: 100, Window: time.Second, Buckets: 10, Margin: time.Millisecond},
			policies.TokenBucket{Rate: 100, Per: time.Second, Burst: 100},
			policies.Concurrency{Max: 1000, Lease: time.Minute},
		), Options{Mode: FailFast, Clock: clock.Now})
		ps := admit(t, lim, clock, 81, 10*time.Millisecond)
		if err := ps[80].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		// A first refusal halves every rule that counts calls over time; a
		// concurrency rule counts none.
		if got := limitInForce(t, lim); !slices.Equal(got, []int{50, 50, 1000}) {
			t.Errorf("limits in force %v, want [50 50 1000]", got)
		}
		// A refusal under the cap: the counter counts the buckets in the
		// window before the call by the part of them inside it; the bucket
		// keeps no history, and halves again.
		clock.Add(2 * time.Second)
		ps = admit(t, lim, clock, 41, 20*time.Millisecond)
		if err := ps[40].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] < 38 || got[0] > 40 || got[1] != 25 {
			t.Errorf("limits in force %v, want the counter at the 40 calls it admitted in the second before, the bucket at 25", got)
		}
		// The bucket's rate falls with its cap: 50 a second.
		clock.Add(5 * time.Second)
		lim2 := newLimiter(t, s.Client(t), policies.TokenBucket{Rate: 100, Per: time.Second, Burst: 100}, Options{Mode: FailFast, Clock: clock.Now, Prefix: "alone"})
		ps = admit(t, lim2, clock, 1, time.Millisecond)
		if err := ps[0].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		clock.Add(5 * time.Second)
		if n := admittedIn(lim2, clock, 4*time.Second, time.Millisecond); n < 4*50 || n > 4*50+50+2 {
			t.Errorf("bucket capped at 50 a second admitted %d calls in 4s", n)
		}
	})
}

// A first refusal that the fleet's own record explains teaches no cap:
// its calls, settled above their estimates, held more than the limit in
// the vendor's window with the refused one (a vendor that counts a call's
// cost when it ends). One the record does not explain halves the limit.
func TestRefused_ARefusalTheFleetsOwnRecordExplainsTeachesNoCap(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ps := admit(t, lim, clock, 6, time.Millisecond)
		for _, p := range ps[:5] {
			if err := p.Settle(ctx, Cost(2)); err != nil {
				t.Fatal(err)
			}
		}
		if err := ps[5].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 10 {
			t.Errorf("limit in force %v after a refusal of the 11th unit the fleet sent, want the configured 10", got)
		}
		// A window later, six calls at 1 and a refusal: unexplained.
		clock.Add(2 * time.Second)
		ps = admit(t, lim, clock, 6, time.Millisecond)
		if err := ps[5].refused(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim); got[0] != 5 {
			t.Errorf("limit in force %v after a refusal of the 6th unit of 10, want 5", got)
		}
	})
}

func TestRefused_PerKeyCapsAreTheKeysOwn(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second, Margin: time.Millisecond}},
			Options{Mode: FailFast, Clock: clock.Now})
		a, b := Key("token-a"), Key("token-b")
		ps := admit(t, lim, clock, 9, time.Millisecond, a)
		if err := ps[8].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		if got := limitInForce(t, lim, a); got[0] != 5 {
			t.Errorf("key a's limit in force %v, want 5", got)
		}
		if got := limitInForce(t, lim, b); got[0] != 10 {
			t.Errorf("key b's limit in force %v, want its own 10", got)
		}
	})
}

func TestRefused_CostAboveTheCapIsRefusedNotAnError(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ps := admit(t, lim, clock, 31, time.Millisecond)
		if err := ps[30].refused(context.Background(), 0); err != nil {
			t.Fatal(err)
		}
		clock.Add(2 * time.Second)
		_, err := lim.Acquire(context.Background(), Cost(80))
		var le *LimitedError
		if !errors.As(err, &le) || le.RetryAfter < 5*time.Second {
			t.Fatalf("a call of 80 under a cap of 50: %v, want ErrLimited with a retry after the cap's hold", err)
		}
	})
}

func TestWithoutLearning_RefusalsOnlyPause(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now, WithoutLearning: true})
		ps := admit(t, lim, clock, 51, time.Millisecond)
		if err := ps[50].refused(context.Background(), time.Second); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Limit != 100 || u.Paused <= 0 {
			t.Errorf("usage %+v, want the configured limit, paused", u)
		}
	})
}

func TestTransport_LearnsOnlyFromRefusalsAboutTheQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		var remaining atomic.Int64
		var retryAfter atomic.Value
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if n := remaining.Load(); n >= 0 {
				w.Header().Set("X-RateLimit-Remaining", "7")
			}
			w.Header().Set("Retry-After", retryAfter.Load().(string))
			w.WriteHeader(http.StatusTooManyRequests)
		}))
		defer vendor.Close()
		for _, tc := range []struct {
			name       string
			prefix     string
			remaining  int64
			retryAfter string
			want       int
		}{
			{"a 429 about the rate that says nothing of the count", "silent", -1, "1", 50},
			{"a 429 about the rate with units left: a secondary limit", "secondary", 7, "1", 100},
			{"a 429 about the rate that says to retry now", "now", -1, "0", 100},
		} {
			remaining.Store(tc.remaining)
			retryAfter.Store(tc.retryAfter)
			lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second}, Options{Mode: FailFast, Prefix: tc.prefix})
			aboutRate := func(*http.Response) bool { return true }
			c := &http.Client{Transport: &Transport{Limiter: lim, MaxRetries: -1, AboutRate: aboutRate}}
			resp, err := c.Get(vendor.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if got := limitInForce(t, lim); got[0] != tc.want {
				t.Errorf("%s: limit in force %v, want %d", tc.name, got, tc.want)
			}
		}
	})
}

func TestSetRemaining_AnswersOfCallsInFlightChargeTheGapOnce(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		// Configured at twice the vendor's real cap of 40 a minute.
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 80, Window: time.Minute, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		ps := admit(t, lim, clock, 10, 10*time.Millisecond)
		// Each answer says what the vendor had left once it counted its
		// call; they come back in any order, the latest call's first.
		for _, i := range []int{9, 4, 7, 0} {
			if err := lim.setRemaining(ctx, 40-(i+1), time.Minute, ps[i].r, nil); err != nil {
				t.Fatal(err)
			}
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// The vendor's 40 for the 10 calls and its 30 left: the gap of 40
		// is left to others once (and a unit more, for their jitter), or,
		// with shares off, charged once.
		got, want := u.Rules[0].Used+u.Rules[0].Booked+u.Rules[0].Others, 80-leftAfter(80, 10, 30)
		if got != want {
			t.Errorf("the count holds %d units and leaves others %d, want %d in all: the 10 calls and the 40 the vendor does not have",
				u.Rules[0].Used+u.Rules[0].Booked, u.Rules[0].Others, want)
		}
		if u.Rules[0].Remaining != 80-want {
			t.Errorf("remaining %d, want %d", u.Rules[0].Remaining, 80-want)
		}
	})
}

func TestDo_HandsFnItsPermit(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Second, Margin: time.Millisecond},
			Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		if PermitFrom(ctx) != nil {
			t.Fatal("a context Do did not make has a permit")
		}
		// An LLM call admitted with an estimate of 500 tokens, settled with
		// the 120 it used.
		_, err := Do(ctx, lim, func(ctx context.Context) (int, error) {
			p := PermitFrom(ctx)
			if p == nil || p.cost() != 500 {
				t.Fatalf("fn's permit %+v, want the call's, of cost 500", p)
			}
			return 0, p.Settle(ctx, Cost(120))
		}, Cost(500))
		if err != nil {
			t.Fatal(err)
		}
		f := Go(ctx, lim, func(ctx context.Context) (int, error) { return PermitFrom(ctx).cost(), nil }, Cost(7))
		if n, err := f.Wait(); err != nil || n != 7 {
			t.Fatalf("Go's fn saw a permit of cost %d (%v), want 7", n, err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Used != 127 {
			t.Errorf("the quota counts %d units, want 120 settled and 7", u.Rules[0].Used)
		}
		// A nil permit's methods fail or do nothing; they never panic.
		var p *Permit
		p.Release()
		if p.Settle(ctx, Cost(1)) == nil || p.refused(ctx, 0) == nil || p.Extend(ctx, time.Second) == nil {
			t.Error("a nil permit's methods succeeded")
		}
		(&Permit{}).Release()
	})
}

// The surprises a user meets first: zero values, a Key a quota does not
// use, messages that name what the user set.
func TestNewcomer_ZeroValuesAndMessages(t *testing.T) {
	ctx := context.Background()
	var zero Limiter
	if _, err := zero.Acquire(ctx); err == nil || !strings.Contains(err.Error(), "throttle.New") {
		t.Errorf("a zero Limiter's Acquire: %v, want an error saying to use throttle.New", err)
	}
	if _, err := Do(ctx, (*Limiter)(nil), func(context.Context) (int, error) { return 0, nil }); err == nil {
		t.Error("Do on a nil Limiter ran")
	}
	if zero.Pause(ctx, time.Second) == nil || zero.Close(ctx) == nil {
		t.Error("a zero Limiter's Pause or Close succeeded")
	}
	resp, err := (&Transport{}).RoundTrip(httptest.NewRequest(http.MethodGet, "http://127.0.0.1:1/", nil))
	if err == nil {
		resp.Body.Close()
	}
	// (A zero Transport sends with http.DefaultTransport: here, to nowhere.)

	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		shared := newLimiter(t, s.Client(t), policies.TokenBucket{Rate: 100, Per: time.Second}, Options{Mode: FailFast})
		if _, err := shared.Acquire(ctx, Key("tenant-1")); err == nil || !strings.Contains(err.Error(), "PerKey") {
			t.Errorf("a Key on a quota with no per-key limit: %v, want an error naming PerKey", err)
		}
		if _, err := shared.Acquire(ctx, Cost(2)); err == nil || !strings.Contains(err.Error(), "TokenBucket.Burst 1") {
			t.Errorf("Cost 2 over the default burst: %v, want an error naming TokenBucket.Burst", err)
		}
		// While paused, nothing is left.
		p := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Second}, Options{Mode: FailFast, Prefix: "paused"})
		if err := p.Pause(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
		if d, err := p.Allow(ctx); err != nil || d.OK || d.Remaining != 0 {
			t.Errorf("Allow during a pause: %+v, %v; want refused with 0 remaining", d, err)
		}
	})
}
