package throttle

import (
	"cmp"
	"errors"
	"slices"
	"sync"
	"time"
)

// Units given back move the calls that wait for them. A call booked ahead
// holds its slot at the cost it was admitted with; when the fleet gives
// units back (a Settle below the estimate, a Cancel, a booking given back
// by a call that books again), the calls booked after them could fit
// earlier. The script that gave units back tells the fleet on the quota's
// channel ("f", news.go) when calls are booked ahead; each process with
// calls sleeping towards their slots then asks, in one script call for
// all of them (the lane batches them), to move each to the earliest slot
// that fits, in the order of their slots. A call never moves later: the
// script gives its booking back and searches from now, and when nothing
// earlier fits it takes the same slot again, which leaves every window as
// it was (see decide in lua/acquire.lua, and docs/PROTOCOL.md 3.8).

// moveGain is how much earlier than its slot a call must be able to move
// for the move to be made: a smaller gain is not worth rewriting it.
const moveGain = 2 * time.Millisecond

// errRoom ends the sleep of a call when the fleet gave units back.
var errRoom = errors.New("throttle: units were given back")

// woken says how a call sleeping towards its slot came out of its sleep.
type woken int

const (
	wokenAtSlot    woken = iota // at its slot, booked as it was told
	wokenOvertaken              // its booking was overtaken: give it back and book again
	wokenLost                   // its booking may be gone: book again, giving nothing back
)

// moveFailed is the error of a move that Redis failed: the call books
// again, and waits for Redis no later than by, the move's own deadline,
// so that it never waits for Redis longer than the timeout in all.
type moveFailed struct {
	err error
	by  time.Time
}

func (e *moveFailed) Error() string { return e.err.Error() }
func (e *moveFailed) Unwrap() error { return e.err }

// roomEvery is how often at most the calls of a limiter move: the news of
// units given back within it sets them moving once, at its end. A fleet
// whose calls settle at a high rate costs each process at most one or two
// script calls per roomEvery, however many refunds it hears.
const roomEvery = 20 * time.Millisecond

// roomNews tells a limiter's calls sleeping towards their slots that the
// fleet gave units back, at most once per roomEvery; its lock guards the
// fields below it.
type roomNews struct {
	work *running  // the limiter's: its timers end with Close
	wake broadcast // signalled when the fleet gave units back

	mu    sync.Mutex
	at    time.Duration // Redis's time of the latest units given back heard of
	last  time.Time     // when wake was last signalled
	due   bool          // a signal is due at last + roomEvery
	retry bool          // a signal is due when Redis's trouble is over (afterTrouble)
}

// signal wakes every call sleeping towards its slot, to move earlier: the
// fleet gave units back, at Redis's time at (0 when no new units were
// given back). Within roomEvery of the last time it did, it does so once
// that time is out.
func (n *roomNews) signal(at time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.at = max(n.at, at)
	if n.due {
		return
	}
	if wait := time.Until(n.last.Add(roomEvery)); wait > 0 {
		n.due = true
		n.work.after(wait, func() {
			n.mu.Lock()
			defer n.mu.Unlock()
			n.due = false
			n.open()
		})
		return
	}
	n.open()
}

// open wakes the calls waiting on the news; mu is held.
func (n *roomNews) open() {
	n.wake.signal()
	n.last = time.Now()
}

// now returns the channel that closes the next time the fleet gives
// units back. A call takes it before the script call that books or moves
// it: news that comes while the reply is on its way, before the call
// sleeps, wakes it all the same (taken after the reply, the channel of
// that news was already closed, and the call slept through it).
func (n *roomNews) now() <-chan struct{} { return n.wake.wait() }

// since reports whether units were given back at or after Redis's time t:
// the script that booked a call at t saw those given back before.
func (n *roomNews) since(t time.Duration) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.at >= t
}

// afterTrouble wakes the calls waiting on the news again once Redis's
// trouble is over (troubleSpan after its last failure, at failed): a call
// that heard of room while troubled did not move, and the news, told only
// to the processes it names, may not come again.
func (n *roomNews) afterTrouble(failed time.Time) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.retry {
		return
	}
	n.retry = true
	n.work.after(time.Until(failed.Add(troubleSpan)), func() {
		n.mu.Lock()
		n.retry = false
		n.mu.Unlock()
		n.signal(0)
	})
}

// roomFor returns room, the channel taken before a call was booked as r
// (roomNews.now), or nil when such a call does not move: decided without
// Redis, or on a quota with a token bucket, which can take back only its
// latest call's units.
func (l *Limiter) roomFor(r result, room <-chan struct{}) <-chan struct{} {
	if r.local || l.cfg.hasBucket || isOff(offMoves) {
		return nil
	}
	return room
}

// troubleSpan is how long after a Redis failure this process's calls do
// not move: a move is a script call the call does not need, and on a
// failing Redis one that fails leaves the call to book again.
const troubleSpan = time.Second

// troubled reports whether the calls of this limiter should stay as they
// are: Redis failed one of its script calls lately. (A call booked before
// a gap in the news moves all the same: its move books it again, as its
// waking would.)
func (l *Limiter) troubled() bool {
	return time.Since(time.Unix(0, l.batches.lastFailure.Load())) < troubleSpan
}

// afterMove says why a call books again, giving back the booking moved
// that a move gave it, as EventBookedAgain's Reason: it was decided by a
// clock that had just stepped, or kept at a slot that passed while the
// call waited for the script (behind another in the lane), and would start
// after its slot by more than its lateness shows, which is measured from
// the script's end. "" when the call sleeps towards it.
func afterMove(moved result) string {
	switch {
	case moved.stale:
		return againClock
	case moved.wait < 0:
		return againLate
	}
	return ""
}

// movesFirst puts the calls of batch that move their bookings first, in
// the order of their slots, and the others after them in their order. In
// that order each move finds its own slot free again: a call moved ahead
// of it had a slot no later than its own, so any window holding both the
// moved call and this slot held the moved call's old slot too.
func movesFirst(batch []*request) {
	slices.SortStableFunc(batch, func(a, b *request) int {
		switch {
		case a.c.moves && b.c.moves:
			return cmp.Compare(a.late.slot(), b.late.slot())
		case a.c.moves:
			return -1
		case b.c.moves:
			return 1
		}
		return 0
	})
}
