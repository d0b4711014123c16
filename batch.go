package throttle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/throttlekit/throttle/internal/protocol"
)

// maxBatch bounds how many calls one script call decides.
const maxBatch = 32

// Calls of one process that need a decision at the same moment share one
// script call: while a decision is on its way to Redis, the calls that
// arrive meanwhile wait in the limiter's lane, and the next script call
// decides them all, in arrival order, whatever their keys: one script
// serves the calls of several keys of a quota. An uncontended call goes at
// once; a busy process pays one round trip per batch instead of one per
// call.

// lane holds the calls waiting for the next decision.
type lane struct {
	pending []*request
}

// request is one call waiting for its decision.
type request struct {
	sc      scope // the keys it touches
	c       call
	maxWait time.Duration
	member  string
	late    *result // a booking of this call to give back first: it would start too late
	asked   time.Time
	done    chan struct{}
	// deadline is when the call stops waiting for Redis, in Unix
	// nanoseconds: the Redis timeout after it asked, moved out each time
	// Redis answers a script call ahead of it (see answered).
	deadline atomic.Int64
	res      result
	err      error
	state    atomic.Int32 // requestWaiting, requestDecided or requestAbandoned
}

const (
	requestWaiting int32 = iota
	requestDecided
	requestAbandoned
)

// decideInRedis decides one call in Redis: it admits it, books it within
// maxWait, or refuses it. It waits no longer than ctx allows, and no longer
// than the limiter's Redis timeout for an answer (see request.deadline).
//
// A call that got a slot too late to start in it passes that booking as
// late: it is given back in the same script call that books the call again.
//
// A probe of the breaker goes alone, at once: it must not wait behind a
// script call that may be hanging on a dead node until its timeout (the
// one it probes for may have been promoted since).
func (l *Limiter) decideInRedis(ctx context.Context, sc scope, c call, maxWait time.Duration, late *result, probe bool) (result, error) {
	l.listen()
	req := &request{sc: sc, c: c, maxWait: maxWait, member: l.newMember(), late: late, asked: time.Now(), done: make(chan struct{})}
	if !probe && l.failedWhileQueued(c) {
		return result{}, l.unavailable(errQueuedBehindFailures)
	}
	deadline := time.Now().Add(l.s.redisTimeout)
	if f := c.moved; f != nil && f.by.Before(deadline) {
		if !time.Now().Before(f.by) {
			return result{}, f.err
		}
		deadline = f.by
	}
	req.deadline.Store(askDeadline(deadline))
	if probe {
		l.work.start(func() { l.decide(sc, []*request{req}) })
	} else if ln := l.submit(req); ln != nil {
		// Nothing was on its way: decide this call, and then the calls
		// that queued meanwhile. A caller that cannot give up decides in
		// its own goroutine, with no hand-over; one that can, in another,
		// which finishes the script call, and gives back what it booked,
		// if the caller leaves: a script call cut short by a deadline
		// closes its connection, and on a distant Redis every next call
		// would pay a new connection again and miss its deadline too.
		lead := func() {
			l.decide(sc, []*request{req})
			if batch := l.take(ln); batch != nil {
				l.work.start(func() { l.drain(ln, batch) })
			}
		}
		if ctx.Done() == nil {
			lead()
			return req.res, req.err
		}
		l.work.start(lead)
	}
	return l.await(ctx, req)
}

// await waits for the decision of req, no longer than ctx allows, nor than
// the Redis timeout after the script call ahead of it was last answered.
func (l *Limiter) await(ctx context.Context, req *request) (result, error) {
	var err error
	timer := time.NewTimer(time.Until(time.Unix(0, req.deadline.Load())))
	defer timer.Stop()
	for err == nil {
		select {
		case <-req.done:
			return req.res, req.err
		case <-ctx.Done():
			err = ctx.Err()
		case <-timer.C:
			// An answer to the script call ahead of this one moves the
			// deadline out; none came since the call asked.
			if left := time.Until(time.Unix(0, req.deadline.Load())); left > 0 {
				timer.Reset(left)
				continue
			}
			l.batches.lastFailure.Store(time.Now().UnixNano())
			err = l.unavailable(fmt.Errorf("no answer within %v: %w", l.s.redisTimeout, context.DeadlineExceeded))
		}
	}
	if !req.state.CompareAndSwap(requestWaiting, requestAbandoned) {
		// The decision came in at the same moment: keep it.
		<-req.done
		return req.res, req.err
	}
	return result{}, err
}

// errQueuedBehindFailures is the cause of a call that waited in the local
// queue (Queue mode) while Redis failed the calls ahead of it.
var errQueuedBehindFailures = errors.New("the calls ahead of this one in the queue found Redis failing, and it answered none since")

// failedWhileQueued reports whether Redis failed a script call since call c
// entered the local queue (Queue mode), and answered none since: the calls
// ahead of it in the queue waited for the same Redis, and it fails at once
// rather than wait a Redis timeout of its own after theirs.
func (l *Limiter) failedWhileQueued(c call) bool {
	if c.queued.IsZero() || isOff(offQueuedFailures) {
		return false
	}
	failed := l.batches.lastFailure.Load()
	return failed > c.queued.UnixNano() && failed > l.batches.lastAnswer.Load()
}

// askDeadline returns when a call that asked Redis stops waiting for it,
// at t, in Unix nanoseconds: never when the time runs from each call's own
// script call instead (switches.go), which the script call's context ends.
func askDeadline(t time.Time) int64 {
	if isOff(offBatches) {
		return math.MaxInt64
	}
	return t.UnixNano()
}

// answered moves out the Redis deadline of every call still waiting in the
// lane: Redis just answered the script call ahead of them, so their wait
// so far is no sign of a failing Redis, and their own script call gets the
// whole timeout. Waiting behind a script call that fails is: a call never
// waits for Redis longer than the timeout in all.
func (l *Limiter) answered() {
	now := time.Now()
	l.batches.lastAnswer.Store(now.UnixNano())
	deadline := askDeadline(now.Add(l.s.redisTimeout))
	l.batches.lanesMu.Lock()
	defer l.batches.lanesMu.Unlock()
	if l.batches.lane == nil {
		return
	}
	for _, req := range l.batches.lane.pending {
		req.deadline.Store(deadline)
	}
}

// submit puts req in the lane if a decision is on its way, and returns nil.
// Otherwise it opens the lane and returns it: the caller then decides req
// itself.
func (l *Limiter) submit(req *request) *lane {
	l.batches.lanesMu.Lock()
	defer l.batches.lanesMu.Unlock()
	if l.batches.lane != nil {
		l.batches.lane.pending = append(l.batches.lane.pending, req)
		return nil
	}
	l.batches.lane = &lane{}
	return l.batches.lane
}

// take takes the next batch of calls that queued in the lane while a
// decision was on its way, or closes the lane and returns nil when there are
// none.
func (l *Limiter) take(ln *lane) []*request {
	l.batches.lanesMu.Lock()
	defer l.batches.lanesMu.Unlock()
	var batch []*request
	most := maxBatch
	if isOff(offBatches) {
		most = 1
	}
	for len(ln.pending) > 0 && len(batch) < most {
		req := ln.pending[0]
		ln.pending = ln.pending[1:]
		if req.state.Load() == requestWaiting && req.aged() {
			batch = append(batch, req)
		}
	}
	if len(batch) == 0 {
		l.batches.lane = nil
	}
	return batch
}

// errOutrun is the answer to a move that waited in the lane until it
// could no longer pay (see aged): it was not sent, and the call sleeps on
// towards the slot it holds.
var errOutrun = errors.New("throttle: a move outrun by its slot")

// aged counts the time req waited in the lane out of its maxWait, which
// runs from when it asked: the script measures it from its own now, and
// would otherwise book a call past its deadline by that time (seed 548683:
// calls that waited 400 ms behind the script calls ahead of them, booked
// past their deadlines, refused as they slept, their slots idle). A move
// earlier (moveEarlier) that waited all the time its move could gain is
// not sent: its reply would come after the slot it holds, and make the
// call late for it (the same seed: ten calls of a window booked again
// behind the queue). It reports whether req is still to be decided; lanesMu
// is held.
func (req *request) aged() bool {
	waited := time.Since(req.asked)
	if req.c.moves && req.maxWait > 0 && req.maxWait <= waited {
		req.finish(result{}, errOutrun) // a check (keepPlace, maxWait 0) is always sent
		return false
	}
	req.maxWait = max(req.maxWait-waited, 0)
	return true
}

// drain decides batch, then every call that queued in the lane meanwhile,
// until the lane is empty.
func (l *Limiter) drain(ln *lane, batch []*request) {
	for len(batch) > 0 {
		l.decide(batch[0].sc, batch)
		batch = l.take(ln)
	}
}

// decide runs the acquire script once for a batch of calls, of scope sc
// and of any others, with the spare admissions of sc to give back and to
// take (spare.go); with no calls, to give spares back alone. It waits for
// Redis no longer than the Redis timeout.
func (l *Limiter) decide(sc scope, batch []*request) {
	movesFirst(batch)
	give, spares, spareCost := l.spareTerms(sc, batch)
	give = append(give, l.takeAbandoned(maxBatch)...)
	if len(batch) == 0 && len(give) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.s.redisTimeout)
	defer cancel()
	age, describing := l.describing()
	keys, args, members := l.batchArgs(sc, batch, lateOf(batch, give), spares, spareCost, age, describing)
	// A gap in the news from now on, however soon, may hide what would
	// make these decisions unusable.
	gaps := l.view.gaps.Load()
	sent := l.timing.now()
	v, err := l.runOn(ctx, scripts.acquire, keys, args).Int64Slice()
	recvd := l.timing.now()
	var rep acquireReply
	if err == nil {
		rep, err = decodeAcquire(v, len(batch)+spares)
	}
	if err != nil {
		l.failBatch(batch, recvd-sent, err)
		return
	}
	stale := l.noteAcquireReply(sc, rep, len(batch), sent, recvd)
	if describing != "" {
		l.view.described.Store(rep.epoch)
	}
	// The spares first: a caller that has its decision finds the pool it
	// filled (and Close, after the last call, gives it back).
	l.keepSpares(sc, batch, rep, members, spareCost, stale, gaps)
	l.finishBatch(sc, batch, rep, stale, gaps)
}

// lateOf returns the bookings a script call gives back: those of the calls
// of batch that got a slot too late to start in, then give.
func lateOf(batch []*request, give []result) []*result {
	var late []*result
	for _, req := range batch {
		if req.late != nil {
			late = append(late, req.late)
		}
	}
	for i := range give {
		late = append(late, &give[i])
	}
	return late
}

// scriptScopes returns the scopes of a script call for sc, the calls of
// batch and the bookings late to give back, and the place of each by its
// id, from 1. sc comes first: its keys are the script's KEYS, and the
// others' keys follow the arguments.
func scriptScopes(sc scope, batch []*request, late []*result) ([]scope, map[string]int) {
	scopes := []scope{sc}
	index := map[string]int{sc.id: 1}
	add := func(s scope) {
		if _, ok := index[s.id]; !ok {
			scopes = append(scopes, s)
			index[s.id] = len(scopes)
		}
	}
	for _, req := range batch {
		add(req.sc)
	}
	for _, r := range late {
		add(r.scope)
	}
	return scopes, index
}

// batchArgs returns the arguments of the acquire script that decides the
// calls of batch, gives back the bookings late, and takes spares spare
// admissions of cost spareCost for sc, and the members of those spares;
// described is the policy's description for the meta, or "". keys are
// the script call's KEYS: every key it may touch (see declared).
func (l *Limiter) batchArgs(sc scope, batch []*request, late []*result, spares, spareCost int, age int64, described string) (keys []string, args []any, members []string) {
	scopes, index := scriptScopes(sc, batch, late)
	lates := l.lates.report()
	head := l.acquireHead()
	head.Described, head.Age = described, age
	head.Lates, head.Scopes, head.Gives, head.Calls = int64(len(lates)), int64(len(scopes)), int64(len(late)), int64(len(batch)+spares)
	args = l.args(head)
	for _, x := range lates {
		args = x.Append(args)
	}
	for _, s := range scopes[1:] {
		for _, k := range s.keys[1:] {
			args = append(args, k)
		}
	}
	var classes []classIn // the classes the calls book in, by scope
	for _, r := range late {
		args = protocol.Give{Booking: r.booking(l.costArg(r.cost, r.named)), Scope: int64(index[r.scope.id])}.Append(args)
		if r.noted != 0 {
			classes = append(classes, classIn{r.scope, r.class})
		}
	}
	given := 0 // the place of a call's own booking among those given back
	for _, req := range batch {
		moves := 0
		if req.late != nil {
			if given++; req.c.moves {
				moves = given
			}
		}
		class := l.classOf(req.c, req.sc)
		classes = append(classes, classIn{req.sc, class})
		args = protocol.Call{ID: req.member, Cost: l.costArg(req.c.cost, req.c.named), Maxwait: req.maxWait.Microseconds(),
			Lead: req.c.lead.Microseconds(), Scope: int64(index[req.sc.id]), Moves: int64(moves), Class: class, Prio: int64(req.c.priority)}.Append(args)
	}
	members = make([]string, spares)
	class, prio := l.spareClass(batch, sc)
	if spares > 0 {
		classes = append(classes, classIn{sc, class})
	}
	for i := range members {
		members[i] = l.newMember()
		args = protocol.Call{ID: members[i], Cost: spareCost, Scope: 1, Class: class, Prio: int64(prio)}.Append(args)
	}
	return l.batchKeys(scopes, classes), args, members
}

// spareClass is the class of the spares a script call deciding batch
// takes for sc, and its priority: they go to the scope's next calls, of
// the class of its calls.
func (l *Limiter) spareClass(batch []*request, sc scope) (string, int) {
	if len(batch) == 0 {
		return "0", 0
	}
	return l.classOf(batch[0].c, sc), batch[0].c.priority
}

// classIn is a class a call books in, in its scope.
type classIn struct {
	sc    scope
	class string
}

// batchKeys returns the KEYS of an acquire script call on scopes, the
// first one's first, as the script reads them by place, then every other
// key it may touch (see declared): the other scopes' keys, each once, and
// the logs of the classes the calls book in.
func (l *Limiter) batchKeys(scopes []scope, classes []classIn) []string {
	keys := l.declaredFor(scripts.acquire, scopes[0])
	if len(scopes) == 1 && len(classes) == 0 {
		return keys
	}
	keys = slices.Clone(keys)
	if len(scopes) > 1 {
		seen := make(map[string]bool, len(keys))
		for _, k := range keys {
			seen[k] = true
		}
		for _, s := range scopes[1:] {
			for _, k := range l.declaredFor(scripts.acquire, s)[1:] {
				if !seen[k] {
					seen[k] = true
					keys = append(keys, k)
				}
			}
		}
	}
	for i, c := range classes {
		// A class's logs are its scope's: one (scope, class) declares them.
		if !slices.ContainsFunc(classes[:i], func(d classIn) bool { return d.sc.id == c.sc.id && d.class == c.class }) {
			keys = l.declareClasses(keys, c.sc, c.class)
		}
	}
	return keys
}

// newStep returns when Redis's clock stepped forward by more than the
// margin, in microseconds, if no script call was told of that step yet;
// otherwise 0.
//
// A forward step of Redis's clock larger than the margin shortened the
// windows by that much: the script counts it as a loss, unless one found
// after the step already did. A loss before the step is dated by the old
// clock, at least by before the reply that showed the step; one after it,
// by the new clock; half the step tells them apart.
func (l *Limiter) newStep() int64 {
	seq, by, at := l.timing.step()
	if seq <= l.seenStep.Load() || isOff(offClockSteps) {
		return 0
	}
	l.seenStep.Store(seq)
	if by <= l.cfg.minMargin {
		return 0
	}
	return (at - by/2).Microseconds()
}

// stepUntold reports whether Redis decided the reply rep by its clock after
// a forward step that the quota's data had not yet counted as a loss: rep's
// time is past the step and within a window of it, its epoch (the time of
// the quota's last loss, which the step's loss sets) before it. Such
// decisions read windows the step ended early: they go back, and the next
// script call tells the step again, whoever told it before (newStep).
//
// Whether this reply was the first to show the step does not tell it: the
// process's limiters on a server share one timing, and a reply of one quota
// may come after another quota's reply showed the step, its script decided
// by the new clock all the same (seed 446016: two quotas under one shared
// rule, 16 and 17 calls in the shared rule's window of 15).
func (l *Limiter) stepUntold(rep acquireReply) bool {
	seq, by, at := l.timing.step()
	if seq == 0 || by <= l.cfg.minMargin {
		return false
	}
	mid := at - by/2 // between the old clock's times and the new one's
	if rep.now < mid || rep.now > at+l.cfg.longest || rep.epoch >= mid.Microseconds() {
		return false
	}
	l.seenStep.Store(seq - 1)
	return true
}

// failBatch fails every call of batch with err, the failure of a script
// call that took d.
func (l *Limiter) failBatch(batch []*request, d time.Duration, err error) {
	l.batches.lastFailure.Store(time.Now().UnixNano())
	l.emit(Event{Kind: EventRedis, Duration: d, Calls: len(batch), Err: err})
	err = l.unavailable(err)
	for _, req := range batch {
		req.finish(result{}, err)
	}
}

// noteAcquireReply notes that Redis answered a script call that decided n
// calls of scope sc, and learns what its reply rep tells: Redis's clock,
// the pause of sc, the quota's epoch and scripts. It reports whether the
// decisions are stale.
func (l *Limiter) noteAcquireReply(sc scope, rep acquireReply, n int, sent, recvd time.Duration) (stale bool) {
	l.answered()
	l.emit(Event{Kind: EventRedis, Duration: recvd - sent, Calls: n, Margin: rep.margin})
	before, _, _ := l.timing.step()
	back, prev := l.timing.observe(rep.now, rep.done, sent, recvd)
	if was := l.view.replied.Swap(rep.epoch); back && was != 0 && was != rep.epoch {
		// A loss since this limiter's last reply, and the clocks moved
		// back: a step forward may hide behind it.
		l.timing.hiddenStep(rep.now, time.Duration(rep.epoch)*time.Microsecond, prev, sent, recvd)
	}
	// Decided by a clock that stepped forward before the quota counted the
	// step: the calls go back and ask again, the step told (stepUntold).
	// With step_epoch off, only the reply that showed the step is stale.
	if isOff(offStepEpoch) {
		after, by, _ := l.timing.step()
		stale = after > before && by > l.cfg.minMargin
	} else {
		stale = l.stepUntold(rep)
	}
	l.notePause(sc, rep.now, rep.pause)
	newEpoch := l.view.epoch.Load() != rep.epoch
	l.noteEpoch(rep.epoch, rep.lost)
	l.noteScripts(newEpoch, rep.seq)
	l.noteRan(rep.epoch, rep.lost)
	return stale
}

// finishBatch hands each call of batch its decision in rep, and gives back
// the booking of a caller that gave up meanwhile.
func (l *Limiter) finishBatch(sc scope, batch []*request, rep acquireReply, stale bool, gaps uint64) {
	answered := time.Now()
	for i, req := range batch {
		c := rep.calls[i]
		if req.sc.id != sc.id {
			l.notePause(req.sc, rep.now, c.pause)
		}
		r := result{
			admitted:  c.admitted,
			wait:      c.wait,
			remaining: c.remaining,
			room:      c.room,
			reason:    c.reason,
			now:       rep.now,
			answered:  answered,
			pause:     c.pause,
			pausedBy:  cmp.Or(rep.pausedFor(c.pause), c.blindBy),
			scope:     req.sc,
			member:    req.member,
			cost:      req.c.cost,
			named:     req.c.named,
			epoch:     rep.epoch,
			margin:    rep.margin,
			done:      rep.done,
			stale:     stale,
			gaps:      gaps,
			noted:     c.noted,
			logged:    c.logged,
		}
		if c.noted != 0 {
			r.class, r.prio = l.classOf(req.c, req.sc), req.c.priority
		}
		if !req.finish(r, nil) && r.admitted {
			// The caller gave up while its call was being booked.
			l.abandon(r)
		}
	}
}

// abandon gives back the booking r of a caller that gave up while Redis
// decided it: in the next script call, with the calls of a batch, or in one
// of its own started now. Giving each back in a script call of its own
// before the next batch would hold the lane a round trip per booking, and
// on a distant Redis the calls waiting in it would miss their deadlines in
// turn, and be given back in turn.
func (l *Limiter) abandon(r result) {
	if isOff(offBatches) {
		l.cancel(context.Background(), call{cost: r.cost, named: r.named}, r)
		return
	}
	l.batches.lanesMu.Lock()
	l.batches.abandoned = append(l.batches.abandoned, r)
	start := !l.batches.giving
	l.batches.giving = true
	l.batches.lanesMu.Unlock()
	if start {
		l.work.start(l.giveAbandoned)
	}
}

// giveAbandoned gives back the abandoned bookings that no batch took, in
// script calls of their own, until none are left.
func (l *Limiter) giveAbandoned() {
	for {
		l.batches.lanesMu.Lock()
		if len(l.batches.abandoned) == 0 {
			l.batches.giving = false
			l.batches.lanesMu.Unlock()
			return
		}
		sc := l.batches.abandoned[0].scope
		l.batches.lanesMu.Unlock()
		l.decide(sc, nil)
	}
}

// takeAbandoned returns up to n abandoned bookings to give back in a script
// call, and forgets them.
func (l *Limiter) takeAbandoned(n int) []result {
	l.batches.lanesMu.Lock()
	defer l.batches.lanesMu.Unlock()
	n = min(n, len(l.batches.abandoned))
	give := slices.Clone(l.batches.abandoned[:n])
	l.batches.abandoned = slices.Delete(l.batches.abandoned, 0, n)
	return give
}

// finish hands the decision to the waiting caller, and reports false if the
// caller had given up.
func (req *request) finish(r result, err error) bool {
	req.res, req.err = r, err
	ok := req.state.CompareAndSwap(requestWaiting, requestDecided)
	close(req.done)
	return ok
}

// batches is the state of the limiter's batches.
type batches struct {
	lanesMu   sync.Mutex
	lane      *lane    // the calls waiting for the next decision, or nil when none is on its way
	abandoned []result // bookings of callers that left while Redis decided them, to give back
	giving    bool     // giveAbandoned is running
	// lastAnswer and lastFailure are when Redis last answered a script
	// call, and when one last failed, in Unix nanoseconds (see
	// failedWhileQueued).
	lastAnswer, lastFailure atomic.Int64
}

// classOf names the class of call c in scope sc, whose share of a full
// quota the acquire script keeps for it (see Classes in lua/acquire.lua):
// its priority and, for a call of a key, the key as hashed in sc; "" for
// a limiter in ArrivalOrder, whose calls are of no class.
func (l *Limiter) classOf(c call, sc scope) string {
	if l.s.arrival {
		return ""
	}
	p := strconv.Itoa(c.priority)
	if sc.id == "" {
		return p
	}
	return p + "/" + sc.id
}
