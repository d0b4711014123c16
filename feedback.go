package throttle

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/throttlekit/throttle/internal/protocol"
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
	l.view.counted.Store(true)
	c := vendorCount{left: remaining, reset: max(reset, 0)}
	said := vendorSaid{units: c, calls: unknownCount}
	if !l.cfg.unitRules {
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
	named        map[string]vendorCount // of the named units (policies.Unit), by name
	learn        bool
	// late is how long after its slot the vendor may have taken its
	// count: when the answer came (or, when that is not known, when the
	// call started), 0 when neither is known. A vendor sends the counts
	// of the moment it answers, the fleet's calls still in flight at
	// their estimate or max_tokens: the fleet's calls booked up to then
	// are its own, neither other consumers' nor a gap to charge.
	late time.Duration
	// refused says that the vendor refused the call: it most often does
	// not count a refused call, which the measure of the others must know.
	refused bool
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
	keys, rules, named := l.rulesAbout(sc, said)
	args := scriptArgs(l.s.clock, rules, protocol.Feedback{ID: l.newMember(), AsOf: asOf.Microseconds(), Pause: pause.Microseconds(),
		Left: int64(max(said.units.left, -1)), Reset: said.units.reset.Microseconds(), Known: l.view.epoch.Load(), Refused: learn,
		Limit: int64(max(said.units.limit, 0)), CallsLeft: int64(max(said.calls.left, -1)),
		CallsReset: said.calls.reset.Microseconds(), CallsLimit: int64(max(said.calls.limit, 0)),
		Late: max(said.late, 0).Microseconds(), RefusedCost: refusedCost(said, r, rules),
		Span: policySpan(l.cfg.rules).Microseconds(), Named: int64(len(named))})
	for _, n := range named {
		args = n.Append(args)
	}
	v, err := scripts.feedback.Run(ctx, l.rdb, declared(scripts.feedback, keys, rules, l.cfg.groupKey), args...).Int64Slice()
	if err != nil {
		return l.unavailable(err)
	}
	rep, err := decodeFeedback(v)
	if err != nil {
		return fmt.Errorf("throttle: quota %q: %w", l.name, err)
	}
	l.notePause(sc, rep.now, rep.until)
	l.noteOthers(rep)
	if rep.dropped {
		l.noteLowered(rep.now)
	}
	if pause > 0 {
		l.emit(Event{Kind: EventPaused, Duration: pause, PausedBy: PausedByVendor})
	}
	if rep.lowered {
		l.s.logger.Warn("throttle: the vendor refused a call over its limit; the quota's limit in force is lowered to what the vendor accepted",
			"quota", l.name, "limit", rep.limit)
		l.emit(Event{Kind: EventCapLearned, Limit: rep.limit})
	}
	return nil
}

// rulesAbout returns the rules of scope sc that the vendor's answer said is
// about, and their keys after the scope's two: the shared ones, or the
// key's own when there are none; a named unit's rules only with their own
// unit's count, and never to learn a cap, since a refusal does not say
// which of the vendor's counts it is about (policies.Unit); never a part
// of a window (policies.Spread), which no vendor counts. named holds,
// for each of those, its place among rules and its count, as feedback.lua
// takes them.
func (l *Limiter) rulesAbout(sc scope, said vendorSaid) (keys []string, rules []policies.Rule, named []protocol.Named) {
	keys = sc.keys[:2:2]
	for i, r := range l.cfg.rules {
		about := !r.PerKey
		if !l.cfg.hasShared {
			about = r.PerKey
		}
		c, counted := said.named[r.Unit]
		if r.Unit != "" && (!counted || said.learn) || r.Paces {
			about = false // a Spread's part is the fleet's own
		}
		if about && r.Kind != policies.KindConcurrency {
			keys = append(keys, sc.keys[2+i])
			rules = append(rules, r)
			if r.Unit != "" {
				named = append(named, protocol.Named{Rule: int64(len(rules)), Left: int64(max(c.left, -1)), Reset: c.reset.Microseconds()})
			}
		}
	}
	return keys, rules, named
}

// policySpan returns the longest window of rules, each with the widest
// margin it can take: a loss that feedback.lua finds, given only the rules
// an answer is about, pauses the quota for it, since every rule of the
// policy still counts the calls Redis forgot (loss_pause in lib.lua).
func policySpan(rules []policies.Rule) time.Duration {
	var span time.Duration
	for _, r := range rules {
		switch r.Kind {
		case policies.KindSlidingLog:
			w := r.Window - r.Margin
			span = max(span, w+policies.MarginCeiling(w, r.Margin))
		case policies.KindSlidingCounter:
			span = max(span, r.Window)
		}
	}
	return span
}

// refusedCost returns the cost of the call r under each of rules, as
// feedback.lua reads it, when the vendor refused it, else "".
func refusedCost(said vendorSaid, r result, rules []policies.Rule) string {
	if !said.refused || !r.admitted || r.local {
		return ""
	}
	parts := make([]string, len(rules))
	for i, rule := range rules {
		n := r.cost
		if rule.Unit != "" {
			n = r.named[rule.Unit]
		}
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ",")
}

// newFeedbackCall reads the options of Pause and SetRemaining: only Key
// matters, and only on a quota of per-key policies.
func (l *Limiter) newFeedbackCall(opts []CallOption) (call, error) {
	c := callOf(opts)
	if err := l.made(); err != nil {
		return c, err
	}
	if l.cfg.perKey && !l.cfg.hasShared && !c.hasKey {
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

// Answer is what a vendor's answer to one call says about its rate limits.
// Permit.Heard makes it known to the whole fleet. Transport fills one from
// each response's status and headers; fill one yourself to feed the answers
// a vendor gives through another client (a vendor SDK, a gRPC interceptor:
// a RESOURCE_EXHAUSTED is a 429).
type Answer struct {
	// Status is the answer's HTTP status. A 429 is a refusal; so are a
	// 503 with a RetryAfter (an overloaded vendor: the fleet pauses, but
	// learns no cap from it) and a 403 with a RetryAfter or with nothing
	// Remaining until a Reset (GitHub's ways of refusing). Other statuses
	// are not refusals. A refusal teaches a cap only when AboutRate says
	// so, or a count shows nothing left of a stated limit.
	Status int
	// RetryAfter is how long the vendor asked callers to wait (the
	// Retry-After header), and HasRetryAfter whether it said so at all: a
	// Retry-After of 0 says there is room now.
	RetryAfter    time.Duration
	HasRetryAfter bool
	// Requests is the vendor's count of requests (X-RateLimit-Remaining
	// and its kin); nil when it gave none.
	Requests *Count
	// Tokens is its count of tokens (an LLM API's), nil when it gave none.
	// When the call was given a Cost, the quota's units follow Tokens; when
	// not, or when the vendor gives no Tokens, they follow Requests (on a
	// quota with policies.PerCall rules, a Cost with no Tokens tells
	// nothing of the units, and Requests counts the calls alone).
	Tokens *Count
	// Units are its counts of named units, by the names of the quota's
	// policies.Unit (Anthropic's input and output tokens, which Transport
	// reads as "input_tokens" and "output_tokens"): each reaches the rules
	// that count its unit, which no other count reaches. A name the quota
	// does not count is ignored.
	Units map[string]*Count
	// Shared reports a refusal about a resource the quota shares with
	// others (Discord's X-RateLimit-Scope: shared): the fleet pauses, but
	// learns no cap from it.
	Shared bool
	// AboutRate reports a refusal the vendor said is about its rate limit
	// (Stripe-Rate-Limited-Reason: global-rate, OpenAI's error code
	// rate_limit_exceeded): only such a refusal teaches the quota a cap
	// when it gives no count. A 429 may be about a lock, a concurrency
	// limit or a bill as well: one that says nothing of why pauses the
	// fleet and teaches nothing. Transport sets it from each vendor's
	// documented reasons (docs/VENDORS.md), or from Transport.AboutRate.
	AboutRate bool
	// AboutConcurrency reports a refusal the vendor said is about its
	// calls in flight (Stripe-Rate-Limited-Reason: global-concurrency or
	// endpoint-concurrency, Twilio's 20429). A quota with a
	// policies.Concurrency rule takes it as that rule's: the fleet is not
	// paused, learns no cap, and the call's retry waits for a free slot.
	// A quota without one pauses, as for a refusal that gives no reason.
	AboutConcurrency bool
	// DefaultPause is how long a 429 that names no time (no RetryAfter,
	// no count with nothing left until a reset) pauses the fleet, with up
	// to a quarter more at random. 0 means a second.
	DefaultPause time.Duration
}

// Count is one of a vendor's counts of its rate limit.
type Count struct {
	// Remaining is what the vendor says is left of the limit.
	Remaining int
	// Reset is how long until the vendor's window resets; 0 when unknown.
	Reset time.Duration
	// Limit is the limit's size; 0 when unknown.
	Limit int
}

// check reports a negative field of a Count.
func (c *Count) check(field string) error {
	switch {
	case c == nil:
		return nil
	case c.Remaining < 0:
		return fmt.Errorf("%s.Remaining must not be negative, got %d", field, c.Remaining)
	case c.Reset < 0:
		return fmt.Errorf("%s.Reset must not be negative, got %v", field, c.Reset)
	case c.Limit < 0:
		return fmt.Errorf("%s.Limit must not be negative, got %d", field, c.Limit)
	}
	return nil
}

// count returns c as the feedback script takes it: unknown when nil.
func (c *Count) count() vendorCount {
	if c == nil {
		return unknownCount
	}
	return vendorCount{left: c.Remaining, reset: min(c.Reset, maxPause), limit: c.Limit}
}

// Heard makes what the vendor answered to the permit's call known to every
// replica, as Transport does with each response, and reports how long the
// vendor asked the fleet to keep quiet and whether it refused the call:
//
//   - A refusal pauses the quota (Limiter.Pause) until the time the vendor
//     named, or for DefaultPause when it named none; so does any answer that
//     says nothing is left until a reset, unless the quota's own count had
//     nothing left after the call either.
//   - A refusal AboutRate teaches the quota the vendor's cap, unless the
//     limiter's Options say WithoutLearning: the Limit it states, or what
//     the fleet admitted in the window before the call, which the vendor
//     accepted (half the limit at most, per refusal). The cap holds for
//     eight windows without a refusal, then rises back while the fleet
//     fills it. A 503, a refusal about a resource shared with others and
//     one with Retry-After: 0 (room now) teach nothing; so does a refusal
//     that gives no reason and no count, which only pauses. An answer that
//     says nothing is left of a Limit it states teaches that Limit.
//   - A count that says fewer are left than the quota believed right after
//     it admitted the call lowers the quota's count, as
//     Limiter.SetRemaining does; calls admitted after this one, on their
//     way to the vendor, are not in its count.
//   - After Redis lost the quota's data, its clock stepped, or a deploy
//     added a rule, a rule counts as full for its window (Usage.PausedBy
//     says why). A count of a call decided since rebuilds that rule for
//     the call's key: the calls after it go at once. Once a count has
//     reached the limiter, its first call per rule and key goes out alone
//     to learn it (a scout); a vendor at its cap refuses only that one.
//
// Heard asks Redis only when the answer tells the quota something: an
// answer that says nothing of a limit, or a count that believes no fewer
// left than the quota did, costs nothing. The pause is capped at an hour. An
// error says the answer was not made known (Redis could not be reached, a
// negative field); the pause and the refusal are reported all the same.
func (p *Permit) Heard(ctx context.Context, a Answer) (pause time.Duration, refused bool, err error) {
	p, err = p.acting("Heard")
	if err != nil {
		return 0, false, err
	}
	l := p.l
	if err := a.check(); err != nil {
		return 0, false, fmt.Errorf("throttle: quota %q: Heard: %w", l.name, err)
	}
	requests, tokens := a.Requests.count(), a.Tokens.count()
	said := p.counts(a, requests, tokens)
	if said.units.left >= 0 || said.calls.left >= 0 || len(said.named) > 0 {
		l.view.counted.Store(true)
	}
	pause, refused = a.refusal(requests, untilReset(requests, tokens))
	if refused && a.AboutConcurrency && l.cfg.hasConc && !isOff(offConcRefusals) {
		// The Concurrency rule's slots, not a pause, hold the calls back.
		l.emit(Event{Kind: EventVendorLimited})
		return 0, true, nil
	}
	if !refused && p.r.admitted && !p.r.local && p.r.room == 0 {
		// The fleet's count was as full as the vendor's after this call: it
		// admits nothing before its own units leave the window, which a
		// vendor's reset in whole seconds would only delay.
		pause = 0
	}
	pause = min(pause, maxPause)
	if refused {
		l.emit(Event{Kind: EventVendorLimited})
	}
	said.refused = refused
	return pause, refused, p.tell(ctx, said, pause, a.teaches(said, refused))
}

// check reports a negative field of the answer.
func (a Answer) check() error {
	if err := errors.Join(a.Requests.check("Answer.Requests"), a.Tokens.check("Answer.Tokens")); err != nil {
		return err
	}
	for name, c := range a.Units {
		if err := c.check("Answer.Units[" + strconv.Quote(name) + "]"); err != nil {
			return err
		}
	}
	if a.RetryAfter < 0 || a.DefaultPause < 0 {
		return fmt.Errorf("Answer.RetryAfter and Answer.DefaultPause must not be negative, got %v and %v",
			a.RetryAfter, a.DefaultPause)
	}
	return nil
}

// untilReset returns the pause that the vendor's counts ask: until the
// reset of a count with nothing left.
func untilReset(requests, tokens vendorCount) time.Duration {
	var pause time.Duration
	if requests.left == 0 {
		pause = requests.reset
	}
	if tokens.left == 0 {
		pause = max(pause, tokens.reset)
	}
	return pause
}

// counts returns the vendor's counts, requests and tokens, as the quota's
// rules keep them: the rules that count units follow its count of tokens
// when the call's Cost was given and the vendor counts tokens, else its
// count of requests; policies.PerCall rules follow its count of requests.
func (p *Permit) counts(a Answer, requests, tokens vendorCount) vendorSaid {
	said := vendorSaid{units: requests, calls: unknownCount}
	switch {
	case p.call.hasCost && a.Tokens != nil:
		said.units = tokens
	case p.call.hasCost && p.l.cfg.callRules:
		said.units = unknownCount // the vendor counts requests alone
	}
	if p.l.cfg.callRules {
		said.calls = requests
	}
	for name, c := range a.Units {
		if _, ok := p.l.cfg.unitMax[name]; ok && c != nil {
			if said.named == nil {
				said.named = map[string]vendorCount{}
			}
			said.named[name] = c.count()
		}
	}
	return said
}

// refusal reports whether the answer refuses the call for being over the
// vendor's rate limit, and the pause it asks: pause, what its counts ask,
// or longer.
func (a Answer) refusal(requests vendorCount, pause time.Duration) (time.Duration, bool) {
	switch {
	case a.Status == http.StatusTooManyRequests:
		pause = max(pause, a.RetryAfter)
		if pause == 0 && !a.HasRetryAfter {
			d := a.DefaultPause
			if d == 0 {
				d = time.Second
			}
			pause = d + rand.N(d/4+1)
		}
		return pause, true
	case a.Status == http.StatusServiceUnavailable && a.HasRetryAfter:
		return max(pause, a.RetryAfter), true
	case a.Status == http.StatusForbidden && (requests.left == 0 && pause > 0 || a.HasRetryAfter):
		// GitHub's ways of refusing a call over its primary rate limit
		// (nothing left until the reset), or over a secondary one.
		return max(pause, a.RetryAfter), true
	}
	return pause, false
}

// teaches reports whether the answer, with the counts said, teaches the
// quota the vendor's cap.
//
// A refusal about the vendor's rate (AboutRate) teaches the quota the cap
// (learn_cap in lib.lua): the limit the vendor states with it, or, when it says
// nothing of its count, what the fleet admitted before the call. A refusal
// that gives no reason teaches nothing by its status alone: a 429 may be a
// lock, a concurrency limit or a bill. A refusal that gives a count of
// units left without a limit is heeded through the count: nothing left
// until the reset is a pause, units left mean a secondary limit or a limit
// of one endpoint, not the quota's. An overloaded vendor (503) teaches
// nothing, nor does a refusal that Discord says is about a resource shared
// with others.
//
// An answer that says nothing is left of a limit it states teaches that
// limit too, refused or not: the fleet has just used it all. A refusal
// with Retry-After: 0 teaches nothing: a vendor over a window's cap
// says when there is room, and this one says there is room now.
func (a Answer) teaches(said vendorSaid, refused bool) bool {
	// The count that says whether the vendor refused for being over its
	// limit: the units', or the requests' when the units' is unknown.
	remaining, limit := said.units.left, said.units.limit
	if remaining < 0 {
		remaining, limit = said.calls.left, said.calls.limit
	}
	retryNow := a.HasRetryAfter && a.RetryAfter == 0
	return a.Status != http.StatusServiceUnavailable && !a.Shared &&
		(refused && a.AboutRate && remaining < 0 && !retryNow || remaining == 0 && limit > 0)
}

// tell makes known to the fleet what the vendor's answer said, and the
// pause it asks: a cap to learn, when learn, or a pause, or a count that
// lowers the quota's. It asks Redis nothing when the answer tells the
// quota nothing.
func (p *Permit) tell(ctx context.Context, said vendorSaid, pause time.Duration, learn bool) error {
	l := p.l
	said.late = p.answeredLate()
	if said.refused && !p.r.local {
		// A call the fleet admitted and the vendor refused: another
		// consumer of the key may spend it. The counts that follow are
		// passed on, to measure them, even those that say more is left
		// than the fleet believes (its refused calls are in its record).
		l.measureOthers()
	}
	scout := p.r.room < 0 && (said.units.left >= 0 || said.calls.left >= 0 || len(said.named) > 0)
	if scout {
		// A scout's count rebuilds a blind rule (lua/feedback.lua,
		// rebuild), whatever else the answer asks.
		counts := vendorSaid{units: said.units, calls: said.calls, named: said.named, late: said.late}
		if err := l.feedback(ctx, counts, p.r, p.opts()); err != nil {
			return err
		}
	}
	switch {
	case learn && !l.s.noLearning:
		// Its counts measure the others' share too (lua/feedback.lua), but
		// charge nothing: the cap or the pause it teaches holds the fleet.
		said.pause, said.learn = pause, true
		if isOff(offLearnMeasures) {
			said.units.left, said.calls.left = -1, -1
		}
		return l.feedback(ctx, said, p.r, p.opts())
	case pause > 0 && said.refused:
		// The refusal is noted with the pause (see refusedCost).
		return l.feedback(ctx, vendorSaid{pause: min(pause, maxPause), units: unknownCount, calls: unknownCount,
			refused: true}, p.r, p.opts())
	case pause > 0:
		return l.Pause(ctx, pause, p.opts()...)
	case scout:
		return nil
	case len(said.named) > 0:
		// Counts of named units: the quota keeps no belief of their
		// remaining to save the call by.
		said.units.limit, said.calls.limit = 0, 0
		return l.feedback(ctx, said, p.r, p.opts())
	case (said.units.left >= 0 || said.calls.left >= 0) && countsCalls(l) &&
		(l.cfg.hasConc || l.cfg.callRules || said.units.left < p.r.room || l.measuringOthers() || l.firstCount()):
		// The count only ever believes fewer are left after it admitted
		// this call: when it believed no more than the vendor then, a call
		// to Redis is saved. A Concurrency rule's free slots take part in
		// that belief, and so do the counts of calls beside units: with
		// one, the vendor's count is always passed on. So is every count
		// while the quota measures what other consumers of the key spend:
		// counts passed on only when they say less is left than the fleet
		// believed would measure the others high. The vendor counted as of
		// this call: calls admitted after it, on their way, are not in its
		// number.
		return l.feedback(ctx, said, p.r, p.opts())
	}
	return nil
}

// firstCount reports whether this is the limiter's first count of the
// vendor in the quota's epoch, and notes it told: passed on, it tells the
// quota that the vendor states its counts (the meta's counted), so that a
// process deployed later may send scouts before it heard one itself
// (Limiter.scouts).
func (l *Limiter) firstCount() bool {
	epoch := l.view.epoch.Load()
	return l.view.countTold.Swap(epoch) != epoch
}

// noteOthers keeps what the feedback script said of the others' share,
// and reports a change of it.
func (l *Limiter) noteOthers(rep feedbackReply) {
	if rep.measuring {
		l.measureOthers()
	}
	if old := l.view.others.Swap(int64(rep.others)); old != int64(rep.others) {
		l.emit(Event{Kind: EventOthers, Others: rep.others})
	}
}

// measureOthers makes every count the vendor gives in the next two
// windows measure what other consumers of the key spend (see tell).
func (l *Limiter) measureOthers() {
	raise(&l.view.measuring, time.Now().Add(2*l.cfg.longest).UnixNano())
}

// measuringOthers reports whether the quota measured lately what other
// consumers of the key spend, or should.
func (l *Limiter) measuringOthers() bool {
	return time.Now().UnixNano() < l.view.measuring.Load()
}

// countsCalls reports whether the quota has a rule that counts calls over
// time, the only kind a vendor's remaining count is about.
func countsCalls(l *Limiter) bool {
	for _, r := range l.cfg.rules {
		if r.Kind != policies.KindConcurrency {
			return true
		}
	}
	return false
}
