package throttle

import (
	"sync/atomic"
	"time"
)

// notePause remembers, in local time, until when a scope is paused, so that
// a waiter of this process that wakes during a pause books again instead of
// calling a vendor that asked for quiet.
//
// Pauses that ended are swept now and then, so that the memory of a quota
// with many keys paused once does not only grow.
func (l *Limiter) notePause(sc scope, now, until time.Duration) {
	if until <= now {
		return
	}
	p := pauseEnd{local: time.Now().Add(until - now), until: until}
	if old, had := l.view.pauses.Load(sc.keys[1]); had && old.(pauseEnd).until >= until {
		// Each reply restates a pause it knows; the first news of it
		// stands, however long its trip took.
		return
	}
	if _, had := l.view.pauses.Swap(sc.keys[1], p); !had && l.view.pausesAdded.Add(1)%pauseSweep == 0 {
		t := time.Now()
		l.view.pauses.Range(func(k, v any) bool {
			if !v.(pauseEnd).local.After(t) {
				l.view.pauses.CompareAndDelete(k, v)
			}
			return true
		})
	}
}

// pauseEnd is the end of a pause, in local time and in Redis time.
type pauseEnd struct {
	local time.Time
	until time.Duration
}

// pauseSweep is how many pauses are noted between two sweeps of the ended
// ones.
const pauseSweep = 256

// noteEpoch remembers the quota's epoch. A new one means Redis lost the
// quota's data: calls sleeping towards slots booked before then book again,
// since the new data knows nothing of them.
func (l *Limiter) noteEpoch(epoch int64, lost bool) {
	if old := l.view.epoch.Swap(epoch); old != epoch && old != 0 {
		l.view.scripts.Store(0)
		// The new epoch's bookings were all decided after it, so a limit
		// lowered before it overtakes none of them; but a loss that Redis's
		// clock going back made has its epoch by the new clock, and a limit
		// lowered by the old one would lie ahead of every booking for the
		// length of the step: each call woken at its slot would book again,
		// an hour's step an hour long (seed 448396).
		if !isOff(offLoweredEpoch) {
			lower(&l.view.lowered, epoch)
		}
		l.s.logger.Warn("throttle: Redis lost the quota's data; every limit counts as full for one window",
			"quota", l.name, "old_epoch", old, "epoch", epoch, "detected_here", lost)
		l.emit(Event{Kind: EventDataLost})
	}
}

// noteScripts remembers the quota's count of scripts run in its epoch (a
// new one when newEpoch), so that a Redis whose count goes back (a replica
// that missed the latest writes) is found out by the script.
func (l *Limiter) noteScripts(newEpoch bool, n int64) {
	if newEpoch {
		l.view.scripts.Store(n)
		return
	}
	raise(&l.view.scripts, n)
}

// scriptsRan counts the acquire scripts of a limiter that Redis answered
// in one epoch of the quota.
type scriptsRan struct{ epoch, n int64 }

// noteRan counts an acquire script of this limiter that Redis answered in
// epoch, the first of it when the script found a loss (lost). The count
// errs low, never high: a reply of another epoch starts it again.
func (l *Limiter) noteRan(epoch int64, lost bool) {
	for {
		old := l.view.ran.Load()
		next := &scriptsRan{epoch: epoch, n: 1}
		if old != nil && old.epoch == epoch && !lost {
			next.n = old.n + 1
		}
		if l.view.ran.CompareAndSwap(old, next) {
			return
		}
	}
}

// raise stores v in a unless a holds as much already.
func raise(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// lower lowers a to v, if v is less.
func lower(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if v >= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// overtaken reports whether what this process learned since r was decided
// in Redis makes its slot unusable: a pause that ends after it; a loss of
// the quota's data (a new epoch), which took the booking with it; a limit
// in force that dropped after r was decided against it (a cap learned, a
// larger share left to other consumers of the key); or a gap in the
// quota's news, during which any of these may have gone unheard, or Redis
// failed and the fleet began to decide without it (the Local fallback,
// which counts this process's calls as it decides them).
func (l *Limiter) overtaken(r result) bool { return l.overtakenBy(r) != "" }

// overtakenBy returns why r's slot is unusable (see overtaken), as an
// EventBookedAgain's Reason says it, or "" when it is not.
func (l *Limiter) overtakenBy(r result) string {
	switch {
	case l.pausedPast(r.scope, r.slot()):
		return againPaused
	case l.view.epoch.Load() != r.epoch:
		return againLost
	case l.view.gaps.Load() != r.gaps:
		return againUnheard
	case r.now < time.Duration(l.view.lowered.Load())*time.Microsecond && !isOff(offRebookLowered):
		return againLowered
	}
	return ""
}

// noteLowered keeps the Redis time at which a limit in force dropped.
func (l *Limiter) noteLowered(at time.Duration) {
	raise(&l.view.lowered, at.Microseconds())
}

// pausedPast reports whether a pause this process knows of, not over yet,
// ends after the Redis time slot: a call booked at slot before the pause
// was known must not go ahead. A pause that ends at the slot or before it
// is one the booking already kept.
func (l *Limiter) pausedPast(sc scope, slot time.Duration) bool {
	now := time.Now()
	for _, k := range sc.keys[:2] {
		if v, ok := l.view.pauses.Load(k); ok {
			p := v.(pauseEnd)
			if p.local.After(now) && p.until > slot {
				return true
			}
		}
	}
	return false
}

// paused reports how long, as far as this process knows, the quota stays
// paused for a call with opts (their Key matters, on a quota of
// policies.PerKey policies only): by Pause, by a vendor's refusal that this
// replica or another made known. It asks nothing of Redis; 0 means no pause
// is known. A call admitted during a pause is booked after it.
func (l *Limiter) paused(opts ...CallOption) time.Duration {
	if l.made() != nil {
		return 0
	}
	sc := l.scopeFor(callOf(opts))
	now := time.Now()
	var d time.Duration
	for _, k := range sc.keys[:2] {
		if v, ok := l.view.pauses.Load(k); ok {
			d = max(d, v.(pauseEnd).local.Sub(now))
		}
	}
	return d
}
