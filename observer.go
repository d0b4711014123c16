package throttle

import (
	"errors"
	"time"
)

// EventKind says what an Event reports; its value is the kind's name.
type EventKind string

// The kinds of Event.
const (
	// EventAdmitted: a call got its permit, after Wait. Cost is its units.
	EventAdmitted EventKind = "admitted"
	// EventLimited: a call was refused because the quota is full
	// (ErrLimited; Wait is how long it would have had to wait), or, in Queue
	// mode, because the queue is (Err is ErrQueueFull).
	EventLimited EventKind = "limited"
	// EventUnavailable: a call was refused because Redis could not decide
	// it (ErrUnavailable).
	EventUnavailable EventKind = "unavailable"
	// EventRedis: one script call to Redis. Duration is its round trip,
	// Margin the smallest margin in force of the quota's windows, as the
	// script answered (0 when it failed or no window has one),
	// Calls the number of calls it decided, Err its failure if any.
	EventRedis EventKind = "redis"
	// EventFallback: Redis kept failing, and calls are now decided as
	// OnRedisError says, without Redis.
	EventFallback EventKind = "fallback"
	// EventRecovered: Redis answered a probe; calls are decided in Redis
	// again.
	EventRecovered EventKind = "recovered"
	// EventDataLost: Redis lost the quota's data; every limit counts as
	// full for one window.
	EventDataLost EventKind = "data_lost"
	// EventVendorLimited: the vendor answered 429 or 503 (Transport).
	EventVendorLimited EventKind = "vendor_limited"
	// EventPaused: the quota, or one key of it, was paused for Duration at
	// the vendor's request (PausedBy is PausedByVendor).
	EventPaused EventKind = "paused"
	// EventCapLearned: the vendor refused a call over its limit, and the
	// quota learned its cap: Limit is the lowest limit in force of its rules
	// (see Permit.Heard).
	EventCapLearned EventKind = "cap_learned"
	// EventOthers: the units the quota leaves other consumers of the
	// vendor's key changed: Others is the most a rule of it leaves them,
	// per window, as the vendor's counts measure them (0 when the others
	// stopped). See Limiter.SetRemaining.
	EventOthers EventKind = "others"
	// EventBookedAgain: a call of Block or Queue mode gave its slot back
	// and asked for another, which may come later: Reason says why, Wait is
	// how long it had waited.
	EventBookedAgain EventKind = "booked_again"
)

// The reasons of EventBookedAgain.
const (
	againLate     = "late"     // it would start too late in its slot (Redis's reply or its wake came late)
	againPaused   = "paused"   // a pause it did not know of when it booked ends after its slot
	againLost     = "lost"     // Redis lost the quota's data, and its booking with it
	againUnheard  = "unheard"  // the quota's news had a gap: a pause or a lowered limit may have gone unheard
	againLowered  = "lowered"  // a limit in force dropped after it booked (a cap learned, a share left to others)
	againClock    = "clock"    // Redis's clock stepped forward as it booked
	againRedis    = "redis"    // Redis failed while the call moved, and its booking may be gone
	againOutdated = "outdated" // the fallback's decision was taken back by another process's
	againYielded  = "yielded"  // a call of its process that asked before it, too late for its own slot, took its slot
)

// Event is one thing a limiter did. Fields that do not apply to its Kind
// are zero.
type Event struct {
	Kind  EventKind // what happened
	Quota string    // the limiter's name; never a call's key, which may be a secret
	Mode  Mode      // the limiter's Mode
	// Cost is the call's units.
	Cost int
	// Wait is how long the call waited for its slot (EventAdmitted), or
	// would have had to wait (EventLimited).
	Wait time.Duration
	// Duration is a Redis round trip (EventRedis) or a pause (EventPaused).
	Duration time.Duration
	// Margin is the smallest margin in force of the quota's windows: the
	// configured Margin, or wider while the fleet's calls start late
	// (EventRedis; see policies.SlidingLog.Margin).
	Margin time.Duration
	// Calls is how many calls one script call decided (EventRedis).
	Calls int
	// Limit is the lowest limit in force of the quota's rules after the
	// vendor's refusal taught it a cap (EventCapLearned).
	Limit int
	// Others is the units per window the quota leaves other consumers of
	// the vendor's key (EventOthers).
	Others int
	// Queued is how many calls wait in the local queue (Queue mode).
	Queued int
	// Local reports a call decided without Redis, by the fallback.
	Local bool
	// Shadow reports a call that went ahead although the limiter refused
	// it, because the limiter is in shadow mode (Options.Shadow).
	Shadow bool
	// PausedBy says why the quota was paused, as Usage.PausedBy does: for a
	// call refused while it was (EventLimited), and for EventPaused.
	PausedBy string
	// Reason says why a call booked again (EventBookedAgain): "late" (its
	// reply or its wake came too late to start in its slot), "paused" (a
	// pause it did not know of ends after its slot), "lost" (Redis lost the
	// quota's data), "unheard" (a gap in the quota's news), "lowered" (a
	// limit in force dropped after it booked), "clock" (Redis's clock
	// stepped forward), "redis" (Redis failed while the call moved),
	// "outdated" (the Local fallback's decision was taken back) or
	// "yielded" (a call of the same Limiter that asked before it, too late
	// for its own slot, took its slot).
	Reason string
	// Err is the failure of a Redis round trip, or why a call was refused.
	Err error
}

func (l *Limiter) emit(e Event) {
	if l.s.observer == nil {
		return
	}
	e.Quota, e.Mode = l.name, l.s.mode
	if l.q != nil {
		e.Queued = l.q.len()
	}
	l.s.observer(e)
}

// emitOutcome reports how a call that asked for a permit fared.
func (l *Limiter) emitOutcome(c call, p *Permit, err error, shadow bool) {
	if l.s.observer == nil {
		return
	}
	e := Event{Cost: c.cost, Err: err, Shadow: shadow}
	switch {
	case err == nil:
		e.Kind, e.Wait, e.Local = EventAdmitted, p.waited, p.r.local
	case errors.Is(err, ErrLimited):
		e.Kind = EventLimited
		if le, ok := err.(*LimitedError); ok {
			e.Wait, e.PausedBy = le.RetryAfter, le.PausedBy
		}
	case errors.Is(err, ErrQueueFull):
		e.Kind = EventLimited
	case errors.Is(err, ErrUnavailable):
		e.Kind = EventUnavailable
	default:
		return // the caller's context ended, or bad options
	}
	l.emit(e)
}
