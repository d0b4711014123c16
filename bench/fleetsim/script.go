package main

import (
	"math"
)

// The acquire script for a quota of one SlidingLog rule, as
// lua/acquire.lua and lib.lua decide it, with what a saturated
// fleet exercises: the fleet's spread and the margins it gives, the holds,
// warming up, pacing, give-backs and the log's hint. Pauses, losses, learned
// caps, the Local fallback and costs other than 1 are left out.
const (
	// timingPeriod is TIMING_PERIOD: the fleet's spread is the
	// spreadQuantile of its latenesses over a period.
	timingPeriod   = 2_000_000
	lateBuckets    = 22
	spreadQuantile = 0.99
	spreadSamples  = 50
	// guarded is GUARDED: a margin under it never grows.
	guarded = 2000
	// maxMargin is MAX_MARGIN, the ceiling's own ceiling.
	maxMargin = 1_000_000
	// warmMargin is WARM_MARGIN.
	warmMargin = 200_000
	// warmIdle is WARM_IDLE.
	warmIdle = 60_000_000
	// maxRounds is how many rounds over the rules a call makes before its
	// search settles for the log's tail.
	maxRounds = 16
	// pacedScan is PACED_SCAN: what a search may still read once pacing
	// moved its call.
	pacedScan = 32
	// warmPacers is WARM_PACERS: while the quota warms up, a lone call is
	// paced when the log's latest warmPacers entries are the lone calls of
	// as many other limiters.
	warmPacers = 8
)

// quota is what Redis holds of one quota: its log, the log's hint, and the
// fields of the meta key the decisions read.
type quota struct {
	limit  int
	window int64 // configured, without the margin
	margin int64 // configured

	log  slidingLog
	hint hint

	created bool
	jp      int64 // the timing period the histogram is of
	js      int64 // the fleet's spread in force
	h       [lateBuckets]int
	hs, hu  int64
	ns, nu  int64
	wu, wh  int64
	la      int64
}

func newQuota(limit int, window, margin int64) *quota {
	return &quota{limit: limit, window: window, margin: margin}
}

// ceiling is margin_ceiling: the widest the margin grows.
func (q *quota) ceiling() int64 {
	if q.margin < guarded {
		return q.margin
	}
	return max(q.margin, min(q.window/10, maxMargin))
}

// scriptCall is one call a script decides.
type scriptCall struct {
	id      int64
	lim     int   // the limiter asking
	maxWait int64 // the longest wait it accepts
	lead    int64 // the least wait it asks for
}

// booking is a call's entry in the log: given back by a call that would
// start too late, or by a cancel.
type booking struct {
	id, at int64
}

// decision is the script's answer for one call.
type decision struct {
	admitted bool
	wait     int64 // until the slot; when refused, until it would fit
}

// scriptReply is what a script returns, and the work it did.
type scriptReply struct {
	now    int64
	margin int64 // the margin the calls are held to (the least of margins)
	paced  bool  // the log's calls that may wait are paced
	calls  []decision
	read   int // log entries read, the searches' budgets spent
}

// acquire runs the script at Redis time now for calls, after giving back
// gives, and folding report (the calling limiter's latenesses since its
// last report, by bucket) into the fleet's spread.
func (q *quota) acquire(now int64, report *[lateBuckets]int, gives []booking, calls []scriptCall) scriptReply {
	m, spread, warming := q.begin(now, report)
	rep := scriptReply{now: now, margin: m.own, paced: m.pace > 0}
	for _, g := range gives {
		q.giveBack(g, now, m)
	}
	q.log.dropUpTo(now - m.keep)
	n := len(q.log.e) - q.log.upTo(now-m.window)
	if warming && len(calls) == 1 && m.inUse >= guarded && m.pace == 0 {
		m.pace = q.warmPace(now, calls[0].lim)
		rep.read += min(len(q.log.e), warmPacers)
	}
	atOnce := false
	latest := int64(0)
	s := search{q: q, m: m, n: n, now: now}
	for _, c := range calls {
		t, read := s.slot(c)
		rep.read += read
		if t-now > c.maxWait {
			rep.calls = append(rep.calls, decision{wait: t - now})
			continue
		}
		q.log.add(t, c.id, c.lim)
		s.n++
		s.fits = false
		latest = max(latest, t)
		if t <= now {
			atOnce = true
		}
		rep.calls = append(rep.calls, decision{admitted: true, wait: t - now})
	}
	if warming && atOnce {
		q.wh = max(q.wh, now+m.keep)
	}
	if latest > 0 {
		q.holdSpread(now, spread, latest, m)
	}
	return rep
}

// begin is the script's start for one log: it folds report into the fleet's
// spread and rolls the holds, and returns the margins the calls are held
// to, the spread, and whether the quota warms up.
func (q *quota) begin(now int64, report *[lateBuckets]int) (m margin, spread int64, warming bool) {
	span := q.window + q.margin // longest_window: the window as configured, margin included
	start := !q.created || now-q.la > max(span, warmIdle)
	warming = start || q.wu > now
	held, warm := int64(0), false
	if q.created {
		q.noteTiming(now, report)
		q.rollHold(now)
		held, warm = q.heldSpread(now), q.wh > now
	}
	spread = q.fleetSpread(now)
	m = q.margins(spread, held, warm)
	if !q.created {
		q.created, q.jp = true, -1
	}
	if start {
		q.wu = now + span
	}
	q.la = now
	return m, spread, warming
}

// warmPace is the gap at which a lone call of limiter lim is paced while
// the quota warms up, or 0. It paces when the log's latest warmPacers
// entries are the lone calls of as many other limiters.
func (q *quota) warmPace(now int64, lim int) int64 {
	pace := q.window / int64(q.limit)
	e := q.log.e
	if len(e) < warmPacers || e[len(e)-1].at <= now-pace {
		return 0
	}
	others := map[int]bool{}
	for _, x := range e[len(e)-warmPacers:] {
		if x.lim != lim {
			others[x.lim] = true
		}
	}
	if len(others) == warmPacers {
		return pace
	}
	return 0
}

// slot is the earliest time at which call c fits, and the log entries its
// search read. Pacing moves the call at most twice, and never refuses a
// call that fits unpaced.
func (s *search) slot(c scriptCall) (t int64, read int) {
	t = s.now + c.lead
	budget := scanBudget
	rounds := 0
	moved, paces := true, 0
	if c.maxWait > 0 {
		paces = 2
	}
	unpaced, hasUnpaced := int64(0), false
	for moved {
		moved = false
		if rounds++; rounds > maxRounds {
			budget = 0
		}
		if u := s.earliest(t, &budget); u > t {
			t, moved = u, true
		}
		if !moved && paces > 0 {
			paces--
			p, r := s.paced(t)
			read += r
			if p > t && p-s.now <= c.maxWait {
				if !hasUnpaced {
					unpaced, hasUnpaced = t, true
				}
				t, moved = p, true
				budget = min(budget, pacedScan)
			}
		}
	}
	read += scanBudget - budget
	if hasUnpaced && t-s.now > c.maxWait {
		t = unpaced
	}
	return t, read
}

// paced is t moved to keep the pacing gap from every entry of the log, and
// the entries read to find it; t itself when the log is not paced.
func (s *search) paced(t int64) (int64, int) {
	if s.m.pace <= 0 {
		return t, 0
	}
	p, read := s.q.log.paced(t, s.m.pace)
	return max(p, t), read
}

// margin is what margins gives one log.
type margin struct {
	own    int64 // the margin the fleet's spread gives, which calls are held to
	inUse  int64 // the margin in force: halfway between own and the held one
	window int64 // the window in force, window + inUse
	keep   int64 // how long entries are kept
	pace   int64 // the gap between paced bookings, or 0
}

// margins is margins in lib.lua for one log.
func (q *quota) margins(spread, held int64, warm bool) margin {
	w, m := q.window, q.margin
	ceiling := q.ceiling()
	out := margin{own: m, inUse: m}
	if m >= guarded {
		own := min(max(m, 2*spread), ceiling)
		old := min(max(m, 2*max(spread, held)), ceiling)
		if warm {
			old = max(old, min(ceiling, warmMargin))
		}
		if ceiling > m && 2*spread >= ceiling {
			out.pace = w / int64(q.limit)
		}
		out.own, out.inUse = own, (own+old+1)/2
	}
	out.window, out.keep = w+out.inUse, w+ceiling
	return out
}

// noteTiming is note_timing: it folds a report into the period's
// histogram, rolls the period, and raises the spread as soon as the period
// shows more.
func (q *quota) noteTiming(now int64, report *[lateBuckets]int) {
	p := now / timingPeriod
	if q.jp != p {
		quant, n := quantile(&q.h)
		if q.jp == p-1 && q.wu > q.jp*timingPeriod {
			// The period held the warm-up: its spread was the start's.
			q.js = 0
		} else if q.jp == p-1 && n >= spreadSamples {
			q.js = quant
		} else if q.jp < p-1 {
			q.js = 0
		}
		q.jp, q.h = p, [lateBuckets]int{}
	}
	for k, n := range report {
		q.h[k] += n
	}
	if quant, n := quantile(&q.h); n >= spreadSamples && quant > q.js {
		q.js = quant
	}
}

// fleetSpread is fleet_spread, the usual delays of the processes left out:
// they differ by tens of microseconds on one machine.
func (q *quota) fleetSpread(now int64) int64 {
	if !q.created || q.jp < now/timingPeriod-1 {
		return 0
	}
	return q.js
}

func (q *quota) rollHold(now int64) {
	if q.hu > now || q.nu <= 0 {
		return
	}
	q.hs, q.hu, q.ns, q.nu = q.ns, q.nu, 0, 0
}

func (q *quota) heldSpread(now int64) int64 {
	switch {
	case q.hu > now:
		return q.hs
	case q.nu > now:
		return q.ns
	}
	return 0
}

// holdSpread is hold_spread.
func (q *quota) holdSpread(now, spread, slot int64, m margin) {
	if spread <= 0 {
		return
	}
	span := m.window + m.inUse
	s, u := &q.hs, &q.hu
	if spread < q.hs && q.hu > now {
		s, u = &q.ns, &q.nu
	}
	until := slot + span
	if spread > *s || *u <= now || until > *u+span/10 {
		if *u <= now || spread > *s {
			*s = spread
		}
		*u = max(*u, until+span/10)
	}
}

// giveBack is give_back and change for a log: the booking's entry goes, and
// the hint is lowered below it where that may make room.
func (q *quota) giveBack(g booking, now int64, m margin) {
	if !q.log.remove(g.at, g.id) {
		return
	}
	h := &q.hint
	t := g.at - m.keep
	if !h.set || h.at <= t {
		return
	}
	if g.at < now {
		// A slot already past makes room only from now on: the hint
		// stays if the entries from now on leave none within its window.
		if k := q.log.upTo(now-1) + q.limit - 1; k < len(q.log.e) && q.log.e[k].at < now+h.w {
			return
		}
	}
	h.at = t
}

// search is the state of the calls of one script: the log's count, what
// the script's searches found (memo and fits in acquire.lua).
type search struct {
	q      *quota
	m      margin
	now    int64
	n      int // entries after now - window, bookings included
	memoT  int64
	memoAt int64
	memo   bool
	fitsAt int64
	fits   bool
}

// earliest is earliest in acquire.lua for a log and a call of cost 1.
func (s *search) earliest(t int64, budget *int) int64 {
	q := s.q
	if s.n <= q.limit-1 {
		return t
	}
	if s.fits && s.fitsAt == t {
		return t
	}
	from := t
	if s.memo && s.memoT <= t && s.memoAt > from {
		from = s.memoAt
	}
	h := q.hint
	if h.set && h.t <= t && h.w <= s.m.window && h.at > from {
		from = h.at
	}
	at := q.log.earliest(from, q.limit, s.m.window, budget)
	s.memo, s.memoT, s.memoAt = true, t, at
	s.fits, s.fitsAt = true, at
	// A search from within the times the hint holds for joins it; one from
	// past the hint's room (a paced time) leaves it, unless that room is
	// already past.
	joins := h.set && h.w <= s.m.window && h.t <= t && h.at >= t
	if !h.set || h.t > t || h.w > s.m.window || at > h.at && (joins || h.at < s.now) {
		since := t
		if joins {
			since = h.t
		}
		q.hint = hint{t: since, at: at, w: s.m.window, set: true}
	}
	return at
}

// lateBucket is the bucket of a lateness in microseconds, as lates.note in
// timing.go counts it.
func lateBucket(late int64) int {
	if late < 1000 {
		return 0
	}
	return min(int(2*math.Log2(float64(late)/1000))+1, lateBuckets-1)
}

// bucketTop is bucket_top: the top of bucket k in microseconds.
func bucketTop(k int) int64 {
	if k == 0 {
		return 0
	}
	return int64(math.Floor(1000 * math.Pow(2, float64(k)/2)))
}

// quantile is quantile in lib.lua: the spreadQuantile of h at the top of
// its bucket, and how many latenesses h holds.
func quantile(h *[lateBuckets]int) (int64, int) {
	total := 0
	for _, n := range h {
		total += n
	}
	want, seen := spreadQuantile*float64(total), 0
	for k, n := range h {
		seen += n
		if float64(seen) >= want && seen > 0 {
			return bucketTop(k), total
		}
	}
	return 0, total
}
