package throttle

import (
	"context"
	"fmt"
	"time"

	"github.com/throttlekit/throttle/lua"
	"github.com/throttlekit/throttle/policies"
)

// MaxPause bounds a pause asked by a vendor, so that a hostile or broken
// Retry-After cannot stop a fleet for days.
const MaxPause = time.Hour

// Pause stops every replica from admitting calls on this quota for d, as Redis
// counts time: for a vendor that answered 429 with Retry-After. A pause only
// lengthens one already in force, and d is capped at MaxPause. Calls already
// sleeping towards a slot inside the pause book again when they wake.
//
// The pause applies to the shared policies of the quota. On a quota with
// only policies.PerKey policies (one quota per API token), it applies to the
// call's Key alone.
func (l *Limiter) Pause(ctx context.Context, d time.Duration, opts ...CallOption) error {
	if d <= 0 {
		return nil
	}
	return l.feedback(ctx, min(d, MaxPause), -1, 0, 0, opts)
}

// SetRemaining tells the quota how many units the vendor says are left
// (X-RateLimit-Remaining), and, when known, how long until the vendor's window
// resets. When our shared count believes more are left (another consumer of
// the same API key, a restart), the difference is charged to the quota until
// the reset, so the fleet slows down before the vendor answers 429. A count
// that believes fewer are left is kept: it errs on the safe side. Its scope is
// that of Pause.
func (l *Limiter) SetRemaining(ctx context.Context, remaining int, reset time.Duration, opts ...CallOption) error {
	return l.setRemaining(ctx, remaining, reset, result{}, opts)
}

// setRemaining is SetRemaining as of the call r, whose answer carried the
// vendor's count: the units our count holds after r's slot are calls on
// their way, which the vendor could not have counted yet.
func (l *Limiter) setRemaining(ctx context.Context, remaining int, reset time.Duration, r result, opts []CallOption) error {
	if remaining < 0 {
		return fmt.Errorf("throttle: quota %q: SetRemaining: remaining must not be negative, got %d", l.name, remaining)
	}
	var asOf time.Duration
	if r.admitted && !r.local {
		asOf = r.slot()
	}
	return l.feedback(ctx, 0, remaining, max(reset, 0), asOf, opts)
}

func (l *Limiter) feedback(ctx context.Context, pause time.Duration, remaining int, reset, asOf time.Duration, opts []CallOption) error {
	c, err := l.newFeedbackCall(opts)
	if err != nil {
		return err
	}
	sc := l.scopeFor(c)
	// Only the rules the vendor's answer is about: the shared ones, or the
	// key's own when there are none.
	keys := sc.keys[:2:2]
	var rules []policies.Rule
	for i, r := range l.rules {
		about := !r.PerKey
		if !l.hasShared {
			about = r.PerKey
		}
		if about && r.Kind != policies.KindConcurrency {
			keys = append(keys, sc.keys[2+i])
			rules = append(rules, r)
		}
	}
	args := argsFor(l.s.clock, l.newMember(), int(asOf.Microseconds()), pause.Microseconds(), int64(remaining), reset.Microseconds(), rules)
	args = append(args, l.epoch.Load())
	v, err := lua.Feedback.Run(ctx, l.rdb, keys, args...).Int64Slice()
	if err != nil {
		return l.unavailable(err)
	}
	if len(v) != 3 {
		return fmt.Errorf("throttle: quota %q: unexpected script reply %v", l.name, v)
	}
	l.notePause(sc, time.Duration(v[2])*time.Microsecond, time.Duration(v[0])*time.Microsecond)
	if pause > 0 {
		l.emit(Event{Kind: EventPaused, Duration: pause})
	}
	return nil
}

// newFeedbackCall reads the options of Pause and SetRemaining: only Key
// matters, and only on a quota of per-key policies.
func (l *Limiter) newFeedbackCall(opts []CallOption) (call, error) {
	c := callOf(opts)
	if l.perKey && !l.hasShared && !c.hasKey {
		return c, fmt.Errorf("throttle: quota %q has only per-key limits: the feedback needs a Key", l.name)
	}
	return c, nil
}
