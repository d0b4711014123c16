package throttle

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"
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
	minGuardedMargin = 2 * time.Millisecond
)

// wait is Block mode: book the earliest slot the call fits in, within the
// context's deadline and MaxWait, and sleep until it. One script call admits
// the call; a waiter never polls, except for a concurrency slot, whose
// release no one can foresee.
func (l *Limiter) wait(ctx context.Context, c call) (*Permit, error) {
	start := time.Now()
	busy := busyFirst
	for {
		maxWait := l.s.maxWait - time.Since(start)
		if deadline, ok := ctx.Deadline(); ok {
			maxWait = min(maxWait, time.Until(deadline))
		}
		r, err := l.acquire(ctx, c, max(maxWait, 0))
		if err != nil {
			return nil, err
		}
		if !r.admitted {
			if r.reason == reasonBusy && maxWait > busy {
				if err := l.sleepBusy(ctx, busy, r.wait); err != nil {
					return nil, err
				}
				busy = min(2*busy, busyMax)
				continue
			}
			return nil, l.limited(r.wait)
		}
		if !r.local {
			l.skew.observe(r.now, r.sent)
		}
		if r.wait <= 0 {
			if l.tooLate(r) {
				l.cancel(ctx, c, r)
				continue
			}
			return l.permit(c, r, time.Since(start)), nil
		}
		// The script counted the wait from its own clock; the reply took some
		// of it to arrive, so sleeping the whole wait from here never wakes
		// early.
		if deadline, ok := ctx.Deadline(); ok && time.Now().Add(r.wait).After(deadline) {
			l.cancel(ctx, c, r)
			return nil, l.limited(r.wait)
		}
		if err := sleep(ctx, r.wait); err != nil {
			l.cancel(ctx, c, r)
			return nil, err
		}
		// A vendor may have asked the fleet to pause while this call slept,
		// the process may have been starved past the slot, or Redis may have
		// lost the booking with the rest of the quota's data. Calling then
		// would crowd the windows after the slot, so the call gives its slot
		// back and books again.
		if !r.local && (l.pausedFor(r.scope) > 0 || l.tooLate(r) || l.epoch.Load() != r.epoch) {
			l.cancel(ctx, c, r)
			continue
		}
		return l.permit(c, r, time.Since(start)), nil
	}
}

// tooLate reports whether a call would now start later after its slot than
// the margin allows.
func (l *Limiter) tooLate(r result) bool {
	if l.late <= 0 || r.local {
		return false
	}
	late, ok := l.skew.lateness(r.slot(), time.Now())
	return ok && late > l.late
}

// skew estimates how far Redis's clock runs ahead of this process's, so that
// a call can tell how late after its slot it starts, whatever the clocks of
// the machines say. The script ran at Redis time now, after the call was sent
// at local time asked: so the offset is at most now - asked. The least such
// bound over recent calls is close to the true offset; a call's lateness is
// then at most its local start minus its slot, plus that bound. Bounds are
// kept for two periods, so that a clock that steps is forgotten soon.
type skew struct {
	mu       sync.Mutex
	cur      time.Duration // least bound in the current period
	prev     time.Duration // least bound in the previous period
	curSet   bool
	prevSet  bool
	periodAt time.Time
}

const skewPeriod = 10 * time.Second

func (k *skew) observe(redisNow time.Duration, asked time.Time) {
	bound := redisNow - time.Duration(asked.UnixMicro())*time.Microsecond
	k.mu.Lock()
	defer k.mu.Unlock()
	if asked.Sub(k.periodAt) > skewPeriod {
		k.prev, k.prevSet = k.cur, k.curSet
		k.curSet, k.periodAt = false, asked
	}
	if !k.curSet || bound < k.cur {
		k.cur, k.curSet = bound, true
	}
}

// lateness returns an upper bound of how long after the Redis time slot the
// local time at lies, and false before any observation.
func (k *skew) lateness(slot time.Duration, at time.Time) (time.Duration, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.curSet {
		return 0, false
	}
	bound := k.cur
	if k.prevSet && k.prev < bound {
		bound = k.prev
	}
	return time.Duration(at.UnixMicro())*time.Microsecond - slot + bound, true
}

// sleepBusy waits before a call retries a full concurrency rule: d with
// jitter, no longer than until the first lease runs out, and no longer than
// until a call of this process releases its slot.
func (l *Limiter) sleepBusy(ctx context.Context, d, leaseEnds time.Duration) error {
	d = d/2 + rand.N(d/2+1)
	if leaseEnds > 0 {
		d = min(d, leaseEnds)
	}
	l.freedMu.Lock()
	freed := l.freed
	l.freedMu.Unlock()
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
// slot.
func (l *Limiter) signalFreed() {
	l.freedMu.Lock()
	close(l.freed)
	l.freed = make(chan struct{})
	l.freedMu.Unlock()
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
