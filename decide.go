package throttle

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// acquire decides one call: in Redis while Redis answers, and otherwise as
// the limiter's OnRedisError says.
//
// giveBack, when not nil, is a booking of the call to give back in the same
// script call: it came too late to start in.
func (l *Limiter) acquire(ctx context.Context, c call, maxWait time.Duration, giveBack *result) (result, error) {
	if err := ctx.Err(); err != nil {
		return result{}, err
	}
	sc := l.scopeFor(c)
	pass := l.failover.brk.allow()
	if !pass.ok {
		return l.fallback(sc, c, maxWait, l.unavailable(errBreakerOpen))
	}
	if giveBack != nil && giveBack.local {
		l.cancel(ctx, c, *giveBack)
		giveBack = nil
	}
	if l.onFallback() {
		// Back from the fallback: Redis learns of the calls decided without
		// it before it decides any more.
		if err := l.awaitHandBack(ctx); err != nil {
			if ctx.Err() != nil {
				l.failover.brk.abort(pass)
				return result{}, ctx.Err()
			}
			if !errors.Is(err, errHandBackBusy) {
				// Redis did not answer; outrun, it did.
				l.reloadSlots(err)
				l.failover.brk.failure()
			}
			return l.fallback(sc, c, maxWait, err)
		}
	}
	if giveBack == nil {
		if r, ok := l.takeSpare(sc, c); ok {
			l.failover.brk.abort(pass)
			return r, nil
		}
	}
	r, err := l.decideInRedis(ctx, sc, c, maxWait, giveBack, pass.probe)
	if err == nil {
		l.redisAnswered()
		return r, nil
	}
	if !errors.Is(err, ErrUnavailable) || refusedByConfiguration(err) {
		// The caller gave up, or Redis refused the call for a reason only
		// its configuration can change: no outage, so no fallback would
		// be right, and no probe will fix it.
		l.failover.brk.abort(pass)
		return r, err
	}
	l.redisFailed(err)
	return l.fallback(sc, c, maxWait, err)
}

// redisFailed records that Redis failed a call's script call: the breaker
// counts it, and says so when it opened.
func (l *Limiter) redisFailed(err error) {
	l.reloadSlots(err)
	if l.failover.brk.failure() {
		l.s.logger.Warn("throttle: Redis keeps failing; deciding without it until it answers a probe",
			"quota", l.name, "on_redis_error", string(l.s.onRedisError), "err", err)
		l.emit(Event{Kind: EventFallback, Err: err})
	}
}

// cancel gives a booking back so that the next caller can have the slot. It
// runs even though ctx has ended; if Redis cannot be reached the booking
// stays, which wastes its slot but never overfills a window.
func (l *Limiter) cancel(ctx context.Context, c call, r result) {
	if r.local {
		if l.failover.local != nil {
			l.failover.local.forget(r.scope, r.member)
		}
		return
	}
	l.within(ctx, func() {
		_ = l.runBooking(context.WithoutCancel(ctx), scripts.cancel, r, l.cancelArgs(r, l.costArg(c.cost, c.named))).Err()
	})
}

// onFallback reports whether the Local fallback decides calls now: Redis
// has not learned of the calls of its turn yet.
func (l *Limiter) onFallback() bool { return l.failover.local != nil && l.failover.local.on.Load() }

// redisAnswered records an answer from Redis, and says so when it closed
// the breaker.
func (l *Limiter) redisAnswered() {
	if l.failover.brk.success() {
		l.s.logger.Info("throttle: Redis answers again; deciding in Redis", "quota", l.name)
		l.emit(Event{Kind: EventRecovered})
	}
}

// fallback decides a call that Redis could not.
func (l *Limiter) fallback(sc scope, c call, maxWait time.Duration, cause error) (result, error) {
	switch l.s.onRedisError {
	case FailOpen:
		return result{admitted: true, local: true, scope: sc}, nil
	case Local:
		member := l.newMember()
		r, began := l.failover.local.decide(sc, c, member, maxWait)
		if began {
			// This process's calls booked in Redis and still asleep ask
			// again when they wake: the fallback counts them against this
			// process's share, whatever Redis admitted them at.
			l.view.gaps.Add(1)
			l.work.start(l.watchForRedis)
		}
		r.scope, r.member = sc, member
		if r.reason == reasonShare {
			// Only Redis may admit it: it asks again when a probe may go.
			r.wait = l.failover.brk.nextProbe()
		}
		return r, nil
	}
	return result{}, cause
}

// refusedByConfiguration reports whether Redis answered the script with a
// refusal that only its configuration can change: a user without a right
// the scripts need (a command, a key, a channel), a password refused, a key
// of another type, scripting turned off, an undeclared key refused. Such a
// call fails with the error whatever Options.OnRedisError says: FailOpen
// must not turn a missing right into no limit at all.
//
// Engines and versions word their refusals differently (Redis 7.0 "can't
// run this command", 7.2 and Valkey "ACL failure in script: ... no
// permissions", managed services their own), so refusals are not told by
// their words: a Redis that answers with an error reply is up, and every
// error reply is a refusal but those that say the server is passing
// through a state it leaves by itself (loading, a failover, a full memory,
// a script running too long; see passing). A failure to reach Redis at all
// is no error reply.
func refusedByConfiguration(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply) && !passing(reply.Error())
}

// passingStates are the error codes of a Redis, or of a proxy in front of
// it, that is up but cannot serve for a while: go-redis retries the same
// ones.
var passingStates = []string{
	"LOADING", "BUSY", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS",
	"OOM", "MISCONF", "MOVED", "ASK", "NOSCRIPT",
}

// passingWords are the words of passing states that come without a code of
// their own: too many clients, and a proxy (Envoy, twemproxy) that lost
// its upstream.
var passingWords = []string{"max number of clients reached", "no upstream host", "upstream failure", "connection refused", "timed out"}

// passing reports whether the error reply msg says the server is passing
// through a state it leaves by itself. Inside a script the code may follow
// the script's own words ("ERR Error running script ...: -READONLY ...").
func passing(msg string) bool {
	for _, code := range passingStates {
		if strings.HasPrefix(msg, code+" ") || msg == code || strings.Contains(msg, "-"+code+" ") || strings.Contains(msg, ": "+code+" ") {
			return true
		}
	}
	lower := strings.ToLower(msg)
	for _, w := range passingWords {
		if strings.Contains(lower, w) {
			return true
		}
	}
	return false
}

// reloadSlots asks a ClusterClient to reload its slot map when a decision
// failed for want of a node rather than with an error reply. go-redis
// otherwise learns of a failover only from a MOVED reply, which a dead master
// never sends, or after ClusterStateReloadInterval (a minute by default). The
// reload is lazy and coalesced by go-redis.
func (l *Limiter) reloadSlots(err error) {
	cc, ok := l.rdb.(*redis.ClusterClient)
	var reply redis.Error
	if !ok || errors.As(err, &reply) {
		return
	}
	cc.ReloadState(context.Background())
}

// watchForRedis hands the Local fallback's calls back to Redis as soon as
// it answers a probe, whether or not a call asks: the fallback books calls
// ahead (a window and the time the fleet takes to notice, at least), and
// a process whose calls all sleep towards such slots would otherwise tell
// Redis of them only when they run, while the rest of the fleet, back on
// Redis, fills the windows they fall in. It probes on the breaker's
// schedule, and ends once Redis decides again or the limiter is closed.
func (l *Limiter) watchForRedis() {
	for l.onFallback() && !l.closed.Load() {
		time.Sleep(l.failover.brk.nextProbe())
		pass := l.failover.brk.allow()
		if !pass.ok || !l.onFallback() {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), l.s.redisTimeout)
		err := l.awaitHandBack(ctx)
		cancel()
		switch {
		case err == nil:
			l.redisAnswered()
			return
		case errors.Is(err, errHandBackBusy):
			// The fallback outran the hand-back, but Redis answered: the
			// next probe tries again.
		default:
			l.failover.brk.failure()
		}
	}
}

// handing is a hand-back on its way to Redis: its callers wait for it, or
// leave it when their contexts end, and it goes on without them.
type handing struct {
	done chan struct{}
	err  error
}

// errHandBackBusy is a hand-back that the fallback outran three times: it
// admitted calls while each try was on its way. The call is decided by the
// fallback, and the next one tries again.
var errHandBackBusy = errors.New("throttle: the Local fallback admitted calls while its calls were handed back to Redis")

// awaitHandBack hands the fallback's calls back to Redis, or joins the
// hand-back already on its way, and waits for it no longer than ctx allows.
// When it succeeds, Redis decides again. A call the fallback admitted while
// a try was on its way is handed back by the next try, with the others
// again, which counts them twice in Redis for a window rather than never.
func (l *Limiter) awaitHandBack(ctx context.Context) error {
	lo := l.failover.local
	lo.mu.Lock()
	h := lo.handing
	if h == nil {
		h = &handing{done: make(chan struct{})}
		lo.handing = h
		l.work.start(func() {
			h.err = errHandBackBusy
			for try := 0; try < 3 && errors.Is(h.err, errHandBackBusy); try++ {
				var complete bool
				if complete, h.err = l.handBack(); h.err == nil && !complete {
					h.err = errHandBackBusy
				}
			}
			lo.mu.Lock()
			lo.handing = nil
			lo.mu.Unlock()
			close(h.done)
		})
	}
	lo.mu.Unlock()
	select {
	case <-h.done:
		return h.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// handBack tells Redis, back from a failure, of the calls the Local
// fallback admitted that still count in a window, at their own times, so
// that the fleet deciding in Redis again does not admit them a second time;
// and reserves the quota for the replicas that may still decide without
// Redis: until their probes have found it and their calls have left the
// windows, Redis admits only the share none of them takes. It reports
// whether the fallback admitted nothing while it ran.
func (l *Limiter) handBack() (complete bool, err error) {
	ctx := context.Background()
	charges, gen := l.failover.local.charges()
	if isOff(offHandBack) {
		charges = nil
	}
	byScope := map[string][]charge{}
	scopes := map[string]scope{"": l.scopeFor(call{})}
	for _, c := range charges {
		byScope[c.scope.id] = append(byScope[c.scope.id], c)
		scopes[c.scope.id] = c.scope
	}
	var span time.Duration
	for _, r := range l.cfg.rules {
		span = max(span, r.Window, time.Duration(r.Limit)*r.Every, r.Lease)
	}
	span += probeLongest
	if _, ok := byScope[""]; !ok {
		byScope[""] = nil
	}
	for id, cs := range byScope {
		args := l.handBackArgs(l.s.replicas, span, len(cs))
		for _, c := range cs {
			// Placed no earlier than they happened, or were booked for, as
			// Redis's clock goes: late units stay in the windows a little
			// longer, never shorter. When this process no longer knows
			// Redis's clock, as far from Redis's now as from this
			// process's, and no earlier than now (see handback.lua).
			at := -max(time.Until(c.at), 0)
			if t, ok := l.timing.redisAt(c.at); ok {
				at = t
			}
			args = append(args, c.rule+1, at.Microseconds(), c.units, l.newMember())
		}
		if err := l.run(ctx, scripts.handback, scopes[id], args).Err(); err != nil {
			return false, l.unavailable(err)
		}
	}
	return l.failover.local.handedBack(gen), nil
}

// moveEarlier asks Redis to move the booking r of call c to the earliest
// slot that fits, moveGain earlier than its own at least (see move). It
// returns r, unasked, when the call is too close to its slot to ask: the
// move's reply comes a round trip from now, and a slot the script finds
// at its own now starts the call then; a move asked later than that gains
// nothing, and one that finds nothing earlier makes the call late for its
// own slot. The wait runs from the script's now, a one-way delay ahead.
func (l *Limiter) moveEarlier(ctx context.Context, c call, r result) (result, woken, error) {
	in, ok := l.timing.wakeIn(r.startsAt())
	maxWait := in - 2*l.timing.delay() - moveGain
	if !ok || maxWait <= 0 {
		return r, wokenAtSlot, nil
	}
	return l.move(ctx, c, r, maxWait)
}

// keepPlace asks Redis whether call c, woken at the slot of its booking r
// after a limit in force dropped, still fits there: a move that may find
// nothing earlier, and keeps the slot only if the call's units still fit
// every window that ends at it (fits_behind in lua/acquire.lua). The calls
// at the front of the queue keep their places, and those the lower limit
// leaves no room for book again, behind. It returns the booking kept, or,
// with wokenOvertaken or wokenLost, none: the call books again.
func (l *Limiter) keepPlace(ctx context.Context, c call, r result) (result, woken, error) {
	if !l.keepsChecked() {
		return r, wokenOvertaken, nil
	}
	kept, how, err := l.move(ctx, c, r, 0)
	if err == nil && how == wokenAtSlot && kept.slot() <= r.slot() {
		// Not asked (Redis is in trouble, or decided without), or kept
		// unchecked: it books again, as any call overtaken.
		if kept.again = l.overtakenBy(kept); kept.again != "" {
			return kept, wokenOvertaken, nil
		}
	}
	return kept, how, err
}

// keepAhead returns how long before the slot of r its call looks whether
// a limit in force dropped since r was decided, to ask then whether it
// keeps its place (keepPlace): two round trips to Redis, one for the
// lane's script call ahead of it, so that the answer comes before the
// slot. Asked at the slot, a place kept has passed by a round trip when
// the answer comes: on a Redis farther than half the margin, every call
// booked ahead before a drop was then too late for its place, and booked
// again, and again (seed 756327). While the process has no reading of its
// delay (its first replies), the call looks half way. 0 when the call
// keeps no place, or its slot is nearer than that; a drop heard later is
// seen at the slot (awaitSlot).
func (l *Limiter) keepAhead(r result) time.Duration {
	if r.local || !l.keepsChecked() {
		return 0
	}
	left := r.left()
	d := l.timing.delay()
	if d < 0 {
		if left > 2*keepUnknown {
			return left / 2
		}
		return 0
	}
	if ahead := 4*d + moveGain; left > ahead {
		return ahead
	}
	return 0
}

// keepUnknown is how near its slot a call whose process has no reading of
// its delay looks no more, ahead of it, whether a drop overtook it
// (keepAhead).
const keepUnknown = 50 * time.Millisecond

// keepsChecked reports whether the script checks a slot a move keeps
// against the limits in force (moves.fits_behind): not a token bucket's,
// whose one time holds the bookings after the slot too.
func (l *Limiter) keepsChecked() bool {
	return !l.cfg.hasBucket && !isOff(offKeepPlace)
}

// move asks Redis to move the booking r of call c to the earliest slot
// that fits within maxWait. It returns the booking the call then holds: r
// when Redis cannot be asked now (the breaker is open, calls are decided
// without Redis); the moved or kept booking; or, with wokenLost, nothing:
// the script kept nothing (r was of a lost epoch, or no longer fits at its
// slot under a limit lowered since: either way nothing of it is left to
// give back), or Redis failed the script call, which may or may not have
// given r back. The error is the caller's context's, or a *moveFailed
// when Redis could not be reached: the move was the call's script call.
func (l *Limiter) move(ctx context.Context, c call, r result, maxWait time.Duration) (result, woken, error) {
	if l.troubled() {
		l.room.afterTrouble(time.Unix(0, l.batches.lastFailure.Load()))
		return r, wokenAtSlot, nil
	}
	pass := l.failover.brk.allow()
	if !pass.ok || pass.probe || l.onFallback() {
		l.failover.brk.abort(pass)
		return r, wokenAtSlot, nil
	}
	c.moves = true
	asked := time.Now()
	moved, err := l.decideInRedis(ctx, r.scope, c, maxWait, &r, false)
	switch {
	case errors.Is(err, errOutrun):
		// Not sent: r is held as it was.
		l.failover.brk.abort(pass)
		return r, wokenAtSlot, nil
	case err != nil && ctx.Err() != nil:
		// The script call goes on; what it booked is given back (abandon).
		l.failover.brk.abort(pass)
		return r, wokenAtSlot, ctx.Err()
	case err != nil && (!errors.Is(err, ErrUnavailable) || refusedByConfiguration(err)):
		l.failover.brk.abort(pass)
		return r, wokenLost, nil
	case err != nil:
		// The booking may be gone. The call asks again within what is
		// left of the move's Redis timeout: a failed move tells the
		// breaker nothing (a killed connection fails every move at once),
		// but a hung Redis must not hold the call for a second timeout.
		l.failover.brk.abort(pass)
		return r, wokenLost, &moveFailed{err: err, by: asked.Add(l.s.redisTimeout)}
	}
	l.redisAnswered()
	if !moved.admitted {
		r.again = cmp.Or(l.overtakenBy(r), againLowered)
		return r, wokenLost, nil
	}
	kept := l.keptAsBooked(r, moved)
	if kept.again = afterMove(moved); kept.again == againLate && kept.done <= kept.slot() {
		kept.again = "" // kept at a slot that passed, checked: its lateness counts from the slot
	}
	if kept.again != "" {
		return kept, wokenOvertaken, nil
	}
	return kept, wokenAtSlot, nil
}

// keptAsBooked returns the booking a move gave a call that was booked as
// r. A move that found nothing earlier keeps r's slot: the script gave the
// booking back and took the same slot again if the call still fits there
// (fits_behind in lua/acquire.lua), under the limits in force now. Such a
// booking keeps r's news gaps and margin, so that overtaken still sees a
// gap in the news since r, and the lateness it is held to is r's. It is
// decided at the move's time, so that a limit lowered before the move no
// longer overtakes it; but not when a token bucket's slot was kept
// unchecked, or the scope is paused past the slot: then it keeps r's time
// too, and books again when it wakes.
func (l *Limiter) keptAsBooked(r, moved result) result {
	if moved.slot() != r.slot() {
		return moved
	}
	if !l.keepsChecked() || moved.pause > moved.slot() {
		moved.now, moved.wait, moved.answered = r.now, r.wait, r.answered
	} else if moved.wait < 0 {
		// Kept at a slot that passed while the call waited for the script:
		// it starts as late as that, which its lateness must show (late
		// counts from the script's end otherwise; see startsAt).
		moved.done = moved.slot()
	}
	moved.gaps, moved.margin = r.gaps, r.margin
	moved.stale = moved.stale || r.stale
	return moved
}

// settleTaken gives back, in one settle script call, what the booking
// taken holds beyond the units of r, the late booking that takes it, and
// makes taken r's units. When Redis fails the script call, the rest may
// stay booked until its window passes: the call never gives back more
// than its own units, which is all Redis holds if the script ran.
func (l *Limiter) settleTaken(ctx context.Context, r result, taken *result) {
	if taken.cost == r.cost && maps.Equal(taken.named, r.named) {
		return
	}
	args := l.settleArgs(*taken, l.costArg(taken.cost, taken.named), l.costArg(r.cost, r.named))
	_ = l.runBooking(ctx, scripts.settle, *taken, args).Err()
	taken.cost, taken.named = r.cost, r.named
}
