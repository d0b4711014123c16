// Package policies describes the limits a throttle quota enforces.
//
// A policy is a plain struct, validated by throttle.New:
//
//   - SlidingLog: exactly Limit per Window, as most vendors count. Exact, and
//     it books slots for waiting calls. The default choice.
//   - SlidingCounter: Limit per Window in O(1) memory per key, for very large
//     limits such as tokens per minute; it gives up at most 1/Buckets of the
//     quota to stay under it.
//   - TokenBucket: Rate per Per with a Burst, for vendors that publish a rate
//     and a burst, and for even pacing (a minimum gap between calls).
//   - Concurrency: at most Max calls in flight.
//
// Policies combine:
// All checks several limits at once (10 per second AND 1000 per minute), and
// PerKey applies a limit to each key separately (each tenant, each API token).
//
//	// The vendor allows 100 calls per second in all, and 10 per second per tenant.
//	policies.All(
//		policies.SlidingLog{Limit: 100, Window: time.Second},
//		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
//	)
//
//	// Each API token has its own 5000 per hour; there is no shared limit.
//	policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}
package policies

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// DefaultMargin is the Margin a SlidingLog uses when its Margin is zero.
//
// Between the moment Redis admits a call and the moment the vendor counts it
// lie a network round trip, a timer, a connection to open and the scheduler
// of a busy machine. Two calls a window apart at Redis can arrive less than a
// window apart at the vendor. Widening our window by more than that spread
// keeps a strict vendor from ever counting one call too many. On a loaded
// 2-core machine, with the race detector on, the spread between bursts of 100
// concurrent HTTP calls on loopback reached about 30ms; 30ms costs 3% of a
// one-second window and 0.05% of a one-minute one. Calls that cross the
// internet to the vendor see a wider spread: measure it, and set Margin to
// its maximum.
const DefaultMargin = 30 * time.Millisecond

// MarginCeiling returns the widest a SlidingLog's margin grows for a
// window of length w (see SlidingLog.Margin): a tenth of the window, at most
// MaxMarginCeiling, and never less than the configured margin.
func MarginCeiling(w, configured time.Duration) time.Duration {
	return max(configured, min(w/10, MaxMarginCeiling))
}

// MaxMarginCeiling bounds the growth of a SlidingLog's margin, whatever its
// window.
const MaxMarginCeiling = time.Second

// MinWindow is the shortest Window a policy accepts. Redis keeps time in
// microseconds, and below a millisecond the jitter of a network round trip
// dominates any window.
const MinWindow = time.Millisecond

// MaxWindow is the longest Window a policy accepts: a year, which keeps every
// time Redis computes exact in microseconds.
const MaxWindow = 366 * 24 * time.Hour

// MaxLogLimit is the largest Limit a SlidingLog accepts: it keeps one entry
// per unit. For larger limits (tokens per minute), use SlidingCounter.
const MaxLogLimit = 100_000

// A Policy describes the limits of a quota. The types in this package are the
// only implementations.
type Policy interface {
	// Validate reports the first field that is out of range, naming it and
	// its value.
	Validate() error
	rules(perKey bool) []Rule
}

// SlidingLog admits at most Limit units in any window of length Window: the
// exact sliding window that most vendors enforce. Redis keeps one sorted-set
// entry per admitted unit (and per booked waiting unit) for one window.
//
// Choose it when the limit is up to some tens of thousands per window: it is
// exact, and it books future slots for waiting calls, so waiters are served
// in arrival order across the fleet.
type SlidingLog struct {
	// Limit is the number of units admitted in any window. It must be > 0.
	Limit int
	// Window is the length of the sliding window, at least MinWindow.
	Window time.Duration
	// Margin widens the window by this much, to absorb the jitter between
	// the admission at Redis and the arrival at the vendor. Zero means
	// DefaultMargin. To run with no margin, set 1ns. It must not be negative.
	//
	// It is a floor. Every process measures how much later than its usual
	// delay its calls start after their slots, and reports it with its
	// calls; the margin in force grows to twice the widest such spread of
	// the fleet, up to MarginCeiling, so that a fleet on busy machines
	// widens its windows instead of going over the cap. It narrows again
	// once the spread goes down, within two timing periods (4s) and the
	// windows of the calls booked with the wider margin, which keep half of
	// it meanwhile; a fleet that always books ahead narrows too. Usage
	// shows both. While the spread needs more than MarginCeiling, the log's
	// calls that may wait (Block and Queue mode) are paced: each is booked at
	// least Window / Limit away from every other, so that a fleet too busy
	// to start a window's calls at one moment gets them spread evenly over
	// the window (a burst so paced waits up to a window longer, once).
	//
	// A quota warms up when the fleet starts calling it (new, or after a
	// minute without a call, or longer than its longest window): its first
	// calls open connections, and may reach the vendor later than the calls
	// a window after them, which find those connections open. So for its
	// longest window the calls admitted at once are held as if booked with a
	// margin of 200ms (MarginCeiling if less): until they have left their
	// windows, the margin in force keeps half of that from them, and half of
	// its own. With the defaults and a one-second window, the window after a
	// cold start begins 65ms after the first, not 30ms. Meanwhile, a call
	// that may wait and comes alone in its script call is paced as above
	// when the log's latest 8 entries are the lone calls of 8 other
	// limiters, the latest less than Window / Limit before it: many small
	// replicas that start together get their first window's calls spread
	// over it rather than all at once, which Redis and their cores could not
	// start on time. A few replicas, a lone limiter's calls, and the calls
	// one process batches into a script call are not paced.
	// The spread the calls of a warm-up show (the start's burst) widens the
	// margin while it lasts, but is not carried into the next timing period,
	// which measures the fleet afresh.
	//
	// Half of the margin in force bounds how late a call may start: a call
	// that would start more than that after its slot, beyond the usual delay
	// of Redis's replies (a slow reply, a starved process), gives its slot
	// back and books again in the same script call, at most three times,
	// and then fails with ErrLimited. A delay that every call shares, such as
	// a Redis 50 ms away, is no lateness: it shifts every call alike. A
	// Margin under 2ms turns the check, and the growth, off.
	Margin time.Duration
}

// Validate reports whether the fields are usable.
func (p SlidingLog) Validate() error {
	switch {
	case p.Limit <= 0:
		return fmt.Errorf("policies: SlidingLog.Limit must be > 0, got %d", p.Limit)
	case p.Limit > MaxLogLimit:
		return fmt.Errorf("policies: SlidingLog.Limit must be at most %d (one entry per unit; use SlidingCounter for more), got %d", MaxLogLimit, p.Limit)
	case p.Window < MinWindow || p.Window > MaxWindow:
		return fmt.Errorf("policies: SlidingLog.Window must be between %v and %v, got %v", MinWindow, MaxWindow, p.Window)
	case p.Margin > p.Window:
		return fmt.Errorf("policies: SlidingLog.Margin must not exceed the Window %v, got %v", p.Window, p.Margin)
	case p.Margin < 0:
		return fmt.Errorf("policies: SlidingLog.Margin must not be negative, got %v", p.Margin)
	}
	return nil
}

// EffectiveWindow is Window plus the margin in force.
func (p SlidingLog) EffectiveWindow() time.Duration {
	if p.Margin == 0 {
		return p.Window + DefaultMargin
	}
	return p.Window + p.Margin
}

func (p SlidingLog) rules(perKey bool) []Rule {
	return []Rule{{Kind: KindSlidingLog, PerKey: perKey, Limit: p.Limit, Window: p.EffectiveWindow(), Margin: p.EffectiveWindow() - p.Window}}
}

// All admits a call only when every one of its policies admits it: "10 per
// second and 1000 per minute", or a shared limit with a per-key one beside
// it. The check and the record happen in one atomic script.
func All(ps ...Policy) Policy { return all(ps) }

type all []Policy

func (a all) Validate() error {
	if len(a) == 0 {
		return errors.New("policies: All needs at least one policy, got none")
	}
	for i, p := range a {
		if p == nil {
			return fmt.Errorf("policies: All policy %d is nil", i)
		}
		if err := p.Validate(); err != nil {
			return fmt.Errorf("policies: All policy %d: %w", i, err)
		}
	}
	return nil
}

func (a all) rules(perKey bool) []Rule {
	var rs []Rule
	for _, p := range a {
		rs = append(rs, p.rules(perKey)...)
	}
	return rs
}

// PerKey applies Policy to each key separately: every value passed with
// throttle.Key gets its own quota. Alone, it gives independent quotas per key
// (one per API token); inside All beside a shared policy, it gives per-key
// sub-limits under the shared quota (each tenant 10/s of a vendor's 100/s).
type PerKey struct {
	Policy Policy // what each key may spend of its own quota
}

// Validate reports whether the wrapped policy is usable.
func (p PerKey) Validate() error {
	if p.Policy == nil {
		return errors.New("policies: PerKey.Policy is nil")
	}
	if hasPerKey(p.Policy) {
		return errors.New("policies: PerKey.Policy must not contain another PerKey")
	}
	if err := p.Policy.Validate(); err != nil {
		return fmt.Errorf("policies: PerKey.Policy: %w", err)
	}
	return nil
}

func (p PerKey) rules(bool) []Rule { return p.Policy.rules(true) }

// PerCall counts each call once, whatever its Cost, under Policy: requests
// per minute beside tokens per minute, in one All whose calls cost their
// tokens.
//
//	policies.All(
//		policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}},
//		policies.SlidingCounter{Limit: 200_000, Window: time.Minute},
//	)
//
// A call's Cost, and what Permit.Settle makes of it, count under the other
// policies only; the one script decides both, booked slots included. A
// vendor's counts of requests (OpenAI's x-ratelimit-*-requests) speak of
// the PerCall policies, its counts of tokens of the others.
type PerCall struct {
	Policy Policy // the limits on calls, each counted once
}

// Validate reports whether the wrapped policy is usable.
func (p PerCall) Validate() error {
	if p.Policy == nil {
		return errors.New("policies: PerCall.Policy is nil")
	}
	if hasPerCall(p.Policy) {
		return errors.New("policies: PerCall.Policy must not contain another PerCall")
	}
	if holds(p.Policy, isUnit) {
		return errors.New("policies: PerCall.Policy must not contain a Unit: a PerCall policy counts calls")
	}
	if err := p.Policy.Validate(); err != nil {
		return fmt.Errorf("policies: PerCall.Policy: %w", err)
	}
	return nil
}

func (p PerCall) rules(perKey bool) []Rule {
	rs := p.Policy.rules(perKey)
	for i := range rs {
		rs[i].PerCall = true
	}
	return rs
}

func hasPerCall(p Policy) bool {
	return holds(p, func(q Policy) bool { _, ok := q.(PerCall); return ok })
}

func hasPerKey(p Policy) bool {
	return holds(p, func(q Policy) bool { _, ok := q.(PerKey); return ok })
}

// holds reports whether p, or a policy it wraps at any depth, is one that
// is reports true for.
func holds(p Policy, is func(Policy) bool) bool {
	if is(p) {
		return true
	}
	switch p := p.(type) {
	case PerKey:
		return holds(p.Policy, is)
	case PerCall:
		return holds(p.Policy, is)
	case Unit:
		return holds(p.Policy, is)
	case Shared:
		return holds(p.Policy, is)
	case Spread:
		return holds(p.Policy, is)
	case all:
		for _, q := range p {
			if holds(q, is) {
				return true
			}
		}
	}
	return false
}

// Kind names the algorithm a Rule uses; the script dispatches on it.
type Kind int

// The kinds of rule the script knows.
const (
	KindSlidingLog     Kind = 1
	KindSlidingCounter Kind = 2
	KindTokenBucket    Kind = 3
	KindConcurrency    Kind = 4
)

// String names the kind as people read it ("sliding log", "sliding
// counter", "token bucket", "concurrency"); a kind the script does not
// know reads "kind N".
func (k Kind) String() string {
	switch k {
	case KindSlidingLog:
		return "sliding log"
	case KindSlidingCounter:
		return "sliding counter"
	case KindTokenBucket:
		return "token bucket"
	case KindConcurrency:
		return "concurrency"
	}
	return "kind " + strconv.Itoa(int(k))
}

// A Rule is one limit in the flat form the Redis script checks:
// throttle.New flattens a Policy into its rules (see Rules), and
// throttle.Usage reports how full each one is. How a rule is encoded for the
// script is the throttle package's own business.
type Rule struct {
	Kind    Kind          // the algorithm the script applies
	PerKey  bool          // the rule applies to each key separately
	PerCall bool          // the rule counts each call once, whatever its cost
	Limit   int           // units per window, burst, or calls in flight
	Window  time.Duration // window length, margin included (log, counter)
	Bucket  time.Duration // bucket width (counter)
	Every   time.Duration // emission interval per unit (token bucket)
	Lease   time.Duration // how long a crashed holder keeps its slot (concurrency)
	// Margin is the jitter the rule absorbs between the decision in Redis
	// and the arrival at the vendor (log, counter, token bucket).
	Margin time.Duration
	// Unit names what the rule counts, when not a call's Cost: a Unit
	// policy's Name (see Unit).
	Unit string
	// Shared names the quotas that share the rule: a Shared policy's Name
	// (see Shared), or "" for a rule of the quota's own.
	Shared string
	// Paces marks a rule of a part of another's window (Spread): the
	// fleet's own, which no vendor's answer is about.
	Paces bool
}

// ID names the rule by what its data means, for the Redis key that holds
// it: its kind, and the parameters that shape the data (a window, a bucket
// width, an emission interval), not its limit. A deploy that changes a
// limit keeps the data; one that changes a rule's kind or window starts
// that rule on a key of its own, where the old data cannot be misread; the
// order of the rules in All does not matter.
func (r Rule) ID() string {
	if r.Unit != "" {
		// Units of different names are different data.
		unit := r.Unit
		r.Unit = ""
		return unit + ":" + r.ID()
	}
	if r.PerCall {
		// Calls and units are different data.
		r.PerCall = false
		return "calls:" + r.ID()
	}
	us := func(d time.Duration) string { return strconv.FormatInt(d.Microseconds(), 10) }
	switch r.Kind {
	case KindSlidingLog:
		return "log" + us(r.Window-r.Margin)
	case KindSlidingCounter:
		return "counter" + us(r.Window-r.Margin) + "/" + us(r.Bucket)
	case KindTokenBucket:
		return "bucket" + us(r.Every)
	case KindConcurrency:
		return "concurrency"
	}
	return "kind" + strconv.Itoa(int(r.Kind))
}

// Rules validates p and flattens it into the rules the script checks, in a
// stable order: the same policy always yields the same rules.
func Rules(p Policy) ([]Rule, error) {
	if p == nil {
		return nil, errors.New("policies: policy is nil")
	}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	rs := p.rules(false)
	if err := sharedNames(rs); err != nil {
		return nil, err
	}
	return rs, nil
}
