package throttle

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
	"github.com/throttlekit/throttle/policies"
)

// reason says why acquire refused a call.
type reason int

const (
	reasonNone   reason = protocol.ReasonNone
	reasonTooFar reason = protocol.ReasonTooFar // the slot lies beyond the wait the call accepts
	reasonBusy   reason = protocol.ReasonBusy   // a concurrency rule is full
	reasonShare  reason = protocol.ReasonShare  // larger than the share one replica may take while replicas may decide without Redis
	reasonLate   reason = 4                     // every admission came too late to start in (decided here, not by the script)
)

// acquireReply is acquire.lua's reply, field by field, in the order its
// header documents them.
type acquireReply struct {
	now    time.Duration // the time the script used, since the Unix epoch
	pause  time.Duration // the time until which the scope is paused, or 0
	epoch  int64         // the quota's epoch
	lost   bool          // this script found that Redis lost the quota's data
	margin time.Duration // the smallest guarded margin in force, or 0
	done   time.Duration // the time the script ended
	seq    int64         // the quota's count of scripts run
	// paused is the time until which the quota itself is paused, or 0, and
	// pausedBy why (see Usage.PausedBy).
	paused   time.Duration
	pausedBy string
	calls    []callReply
}

// pausedFor returns why a call paused until pause was refused: the
// quota's cause, or the vendor's for a pause of the call's key that ends
// later; "" for no pause in force at now.
func (rep acquireReply) pausedFor(pause time.Duration) string {
	switch {
	case pause <= rep.now:
		return ""
	case pause > rep.paused:
		return PausedByVendor
	}
	return rep.pausedBy
}

// callReply is acquire.lua's decision of one call.
type callReply struct {
	admitted  bool          // admitted now, or booked for later
	wait      time.Duration // until its slot; if refused, until it would fit
	remaining int           // units free now under the tightest rule, after it, its class's own log included
	reason    reason
	blindBy   string        // why a blind rule refused it (see Usage.PausedBy), or ""
	pause     time.Duration // the time until which its scope is paused, or 0
	// noted and logged are the rules, rule i as bit i, under which its
	// class's demand counts it, and its class's own log holds it.
	noted, logged int64
	// room is remaining under the rules alone: a vendor's count is read
	// against it, since a class's own log is no count the vendor keeps;
	// -1 for a scout, whose every count is news (lua/lib.lua, Scouts).
	room int
}

// decodeAcquire reads acquire.lua's reply v about n calls, or says what is
// wrong with it.
func decodeAcquire(v []int64, n int) (acquireReply, error) {
	if len(v) != protocol.AcquireSize+protocol.AnswerSize*n {
		return acquireReply{}, fmt.Errorf("unexpected script reply %v", v)
	}
	us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
	rep := acquireReply{
		now: us(v[protocol.AcquireNow]), pause: us(v[protocol.AcquirePause]), epoch: v[protocol.AcquireEpoch],
		lost: v[protocol.AcquireLost] == 1, margin: us(v[protocol.AcquireMargin]), done: us(v[protocol.AcquireDone]),
		seq: v[protocol.AcquireSeq], paused: us(v[protocol.AcquirePaused]), pausedBy: pausedBy[v[protocol.AcquirePausedBy]],
		calls: make([]callReply, n),
	}
	for i := range n {
		w := v[protocol.AcquireSize+protocol.AnswerSize*i:]
		rep.calls[i] = callReply{admitted: w[protocol.AnswerAdmitted] == 1, wait: us(w[protocol.AnswerWait]),
			remaining: int(w[protocol.AnswerRemaining]), reason: reason(w[protocol.AnswerReason]),
			blindBy: pausedBy[w[protocol.AnswerBlindBy]], pause: us(w[protocol.AnswerPause]),
			noted: w[protocol.AnswerNoted], logged: w[protocol.AnswerLogged], room: int(w[protocol.AnswerRoom])}
	}
	return rep, nil
}

// feedbackReply is feedback.lua's reply, field by field.
type feedbackReply struct {
	now     time.Duration // the time the script used
	until   time.Duration // the pause in force until then, or 0
	charged int           // units charged to match the vendor's count
	lowered bool          // a rule's learned cap dropped
	limit   int           // the lowest limit in force of a capped rule, or -1
	// others is the most units a rule leaves other consumers of the
	// vendor's key; measuring reports that a rule keeps their share.
	others    int
	measuring bool
	dropped   bool // a rule's limit in force dropped: calls booked before book again
}

// decodeFeedback reads feedback.lua's reply v, or says what is wrong with it.
func decodeFeedback(v []int64) (feedbackReply, error) {
	if len(v) != protocol.FeedbackSize {
		return feedbackReply{}, fmt.Errorf("unexpected script reply %v", v)
	}
	us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
	return feedbackReply{now: us(v[protocol.FeedbackNow]), until: us(v[protocol.FeedbackUntil]),
		charged: int(v[protocol.FeedbackCharged]), lowered: v[protocol.FeedbackLowered] == 1, limit: int(v[protocol.FeedbackCap]),
		others: int(v[protocol.FeedbackOthers]), measuring: v[protocol.FeedbackMeasuring] == 1,
		dropped: v[protocol.FeedbackDropped] == 1}, nil
}

// costArg is a call's cost as the scripts take it: its Cost, or, on a
// quota that counts named units, its units under each rule in the rules'
// order, comma-separated (see read_cost in lua/lib.lua).
func (l *Limiter) costArg(cost int, named map[string]int) any {
	if len(l.cfg.units) == 0 {
		return cost
	}
	var b strings.Builder
	for i, r := range l.cfg.rules {
		if i > 0 {
			b.WriteByte(',')
		}
		n := cost
		if r.Unit != "" {
			n = named[r.Unit]
		}
		b.WriteString(strconv.Itoa(n))
	}
	return b.String()
}

// appender is a layout of arguments of internal/protocol.
type appender interface{ Append(args []any) []any }

// args builds a script's arguments (see internal/protocol): the time, the
// rules, and then the script's own, own.
func (l *Limiter) args(own appender) []any {
	return scriptArgs(l.s.clock, l.cfg.rules, own)
}

// acquireHead is acquire.lua's own arguments but for the counts of what
// follows. The limiter tells who it is and how many of its scripts Redis
// answered in the epoch (a Redis behind that count lost them), and, when
// the vendor's counts reached it, that its calls may go out as scouts.
func (l *Limiter) acquireHead() protocol.Acquire {
	ran := l.view.ran.Load()
	if ran == nil {
		ran = &scriptsRan{}
	}
	return protocol.Acquire{
		Scout: l.scouts(), Ran: ran.n, RanIn: ran.epoch, Limiter: l.id,
		Seen: l.view.scripts.Load(), Known: l.view.epoch.Load(), Delay: l.timing.delay().Microseconds(), Policy: l.cfg.policyID,
		Stepped: l.newStep(),
	}
}

// releaseArgs are release.lua's: the call member's held units, released
// (lease 0) or their lease renewed for lease from now.
func (l *Limiter) releaseArgs(member string, held int, lease time.Duration) []any {
	return l.args(protocol.Release{ID: member, Cost: held, Lease: lease.Microseconds()})
}

// cancelArgs are cancel.lua's: the booking r, of cost (costArg), given
// back.
func (l *Limiter) cancelArgs(r result, cost any) []any {
	return l.args(protocol.Cancel{Booking: r.booking(cost)})
}

// settleArgs are settle.lua's: the call admitted as r, for cost, counts
// actual instead (both as costArg gives them).
func (l *Limiter) settleArgs(r result, cost, actual any) []any {
	return l.args(protocol.Settle{Booking: r.booking(cost), Actual: actual})
}

// handBackArgs start handback.lua's: the quota divided among replicas,
// others deciding without Redis for span yet, and the number of charges
// that follow.
func (l *Limiter) handBackArgs(replicas int, span time.Duration, charges int) []any {
	return l.args(protocol.Handback{Replicas: int64(replicas), Span: span.Microseconds(), Charges: int64(charges)})
}

// usageArgs are usage.lua's: the rules alone.
func (l *Limiter) usageArgs() []any {
	return l.args(nil)
}

// scriptArgs builds a script's arguments: the time by clock (nil for
// Redis's), the rules, and then own, unless nil.
func scriptArgs(clock func() time.Time, rules []policies.Rule, own appender) []any {
	var now int64
	if clock != nil {
		now = clock().UnixMicro()
	}
	args := make([]any, 0, 2+7*len(rules)+16)
	args = append(args, now, len(rules))
	for _, r := range rules {
		args = ruleArgs(r).Append(args)
	}
	if own != nil {
		args = own.Append(args)
	}
	return args
}

// ruleArgs encodes rule r as the scripts read it (see protocol.Rule).
func ruleArgs(r policies.Rule) protocol.Rule {
	us := func(d time.Duration) int64 { return d.Microseconds() }
	kind := int64(r.Kind)
	if r.PerCall {
		kind += protocol.FlagPerCall
	}
	if r.PerKey {
		kind += protocol.FlagPerKey
	}
	if r.Shared != "" {
		kind += protocol.FlagShared
	}
	a := protocol.Rule{Kind: kind, Limit: int64(r.Limit)}
	switch r.Kind {
	case policies.KindSlidingCounter:
		a.Window, a.Width, a.Margin = us(r.Window), us(r.Bucket), us(r.Margin)
	case policies.KindTokenBucket:
		a.Interval, a.Margin = us(r.Every), us(r.Margin)
	case policies.KindConcurrency:
		a.Lease = us(r.Lease)
	default:
		a.Window, a.Margin = us(r.Window), us(r.Margin)
	}
	return a
}

type result struct {
	admitted  bool
	reason    reason
	wait      time.Duration
	remaining int
	room      int           // remaining under the rules alone, for a call decided in Redis (see callReply)
	now       time.Duration // Redis time since the Unix epoch
	answered  time.Time     // when the reply that decided it arrived; zero when decided without Redis
	done      time.Duration // Redis time the script ended
	pause     time.Duration // Redis time until which the scope is paused, or 0
	pausedBy  string        // why, as Usage.PausedBy says (see acquireReply.pausedFor)
	scope     scope
	member    string
	cost      int            // the units booked
	named     map[string]int // the call's costs in named units (CostIn)
	epoch     int64          // the quota's epoch when the call was decided
	margin    time.Duration  // the smallest guarded margin in force, 0 for none
	stale     bool           // decided by a Redis clock that had just stepped forward
	gaps      uint64         // the gaps in the quota's news this process knew of when it was decided (see news.go)
	local     bool           // decided without Redis (FailOpen, Local)
	turn      uint64         // the Local fallback's turn that decided it (see local)
	again     string         // why the call must give it back and book again (EventBookedAgain's Reason), once woken
	// class is the call's class, and noted and logged the rules where it
	// counts in it, as acquire.lua answered (see callReply): a booking
	// given back, or settled, leaves its class too.
	class         string
	prio          int // the priority of class
	noted, logged int64
}

// booking is the booking r, of cost (costArg), as the scripts that give it
// back or settle it read it: where it counts in its class among the rest
// (change_classes in lua/lib.lua).
func (r result) booking(cost any) protocol.Booking {
	return protocol.Booking{ID: r.member, Cost: cost, Slot: r.slot().Microseconds(), Epoch: r.epoch,
		Noted: r.noted, Logged: r.logged, Ahead: r.wait > 0, Class: r.class, Prio: int64(r.prio)}
}

// slot is the Redis time of the call's booked slot.
func (r result) slot() time.Duration { return r.now + r.wait }

// left returns how long from now until the slot of r, by this process's
// clock since r's reply arrived: r.wait is counted from when Redis decided
// it, which a booking kept by a move (keptAsBooked) keeps.
func (r result) left() time.Duration {
	if r.answered.IsZero() {
		return r.wait
	}
	return r.wait - time.Since(r.answered)
}

// startsAt is the Redis time from which the call can start: its slot, or
// the end of the script that admitted it, if later. The script's own time
// is not the caller's lateness: it stays under a millisecond on Redis at
// every policy's bounds.
func (r result) startsAt() time.Duration { return max(r.slot(), r.done) }

// within runs f, which talks to Redis on a call's behalf after the call is
// decided (a booking given back, a slot released), and waits for it until
// leaveWithin after ctx ends at most: the call returns by its deadline
// even when Redis is slow or gone, and f goes on without it. On a Redis
// that answers in time, f is done when the call returns.
func (l *Limiter) within(ctx context.Context, f func()) {
	if ctx.Done() == nil {
		f()
		return
	}
	done := make(chan struct{})
	l.work.start(func() {
		defer close(done)
		f()
	})
	select {
	case <-done:
		return
	case <-ctx.Done():
	}
	t := time.NewTimer(leaveWithin)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// leaveWithin is how long a call whose context ended waits for Redis to
// take back what it booked or held, before it returns and leaves that to
// go on without it.
const leaveWithin = 50 * time.Millisecond

// run runs a script with the limiter's Redis timeout. go-redis sends
// EVALSHA, and EVAL when Redis does not know the script yet: a fleet on a
// Redis that has the script sends only its SHA, however many replicas start
// at once.
func (l *Limiter) run(ctx context.Context, s *redis.Script, sc scope, args []any) *redis.Cmd {
	return l.runOn(ctx, s, l.declaredFor(s, sc), args)
}

// runBooking runs script s about booking r, with args: a booking given
// back or settled, with every key that may touch (bookingKeys).
func (l *Limiter) runBooking(ctx context.Context, s *redis.Script, r result, args []any) *redis.Cmd {
	return l.runOn(ctx, s, l.bookingKeys(s, r), args)
}

// runOn runs script s with keys, every key it touches (see declared).
func (l *Limiter) runOn(ctx context.Context, s *redis.Script, keys []string, args []any) *redis.Cmd {
	ctx, cancel := context.WithTimeout(ctx, l.s.redisTimeout)
	defer cancel()
	return s.Run(ctx, l.rdb, keys, args...)
}

// unavailable wraps an error of Redis, or of the way to it.
func (l *Limiter) unavailable(err error) error {
	return &unavailableError{Quota: l.name, Err: err, prefix: l.s.prefix}
}

// scouts says whether this limiter's calls may go out as scouts while a
// rule is blind, as acquire.lua's scout argument: 1 when the vendor's
// counts reached it, 2 when none did yet but a Transport reads every
// answer of its calls (a process deployed since the vendor stated them),
// else 0 (lua/lib.lua, Scouts).
func (l *Limiter) scouts() int64 {
	switch {
	case l.view.counted.Load():
		return 1
	case l.view.reads.Load():
		return 2
	}
	return 0
}
