package throttle

import (
	"context"
	"sync"
	"time"
)

// Spare admissions: the cheap path of a call that finds the quota far from
// full. A process that asks for calls of one scope (the quota, or one key
// of it) many times in a few milliseconds while the quota has plenty of
// room takes, in the script call that decides one of them, a few more
// admissions (spares), and gives them to its next calls without asking
// Redis. A spare is an admission like any other: recorded in Redis, at the
// time its script ran, in every window of every rule, counted by every
// replica.
//
// A call that takes a spare starts later after that time than a call
// admitted by its own script call, and the late-start guard allows any call
// at most half the margin in force. So a spare is given only while a call
// starting now is no later than a quarter of that margin, only while the
// margin is the configured one (a fleet whose spread widened it has no room
// to spend), and only in the epoch, with no pause and no step of Redis's
// clock since it was taken, and only while this process's own calls start
// no later than that (a process whose calls start late tells the fleet at
// once, with its next script call). How late a call that took a spare
// starts is noted like any other call's, so that the fleet's spread, and
// the margin that follows it, sees it.
//
// A pool takes no more than a quarter of the units the quota had free, no
// more than maxSpares, and no more than the calls of the scope that came in
// the last pool's lifetime; and none within spareIdle of a call of the
// scope that had to wait or was refused: a contended quota has no room to
// hold. A process that calls now and then never takes any, and one that
// stops leaves at most one pool unused, which it gives back once the pool
// can no longer be used. A quota with a Concurrency rule never pools: its
// admissions hold a slot until released.

const (
	// maxSpares bounds the admissions one pool takes.
	maxSpares = 16
	// spareShare: a pool takes at most 1/spareShare of the units the quota
	// has free, and lives a 1/spareShare of the margin.
	spareShare = 4
	// spareRun is how many calls of a scope must come in since its last pool
	// before it takes another.
	spareRun = 4
	// spareIdle is how long a scope that took no pool keeps counting its
	// calls, and how long an unused pool is kept in memory.
	spareIdle = time.Second
	// maxPools bounds the scopes a limiter counts calls of at once: with
	// many keys, those that called lately, whose pools the sweep keeps.
	maxPools = 1024
)

// spares is the pools of a limiter, one per scope that called lately.
type spares struct {
	mu    sync.Mutex
	pools map[string]*pool
	added int       // pools created since the last sweep
	swept time.Time // when the last sweep ran
}

// pool is the spare admissions of one scope, and what sizes the next.
type pool struct {
	r       result   // the admission the spares share: slot, epoch, margin
	members []string // unused spares
	step    uint64   // the timing's forward steps when they were taken
	gen     int      // counts the fills, so that a timer gives back only its own

	stale []result // spares that can no longer be used, to give back

	since     time.Time     // start of the count of calls
	asked     int           // calls of the scope since then
	margin    time.Duration // the margin in force as the last reply said
	remaining int           // units free after the last reply's calls
	room      int           // the same under the rules alone (see callReply.room)
	used      time.Time     // the last call of the scope
	contended time.Time     // the last reply that booked or refused a call of the scope
}

// mayPool reports whether the limiter's quota may take spares at all: one
// with a Concurrency rule never does, nor one with no guarded margin, whose
// calls have no lateness to spend.
func (l *Limiter) mayPool() bool {
	return !l.cfg.hasConc && len(l.cfg.units) == 0 && l.cfg.guardMin > 0 && !isOff(offSpares)
}

// takeSpare gives call c of scope sc a spare admission, if its pool holds a
// usable one, and counts the call for the next pool's size either way.
func (l *Limiter) takeSpare(sc scope, c call) (result, bool) {
	if !l.mayPool() {
		return result{}, false
	}
	now := time.Now()
	l.spares.mu.Lock()
	defer l.spares.mu.Unlock()
	p := l.spares.pools[sc.id]
	if p == nil {
		l.sweepSpares(now)
		if len(l.spares.pools) >= maxPools {
			return result{}, false
		}
		if l.spares.pools == nil {
			l.spares.pools = map[string]*pool{}
		}
		p = &pool{since: now}
		l.spares.pools[sc.id] = p
		l.spares.added++
	}
	p.asked++
	p.used = now
	if len(p.members) == 0 || c.lead > 0 || c.cost != p.r.cost || p.r.class != l.classOf(c, sc) {
		// A spare counts in the class it was booked in: a call of
		// another class asks Redis, which notes its class and holds
		// each its share.
		return result{}, false
	}
	if !l.spareUsable(p) {
		p.dropSpares()
		return result{}, false
	}
	r := p.r
	r.member = p.members[len(p.members)-1]
	p.members = p.members[:len(p.members)-1]
	r.remaining = p.remaining + len(p.members)*r.cost
	r.room = p.room + len(p.members)*r.cost
	return r, true
}

// spareUsable reports whether a call starting now may take one of p's
// spares.
func (l *Limiter) spareUsable(p *pool) bool {
	r := p.r
	if l.overtaken(r) {
		return false
	}
	if seq, _, _ := l.timing.step(); seq != p.step {
		return false
	}
	late, ok := l.timing.lateness(r.startsAt())
	if !ok || late+l.timing.unsure() > r.margin/spareShare {
		return false
	}
	// A process whose calls started later than that since it last told the
	// fleet tells it with its next call, which asks Redis.
	return l.lates.latest() <= r.margin/spareShare
}

// heldSpares returns how many unused spare admissions of each cost this
// process holds in Redis's log for scope sc. Those it may no longer take
// (spareUsable) count too: its next script call gives them back before it
// decides, so they are free for that call as well. Those of an epoch since
// lost are in no log.
func (l *Limiter) heldSpares(sc scope) map[int]int {
	l.spares.mu.Lock()
	defer l.spares.mu.Unlock()
	p := l.spares.pools[sc.id]
	if p == nil {
		return nil
	}
	epoch, held := l.view.epoch.Load(), map[int]int{}
	if p.r.epoch == epoch && len(p.members) > 0 {
		held[p.r.cost] += len(p.members)
	}
	for _, s := range p.stale {
		if s.epoch == epoch {
			held[s.cost]++
		}
	}
	return held
}

// dropSpares moves p's unused spares to those to give back.
func (p *pool) dropSpares() {
	for _, m := range p.members {
		r := p.r
		r.member = m
		p.stale = append(p.stale, r)
	}
	p.members = nil
}

// spareTerms returns, for a script call deciding batch in scope sc, the
// spares to give back in it, and how many spares of what cost it should
// take.
func (l *Limiter) spareTerms(sc scope, batch []*request) (give []result, n, cost int) {
	if !l.mayPool() {
		return nil, 0, 0
	}
	now := time.Now()
	l.spares.mu.Lock()
	defer l.spares.mu.Unlock()
	p := l.spares.pools[sc.id]
	if p == nil {
		return nil, 0, 0
	}
	cost = likeCost(sc, batch)
	if len(p.members) > 0 && (cost != p.r.cost && len(batch) > 0 || p.remaining < len(batch)*cost+len(p.members)*p.r.cost || !l.spareUsable(p)) {
		// The batch holds a call that could not take a spare (of another
		// cost, or booked again), or calls the room left may not fit while
		// the spares hold their units: the spares go back before Redis
		// decides the batch, so that they never keep this process's own
		// calls out.
		p.dropSpares()
	}
	give, p.stale = p.stale, nil
	if cost == 0 || len(p.members) > 0 || p.asked < spareRun {
		return give, 0, 0
	}
	life := p.margin / spareShare
	if p.margin < minGuardedMargin || p.margin > l.cfg.guardMin || life <= 0 || now.Sub(p.contended) < spareIdle {
		return give, 0, 0
	}
	elapsed := max(now.Sub(p.since), time.Microsecond)
	n = int(int64(p.asked) * int64(life) / int64(elapsed))
	n = min(n, maxSpares, maxBatch-len(batch), p.remaining/spareShare/cost)
	if n > 0 || elapsed > spareIdle {
		p.since, p.asked = now, 0
	}
	return give, max(n, 0), cost
}

// likeCost returns the cost every call of batch has, or 0 when they
// differ, when one is of another scope than sc, booked again or asking for
// a slot ahead, or when there are none: only a batch of like calls takes
// spares.
func likeCost(sc scope, batch []*request) int {
	if len(batch) == 0 {
		return 0
	}
	cost := batch[0].c.cost
	for _, req := range batch {
		if req.sc.id != sc.id || req.late != nil || req.c.lead > 0 || req.c.cost != cost {
			return 0
		}
	}
	return cost
}

// keepSpares keeps what a script call that decided batch, with scope sc
// first, said of sc: the units free after its last call of sc, whether it
// booked or refused one, and the spares it admitted (members, of cost each,
// after the batch's calls in rep).
func (l *Limiter) keepSpares(sc scope, batch []*request, rep acquireReply, members []string, cost int, stale bool, gaps uint64) {
	var last callReply
	seen, contended := false, false
	for i := len(rep.calls) - 1; i >= 0; i-- {
		if i < len(batch) && batch[i].sc.id != sc.id {
			continue
		}
		c := rep.calls[i]
		if !seen {
			last, seen = c, true
		}
		if !c.admitted || c.wait > 0 {
			contended = true
		}
	}
	if !seen {
		return
	}
	var taken []string
	// The spares of one script call count alike in their class, and go to
	// calls of that class only (takeSpare).
	r := result{admitted: true, now: rep.now, pause: rep.pause, scope: sc, cost: cost, epoch: rep.epoch, margin: rep.margin, done: rep.done, stale: stale, gaps: gaps}
	r.class, r.prio = l.spareClass(batch, sc)
	for i, m := range members {
		if c := rep.calls[len(batch)+i]; c.admitted && c.wait == 0 {
			if len(taken) == 0 {
				r.noted, r.logged = c.noted, c.logged
			}
			taken = append(taken, m)
		}
	}
	l.fillSpares(sc, rep.margin, last, contended, r, taken)
}

// fillSpares keeps what a script call that decided calls of scope sc said:
// the margin and the units free after them (as its last answer of sc,
// last, says), whether it booked or refused one (the quota is contended:
// no spares for spareIdle), and the spares it admitted, r being the first
// of them. A reply decided by a clock that had
// just stepped gives its spares back.
func (l *Limiter) fillSpares(sc scope, margin time.Duration, last callReply, contended bool, r result, members []string) {
	l.spares.mu.Lock()
	defer l.spares.mu.Unlock()
	p := l.spares.pools[sc.id]
	if p == nil {
		if len(members) == 0 {
			return
		}
		p = &pool{since: time.Now()}
		l.spares.pools[sc.id] = p
	}
	p.margin, p.remaining, p.room = margin, last.remaining, last.room
	if contended {
		p.contended = time.Now()
	}
	if len(members) == 0 {
		return
	}
	p.dropSpares()
	p.r, p.members = r, members
	p.step, _, _ = l.timing.step()
	if r.stale {
		p.dropSpares()
		return
	}
	p.gen++
	gen := p.gen
	// Past a quarter of the margin, the spares can no longer be used: unless
	// a call of the scope gives them back first, a timer does.
	l.work.after(margin/spareShare+time.Millisecond, func() { l.returnSpares(sc, gen) })
}

// returnSpares gives back the spares of scope sc taken by fill gen, if they
// are still unused and no script call gave them back.
func (l *Limiter) returnSpares(sc scope, gen int) {
	l.spares.mu.Lock()
	p := l.spares.pools[sc.id]
	if p == nil || p.gen != gen || len(p.members) == 0 && len(p.stale) == 0 {
		l.spares.mu.Unlock()
		return
	}
	if len(p.members) > 0 && !l.spareUsable(p) {
		p.dropSpares()
	}
	l.spares.mu.Unlock()
	l.decide(sc, nil)
}

// dropAllSpares gives back every unused spare of the limiter.
func (l *Limiter) dropAllSpares(ctx context.Context) {
	l.spares.mu.Lock()
	var scopes []scope
	for _, p := range l.spares.pools {
		p.dropSpares()
		if len(p.stale) > 0 {
			scopes = append(scopes, p.stale[0].scope)
		}
	}
	l.spares.mu.Unlock()
	for _, sc := range scopes {
		if ctx.Err() != nil {
			return
		}
		l.decide(sc, nil)
	}
}

// sweepSpares forgets the pools of scopes that called no more for
// spareIdle, once enough pools were created since the last sweep, or when
// there are maxPools of them (then at most ten times per spareIdle).
func (l *Limiter) sweepSpares(now time.Time) {
	many := l.spares.added >= 64 && l.spares.added >= len(l.spares.pools)/2
	full := len(l.spares.pools) >= maxPools && now.Sub(l.spares.swept) > spareIdle/10
	if !many && !full {
		return
	}
	l.spares.added, l.spares.swept = 0, now
	for id, p := range l.spares.pools {
		if now.Sub(p.used) > spareIdle && len(p.members) == 0 && len(p.stale) == 0 {
			delete(l.spares.pools, id)
		}
	}
}
