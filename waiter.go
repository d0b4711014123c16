package throttle

import (
	"cmp"
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
)

const (
	// cleanupTimeout bounds giving a booking or a slot back after the
	// caller's context ended.
	cleanupTimeout = time.Second
	// A call that finds every concurrency slot taken retries after a pause
	// that grows from busyFirst to busyMax, with jitter so that waiters across
	// the fleet do not retry in step.
	busyFirst = 5 * time.Millisecond
	busyMax   = 250 * time.Millisecond
	// minGuardedMargin is the smallest Margin under which a call that starts
	// late books again (see policies.SlidingLog.Margin).
	minGuardedMargin = protocol.GuardedMargin
)

// maxRebooks bounds how many times a call books again because it would
// start too late in its slot; past it the call fails with ErrLimited.
const maxRebooks = 3

// lateReason is the LimitedError.Reason of a call that failed for that.
const lateReason = "every slot came too late to start in: Redis's replies or this process are slower than the margin allows"

// wait is Block mode: book the earliest slot the call fits in, within the
// context's deadline and MaxWait, and sleep until it. One script call admits
// the call; a waiter never polls, except for a concurrency slot, whose
// release no one can foresee.
func (l *Limiter) wait(ctx context.Context, c call) (*Permit, error) {
	start, busy := time.Now(), busyFirst
	// A booking to give back in the next script call; one taken from a
	// call that asked after this one (keepTurn), to sleep to without asking.
	giveBack, taken, rebooks := (*result)(nil), (*result)(nil), 0
	for {
		maxWait, reason := l.waitLeft(ctx, start)
		room := l.room.now()
		r, err := l.nextBooking(ctx, c, max(maxWait, 0), giveBack, &taken)
		// Spent once it asked: the booking given back, the queue's wait, a failed move.
		giveBack, c.queued, c.moved = nil, time.Time{}, nil
		if err != nil {
			return nil, err
		}
		if !r.admitted {
			if busy, err = l.notAdmitted(ctx, r, maxWait, busy, reason); err != nil {
				return nil, err
			}
			continue
		}
		if r.stale {
			giveBack = &r
			l.emitAgain(c, againClock, start)
			continue
		}
		// A reply that came back later after the slot than the margin
		// allows (a busy Redis answers a burst of calls at once, a busy
		// process reads them late) is too late before the call sleeps.
		late, tooLate := l.late(r)
		replyLate := tooLate
		if !tooLate && r.wait > 0 {
			var how woken
			r, how, err = l.awaitSlot(ctx, c, r, room, start)
			if failed := (*moveFailed)(nil); errors.As(err, &failed) {
				c.moved = failed
				l.emitAgain(c, againRedis, start)
				continue
			}
			if err != nil {
				return nil, err
			}
			if how != wokenAtSlot {
				if how == wokenOvertaken {
					giveBack = &r
				}
				l.emitAgain(c, cmp.Or(r.again, againRedis), start) // lost: Redis failed the move
				continue
			}
			late, tooLate = l.late(r)
		}
		if tooLate {
			if giveBack, taken, err = l.bookLate(ctx, &c, r, late, replyLate, &rebooks, start); err != nil {
				return nil, err
			}
			l.emitAgain(c, againLate, start)
			continue
		}
		if err := l.endedAtSlot(ctx, c, r); err != nil {
			return nil, err
		}
		return l.permit(c, r, time.Since(start)), nil
	}
}

// endedAtSlot gives back the slot of call c, admitted as r, when its
// context ended as it woke: the call cannot leave, and its units would
// hold a slot that no call uses. A slot just before the deadline wakes its
// call after it as often as not (a timer fires late, Redis's reply was
// slow), and each such call wasted its slot where the next booked could
// have moved into it.
func (l *Limiter) endedAtSlot(ctx context.Context, c call, r result) error {
	err := ctx.Err()
	if err == nil || isOff(offDeadlineGuard) {
		return nil
	}
	l.cancel(ctx, c, r)
	return err
}

// emitAgain reports that call c, waiting since start, books again, and
// why (EventBookedAgain).
func (l *Limiter) emitAgain(c call, why string, start time.Time) {
	l.emit(Event{Kind: EventBookedAgain, Cost: c.cost, Reason: why, Wait: time.Since(start)})
}

// bookLate readies call c, which began to wait at start and whose reply or
// wake came too late for its slot r, to book again: arriving now would
// crowd the windows after the slot. It books again a bounded number of
// times (rebooks counts them); past them, it gives r back and returns the
// error the call fails with. A late reply books that much ahead, so that
// the next reply arrives before its slot and the call waits instead of
// starting late. The lateness is noted either way, and the fleet's margin
// widens if its calls keep starting late: what delays the replies of a
// busy process delays its way to the vendor too. It returns r, to give
// back in the next script call, or the booking of a call that asked after
// c, when c takes it (keepTurn): then that call gives r back.
func (l *Limiter) bookLate(ctx context.Context, c *call, r result, late time.Duration, replyLate bool, rebooks *int, start time.Time) (giveBack, taken *result, err error) {
	if *rebooks++; *rebooks > maxRebooks {
		l.cancel(ctx, *c, r)
		return nil, nil, l.limited(late, lateReason)
	}
	if replyLate && !isOff(offLeads) {
		c.lead += max(late, 0) // none when only the timing is unsure
	}
	if taken = l.keepTurn(ctx, *c, r, start); taken != nil {
		return nil, taken, nil
	}
	return &r, nil, nil
}

// nextBooking returns the booking *taken, when call c took one, and else
// asks Redis for c's slot within maxWait, giving giveBack back (acquire).
func (l *Limiter) nextBooking(ctx context.Context, c call, maxWait time.Duration, giveBack *result, taken **result) (result, error) {
	if r := *taken; r != nil {
		*taken = nil
		return *r, nil
	}
	return l.acquire(ctx, c, maxWait, giveBack)
}

// waitLeft returns how long a call of Block mode that started waiting at
// start may still wait for its slot, and the reason to give when its slot
// lies beyond: what is left of MaxWait, or until the context's deadline,
// when sooner.
func (l *Limiter) waitLeft(ctx context.Context, start time.Time) (time.Duration, string) {
	maxWait := l.s.maxWait - time.Since(start)
	reason := "the slot lies beyond MaxWait " + l.s.maxWait.String()
	if untilDeadline, ok := l.untilDeadline(ctx); ok && (untilDeadline < maxWait || !l.s.maxWaitSet) {
		// Without Options.MaxWait, the deadline alone bounds the wait.
		maxWait = untilDeadline
		reason = "the slot lies beyond the context's deadline"
	}
	return maxWait, reason
}

// untilDeadline returns how long from now a call may still be given a
// slot before ctx's deadline, and false when ctx has none: until the
// deadline, less half the smallest guarded margin. A call may start that
// late in its slot (see late), and one given a slot closer to its deadline
// wakes after it as often as not, its slot then used by no call.
func (l *Limiter) untilDeadline(ctx context.Context) (time.Duration, bool) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return 0, false
	}
	if isOff(offDeadlineGuard) {
		return time.Until(deadline), true
	}
	return time.Until(deadline) - l.cfg.guardMin/2, true
}

// notAdmitted handles the call r that got no slot. When a full concurrency
// rule refused it and it may wait longer than busy, it sleeps about busy
// (see sleepBusy) and returns the longer pause for the next time it finds
// the rule full; when it is larger than the share a replica may take while
// replicas may decide without Redis, it sleeps until it may ask again, if
// it may wait that long; otherwise it fails with the reason: why its slot
// lies beyond its wait, or what refused it.
func (l *Limiter) notAdmitted(ctx context.Context, r result, maxWait, busy time.Duration, reason string) (time.Duration, error) {
	switch r.reason {
	case reasonShare:
		if maxWait < r.wait {
			return busy, l.limited(r.wait, shareReason)
		}
		return busy, sleep(ctx, r.wait)
	case reasonBusy:
	default:
		if r.pausedBy != "" {
			return busy, l.pausedError(r, reason+" while the quota is paused")
		}
		return busy, l.limited(r.wait, reason)
	}
	if maxWait <= busy {
		return busy, l.busyError(r)
	}
	if err := l.sleepBusy(ctx, busy, r.wait); err != nil {
		return busy, err
	}
	return min(2*busy, busyMax), nil
}

// awaitSlot sleeps until the slot of the booked call r, which began to
// wait at start, moving it earlier each time the fleet gives units back
// (move.go) after room, taken before r was booked, and returns the booking
// it woke with and how: at its slot, overtaken meanwhile (to be given
// back: a late call that asked before it may have taken its own, see
// keepTurn), or lost. It gives the booking back and fails when the slot
// lies beyond the context's deadline, or the context ends first.
func (l *Limiter) awaitSlot(ctx context.Context, c call, r result, room <-chan struct{}, start time.Time) (result, woken, error) {
	looked := false // whether the call looked, ahead of its slot, if a drop overtook it
	for {
		left := r.left() // from now, though a move kept the wait r was booked with
		if untilDeadline, ok := l.untilDeadline(ctx); ok && left > 0 && untilDeadline < left {
			l.cancel(ctx, c, r)
			return r, wokenAtSlot, l.limited(left, "the slot lies beyond the context's deadline")
		}
		var ahead time.Duration
		if !looked {
			ahead = l.keepAhead(r)
		}
		s := l.asleep(r, start)
		err := l.sleepToSlot(ctx, r, l.roomFor(r, room), s.wake(), ahead)
		if late := l.awake(s); late != nil {
			return l.yield(ctx, *late)
		}
		if errors.Is(err, errLook) {
			// A drop overtook the booking: it asks now, a round trip and a
			// lane's wait before its slot, whether it keeps its place.
			looked = true
			var how woken
			if r, how, err = l.keepPlace(ctx, c, r); err != nil || how != wokenAtSlot {
				return r, how, err
			}
			continue
		}
		if errors.Is(err, errRoom) {
			var how woken
			room = l.room.now() // before the move's script call
			if !l.room.since(r.now) {
				continue // units given back before r was decided: its script saw them
			}
			if r, how, err = l.moveEarlier(ctx, c, r); err != nil || how != wokenAtSlot {
				return r, how, err
			}
			continue
		}
		if err != nil {
			l.cancel(ctx, c, r)
			return r, wokenAtSlot, err
		}
		// A vendor may have asked the fleet to pause while this call
		// slept, or Redis may have lost the booking with the rest of the
		// quota's data. Calling then would crowd the windows after the
		// slot, so the call gives its slot back and books again.
		if r.local {
			if l.failover.local != nil && !l.failover.local.claim(r) {
				r.again = againOutdated
				return r, wokenOvertaken, nil
			}
			return r, wokenAtSlot, nil
		}
		if r.again = l.overtakenBy(r); r.again == againLowered {
			return l.keepPlace(ctx, c, r)
		} else if r.again != "" {
			return r, wokenOvertaken, nil
		}
		return r, wokenAtSlot, nil
	}
}

// wakeLead is how long before its slot a sleeping call looks at the
// process's fastest reply again (see sleepToSlot).
const wakeLead = 100 * time.Millisecond

// sleepToSlot sleeps until the slot of the booked call r. The call wakes at
// its slot by the clock of the fastest reply seen (see timing.wakeIn): not
// before the slot by Redis's clock (but for the two clocks' drift since that
// reply, under a millisecond), and not as late as r's reply was. Sleeping
// the whole wait from the reply's arrival would start the call as much
// after its slot as the reply was slow, every call of a busy Redis's long
// turn late by its place in the turn. A long sleep looks again shortly
// before the slot (half the way, wakeLead at most): a process's first
// replies, a burst's held up in Redis's long turns, are slower than those
// that come while its first calls sleep, and a call that woke by them would
// start late against what the process then knows, and book again. Without
// a reading, or decided by the Local fallback, it sleeps the whole wait,
// which never wakes early either. When ahead is over 0, the look comes
// that long before the slot at the latest, and returns errLook when a drop
// overtook the booking meanwhile (see keepAhead): the one timer looks for
// both. It returns errRoom when room closes first (see roomFor), and at
// once when taken closes (see keepTurn).
func (l *Limiter) sleepToSlot(ctx context.Context, r result, room, taken <-chan struct{}, ahead time.Duration) error {
	d := r.left()
	if r.local {
		if l.failover.local == nil {
			return sleep(ctx, d)
		}
		return l.failover.local.asleep(ctx, d, r.turn)
	}
	l.view.asleep.Add(1)
	defer l.view.asleep.Add(-1)
	in, byClock := l.timing.wakeIn(r.startsAt())
	byClock = byClock && !isOff(offSleepToSlot)
	var lead time.Duration
	if byClock {
		d = min(d, in)
		lead = min(d/2, wakeLead)
	}
	if lead = max(lead, min(ahead, d)); lead > 0 {
		if err := sleepOr(ctx, d-lead, room, taken); err != nil {
			return err
		}
		if ahead > 0 && l.overtakenBy(r) == againLowered {
			return errLook
		}
		d = lead
		if in, ok := l.timing.wakeIn(r.startsAt()); ok && byClock {
			d = min(d, in)
		}
	}
	return sleepOr(ctx, d, room, taken)
}

// errLook is what sleepToSlot returns when it looked, ahead of the slot,
// and a limit in force had dropped since the booking (see keepAhead).
var errLook = errors.New("throttle: a limit in force dropped")

// now decides a call that runs now or not at all (FailFast, Allow, shadow
// mode), with the same late-start guard as Block mode: an admission that
// arrives too late to start in is given back and asked again, a bounded
// number of times, and then refused with reasonLate. As in Block mode
// (bookLate), a reply that came late asks that much ahead: the call sleeps
// the few milliseconds to its slot and starts on time, where a busy
// process would read each reply of "now" too late. It is admitted only if
// it fits then; it never waits for the quota.
func (l *Limiter) now(ctx context.Context, c call) (result, error) {
	var giveBack *result
	for tries := 0; ; tries++ {
		r, err := l.acquire(ctx, c, c.lead, giveBack)
		if err != nil || !r.admitted {
			return r, err
		}
		giveBack = &r
		if r.stale {
			if tries < maxRebooks {
				continue
			}
			// Each reply came from a clock that had stepped: none is sure.
			l.cancel(ctx, c, r)
			return result{reason: reasonLate, remaining: 0}, nil
		}
		late, tooLate := l.late(r)
		replyLate := tooLate
		if !tooLate && r.wait > 0 {
			// Booked ahead after a late reply: sleep to the slot. A pause
			// or a loss meanwhile books again, as a Block call's does.
			if err := l.sleepToSlot(ctx, r, nil, nil, 0); err != nil {
				l.cancel(ctx, c, r)
				return result{}, err
			}
			if l.outdated(r) {
				if tries < 2*maxRebooks {
					continue // the next script refuses while paused
				}
				l.cancel(ctx, c, r)
				// late was read before the sleep, while the slot lay ahead.
				return result{reason: reasonLate, wait: max(late, 0), remaining: 0}, nil
			}
			late, tooLate = l.late(r)
		}
		if !tooLate {
			return r, nil
		}
		if tries >= maxRebooks {
			l.cancel(ctx, c, r)
			return result{reason: reasonLate, wait: late, remaining: 0}, nil
		}
		if replyLate && !isOff(offLeads) {
			c.lead += max(late, 0)
		}
	}
}

// outdated reports whether the booking r, woken at its slot, must book
// again: the vendor asked the fleet to pause, Redis lost the booking, or
// the Local fallback's turn that decided it has ended (see awaitSlot).
func (l *Limiter) outdated(r result) bool {
	if r.local {
		return l.failover.local != nil && !l.failover.local.claim(r)
	}
	return l.overtakenBy(r) != ""
}

// late returns how late after its slot the call r would start now, beyond
// the usual delay of Redis's replies, and whether that is more than half the
// margin in force when it was booked, which is as late as a call may start:
// the calls booked after it keep that margin from it, and the script never
// narrows the margin while such calls are ahead. A call that is too late is
// noted for the spread the margin follows. A call the Local fallback decided
// is as late as this process's clock says, against the configured margin.
func (l *Limiter) late(r result) (time.Duration, bool) {
	m := r.margin
	if m < minGuardedMargin || isOff(offGuard) {
		return 0, false // no guard, or FailOpen
	}
	late, ok := l.timing.lateness(r.startsAt())
	unsure := l.timing.unsure()
	if r.local {
		// Decided by the Local fallback, by this process's clock.
		late, ok, unsure = time.Duration(time.Now().UnixNano())-r.startsAt(), true, 0
	}
	if !ok || late+unsure <= m/2 {
		return late, false
	}
	l.lates.note(late)
	return late, true
}

// Start tells the limiter that the call leaves for the vendor now. How late
// after its slot each call starts, beyond the usual delay of Redis's
// replies, is what the fleet's margin follows (see
// policies.SlidingLog.Margin): a call that arrives late at the vendor
// crowds the windows after its slot. Do and Go call Start right before fn,
// and the Transport each time its base has written the request (after any
// wait for a connection, dial or TLS handshake; again when it sends the
// request anew on another connection). A caller of Acquire whose call
// waits further before it leaves (for a connection of its own pool, a
// worker) calls Start then; without it, the call counts as starting when
// Acquire returned. The last Start before Release counts, and Release
// notes it; after Release or Cancel, Start does nothing.
func (p *Permit) Start() {
	if p = p.target(); p == nil || p.l == nil || p.released.Load() {
		return
	}
	p.markStart()
}

// markStart keeps how late after its slot the call would start now, for
// Release to note, when that is known.
func (p *Permit) markStart() {
	if late, ok := p.lateness(); ok {
		p.late.Store(int64(late))
	}
}

// startedLate returns how late after its slot the call started, as its
// last Start saw it, or 0 when that is not known.
func (p *Permit) startedLate() time.Duration {
	if late := p.late.Load(); late != noLate && late > 0 {
		return time.Duration(late)
	}
	return 0
}

// answeredLate returns how long after its slot the call's answer came,
// read when the answer is heard: as late as the vendor may have taken the
// counts it sent. It is never less than how late the call started.
func (p *Permit) answeredLate() time.Duration {
	late := p.startedLate()
	if now, ok := p.lateness(); ok && now > late {
		late = now
	}
	return late
}

// lateness returns how late after its slot the call would start now, and
// false when that is not known or not the fleet's: a call decided without
// Redis, or not admitted.
func (p *Permit) lateness() (time.Duration, bool) {
	if p.r.local || !p.r.admitted {
		return 0, false
	}
	return p.l.timing.lateness(p.r.startsAt())
}

// sleepBusy waits before a call retries a full concurrency rule: d with
// jitter, no longer than until the first lease runs out, and no longer than
// until a call of this process releases its slot.
func (l *Limiter) sleepBusy(ctx context.Context, d, leaseEnds time.Duration) error {
	d = d/2 + rand.N(d/2+1)
	if leaseEnds > 0 {
		d = min(d, leaseEnds)
	}
	freed := l.freed.wait()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-freed:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// signalFreed wakes every call of this process waiting for a concurrency
// slot of the limiter, or of any limiter of its group.
func (l *Limiter) signalFreed() { l.freed.signal() }

// broadcast wakes everyone waiting on it at once, without a lock: signal
// closes the channel that wait returned and puts a new one in its place.
// Its zero value is ready.
type broadcast struct{ ch atomic.Pointer[chan struct{}] }

// wait returns the channel the next signal closes.
func (b *broadcast) wait() <-chan struct{} {
	if p := b.ch.Load(); p != nil {
		return *p
	}
	ch := make(chan struct{})
	if b.ch.CompareAndSwap(nil, &ch) {
		return ch
	}
	return *b.ch.Load()
}

// signal wakes everyone waiting.
func (b *broadcast) signal() {
	ch := make(chan struct{})
	if old := b.ch.Swap(&ch); old != nil {
		close(*old)
	}
}

// freed signals a concurrency slot freed in this process.
type freed struct {
	broadcast
	users int // limiters of its group; guarded by groups.mu
}

// groups holds the freed signal of each group of quotas that share rules
// (policies.Shared) on one Redis client under one prefix: a slot one quota
// frees may be the one another quota's calls wait for. A group of the same
// name on another client is another fleet's, and another test's: its
// signal must not wake these calls, nor outlive them (the last limiter of
// a group to close removes it).
var groups = struct {
	mu sync.Mutex
	m  map[groupKey]*freed
}{m: map[groupKey]*freed{}}

// groupKey names a group of quotas that share rules.
type groupKey struct {
	rdb    redis.UniversalClient
	prefix string
	group  string
}

// freedFor returns the signal of the limiter's group, or a signal of its
// own when it has none.
func (l *Limiter) freedFor() *freed {
	if l.cfg.group == "" {
		return &freed{}
	}
	key := groupKey{l.rdb, l.s.keyPrefix(), l.cfg.group}
	groups.mu.Lock()
	defer groups.mu.Unlock()
	f := groups.m[key]
	if f == nil {
		f = &freed{}
		groups.m[key] = f
	}
	f.users++
	return f
}

// leaveGroup forgets the limiter's group signal once no limiter uses it.
func (l *Limiter) leaveGroup() {
	if l.cfg.group == "" {
		return
	}
	key := groupKey{l.rdb, l.s.keyPrefix(), l.cfg.group}
	groups.mu.Lock()
	defer groups.mu.Unlock()
	if f := groups.m[key]; f == l.freed {
		if f.users--; f.users == 0 {
			delete(groups.m, key)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error { return sleepOr(ctx, d, nil, nil) }

// sleepOr sleeps d, and returns errRoom when room closes first; it
// returns at once, with no error, when taken closes first.
func sleepOr(ctx context.Context, d time.Duration, room, taken <-chan struct{}) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-taken:
		return nil
	case <-room:
		return errRoom
	case <-ctx.Done():
		return ctx.Err()
	}
}

// keepTurn finds, for call c that began to wait at start and whose booking
// r came too late to start in, the booking of a call of this limiter that
// began to wait after it, asleep towards the earliest slot far enough
// ahead (c's lead) and within c's wait, that r's call may take (takes). It
// hands that call r to give back, and returns the booking taken, settled
// to r's units when it held more; nil when there is none.
func (l *Limiter) keepTurn(ctx context.Context, c call, r result, start time.Time) *result {
	if r.local {
		return nil // with keep_turn off, asleep registers no sleeper either
	}
	maxWait, _ := l.waitLeft(ctx, start)
	var best *sleeper
	l.sleepers.Range(func(k, _ any) bool {
		s := k.(*sleeper)
		left := s.r.left()
		if s.start.After(start) && left > c.lead && left <= maxWait && l.takes(r, s.r) && (best == nil || s.before(best)) {
			best = s
		}
		return true
	})
	if best == nil {
		return nil
	}
	if _, ok := l.sleepers.LoadAndDelete(best); !ok {
		return nil // it woke meanwhile, or another late call took it
	}
	best.late = r
	close(best.taken)
	taken := best.r
	l.settleTaken(ctx, r, &taken)
	return &taken
}

// yield hands a call whose booking a late call took that call's late
// booking r: it gives r back and books again (wokenOvertaken), or, when its
// context ended meanwhile, gives r back now and fails.
func (l *Limiter) yield(ctx context.Context, r result) (result, woken, error) {
	if err := ctx.Err(); err != nil {
		l.cancel(ctx, call{cost: r.cost, named: r.named}, r)
		return r, wokenAtSlot, err
	}
	r.again = againYielded
	return r, wokenOvertaken, nil
}
