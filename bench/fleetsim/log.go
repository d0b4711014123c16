package main

import "slices"

// The search of a log, as lua/acquire.lua does it. Times are
// microseconds of Redis's clock, as in the scripts.
const (
	// scanBudget is SCAN: how much of a log one call may read before it
	// settles for the time after the log's last entries.
	scanBudget = 512
	// firstRead and maxRead are FIRST_READ and MAX_READ: a search reads
	// the log by rank, firstRead entries at first, twice as many each time
	// after, maxRead at most.
	firstRead = 4
	maxRead   = 256
	// paceRead is PACE_READ: how many entries a paced booking reads.
	paceRead = 16
)

// entry is one unit in a log: the time it counts at, and the call it
// belongs to.
type entry struct {
	at  int64
	id  int64
	lim int // the limiter that booked it; not part of its order
}

// slidingLog is a quota's sorted set: every admitted or booked unit,
// future bookings included, ordered by time (then id, as Redis orders equal
// scores by member).
type slidingLog struct {
	e []entry
}

func compareEntries(x, y entry) int {
	switch {
	case x.at < y.at:
		return -1
	case x.at > y.at:
		return 1
	case x.id < y.id:
		return -1
	case x.id > y.id:
		return 1
	}
	return 0
}

// add records a unit at time at for call id of limiter lim.
func (l *slidingLog) add(at, id int64, lim int) {
	x := entry{at: at, id: id, lim: lim}
	i, _ := slices.BinarySearchFunc(l.e, x, compareEntries)
	l.e = slices.Insert(l.e, i, x)
}

// remove takes the unit of call id at time at out, and reports whether it
// was there.
func (l *slidingLog) remove(at, id int64) bool {
	i, ok := slices.BinarySearchFunc(l.e, entry{at: at, id: id}, compareEntries)
	if ok {
		l.e = slices.Delete(l.e, i, i+1)
	}
	return ok
}

// upTo returns how many entries lie at or before t (ZCOUNT -inf t).
func (l *slidingLog) upTo(t int64) int {
	i, _ := slices.BinarySearchFunc(l.e, entry{at: t + 1, id: -1 << 62}, compareEntries)
	return i
}

// dropUpTo removes every entry at or before t (ZREMRANGEBYSCORE -inf t).
func (l *slidingLog) dropUpTo(t int64) {
	if n := l.upTo(t); n > 0 {
		l.e = slices.Delete(l.e, 0, n)
	}
}

// tail is log_tail: the earliest time >= t after every entry at which one
// more unit fits, room being limit - 1 and w the window in force.
func (l *slidingLog) tail(t int64, room int, w int64) int64 {
	n := len(l.e)
	t = max(t, l.e[n-1].at)
	if k := n - 1 - room; k >= 0 {
		t = max(t, l.e[k].at+w)
	}
	return t
}

// earliest is earliest_log for a call of cost 1: the earliest time >= t at
// which one more unit fits in every window of length w that would hold it,
// the log holding at most limit units a window. It spends budget as the
// script does (two reads of n entries cost 2n, each step 1) and settles for
// the log's tail once the budget runs out.
func (l *slidingLog) earliest(t int64, limit int, w int64, budget *int) int64 {
	room := limit - 1
	j := l.upTo(t - w)
	n := firstRead
	haveA, haveB := 0, 0 // entries left of the reads from rank j and from rank j+room
	for {
		if haveA == 0 {
			if *budget <= 0 {
				return l.tail(t, room, w)
			}
			haveA = min(n, max(len(l.e)-j, 0))
			haveB = min(n, max(len(l.e)-j-room, 0))
			*budget -= 2 * n
			n = min(2*n, maxRead)
			if haveB == 0 {
				return t
			}
		}
		if haveB == 0 {
			// Fewer than room+1 entries from here on: no window can fill.
			return t
		}
		a, b := l.e[j].at, l.e[j+room].at
		if b-w >= t {
			return t
		}
		if b-a < w && t < a+w {
			t = a + w
		}
		j++
		haveA--
		haveB--
		*budget--
	}
}

// paced is paced in acquire.lua: the earliest time >= t at least pace away
// from every entry, reading paceRead entries from t - pace on at most. It
// returns the entries it read too.
func (l *slidingLog) paced(t, pace int64) (int64, int) {
	i := l.upTo(t - pace)
	read := min(paceRead, len(l.e)-i)
	for k := range read {
		e := l.e[i+k].at
		if e >= t+pace {
			return t, read
		}
		t = max(t, e+pace)
	}
	if read < paceRead {
		return t, read
	}
	return max(t, l.e[len(l.e)-1].at+pace), read + 1
}

// hint is a log's hint (read_hint in lib.lua): with window w, no time from
// t to at fits one more unit.
type hint struct {
	t, at, w int64
	set      bool
}

// bruteEarliest is the earliest time >= t, by whole microseconds, at which
// one more unit fits: no limit+1 units of the log, the new one among them,
// lie within less than w of each other. It is the definition the search must
// meet, for the tests.
func (l *slidingLog) bruteEarliest(t int64, limit int, w int64) int64 {
	for ; ; t++ {
		trial := slidingLog{e: slices.Clone(l.e)}
		trial.add(t, -1, 0)
		i := slices.Index(trial.e, entry{at: t, id: -1})
		ok := true
		for first := max(i-limit, 0); first <= i && first+limit < len(trial.e); first++ {
			if trial.e[first+limit].at-trial.e[first].at < w {
				ok = false
				break
			}
		}
		if ok {
			return t
		}
	}
}
