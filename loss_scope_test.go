package throttle

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A loss that a vendor's answer finds first pauses the quota for the
// longest window of its whole policy, not of the rules the answer is about:
// a per-key rule, or a named unit's daily count, still counts the calls
// Redis forgot.
func TestDataLoss_FoundByFeedbackPausesForEveryRule(t *testing.T) {
	t.Parallel()
	minute := policies.All(
		policies.SlidingLog{Limit: 100, Window: 200 * time.Millisecond},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Minute}},
	)
	daily := policies.All(
		policies.SlidingLog{Limit: 100, Window: 200 * time.Millisecond},
		policies.Unit{Name: "tokens", Policy: policies.SlidingLog{Limit: 10, Window: 24 * time.Hour}},
	)
	tests := []struct {
		name   string
		policy policies.Policy
		opts   []CallOption
		find   func(ctx context.Context, lim *Limiter, p *Permit) error
	}{
		{"per-key, Pause", minute, []CallOption{Key("a"), Cost(10)},
			func(ctx context.Context, lim *Limiter, _ *Permit) error { return lim.Pause(ctx, 50*time.Millisecond) }},
		{"per-key, Refused", minute, []CallOption{Key("a"), Cost(10)},
			func(ctx context.Context, _ *Limiter, p *Permit) error { return p.refused(ctx, 50*time.Millisecond) }},
		{"daily unit, Refused", daily, []CallOption{CostIn("tokens", 10)},
			func(ctx context.Context, _ *Limiter, p *Permit) error { return p.refused(ctx, 50*time.Millisecond) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				rdb := s.Client(t)
				lim := newLimiter(t, rdb, tt.policy, Options{Mode: FailFast, Logger: quiet()})
				ctx := context.Background()
				p, err := lim.Acquire(ctx, tt.opts...)
				if err != nil {
					t.Fatalf("first call: %v", err)
				}
				p.Start()
				if err := rdb.FlushAll(ctx).Err(); err != nil {
					t.Fatal(err)
				}
				if err := tt.find(ctx, lim, p); err != nil {
					t.Fatal(err)
				}
				p.Release()
				// Real time: a given clock that jumps reads as a clock step,
				// which finds a loss of its own. The short rule's window and
				// the pause have passed twice over by then.
				time.Sleep(400 * time.Millisecond)
				d, err := lim.Allow(ctx, tt.opts...)
				t.Logf("%+v %v", d, err)
				if err != nil || d.OK {
					t.Fatalf("after a loss the feedback found: %+v, %v; want refused, the long rule still counts the first call", d, err)
				}
			})
		})
	}
}

// Every pause names its cause: in the error of a call it refused, and in
// the Observer's event of that refusal.
func TestPause_TheRefusalNamesItsCause(t *testing.T) {
	for _, tt := range pausesOfEveryCause {
		t.Run(tt.cause, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				ctx := context.Background()
				rdb := s.Client(t)
				var events []Event
				var mu sync.Mutex
				observe = func(e Event) {
					mu.Lock()
					defer mu.Unlock()
					events = append(events, e)
				}
				defer func() { observe = nil }()
				lim := tt.pause(t, ctx, rdb, strings.ReplaceAll(t.Name(), " ", "-"), newClock())
				_, err := lim.Acquire(ctx)
				var le *LimitedError
				if !errors.As(err, &le) || le.PausedBy != tt.cause || !strings.Contains(le.Reason, tt.words) {
					t.Fatalf("the call while paused: %v (%+v); want refused, PausedBy %q, a reason saying %q", err, le, tt.cause, tt.words)
				}
				mu.Lock()
				defer mu.Unlock()
				if n := len(events); n == 0 || events[n-1].Kind != EventLimited || events[n-1].PausedBy != tt.cause {
					t.Errorf("the Observer's last event %+v, want EventLimited with PausedBy %q", events, tt.cause)
				}
			})
		})
	}
}

// causeLog is the policy of the limiters of pausesOfEveryCause.
var causeLog = policies.SlidingLog{Limit: 10, Window: time.Second}

// pausesOfEveryCause are the causes of a pause, the words its refusal
// must say, and how each pauses a new quota.
var pausesOfEveryCause = []struct {
	cause string
	words string
	pause func(t *testing.T, ctx context.Context, rdb redis.UniversalClient, name string, clock *fixedClock) *Limiter
}{
	{PausedByVendor, "the vendor asked", func(t *testing.T, ctx context.Context, rdb redis.UniversalClient, name string, clock *fixedClock) *Limiter {
		lim := causeLimiter(t, rdb, name, causeLog, clock)
		if err := lim.Pause(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
		return lim
	}},
	{PausedByLoss, "lost the quota's data", func(t *testing.T, ctx context.Context, rdb redis.UniversalClient, name string, clock *fixedClock) *Limiter {
		lim := causeLimiter(t, rdb, name, causeLog, clock)
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		return lim
	}},
	{PausedByPolicy, "a deploy changed", func(t *testing.T, ctx context.Context, rdb redis.UniversalClient, name string, clock *fixedClock) *Limiter {
		causeLimiter(t, rdb, name, causeLog, clock)
		lim, err := New(rdb, name, policies.SlidingCounter{Limit: 10, Window: time.Second}, Options{Mode: FailFast, Logger: quiet(), Observer: observed})
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}},
	{PausedByClock, "clock stepped", func(t *testing.T, ctx context.Context, rdb redis.UniversalClient, name string, clock *fixedClock) *Limiter {
		lim := causeLimiter(t, rdb, name, causeLog, clock)
		clock.Add(-time.Second)
		return lim
	}},
}

// A forward step of Redis's own clock, by more than the margin, shortened
// every window by the step: the refusal after it names the clock, not a
// loss of Redis's data (miniredis alone can step its clock).
func TestPause_AForwardStepNamesTheClock(t *testing.T) {
	s := redistest.Mini(t)
	s.SetClock(0)
	lim := causeLimiter(t, s.Client(t), "forward", policies.SlidingLog{Limit: 10, Window: time.Minute}, nil)
	s.SetClock(30 * time.Second)
	_, err := lim.Acquire(context.Background())
	var le *LimitedError
	if !errors.As(err, &le) || le.PausedBy != PausedByClock || !strings.Contains(le.Reason, "clock stepped") {
		t.Fatalf("the call after the step: %v; want refused, PausedBy %q, a reason saying the clock stepped", err, PausedByClock)
	}
	// The step's script admitted the call before the step was known; the
	// booking it gave back on asking again leaves the log, data intact.
	if used := ruleUsed(t, lim); used != 1 {
		t.Errorf("the log holds %d units after the refused call, want the first call's 1", used)
	}
}

// observe, when set, receives the events of the limiters of
// TestPause_TheRefusalNamesItsCause.
var observe func(Event)

func observed(e Event) {
	if observe != nil {
		observe(e)
	}
}

// causeLimiter returns a FailFast limiter of quota name that has made one
// call, on clock when not nil.
func causeLimiter(t *testing.T, rdb redis.UniversalClient, name string, p policies.Policy, clock *fixedClock) *Limiter {
	t.Helper()
	o := Options{Mode: FailFast, Logger: quiet(), Observer: observed}
	if clock != nil {
		o.Clock = clock.Now
	}
	lim, err := New(rdb, name, p, o)
	if err != nil {
		t.Fatal(err)
	}
	if d, err := lim.Allow(context.Background()); err != nil || !d.OK {
		t.Fatalf("the first call: %+v, %v", d, err)
	}
	return lim
}
