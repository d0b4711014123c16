package throttle

import (
	"cmp"
	"maps"
	"slices"
	"time"
)

// A call whose wake or reply came too late for its slot keeps its place
// among the calls of its limiter (keepTurn in waiter.go; docs/PROTOCOL.md
// 3.8): it takes the booking of a call that asked after it, asleep towards
// a slot further ahead, and that call books again in its stead, giving the
// late booking back. The bookings in Redis stay as they were; only their
// callers trade. A call of another process is never taken: it would learn
// of it only by news, and start at its slot if the news came late.

// sleeper is a call of Block or Queue mode asleep towards its slot in
// Redis, registered in Limiter.sleepers while it sleeps.
type sleeper struct {
	start time.Time     // when the call began to wait
	r     result        // its booking
	taken chan struct{} // closed once a late call took the booking
	late  result        // the late call's booking, to give back in its stead
}

// asleep registers the call that began to wait at start, about to sleep
// towards its booking r, for a late call to take; nil when none may.
func (l *Limiter) asleep(r result, start time.Time) *sleeper {
	if r.local || isOff(offKeepTurn) {
		return nil
	}
	s := &sleeper{start: start, r: r, taken: make(chan struct{})}
	l.sleepers.Store(s, nil)
	return s
}

// wake returns the channel closed when a late call takes s's booking.
func (s *sleeper) wake() <-chan struct{} {
	if s == nil {
		return nil
	}
	return s.taken
}

// awake takes s out of the sleepers as its call wakes. It returns the late
// booking the call holds instead of its own when a late call took that,
// or nil.
func (l *Limiter) awake(s *sleeper) *result {
	if s == nil {
		return nil
	}
	if _, ok := l.sleepers.LoadAndDelete(s); ok {
		return nil
	}
	<-s.taken // the taker wrote late before it closed taken
	return &s.late
}

// before orders the sleepers a late call may take: by slot, then by when
// they began to wait, then by id, so that one run of the simulation takes
// the same whatever order sleepers' map is read in.
func (s *sleeper) before(o *sleeper) bool {
	return cmp.Or(cmp.Compare(s.r.slot(), o.r.slot()), s.start.Compare(o.start), cmp.Compare(s.r.member, o.r.member)) < 0
}

// takes reports whether a call booked as r may take the booking b (in
// Redis: asleep registers no other): the same keys, class and epoch, and
// as many units of each kind or more (the same, under a token bucket,
// which takes back only its latest call's units: see settleTaken).
func (l *Limiter) takes(r, b result) bool {
	if b.epoch != r.epoch || b.class != r.class || b.prio != r.prio ||
		!slices.Equal(b.scope.keys, r.scope.keys) || b.cost < r.cost || len(b.named) != len(r.named) {
		return false
	}
	for name, n := range r.named {
		if m, ok := b.named[name]; !ok || m < n {
			return false
		}
	}
	return !l.cfg.hasBucket || b.cost == r.cost && maps.Equal(b.named, r.named)
}
