package model

import (
	"math"
	"sort"
	"strconv"
	"strings"
)

// Classes, as lua/acquire.lua states them: the calls of a quota fall into
// classes, their priority and, under a rule every key shares, their key.
// Each Log and Counter rule counts what each class booked, by period of a
// quarter of its Span, and what of it had to wait; a call books, besides
// every rule, in a log of its class alone whose limit leaves the classes
// that rank above it their demand (hold). The model reads the classes once
// per script, as the script does, and writes what the script booked when
// it ends.
const (
	classPeriods = 4
	classKept    = 6
	classFloor   = 10
)

// class is what one class booked under one rule: units by the period of
// their slots (p), of which booked ahead (a), and the units of its calls
// that waited, by the period they asked in (w); d is its demand as the
// script read it, in thousandths, or -1 until computed.
type class struct {
	prio    int
	p, w, a map[int64]int
	d       int64
	young   bool // younger than a window when d was computed
}

// callClass is a call's class under rule i: its name, the rule's name for
// the key, the log of the class, and the limit of that log, 0 when the
// rule holds nothing against the class.
type callClass struct {
	i               int
	name, rule, log string
	limit           int
}

// period is the period of time t under rule r.
func period(r Rule, t int64) int64 {
	return floorDiv(t, max(r.Span/classPeriods, 1))
}

// className is the class of a call of priority prio for key under rule r.
func (m *Model) className(r Rule, key string, prio int) string {
	name := strconv.Itoa(prio)
	if m.perKey && !r.PerKey {
		name += "/" + key
	}
	return name
}

// read returns the classes of the rule named rule as the current script
// reads them: the periods of the last window and a half and ahead.
func (m *Model) read(r Rule, rule string) map[string]*class {
	if cs, ok := m.seen[rule]; ok {
		return cs
	}
	oldest := period(r, m.now) - classKept
	cs := map[string]*class{}
	for name, c := range m.classes[rule] {
		k := &class{prio: c.prio, p: map[int64]int{}, w: map[int64]int{}, a: map[int64]int{}, d: -1}
		for pi, u := range c.p {
			if pi >= oldest {
				k.p[pi], k.w[pi], k.a[pi] = u, c.w[pi], c.a[pi]
			}
		}
		if len(k.p) > 0 {
			cs[name] = k
		}
	}
	m.seen[rule] = cs
	return cs
}

// demand is class c's units per window in force under rule r, in
// thousandths, as the script reckons it.
func (m *Model) demand(r Rule, c *class) int64 {
	if c.d >= 0 {
		return c.d
	}
	var ps []int64
	for pi := range c.p {
		ps = append(ps, pi)
	}
	sort.Slice(ps, func(a, b int) bool { return ps[a] < ps[b] })
	cur := period(r, m.now)
	most := 0
	for i := range ps {
		if ps[i] < cur-classPeriods {
			continue
		}
		sum := 0
		for j := i; j < len(ps) && ps[j] < ps[i]+classPeriods; j++ {
			u := c.p[ps[j]]
			if ps[j] <= cur-classPeriods {
				// Booked ahead into the oldest period the runs read: a
				// backlog served and leaving the window.
				u = max(u-c.a[ps[j]], 0)
			}
			sum += u
		}
		most = max(most, sum)
	}
	age := max(ps[len(ps)-1], cur) - ps[0] + 1
	d := float64(most) * 1000
	c.young = age < classPeriods
	if c.young {
		d = math.Floor(d * classPeriods / float64(age))
	}
	for pi := cur - classPeriods + 1; pi <= cur; pi++ {
		d += float64(c.w[pi]) * 1000
	}
	c.d = int64(math.Floor(d * float64(m.window(r)) / float64(r.Span)))
	return c.d
}

// fairShare is the max-min fair share of room among demands ds.
func fairShare(ds []int64, room int64) int64 {
	sort.Slice(ds, func(a, b int) bool { return ds[a] < ds[b] })
	for i, d := range ds {
		level := room / int64(len(ds)-i)
		if d > level {
			return level
		}
		room -= d
	}
	return math.MaxInt64
}

// hold is the units rule r holds against a call of class name and
// priority prio, among classes cs.
func (m *Model) hold(r Rule, cs map[string]*class, name string, prio int) int {
	var mine int64
	if own, ok := cs[name]; ok {
		mine = m.demand(r, own)
	}
	floor := max(r.Limit/classFloor, 1)
	var above, lower int64
	peers, lighter := []int64{mine}, []int64{}
	for n, c := range cs {
		if n == name {
			continue
		}
		d := m.demand(r, c)
		switch {
		case c.prio > prio && c.young:
			above += max(d, int64(floor)*1000)
		case c.prio > prio:
			above += d
		case c.prio < prio:
			lower += min(d, int64(floor)*1000)
		default:
			peers = append(peers, d)
			if d < mine {
				lighter = append(lighter, d)
			}
		}
	}
	hold := above
	fair := fairShare(peers, max(int64(r.Limit)*1000-above, 0))
	for _, d := range lighter {
		hold += min(d, fair)
	}
	if mine+hold >= int64(r.Limit-floor)*1000 {
		hold += lower
	}
	if hold == 0 {
		return 0
	}
	units := int((hold + 999) / 1000)
	return min(units+units/32+1, r.Limit-floor)
}

// callClasses returns the classes of a call of cost for key and priority
// prio, under each Log and Counter rule that serves classes.
func (m *Model) callClasses(key string, prio, cost int) []callClass {
	var out []callClass
	for i, r := range m.rules {
		if r.Kind != Log && r.Kind != Counter {
			continue
		}
		rule, name := m.name(i, key), m.className(r, key, prio)
		if name != "0" {
			m.classesUntil = max(m.classesUntil, m.now+2*r.Span)
		} else if m.classesUntil <= m.now {
			// The meta says no class called lately: nothing is read.
			continue
		}
		cs := m.read(r, rule)
		if len(cs) == 0 && name == "0" {
			continue
		}
		if len(cs) == 0 {
			m.fillDefault(i, rule)
		}
		c := callClass{i: i, name: name, rule: rule, log: rule + "|" + name}
		if h := m.hold(r, cs, name, prio); h > 0 {
			c.limit = max(r.Limit-h, cost)
		}
		out = append(out, c)
	}
	return out
}

// fillDefault copies into the default class's log under rule i, named
// rule, the entries the rule holds up to now (a counter's: up to now's
// bucket), as lua/acquire.lua's fill_default does when a class first calls
// under a rule whose classes noted none: every one of them is a call of
// the default class, which called alone, unlogged; those booked ahead
// book again when the news of the class wakes them. The script copies
// those a window may still count; the model copies them all, since no
// window counts the others again. Once per script.
func (m *Model) fillDefault(i int, rule string) {
	if m.filled[rule] {
		return
	}
	m.filled[rule] = true
	to := rule + "|0"
	r := m.rules[i]
	for _, e := range m.logs[rule] {
		if e.cost == 0 {
			// Given back: no longer in the rule's log.
			continue
		}
		if e.at > m.now && (r.Kind == Log || floorDiv(e.at, r.Width) > floorDiv(m.now, r.Width)) {
			// Booked ahead (a counter: in a later bucket than now's):
			// it books again when the news wakes it.
			continue
		}
		if r.Kind == Log {
			m.classLogs[to] = zaddLog(m.classLogs[to], e)
		} else {
			m.classLogs[to] = append(m.classLogs[to], e)
		}
	}
}

// zaddLog adds entry e to a class's log as ZADD adds the members of its
// units (id, id.2, ...): the units an entry of the same id holds move to
// e's time, and those beyond e's cost stay where they were.
func zaddLog(log []entry, e entry) []entry {
	out := make([]entry, 0, len(log)+1)
	for _, x := range log {
		if x.id == e.id {
			if x.cost = max(x.cost-e.cost, 0); x.cost == 0 {
				continue
			}
		}
		out = append(out, x)
	}
	return append(out, e)
}

// noteClasses records call id, of cost, booked at t, in the logs of its
// classes cls, and adds it to their demand.
func (m *Model) noteClasses(cls []callClass, id string, cost int, t int64) {
	if len(cls) > 0 {
		m.booked[id] = bookedIn{cls: cls, t: t, cost: cost, ahead: t > m.now}
	}
	for _, c := range cls {
		r := m.rules[c.i]
		if e := (entry{at: t, id: id, cost: cost}); r.Kind == Log {
			// A log holds each unit of a call once: booked again, the
			// call's units move (a copied entry's too, see fillDefault).
			m.classLogs[c.log] = zaddLog(m.classLogs[c.log], e)
		} else {
			m.classLogs[c.log] = append(m.classLogs[c.log], e)
		}
		a := m.added(c)
		a.p[period(r, t)] += cost
		if t > m.now {
			a.a[period(r, t)] += cost
		}
		if c.name != "0" {
			m.classesUntil = max(m.classesUntil, max(t, m.now)+2*r.Span)
		}
		if t > m.now {
			a.w[period(r, m.now)] += cost
		}
	}
}

// bookedIn is where a call counts in its classes: cls as callClasses
// gave them, its slot and cost, and whether it was booked ahead.
type bookedIn struct {
	cls   []callClass
	t     int64
	cost  int
	ahead bool
}

// leaving is a change d of a booking's units in its classes' demand, left
// for the script's end.
type leaving struct {
	in bookedIn
	d  int
}

// changeClasses changes the cost of call id from `from` to `to` in its
// classes, as lua/lib.lua's change_classes does: in the logs of those
// that hold against it, and in their demand at its slot's period, at
// once, or, for a booking given back in a script (a call that moves),
// when the script ends.
func (m *Model) changeClasses(id string, from, to int) {
	in, ok := m.booked[id]
	if !ok || from == to {
		return
	}
	for _, c := range in.cls {
		log := m.classLogs[c.log]
		for k := range log {
			if log[k].id == id {
				log[k].cost += to - from
			}
		}
	}
	in.cost = to
	m.booked[id] = in
	if to == 0 {
		delete(m.booked, id)
	}
	if m.inScript && to == 0 {
		m.leave = append(m.leave, leaving{in, to - from})
		return
	}
	m.changeDemand(in, to-from)
}

// changeDemand changes by d the units booking in counts for in its
// classes' demand at its slot's period, never below 0.
func (m *Model) changeDemand(in bookedIn, d int) {
	for _, c := range in.cls {
		k := m.classes[c.rule][c.name]
		if k == nil {
			continue
		}
		pi := period(m.rules[c.i], in.t)
		if u, ok := k.p[pi]; ok {
			k.p[pi] = max(u+d, 0)
			if in.ahead {
				k.a[pi] = max(k.a[pi]+d, 0)
			}
		}
	}
}

// noteRefused adds a refused call of cost to the units of its classes cls
// that waited.
func (m *Model) noteRefused(cls []callClass, cost int) {
	for _, c := range cls {
		m.added(c).w[period(m.rules[c.i], m.now)] += cost
	}
}

// unnoteRefused takes back what noteRefused added for a call of cost that
// was kept, not refused (KeepIn): a period left with nothing that waited
// is no period of the class's.
func (m *Model) unnoteRefused(cls []callClass, cost int) {
	for _, c := range cls {
		w := m.added(c).w
		pi := period(m.rules[c.i], m.now)
		if w[pi] -= cost; w[pi] == 0 {
			delete(w, pi)
		}
	}
}

// added returns what the current script added to class c.
func (m *Model) added(c callClass) *class {
	adds := m.adds[c.rule]
	if adds == nil {
		adds = map[string]*class{}
		m.adds[c.rule] = adds
	}
	a := adds[c.name]
	if a == nil {
		a = &class{p: map[int64]int{}, w: map[int64]int{}, a: map[int64]int{}}
		adds[c.name] = a
	}
	return a
}

// writeClasses writes what the script booked into the classes, keeping
// the periods of the last window and a half and ahead.
func (m *Model) writeClasses(now int64) {
	for rule, adds := range m.adds {
		i, _ := strconv.Atoi(rule[:strings.IndexAny(rule+":", ":")])
		r := m.rules[i]
		oldest := period(r, now) - classKept
		if m.classes[rule] == nil {
			m.classes[rule] = map[string]*class{}
		}
		for name, a := range adds {
			c := m.classes[rule][name]
			if c == nil {
				prio, _ := strconv.Atoi(strings.SplitN(name, "/", 2)[0])
				c = &class{prio: prio, p: map[int64]int{}, w: map[int64]int{}, a: map[int64]int{}}
				m.classes[rule][name] = c
			}
			for pi, u := range a.p {
				c.p[pi] += u
			}
			for pi, u := range a.a {
				c.a[pi] += u
			}
			for pi, w := range a.w {
				c.p[pi] += 0
				c.w[pi] += w
			}
			for pi := range c.p {
				if pi < oldest {
					delete(c.p, pi)
					delete(c.w, pi)
					delete(c.a, pi)
				}
			}
		}
	}
	m.adds = map[string]map[string]*class{}
}
