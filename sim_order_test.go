package throttle

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// The checkers of the order calls are served in: priorities, and first
// come, first served against the callers' deadlines.

// ordered returns whether s's calls are served in an order these checkers
// can read: a log or counter quota of calls that wait for their slots, no
// fault, no key (whose fair shares order calls too), no vendor model (whose
// refusals pause the fleet).
func (s schedule) ordered() bool {
	return (s.Policy.Kind == "log" || s.Policy.Kind == "counter") && s.Mode != FailFast && len(s.Events) == 0 &&
		s.Keys == 0 && s.Model == nil
}

// trip is a generous round trip to Redis of s, the vendor's way included:
// calls that begin within it of each other may be decided in either order.
func (s schedule) trip() time.Duration {
	return 2*(slices.Max(s.Latency)+s.Jitter) + 2*s.Vendor + 10*time.Millisecond
}

// asked returns when call c could first ask Redis: when it began, or, for
// a call that began while its process's first script call was on its way,
// when that call was answered. That first call opens the connection (a
// handshake, the script loaded if Redis lacks it: 46 ms at 7 ms from Redis
// in seed 728573, where later calls take one round trip), and the calls
// that begin meanwhile wait behind it in the process's lane (batch.go):
// the fleet's calls that begin after them but before that answer may be
// decided first.
func (o outcome) asked(c simCall) time.Duration {
	if first, ok := o.firstReply[c.replica]; ok && first > c.began {
		return first
	}
	return c.began
}

// priorities checks that a higher priority never waits for a lower one
// beyond one window's turn: while a call of a higher priority waited, the
// calls of lower priorities that began after it (a round trip after, at
// least) reached the vendor with at most a window's limit, and a tenth of
// the limit (a unit at least) for each lower class and each window it
// waited (each class keeps a tenth, so that none starves: seed 601373, a
// counter of 5 a second, where the two classes below the waiting one kept
// a unit a window each). The units are what the vendor counted: a call
// settled lower gives the rest back (Permit.Settle), to its class's log
// too, so a lower class may book more than its tenth when its calls settle
// lower and still take no more of the quota (seed 601373 again: 19 units
// booked in 5.7 s, 7 counted, where 17 are allowed).
func priorities(s schedule, o outcome) []string {
	if !s.ordered() || s.ArrivalOrder || s.classes() < 2 {
		return nil
	}
	for _, h := range o.calls {
		if h.priority == 0 || h.arrived == 0 {
			continue
		}
		waited := h.arrived - h.began
		lower := min(h.priority, s.classes()) // the classes below it: priorities 0 to h.priority-1
		allowed := s.Policy.Limit + int(waited/s.Policy.Window+1)*lower*max(s.Policy.Limit/10, 1)
		overtook, booked := 0, 0
		for _, l := range o.calls {
			if l.priority < h.priority && l.arrived != 0 && l.began > o.asked(h)+s.trip() && l.arrived < h.arrived {
				overtook += l.counted
				booked += l.cost
			}
		}
		if overtook > allowed {
			return []string{fmt.Sprintf("replica %d: a call of priority %d that began at %v waited %v while calls of lower priorities that began after it took %d units (booked %d), at most %d allowed",
				h.replica, h.priority, h.began, waited, overtook, booked, allowed)}
		}
	}
	return nil
}

// firstCome checks, where the fleet serves first come, first served
// (ArrivalOrder, or a single class) from a sliding log (which books exact
// slots: a counter's room comes back a bucket at a time, and may go to
// a call that asks just after one it refused), that no call was refused for its
// deadline while calls that began after it (after it could first ask,
// outcome.asked) reached the vendor within that
// deadline with more than its cost and a tenth of the limit (the
// tolerance: calls a round trip apart may be decided in either order, and
// a refused call's booking is given back to those after it). Not where
// costs are settled lower: a Block call whose slot lies past its deadline
// fails when it asks (README, Modes), and the units settled after that
// go to the calls that ask later (seed 322070: 5 units within a refused
// call's deadline, all freed by settles after it; 0 with costs settled
// higher or not at all). Nor where calls are given back (Permit.Cancel),
// for the same reason (seed 305871: 3 units within a refused call's
// deadline, where 2 are allowed, in 2 replays of 3).
func firstCome(s schedule, o outcome) []string {
	if !s.ordered() || s.Policy.Kind != "log" || s.Deadline == 0 || !s.ArrivalOrder && s.classes() > 1 {
		return nil
	}
	if s.Settle == "lower" || s.Settle == "both" || s.Cancel {
		return nil
	}
	for _, c := range o.calls {
		if !errors.Is(c.err, ErrLimited) {
			continue
		}
		// A slot within half a margin of the deadline is refused by
		// design (the deadline guard, docs/PROTOCOL.md 3.8: the call may
		// start that late): the calls after it may take those (seed 547751:
		// a slot 11 ms before the deadline, refused, taken 40 ms later).
		by := c.began + s.Deadline - policies.DefaultMargin/2
		later := 0
		for _, l := range o.calls {
			if l.arrived != 0 && l.began > o.asked(c)+s.trip() && l.arrived <= by {
				later += l.cost
			}
		}
		if later > c.cost+max(s.Policy.Limit/10, 1) {
			return []string{fmt.Sprintf("replica %d: a call that began at %v was refused for its deadline of %v, while calls that began after it took %d units within it",
				c.replica, c.began, s.Deadline, later)}
		}
	}
	return nil
}
