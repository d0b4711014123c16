package throttle

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// local decides calls in this process when Redis cannot (the Local
// fallback). Each rule keeps its limit divided by the expected replicas, so
// that a fleet in which every replica lost Redis stays under the cap. It
// counts every booking ahead in every window, as a conservative log does.
//
// It decides in turns: a turn begins with the first call Redis could not
// decide (begin) and ends when Redis has learned of the calls the turn
// admitted (handedBack). A call the turn booked ahead and that has not
// begun when it ends books again in Redis (see claim).
type local struct {
	mu        sync.Mutex
	rules     []policies.Rule // limits already divided
	notice    time.Duration   // how long the fleet takes to notice a failure (Limiter.noticeWithin)
	logs      map[string]*localLog
	margin    time.Duration // the smallest guarded margin of the windows: a call may start half of it late
	decisions int
	admits    uint64        // the calls admitted, or begun after the last charges, so far, for handedBack
	charged   time.Time     // when charges last ran: entries up to then were handed back
	full      time.Time     // every rule counts as full for a window from here
	on        atomic.Bool   // a turn is on; written under mu
	turn      uint64        // the turns begun so far
	ended     chan struct{} // closed when the turn ends
	handing   *handing      // the hand-back on its way to Redis, or nil (Limiter.awaitHandBack)
}

type localEntry struct {
	at    time.Time // admission, or for concurrency the lease's end
	cost  int
	id    string
	begun bool // the call has begun (see claim)
}

type localLog struct {
	rule    int
	scope   scope
	entries []localEntry // ascending by at
	tat     time.Time    // token bucket
}

// newLocal divides every limit among the replicas, and refuses a division
// that leaves a rule less than one unit.
func newLocal(rules []policies.Rule, replicas int, notice time.Duration) (*local, error) {
	lr := make([]policies.Rule, len(rules))
	for i, r := range rules {
		r.Limit /= replicas
		if r.Limit < 1 {
			return nil, fmt.Errorf("Options.ExpectedReplicas %d leaves the rule %s less than one unit per replica under OnRedisError Local: "+
				"raise that limit to %d at least, set ExpectedReplicas to %d at most, or choose FailClosed", replicas, ruleName(rules[i]), replicas, rules[i].Limit)
		}
		if r.Kind == policies.KindTokenBucket {
			r.Every *= time.Duration(replicas)
		}
		lr[i] = r
	}
	lo := &local{rules: lr, notice: notice, logs: map[string]*localLog{}}
	for _, r := range lr {
		if (r.Kind == policies.KindSlidingLog || r.Kind == policies.KindSlidingCounter) && r.Margin >= minGuardedMargin &&
			(lo.margin == 0 || r.Margin < lo.margin) {
			lo.margin = r.Margin
		}
	}
	return lo, nil
}

// log returns the log of rule i for scope sc, made if need be.
func (lo *local) log(i int, sc scope) *localLog {
	name := lo.logName(i, sc)
	lg := lo.logs[name]
	if lg == nil {
		lg = &localLog{rule: i, scope: sc}
		lo.logs[name] = lg
	}
	return lg
}

// logName names the log of rule i for scope sc: one per key under a
// per-key rule.
func (lo *local) logName(i int, sc scope) string {
	name := strconv.Itoa(i)
	if lo.rules[i].PerKey {
		name += ":" + sc.id
	}
	return name
}

// units returns the units of the log's entries after t.
func (lg *localLog) unitsAfter(t time.Time) int {
	n := 0
	for _, e := range lg.entries {
		if e.at.After(t) {
			n += e.cost
		}
	}
	return n
}

// decide admits, books or refuses a call, as the script would, in the turn
// on or in one it begins, and reports whether it began one. A call larger
// than this replica's share of a rule is refused (reasonShare), its wait
// left to the caller: every replica may take its share, and one more unit
// here would take the fleet over the cap.
func (lo *local) decide(sc scope, c call, member string, maxWait time.Duration) (result, bool) {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	began := lo.beginLocked()
	return lo.decideInTurn(sc, c, member, maxWait), began
}

// decideInTurn is decide within the turn on; lo.mu is held.
func (lo *local) decideInTurn(sc scope, c call, member string, maxWait time.Duration) result {
	now := time.Now()
	lo.sweep(now)
	remaining := lo.remaining(sc, now)
	for _, r := range lo.rules {
		if unitsOf(r, c) > r.Limit {
			return result{reason: reasonShare, remaining: remaining, local: true}
		}
	}
	if wait, busy := lo.busyFor(sc, c, now); busy {
		return result{reason: reasonBusy, wait: wait, remaining: remaining, local: true}
	}
	t := lo.slot(sc, c, now)
	wait := t.Sub(now)
	if wait > maxWait {
		return result{reason: reasonTooFar, wait: wait, remaining: remaining, local: true}
	}
	lo.book(sc, c, member, t)
	if remaining -= c.cost; remaining < 0 || wait > 0 {
		remaining = 0
	}
	// The slot in local time, for the late-start guard: a call of a busy
	// process that wakes later after it than half the margin would crowd
	// the windows after it, without Redis as with it.
	at := time.Duration(now.UnixNano())
	return result{admitted: true, wait: wait, remaining: remaining, local: true, now: at, done: at, margin: lo.margin, turn: lo.turn}
}

// remaining returns the units free now under the tightest rule of scope sc.
func (lo *local) remaining(sc scope, now time.Time) int {
	remaining := -1
	for i, r := range lo.rules {
		lg := lo.log(i, sc)
		var free int
		switch r.Kind {
		case policies.KindTokenBucket:
			free = int((time.Duration(r.Limit)*r.Every - max(0, lg.tat.Sub(now))) / r.Every)
		case policies.KindConcurrency:
			free = r.Limit - lg.unitsAfter(now)
		default:
			free = r.Limit - lg.unitsAfter(now.Add(-r.Window))
		}
		if remaining < 0 || free < remaining {
			remaining = max(free, 0)
		}
	}
	return remaining
}

// busyFor reports whether a concurrency rule has no slot free for the call,
// and how long until one may free up.
func (lo *local) busyFor(sc scope, c call, now time.Time) (time.Duration, bool) {
	for i, r := range lo.rules {
		if r.Kind != policies.KindConcurrency {
			continue
		}
		// The slots held through Redis when it failed are still
		// taken until their leases run out: no one here knows which.
		if freeAt := lo.full.Add(r.Lease); now.Before(freeAt) {
			return freeAt.Sub(now), true
		}
		if lo.log(i, sc).unitsAfter(now)+unitsOf(r, c) > r.Limit {
			return r.Lease, true
		}
	}
	return 0, false
}

// slot returns the earliest time from now at which the call fits every
// rule that counts over time, and no sooner than a window after the
// fallback took over (see begin).
func (lo *local) slot(sc scope, c call, now time.Time) time.Time {
	t := now
	for _, r := range lo.rules {
		switch r.Kind {
		case policies.KindSlidingLog, policies.KindSlidingCounter:
			t = maxTime(t, lo.full.Add(r.Window))
		case policies.KindTokenBucket:
			t = maxTime(t, lo.full.Add(time.Duration(r.Limit)*r.Every))
		}
	}
	for moved := true; moved; {
		moved = false
		for i, r := range lo.rules {
			if u := lo.log(i, sc).earliest(r, unitsOf(r, c), t); u.After(t) {
				t, moved = u, true
			}
		}
	}
	return t
}

// earliest returns the earliest time from t at which rule r admits cost
// more units of the log. A concurrency rule does not count over time: t.
func (lg *localLog) earliest(r policies.Rule, cost int, t time.Time) time.Time {
	switch r.Kind {
	case policies.KindConcurrency:
		return t
	case policies.KindTokenBucket:
		return maxTime(t, lg.tat.Add(-time.Duration(r.Limit-cost)*r.Every))
	}
	// The earliest time after which at most Limit-cost units of
	// the log lie within a window of it.
	u := t
	over := lg.unitsAfter(t.Add(-r.Window)) + cost - r.Limit
	for j := 0; over > 0 && j < len(lg.entries); j++ {
		e := lg.entries[j]
		if e.at.After(t.Add(-r.Window)) {
			u = e.at.Add(r.Window)
			over -= e.cost
		}
	}
	return u
}

// book admits the call at t, its slot, under every rule.
func (lo *local) book(sc scope, c call, member string, t time.Time) {
	lo.admits++
	for i, r := range lo.rules {
		lg := lo.log(i, sc)
		cost := unitsOf(r, c)
		switch r.Kind {
		case policies.KindTokenBucket:
			lg.tat = maxTime(lg.tat, t).Add(time.Duration(cost) * r.Every)
		case policies.KindConcurrency:
			lg.insert(localEntry{at: t.Add(r.Lease), cost: cost, id: member})
		default:
			lg.insert(localEntry{at: t, cost: cost, id: member})
		}
	}
}

func (lg *localLog) insert(e localEntry) {
	i, _ := slices.BinarySearchFunc(lg.entries, e.at, func(x localEntry, t time.Time) int { return x.at.Compare(t) })
	lg.entries = slices.Insert(lg.entries, i, e)
}

// begin begins a turn, unless one is on, and reports whether it did.
//
// Redis may have admitted a full window just before it failed, and the
// other replicas' calls booked in Redis go on waking at their slots until
// their processes notice the failure (within notice: see
// Limiter.noticeWithin), after which they ask their own fallbacks, as this
// process's sleeping calls do. So a turn admits nothing until a window
// after the last of those, and no concurrency slot until a lease after it,
// since the slots held through Redis are still taken. From then on each
// replica admits its share alone, and the fleet stays under the cap
// whatever any replica booked before.
func (lo *local) begin() bool {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	return lo.beginLocked()
}

func (lo *local) beginLocked() bool {
	if lo.on.Load() {
		return false
	}
	lo.turn++
	lo.ended = make(chan struct{})
	lo.full = time.Now().Add(lo.notice)
	lo.logs = map[string]*localLog{}
	lo.on.Store(true)
	return true
}

// claim begins the call r, booked ahead by the turn, at its slot, and
// reports whether it may run: not once its turn has ended, since Redis,
// deciding again, may have admitted other replicas' calls into the windows
// of its slot before this process told it of the slot (a replica that
// never lost Redis decides at the whole limit from the moment Redis
// answers, and a frozen Redis answers every replica at once). Such a call
// books again in Redis. A call that begins makes the hand-back on its way,
// which may not have counted it, try again.
func (lo *local) claim(r result) bool {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	if !lo.on.Load() || lo.turn != r.turn {
		return false
	}
	for i := range lo.rules {
		lg := lo.logs[lo.logName(i, r.scope)]
		if lg == nil {
			continue
		}
		for j := range lg.entries {
			if e := &lg.entries[j]; e.id == r.member {
				if !e.begun && e.at.After(lo.charged) {
					lo.admits++ // not in the charges on their way: they try again
				}
				e.begun = true
			}
		}
	}
	return true
}

// asleep sleeps d, towards the slot of a call booked ahead by turn, unless
// ctx ends first or the turn ends (and the call books again in Redis).
func (lo *local) asleep(ctx context.Context, d time.Duration, turn uint64) error {
	lo.mu.Lock()
	ended := lo.ended
	if !lo.on.Load() || lo.turn != turn {
		ended = closed
	}
	lo.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ended:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// closed is a channel closed from the start.
var closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// charge is units a returning Redis must learn of: calls the fallback
// admitted, or booked, that still count in a window.
type charge struct {
	rule  int
	scope scope
	at    time.Time
	units int
}

// charges returns what the fallback admitted that still counts, and the
// count of its admissions so far, for handedBack.
func (lo *local) charges() (out []charge, admits uint64) {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	now := time.Now()
	lo.charged = now
	for _, lg := range lo.logs {
		r := lo.rules[lg.rule]
		switch r.Kind {
		case policies.KindSlidingLog, policies.KindSlidingCounter:
			for _, e := range lg.entries {
				// A call booked ahead that has not begun books again in
				// Redis when the turn ends (claim).
				if e.at.After(now.Add(-r.Window)) && (e.begun || !e.at.After(now)) {
					out = append(out, charge{lg.rule, lg.scope, e.at, e.cost})
				}
			}
		case policies.KindTokenBucket:
			if ahead := lg.tat.Sub(now); ahead > 0 {
				// Every unit whose interval has not run out, whole: a
				// part of one still holds a token the vendor counts.
				out = append(out, charge{lg.rule, lg.scope, now, int((ahead + r.Every - 1) / r.Every)})
			}
		case policies.KindConcurrency:
			// Slots still held: Redis keeps them taken until their leases
			// end (their Release goes to the fallback, which forgets them).
			for _, e := range lg.entries {
				if e.at.After(now) {
					out = append(out, charge{lg.rule, lg.scope, e.at, e.cost})
				}
			}
		}
	}
	return out, lo.admits
}

// handedBack ends the fallback's turn once Redis knows of its calls, the
// charges taken when it had made admits admissions, and reports whether it
// ended: not when the fallback admitted more since, which Redis does not
// know of yet.
func (lo *local) handedBack(admits uint64) bool {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	if lo.admits != admits {
		return false
	}
	lo.logs = map[string]*localLog{}
	if lo.on.Load() {
		lo.on.Store(false)
		close(lo.ended)
	}
	return true
}

// forget removes the units of call id under every rule: a cancelled
// booking.
func (lo *local) forget(sc scope, id string) { lo.remove(sc, id, false) }

// release frees the concurrency slots of call id, which ran: its units
// still count under every other rule.
func (lo *local) release(sc scope, id string) { lo.remove(sc, id, true) }

// remove removes the entries of call id under every rule of scope sc, or
// under its concurrency rules only.
func (lo *local) remove(sc scope, id string, slotsOnly bool) {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	for i, r := range lo.rules {
		if slotsOnly && r.Kind != policies.KindConcurrency {
			continue
		}
		lg := lo.log(i, sc)
		lg.entries = slices.DeleteFunc(lg.entries, func(e localEntry) bool { return e.id == id })
	}
}

// sweep drops entries that left every window, now and then, so that keys no
// longer used do not pile up.
func (lo *local) sweep(now time.Time) {
	if lo.decisions++; lo.decisions%1024 != 1 {
		return
	}
	for name, lg := range lo.logs {
		i, _ := strconv.Atoi(name[:indexOrLen(name, ':')])
		r := lo.rules[i]
		horizon := now.Add(-r.Window)
		if r.Kind == policies.KindConcurrency || r.Kind == policies.KindTokenBucket {
			horizon = now
		}
		lg.entries = slices.DeleteFunc(lg.entries, func(e localEntry) bool { return !e.at.After(horizon) })
		if len(lg.entries) == 0 && !lg.tat.After(now) {
			delete(lo.logs, name)
		}
	}
}

func indexOrLen(s string, b byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == b {
			return i
		}
	}
	return len(s)
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// unitsOf returns what call c counts for under rule r: its cost, its cost
// in the rule's unit (policies.Unit), or 1 under a policies.PerCall rule.
func unitsOf(r policies.Rule, c call) int {
	switch {
	case r.PerCall:
		return 1
	case r.Unit != "":
		return c.named[r.Unit]
	}
	return c.cost
}
