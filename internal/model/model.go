// Package model is the reference statement of every rule a quota can have,
// written by brute force so that it can be trusted by reading it. Tests drive
// the Redis script and this model with the same calls and compare every
// decision, and check the promise of each rule on the model's history.
package model

import (
	"math"
	"sort"
	"strconv"
	"time"

	"github.com/throttlekit/throttle/internal/protocol"
)

// Kind is the algorithm of a Rule, numbered as the script numbers them.
type Kind int

// The kinds of rule.
const (
	Log         Kind = 1
	Counter     Kind = 2
	Bucket      Kind = 3
	Concurrency Kind = 4
)

// Rule is one limit. Times are in microseconds.
//
//	Log:         at most Limit units in any window of Window.
//	Counter:     Window cut into buckets of Width; a window is charged every
//	             bucket it touches, in full.
//	Bucket:      GCRA: one unit per Every, bursts of Limit.
//	Concurrency: at most Limit units held; a hold lasts until released or
//	             for Lease.
type Rule struct {
	Kind   Kind  // the algorithm
	Limit  int   // units per window, burst, or units held at once
	Window int64 // Log and Counter: the window, margin included
	Width  int64 // Counter: the width of a bucket
	Every  int64 // Bucket: the emission interval, one unit per Every
	Lease  int64 // Concurrency: how long a hold lasts unless released
	PerKey bool  // the rule counts each key apart
	// Log and Counter rules: how long their entries may count (the window
	// without its margin, and the widest margin it may take), and for a
	// Log rule how much wider its window is while the calls a warming quota
	// admitted at once are held (see Script).
	Keep int64
	Warm int64 // see Keep
	// Log and Counter rules: the window the vendor counts, without the
	// margin, which the classes' periods divide (see Classes).
	Span int64
}

type entry struct {
	at   int64 // admission time; for Concurrency, when the lease ends
	id   string
	cost int
}

// Model holds every admitted or booked unit of every rule, forever.
type Model struct {
	rules []Rule
	logs  map[string][]entry
	tat   map[string]int64  // Bucket rules: theoretical arrival time
	last  map[string]string // Bucket rules: the call that set tat last
	held  map[string][]hold // Concurrency rules: every slot ever held

	// Warming up: a quota new, or idle for longer than its longest window
	// or a minute, warms up for that window; the calls it admits at once meanwhile are
	// held until the widest window they count in has passed, and the Log
	// rules' windows are Warm wider until then.
	called  bool  // some script ran
	lastRun int64 // when the last one ran
	warmTo  int64 // the quota warms up until then
	holdTo  int64 // the calls admitted at once while it did are held until then
	warming bool  // the current script runs while the quota warms up
	holding bool  // the current script decides with the wider windows
	atOnce  bool  // the current script admitted a call at once

	// Classes (see classes.go): the keys and the priorities a quota
	// serves. classes[rule name][class name] is what each class booked;
	// seen holds the classes as the current script read them, with their
	// demand, and adds what it booked, written when it ends; classLogs
	// holds each class's own log under a rule, by rule and class name.
	perKey       bool
	now          int64
	classesUntil int64 // until then a call of the default class reads the classes
	classes      map[string]map[string]*class
	seen         map[string]map[string]*class
	adds         map[string]map[string]*class
	classLogs    map[string][]entry
	filled       map[string]bool // rules whose default class's log the current script filled
	// booked maps each call to the classes it counts in and its slot: a
	// booking given back or settled changes them too. In a script, a
	// booking given back leaves its classes' demand only when the script
	// ends (leave).
	booked   map[string]bookedIn
	inScript bool
	leave    []leaving
}

// hold is a concurrency slot held from one time to another: from the
// decision until the call releases it or its lease runs out.
type hold struct {
	from, to int64
	id       string
	cost     int
}

// New returns an empty model of a quota with the given rules.
func New(rules ...Rule) *Model {
	m := &Model{rules: rules, logs: map[string][]entry{}, tat: map[string]int64{}, last: map[string]string{}, held: map[string][]hold{},
		classes: map[string]map[string]*class{}, seen: map[string]map[string]*class{}, adds: map[string]map[string]*class{},
		classLogs: map[string][]entry{}, booked: map[string]bookedIn{}, filled: map[string]bool{}}
	for _, r := range rules {
		m.perKey = m.perKey || r.PerKey
	}
	return m
}

// warmIdle is how long a quota may go without a script before it warms up
// again, if its longest window is shorter.
const warmIdle = int64(protocol.WarmIdle / time.Microsecond)

// Script begins one acquire script at now: the calls Acquire decides until
// EndScript share what it knew of the quota's warming up. Without it the
// model never warms up.
func (m *Model) Script(now int64) {
	var span int64
	for _, r := range m.rules {
		if r.Kind == Log || r.Kind == Counter {
			span = max(span, r.Window)
		}
	}
	m.now = now
	m.seen, m.adds = map[string]map[string]*class{}, map[string]map[string]*class{}
	m.filled = map[string]bool{}
	start := !m.called || now-m.lastRun > max(span, warmIdle)
	m.warming = start || m.warmTo > now
	m.holding = m.called && m.holdTo > now
	m.atOnce = false
	if start {
		m.warmTo = now + span
	}
	m.called, m.lastRun = true, now
	m.inScript = true
}

// EndScript ends the script Script began at now.
func (m *Model) EndScript(now int64) {
	m.writeClasses(now)
	for _, l := range m.leave {
		m.changeDemand(l.in, l.d)
	}
	m.leave, m.inScript = nil, false
	if !m.warming || !m.atOnce {
		return
	}
	var keep int64
	for _, r := range m.rules {
		keep = max(keep, r.Keep)
	}
	m.holdTo = max(m.holdTo, now+keep)
	m.warming, m.holding, m.atOnce = false, false, false
}

// window is the window in force of rule r.
func (m *Model) window(r Rule) int64 {
	if r.Kind == Log && m.holding {
		return r.Window + r.Warm
	}
	return r.Window
}

// Decision is what the model decides for one call.
type Decision struct {
	Admitted  bool  // the call was booked
	Wait      int64 // until the call's slot; when refused, until it would fit
	Remaining int   // units free now under the tightest rule, the call counted if admitted; 0 when it waits
	Room      int   // as Remaining, under the rules alone: the classes' logs aside
	Busy      bool  // refused because a Concurrency rule is full
}

func (m *Model) name(i int, key string) string {
	name := strconv.Itoa(i)
	if m.rules[i].PerKey {
		name += ":" + key
	}
	return name
}

func units(log []entry, from, to int64) int {
	n := 0
	for _, e := range log {
		if e.at > from && e.at <= to {
			n += e.cost
		}
	}
	return n
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// counterSpan is how many buckets back a window ending in a bucket reaches.
func counterSpan(r Rule) int64 { return (r.Window + r.Width - 1) / r.Width }

// fits reports whether cost more units at t keep the rule within its limit.
func (m *Model) fits(i int, key string, t, now int64, cost int) bool {
	r := m.rules[i]
	log := m.logs[m.name(i, key)]
	switch r.Kind {
	case Log, Counter:
		return m.fitsIn(r, log, r.Limit, t, cost)
	case Bucket:
		tat := m.tat[m.name(i, key)]
		return max(tat, t)+int64(cost)*r.Every-t <= int64(r.Limit)*r.Every
	default:
		return units(log, now, math.MaxInt64)+cost <= r.Limit
	}
}

// fitsIn reports whether cost more units at t keep log, of a Log or
// Counter rule r, within limit.
func (m *Model) fitsIn(r Rule, log []entry, limit int, t int64, cost int) bool {
	if r.Kind == Log {
		// The count of a window (u-w, u] changes only where an entry enters
		// it, so the windows ending at t and at each entry in (t, t+w) are
		// the only ones to check.
		w := m.window(r)
		ends := []int64{t}
		for _, e := range log {
			if e.at > t && e.at < t+w {
				ends = append(ends, e.at)
			}
		}
		for _, u := range ends {
			if m.endingAt(r, log, u)+cost > limit {
				return false
			}
		}
		return true
	}
	// The windows ending in buckets k .. k+span each hold buckets j-span ..
	// j; the count only grows where a bucket that holds units enters, so
	// the windows ending at k and at those buckets are the ones to check.
	k, span := floorDiv(t, r.Width), counterSpan(r)
	ends := []int64{k}
	for _, e := range log {
		if b := floorDiv(e.at, r.Width); b > k && b <= k+span {
			ends = append(ends, b)
		}
	}
	for _, j := range ends {
		if m.endingAt(r, log, j*r.Width)+cost > limit {
			return false
		}
	}
	return true
}

// endingAt returns the units log, of a Log or Counter rule r, holds in the
// window that ends at t: (t-w, t] for a log, a counter's buckets j-span
// .. j for t's bucket j.
func (m *Model) endingAt(r Rule, log []entry, t int64) int {
	if r.Kind == Log {
		return units(log, t-m.window(r), t)
	}
	j, n := floorDiv(t, r.Width), 0
	for _, e := range log {
		if b := floorDiv(e.at, r.Width); b >= j-counterSpan(r) && b <= j {
			n += e.cost
		}
	}
	return n
}

// used is the units log, of a Log or Counter rule r, holds in the window
// ending at now and ahead of it.
func (m *Model) used(r Rule, log []entry, now int64) int {
	if r.Kind == Log {
		return units(log, now-m.window(r), math.MaxInt64)
	}
	oldest := floorDiv(now, r.Width) - counterSpan(r)
	n := 0
	for _, e := range log {
		if floorDiv(e.at, r.Width) >= oldest {
			n += e.cost
		}
	}
	return n
}

// candidates returns the times from start on at which log, of a Log or
// Counter rule r, may free room: as an entry leaves the window, or as a
// bucket does.
func (m *Model) candidates(r Rule, log []entry, start int64) []int64 {
	var cands []int64
	if r.Kind == Log {
		for _, e := range log {
			cands = append(cands, e.at+m.window(r))
		}
		return cands
	}
	last := start
	for _, e := range log {
		last = max(last, e.at)
	}
	for b := floorDiv(start, r.Width) + 1; b <= floorDiv(last, r.Width)+counterSpan(r)+1; b++ {
		cands = append(cands, b*r.Width)
	}
	return cands
}

// free is the units the rule has free at now, bookings ahead counted.
func (m *Model) free(i int, key string, now int64) int {
	r := m.rules[i]
	log := m.logs[m.name(i, key)]
	switch r.Kind {
	case Log, Counter:
		return r.Limit - m.used(r, log, now)
	case Bucket:
		tat := m.tat[m.name(i, key)]
		return int(floorDiv(int64(r.Limit)*r.Every-max(0, tat-now), r.Every))
	default:
		return r.Limit - units(log, now, math.MaxInt64)
	}
}

// Acquire decides a call of priority 0 (see AcquireIn).
func (m *Model) Acquire(now, pause int64, id, key string, cost int, maxWait int64) Decision {
	return m.AcquireIn(now, pause, id, key, 0, cost, maxWait)
}

// AcquireIn decides a call of cost units and priority prio for key at
// time now, not before pause, that accepts a wait of at most maxWait, and
// records it under id when it is admitted.
func (m *Model) AcquireIn(now, pause int64, id, key string, prio, cost int, maxWait int64) Decision {
	cls := m.callClasses(key, prio, cost)
	remaining, room := m.remaining(key, cls, now)
	if pause > now {
		// Nothing is free while the vendor asked for quiet.
		remaining, room = 0, 0
	}
	if busy, hint := m.busy(key, cost, now); busy {
		m.noteRefused(cls, cost)
		return Decision{Wait: hint, Remaining: remaining, Room: room, Busy: true}
	}
	t := m.earliest(key, cls, max(now, pause), now, cost)
	wait := t - now
	if wait > maxWait {
		m.noteRefused(cls, cost)
		return Decision{Wait: wait, Remaining: remaining, Room: room}
	}
	m.record(now, id, key, cost, t)
	m.noteClasses(cls, id, cost, t)
	remaining, room = remaining-cost, room-cost
	if wait > 0 {
		remaining, room = 0, 0
	}
	if wait == 0 {
		m.atOnce = true
	}
	return Decision{Admitted: true, Wait: wait, Remaining: max(remaining, 0), Room: max(room, 0)}
}

// remaining is the units free at now under the tightest rule for key and
// the logs of classes cls, bookings ahead counted, and room the same
// under the rules alone.
func (m *Model) remaining(key string, cls []callClass, now int64) (remaining, room int) {
	room = math.MaxInt
	for i := range m.rules {
		room = min(room, m.free(i, key, now))
	}
	remaining = room
	for _, c := range cls {
		if c.limit > 0 {
			remaining = min(remaining, c.limit-m.used(m.rules[c.i], m.classLogs[c.log], now))
		}
	}
	return max(remaining, 0), max(room, 0)
}

// busy reports whether a full concurrency rule refuses a call of cost for
// key: no one knows when a holder will finish. Its hint is when the first
// lease runs out, in the fullest of them.
func (m *Model) busy(key string, cost int, now int64) (bool, int64) {
	busy, hint := false, int64(0)
	for i, r := range m.rules {
		if r.Kind == Concurrency && !m.fits(i, key, now, now, cost) {
			first := int64(math.MaxInt64)
			for _, e := range m.logs[m.name(i, key)] {
				if e.at > now {
					first = min(first, e.at)
				}
			}
			busy, hint = true, max(hint, first-now)
		}
	}
	return busy, hint
}

// earliest is the earliest time from start on at which cost more units fit
// every rule for key and the logs of classes cls: the start or the moment
// some rule frees room, tried in order.
func (m *Model) earliest(key string, cls []callClass, start, now int64, cost int) int64 {
	cands := []int64{start}
	for i, r := range m.rules {
		log := m.logs[m.name(i, key)]
		switch r.Kind {
		case Log, Counter:
			cands = append(cands, m.candidates(r, log, start)...)
		case Bucket:
			cands = append(cands, m.tat[m.name(i, key)]-int64(r.Limit-cost)*r.Every)
		}
	}
	for _, c := range cls {
		if c.limit > 0 {
			cands = append(cands, m.candidates(m.rules[c.i], m.classLogs[c.log], start)...)
		}
	}
	sort.Slice(cands, func(a, b int) bool { return cands[a] < cands[b] })
	for _, c := range cands {
		if c < start {
			continue
		}
		ok := true
		for i := range m.rules {
			if !m.fits(i, key, c, now, cost) {
				ok = false
				break
			}
		}
		for _, cl := range cls {
			if ok && cl.limit > 0 {
				ok = m.fitsIn(m.rules[cl.i], m.classLogs[cl.log], cl.limit, c, cost)
			}
		}
		if ok {
			return c
		}
	}
	return -1
}

// Keep books call id again at slot, as it was before it was given back to
// move earlier (Cancel, then an Acquire that found nothing earlier), if it
// still fits there, and returns the decision the script answers a kept
// call with; false when it no longer fits (the Acquire's refusal stands).
func (m *Model) Keep(now int64, id, key string, cost int, slot int64) (Decision, bool) {
	return m.KeepIn(now, id, key, 0, cost, slot)
}

// KeepIn is Keep for a call of priority prio. It follows the AcquireIn
// that found nothing earlier for the call: the call is kept, not refused,
// if its cost still fits each window that ends at slot (and each
// concurrency rule now), under the limits in force, its classes' too.
func (m *Model) KeepIn(now int64, id, key string, prio, cost int, slot int64) (Decision, bool) {
	cls := m.callClasses(key, prio, cost)
	if !m.fitsBehind(key, cls, slot, now, cost) {
		return Decision{}, false
	}
	m.unnoteRefused(cls, cost)
	m.record(now, id, key, cost, slot)
	m.noteClasses(cls, id, cost, slot)
	if slot <= now {
		m.atOnce = true
	}
	return Decision{Admitted: true, Wait: slot - now}, true
}

// fitsBehind reports whether cost more units at slot keep the window that
// ends there within each limit: of every Log and Counter rule, of each
// class log held against the call (cls), and each Concurrency rule now.
// A Bucket keeps its slot unchecked.
func (m *Model) fitsBehind(key string, cls []callClass, slot, now int64, cost int) bool {
	for i, r := range m.rules {
		switch r.Kind {
		case Log, Counter:
			if m.endingAt(r, m.logs[m.name(i, key)], slot)+cost > r.Limit {
				return false
			}
		case Concurrency:
			if !m.fits(i, key, slot, now, cost) {
				return false
			}
		}
	}
	for _, cl := range cls {
		if cl.limit > 0 && m.endingAt(m.rules[cl.i], m.classLogs[cl.log], slot)+cost > cl.limit {
			return false
		}
	}
	return true
}

// record books call id of cost units for key at t, decided at now.
func (m *Model) record(now int64, id, key string, cost int, t int64) {
	for i, r := range m.rules {
		name := m.name(i, key)
		switch r.Kind {
		case Bucket:
			m.tat[name] = max(m.tat[name], t) + int64(cost)*r.Every
			m.last[name] = id
			m.logs[name] = append(m.logs[name], entry{at: t, id: id, cost: cost})
		case Concurrency:
			m.logs[name] = append(m.logs[name], entry{at: t + r.Lease, id: id, cost: cost})
			m.held[name] = append(m.held[name], hold{from: now, to: t + r.Lease, id: id, cost: cost})
		default:
			m.logs[name] = append(m.logs[name], entry{at: t, id: id, cost: cost})
		}
	}
}

// Cancel gives back the booking of call id, of cost units, for key, made
// for time slot.
func (m *Model) Cancel(id, key string, cost int, slot, now int64) {
	m.Settle(id, key, cost, 0, slot, now)
	for i, r := range m.rules {
		if r.Kind == Concurrency {
			m.release(i, key, id, now)
		}
	}
}

// Release frees the concurrency units of call id at time now.
func (m *Model) Release(id, key string, now int64) {
	for i, r := range m.rules {
		if r.Kind == Concurrency {
			m.release(i, key, id, now)
		}
	}
}

func (m *Model) release(i int, key, id string, now int64) {
	name := m.name(i, key)
	kept := []entry{}
	for _, e := range m.logs[name] {
		if e.id != id {
			kept = append(kept, e)
		}
	}
	m.logs[name] = kept
	for j, h := range m.held[name] {
		if h.id == id {
			m.held[name][j].to = min(h.to, now)
		}
	}
}

// Settle changes the cost of call id, booked for time slot, from one count
// of units to another.
func (m *Model) Settle(id, key string, from, to int, slot, now int64) {
	m.changeClasses(id, from, to)
	for i, r := range m.rules {
		name := m.name(i, key)
		if r.Kind == Concurrency {
			continue
		}
		if r.Kind == Bucket {
			// A bucket keeps one time, not a history: only its latest call
			// can give units back, and a charge ends the chain.
			switch {
			case to > from:
				m.tat[name] = max(m.tat[name], now) + int64(to-from)*r.Every
				m.last[name] = ""
			case m.last[name] == id:
				m.tat[name] -= int64(from-to) * r.Every
				if to == 0 {
					m.last[name] = ""
				}
			default:
				continue
			}
		}
		for k, e := range m.logs[name] {
			if e.id == id {
				m.logs[name][k].cost += to - from
			}
		}
	}
}

// Violations checks each rule's promise on the model's history, by brute
// force, and describes every breach: a Log or Counter window of length Window
// holding more than Limit units, a Bucket admitting more than Limit units
// plus one per Every in some span, or a Concurrency rule holding more than
// Limit slots at some moment.
func (m *Model) Violations() []string {
	var out []string
	for name, hs := range m.held {
		limit := m.rules[int(name[0]-'0')].Limit
		for _, at := range hs {
			n := 0
			for _, h := range hs {
				if h.from <= at.from && at.from < h.to {
					n += h.cost
				}
			}
			if n > limit {
				out = append(out, name+": "+strconv.Itoa(n)+" slots held at "+strconv.FormatInt(at.from, 10))
			}
		}
	}
	for name, log := range m.logs {
		i, _ := strconv.Atoi(name[:1])
		r := m.rules[i]
		switch r.Kind {
		case Log, Counter:
			for _, e := range log {
				if n := units(log, e.at-r.Window, e.at); n > r.Limit {
					out = append(out, name+": "+strconv.Itoa(n)+" units in the window ending at "+strconv.FormatInt(e.at, 10))
				}
			}
		case Bucket:
			for _, a := range log {
				for _, b := range log {
					if b.at < a.at {
						continue
					}
					if n := units(log, a.at-1, b.at); int64(n) > int64(r.Limit)+(b.at-a.at)/r.Every {
						out = append(out, name+": "+strconv.Itoa(n)+" units between "+strconv.FormatInt(a.at, 10)+" and "+strconv.FormatInt(b.at, 10))
					}
				}
			}
		}
	}
	return out
}
