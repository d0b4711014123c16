package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/throttlekit/throttle/internal/lua"
	"github.com/throttlekit/throttle/policies"
)

// maxPause bounds a pause asked by a vendor, so that a hostile or broken
// Retry-After cannot stop a fleet for days.
const maxPause = time.Hour

// Pause stops every replica from admitting calls on this quota for d, as Redis
// counts time: for a vendor that answered 429 with Retry-After. A pause only
// lengthens one already in force, and d is capped at an hour. Calls already
// sleeping towards a slot inside the pause book again when they wake.
//
// The pause applies to the shared policies of the quota. On a quota with
// only policies.PerKey policies (one quota per API token), it applies to the
// call's Key alone.
func (l *Limiter) Pause(ctx context.Context, d time.Duration, opts ...CallOption) error {
	if d <= 0 {
		return nil
	}
	return l.feedback(ctx, vendorSaid{pause: min(d, maxPause), units: unknownCount, calls: unknownCount}, result{}, opts)
}

// Refused tells the quota that the vendor refused the permit's call for
// being over its rate limit (a 429): every replica pauses for retryAfter
// (none when it is 0; at most an hour), and, unless the limiter's
// Options say WithoutLearning, the quota learns the vendor's cap from the
// refusal: each rule counting calls over time takes as its limit what the fleet admitted
// in the window before the call, which the vendor accepted (one refusal
// lowers a limit by half at most; see policies.SlidingLog.Limit). The cap
// holds for eight windows without a refusal, then rises back towards the
// configured limit, step by step, while the fleet fills it.
//
// A Transport calls it on every 429 about the quota; call it from Do's fn
// (see PermitFrom) when the vendor's client reports the refusal itself. Do
// not call it for a refusal about something else (a limit of one endpoint,
// a vendor overloaded): Pause alone is right for those.
func (p *Permit) Refused(ctx context.Context, retryAfter time.Duration) error {
	if p == nil || p.l == nil {
		return errors.New("throttle: Refused: the permit is nil")
	}
	said := vendorSaid{pause: min(max(retryAfter, 0), maxPause), units: unknownCount, calls: unknownCount, learn: !p.l.s.noLearning}
	return p.l.feedback(ctx, said, p.r, p.opts())
}

// SetRemaining tells the quota how many units the vendor says are left
// (X-RateLimit-Remaining), and, when known, how long until the vendor's window
// resets. When our shared count believes more are left (another consumer of
// the same API key, a restart), the difference is charged to the quota until
// the reset, so the fleet slows down before the vendor answers 429. A count
// that believes fewer are left is kept: it errs on the safe side. Its scope is
// that of Pause. The count is of the units the calls cost; on a quota whose
// every rule is a policies.PerCall, of calls.
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
	c := vendorCount{left: remaining, reset: max(reset, 0)}
	said := vendorSaid{units: c, calls: unknownCount}
	if !l.unitRules {
		said.units, said.calls = unknownCount, c
	}
	return l.feedback(ctx, said, r, opts)
}

// vendorSaid is what a vendor's answer tells the quota: a pause, its
// counts of the units that the calls cost and of calls (requests), and
// whether it refused the call for being over its limit, which teaches the
// quota a cap.
type vendorSaid struct {
	pause        time.Duration
	units, calls vendorCount
	learn        bool
}

// vendorCount is one of the vendor's counts: what is left (-1 when
// unknown), how long until its reset (0 when unknown), and the limit (0
// when unknown, as in vendorLimits).
type vendorCount struct {
	left  int
	reset time.Duration
	limit int
}

var unknownCount = vendorCount{left: -1}

// feedback runs the feedback script: what the vendor said, as of the call
// r (or of now, for a zero r).
func (l *Limiter) feedback(ctx context.Context, said vendorSaid, r result, opts []CallOption) error {
	var asOf time.Duration
	if r.admitted && !r.local {
		asOf = r.slot()
	}
	pause := said.pause
	learn := said.learn && asOf > 0 && countsCalls(l)
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
	args := argsFor(l.s.clock, l.newMember(), int(asOf.Microseconds()), pause.Microseconds(),
		int64(max(said.units.left, -1)), said.units.reset.Microseconds(), rules)
	learnArg := 0
	if learn {
		learnArg = 1
	}
	args = append(args, l.epoch.Load(), learnArg, max(said.units.limit, 0),
		max(said.calls.left, -1), said.calls.reset.Microseconds(), max(said.calls.limit, 0))
	v, err := lua.Feedback.Run(ctx, l.rdb, keys, args...).Int64Slice()
	if err != nil {
		return l.unavailable(err)
	}
	rep, err := decodeFeedback(v)
	if err != nil {
		return fmt.Errorf("throttle: quota %q: %w", l.name, err)
	}
	l.notePause(sc, rep.now, rep.until)
	if pause > 0 {
		l.emit(Event{Kind: EventPaused, Duration: pause})
	}
	if rep.lowered {
		l.s.logger.Warn("throttle: the vendor refused a call over its limit; the quota's limit in force is lowered to what the vendor accepted",
			"quota", l.name, "limit", rep.limit)
		l.emit(Event{Kind: EventCapLearned, Limit: rep.limit})
	}
	return nil
}

// newFeedbackCall reads the options of Pause and SetRemaining: only Key
// matters, and only on a quota of per-key policies.
func (l *Limiter) newFeedbackCall(opts []CallOption) (call, error) {
	c := callOf(opts)
	if err := l.made(); err != nil {
		return c, err
	}
	if l.perKey && !l.hasShared && !c.hasKey {
		return c, fmt.Errorf("throttle: quota %q has only per-key limits: the feedback needs a Key", l.name)
	}
	return c, nil
}

// opts returns the options that name the permit's scope: its Key.
func (p *Permit) opts() []CallOption {
	if !p.call.hasKey {
		return nil
	}
	return []CallOption{Key(p.call.key)}
}
