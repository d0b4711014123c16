package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/throttlekit/throttle/internal/protocol"
	"github.com/throttlekit/throttle/policies"
)

// Usage is how full a quota is, for one key, as Usage reads it.
type Usage struct {
	// Paused is how long the quota, or the key, stays paused: at the
	// vendor's request, or while one of its rules is blind, counting as
	// full since Redis lost its data or a deploy added it (PausedBy says
	// which).
	Paused time.Duration
	// PausedBy says why, while Paused: PausedByVendor, PausedByLoss,
	// PausedByPolicy or PausedByClock; "" when not paused, or when the
	// pause was set before the quota noted why.
	PausedBy string
	// Since is when the quota's data began in this Redis: its first call,
	// or the last loss of its data (see LastLoss).
	Since time.Time
	// LastLoss is when Redis was last found to have lost the quota's data
	// (a restart without persistence, a failover to a replica behind, an
	// eviction), or the zero time.
	LastLoss time.Time
	// Spread is how much later after its slot one call of the fleet may
	// start than another, as the fleet's processes measure it and report it
	// with their calls. The windows' margins follow it (see
	// policies.SlidingLog.Margin). The fleet of a quota with a
	// policies.Shared rule is its whole group's.
	Spread time.Duration
	// Remaining is the units a call could take now under every rule: the
	// least of the rules' Remaining.
	Remaining int
	// Rules holds the usage of each rule, in the order of policies.Rules.
	Rules []RuleUsage
}

// The causes of a pause, as Usage.PausedBy names them.
const (
	// PausedByVendor: the vendor refused a call (Permit.Heard, a
	// Transport's 429), or someone called Pause.
	PausedByVendor = "vendor"
	// PausedByLoss: Redis lost the quota's data; each rule counts as
	// full for its window, whose calls the vendor still counts.
	PausedByLoss = "data loss"
	// PausedByPolicy: a deploy added a rule (a kind or window the quota
	// did not have); that rule alone counts as full for its window.
	PausedByPolicy = "new policy"
	// PausedByClock: Redis's clock stepped back, and the calls admitted
	// before the step lie ahead of it, or forward by more than the margin,
	// which shortened every window by the step.
	PausedByClock = "clock step"
)

// pausedBy names the causes the scripts return (protocol.Cause*).
var pausedBy = map[int64]string{protocol.CauseVendor: PausedByVendor, protocol.CauseLoss: PausedByLoss,
	protocol.CausePolicy: PausedByPolicy, protocol.CauseClock: PausedByClock}

// unixMicro is the time of x microseconds since the Unix epoch, or the
// zero time for 0.
func unixMicro(x int64) time.Time {
	if x <= 0 {
		return time.Time{}
	}
	return time.UnixMicro(x)
}

// RuleUsage is how full one rule is.
type RuleUsage struct {
	// Rule is the rule as configured (policies.Rules); Limit below is its
	// limit in force.
	Rule policies.Rule
	// Used is the units admitted in the window ending now (calls in flight,
	// for a Concurrency rule; the units still to drain, for a TokenBucket).
	// It counts the spare admissions other replicas hold for their next
	// calls (see Limiter), not this process's own.
	Used int
	// Booked is the units booked for later by waiting calls.
	Booked int
	// Remaining is the units a call could take now, this process's spare
	// admissions included.
	Remaining int
	// NextFree is how long until one more unit fits; 0 when one fits now.
	NextFree time.Duration
	// Margin is the margin in force of a SlidingLog or SlidingCounter
	// rule: its configured Margin, or wider when the fleet's Spread needs
	// it. The rule counts a window of Rule.Window - Rule.Margin + Margin.
	Margin time.Duration
	// Limit is the limit in force: Rule.Limit, or lower while a cap learned
	// from the vendor's refusals holds (see Permit.Heard). For a
	// TokenBucket, the units of a burst's span, whose rate falls with it.
	// It also leaves Others their share, and, for a window after a replica
	// comes back from the Local fallback, is the share of it that replicas
	// still on the fallback leave (1/ExpectedReplicas): what the calls meet.
	Limit int
	// Others is the units per window the rule leaves other consumers of
	// the vendor's key: what the vendor's counts show they spend, beside
	// the fleet, smoothed, in steps of a sixty-fourth of the vendor's
	// limit, and a sixteenth more (see Limiter.SetRemaining); 0 when no
	// one else spends it.
	Others int
}

// Usage reads how full the quota is, for the call's Key when it has per-key
// policies, with one read-only script call: it changes nothing in Redis, so
// a dashboard can run it as often as it likes.
func (l *Limiter) Usage(ctx context.Context, opts ...CallOption) (Usage, error) {
	c, err := l.newCall(opts)
	if err != nil && !errors.Is(err, errNoUnitCost) {
		return Usage{}, err
	}
	sc := l.scopeFor(c)
	v, err := l.run(ctx, scripts.usage, sc, l.usageArgs()).Int64Slice()
	if err != nil {
		return Usage{}, l.unavailable(err)
	}
	if len(v) != protocol.UsageSize+protocol.RuleSize*len(l.cfg.rules) {
		return Usage{}, l.unavailable(fmt.Errorf("unexpected script reply %v", v))
	}
	us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
	u := Usage{Paused: max(us(v[protocol.UsagePause]-v[protocol.UsageNow]), 0), Spread: us(v[protocol.UsageSpread]),
		Since: unixMicro(v[protocol.UsageEpoch]), LastLoss: unixMicro(v[protocol.UsageLoss])}
	if u.Paused > 0 {
		u.PausedBy = pausedBy[v[protocol.UsagePausedBy]]
	}
	// This process's spare admissions (spare.go) are free for its calls, not
	// used by any.
	spares := l.heldSpares(sc)
	for i, r := range l.cfg.rules {
		w := v[protocol.UsageSize+protocol.RuleSize*i:]
		held := 0
		for cost, n := range spares {
			held += n * unitsOf(r, call{cost: cost})
		}
		u.Rules = append(u.Rules, RuleUsage{
			Rule:      r,
			Used:      max(int(w[protocol.RuleUsed])-held, 0),
			Booked:    int(w[protocol.RuleBooked]),
			Remaining: int(w[protocol.RuleRemaining]) + held,
			NextFree:  us(w[protocol.RuleNext]),
			Margin:    us(w[protocol.RuleMargin]),
			Limit:     int(w[protocol.RuleLimit]),
			Others:    int(w[protocol.RuleOthers]),
		})
		if i == 0 || u.Rules[i].Remaining < u.Remaining {
			u.Remaining = u.Rules[i].Remaining
		}
	}
	return u, nil
}
