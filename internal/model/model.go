// Package model is the reference statement of a strict sliding window with
// bookings, written by brute force so that it can be trusted by reading it.
// Tests drive the Redis script and this model with the same calls and compare
// every decision.
package model

import "sort"

// Rule is one sliding-log limit: at most Limit units in any window of Window
// microseconds. A PerKey rule keeps one log per key.
type Rule struct {
	Limit  int
	Window int64
	PerKey bool
}

type entry struct {
	at   int64
	id   string
	cost int
}

// Model holds every admitted or booked unit of every log, forever.
type Model struct {
	rules []Rule
	logs  map[string][]entry
}

// New returns an empty model of a quota with the given rules.
func New(rules ...Rule) *Model {
	return &Model{rules: rules, logs: map[string][]entry{}}
}

// Decision is what the model decides for one call.
type Decision struct {
	Admitted  bool
	Wait      int64 // until the call's slot; when refused, until it would fit
	Remaining int
}

func (m *Model) logName(i int, key string) string {
	name := string(rune('0' + i))
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

// fits reports whether cost more units at t keep every window of the log
// within limit. The count of a window (u-w, u] changes only where an entry
// enters it, so the windows ending at t and at each entry in (t, t+w) are the
// only ones to check.
func fits(log []entry, r Rule, t int64, cost int) bool {
	ends := []int64{t}
	for _, e := range log {
		if e.at > t && e.at < t+r.Window {
			ends = append(ends, e.at)
		}
	}
	for _, u := range ends {
		if units(log, u-r.Window, u)+cost > r.Limit {
			return false
		}
	}
	return true
}

// Acquire decides a call of cost units for key at time now that accepts a
// wait of at most maxWait, and records it under id when it is admitted.
func (m *Model) Acquire(now int64, id, key string, cost int, maxWait int64) Decision {
	// The earliest allowed time is now or the moment some entry leaves a
	// window; try them in order.
	cands := []int64{now}
	remaining := m.rules[0].Limit
	for i, r := range m.rules {
		log := m.logs[m.logName(i, key)]
		for _, e := range log {
			if e.at+r.Window > now {
				cands = append(cands, e.at+r.Window)
			}
		}
		// Bookings ahead count too, so a log can hold more than its
		// limit and this can go negative.
		remaining = min(remaining, r.Limit-units(log, now-r.Window, 1<<62))
	}
	sort.Slice(cands, func(a, b int) bool { return cands[a] < cands[b] })
	var t int64
	for _, c := range cands {
		ok := true
		for i, r := range m.rules {
			if !fits(m.logs[m.logName(i, key)], r, c, cost) {
				ok = false
				break
			}
		}
		if ok {
			t = c
			break
		}
	}
	wait := t - now
	if wait > maxWait {
		return Decision{Wait: wait, Remaining: max(remaining, 0)}
	}
	for i := range m.rules {
		name := m.logName(i, key)
		m.logs[name] = append(m.logs[name], entry{at: t, id: id, cost: cost})
	}
	remaining -= cost
	if remaining < 0 || wait > 0 {
		remaining = 0
	}
	return Decision{Admitted: true, Wait: wait, Remaining: remaining}
}

// Cancel removes the booking recorded under id from every log.
func (m *Model) Cancel(id string) {
	for name, log := range m.logs {
		kept := log[:0]
		for _, e := range log {
			if e.id != id {
				kept = append(kept, e)
			}
		}
		m.logs[name] = kept
	}
}

// MaxInWindow returns, for every log, the most units any window of its rule
// ever held. The promise is that it never exceeds the rule's Limit.
func (m *Model) MaxInWindow() map[string]int {
	out := map[string]int{}
	for i, r := range m.rules {
		for name, log := range m.logs {
			if name[0] != byte('0'+i) {
				continue
			}
			for _, e := range log {
				if n := units(log, e.at-r.Window, e.at); n > out[name] {
					out[name] = n
				}
			}
		}
	}
	return out
}
