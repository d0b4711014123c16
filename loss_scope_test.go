package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A loss that a vendor's answer finds first pauses the quota for the
// longest window of its whole policy, not of the rules the answer is about:
// a per-key rule, or a named unit's daily count, still counts the calls
// Redis forgot.
func TestDataLoss_FoundByFeedbackPausesForEveryRule(t *testing.T) {
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
			func(ctx context.Context, _ *Limiter, p *Permit) error { return p.Refused(ctx, 50*time.Millisecond) }},
		{"daily unit, Refused", daily, []CallOption{CostIn("tokens", 10)},
			func(ctx context.Context, _ *Limiter, p *Permit) error { return p.Refused(ctx, 50*time.Millisecond) }},
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
