package throttle

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/policies"
)

// Limiter enforces one quota, shared by every process that uses the same
// Redis and the same name.
//
// A vendor that allows 100 calls per second in a sliding window counts, at
// every instant, the calls of the second before it: wherever the window
// starts, it holds at most 100. The quota's policy states such limits (see
// package policies: sliding windows, token buckets, concurrency, several at
// once, per key), and one Lua script in Redis decides every call against all
// of them with Redis's own clock, so the fleet needs no synchronised clocks
// and never sees two different answers.
//
// Acquire and Do take a call through the limiter in its Mode:
//
//   - Block, the default, books the earliest slot the call fits in and sleeps
//     until it: waiting calls are served in arrival order across the fleet,
//     at one Redis round trip per call, and a call whose slot lies past its
//     context's deadline fails at once. Use it for calls that can wait.
//   - FailFast refuses a call that does not fit now with ErrLimited, which
//     says when to retry. Use it on request paths that must answer now.
//   - Queue holds calls in a bounded local queue by Priority; use it for job
//     workers, with Go to submit without blocking and Close to drain.
//
// Allow asks the same question as FailFast without a Permit. Most callers
// should use Do, or a Transport for HTTP.
//
// A process that calls a quota many times within a few milliseconds while
// the quota has plenty of room pays less than a round trip per call: the
// script call that admits one call also takes a few spare admissions (at
// most 16, and at most a quarter of the units free), which its next calls
// take without asking Redis, in about a microsecond. Spares are counted in
// Redis like any admitted call, by every replica; they are kept for a
// quarter of the margin, no longer than a pause, a loss of the quota's data
// or a widened margin allows, and those left unused are given back. A
// process that calls now and then, and a quota with a Concurrency rule, take
// none.
//
// A Limiter is safe for concurrent use.
type Limiter struct {
	rdb  redis.UniversalClient
	name string
	s    settings
	id   string        // this limiter's part of the ids of its calls
	seq  atomic.Uint64 // numbers this limiter's calls
	born time.Time     // when New made it, on the monotonic clock (see describing)

	cfg      compiled // what the rules need of every call; set by New, read only after
	view     view     // what this limiter last saw of the quota in Redis
	failover failover // what decides calls while Redis cannot

	timing   *timing       // how late calls start, shared with the process's other limiters on the same server
	lates    lates         // how late this limiter's calls started since its last report; its own lock
	seenStep atomic.Uint64 // the timing's forward steps already told to the script

	batches batches     // calls waiting for a shared script call; lanesMu guards them
	spares  spares      // spare admissions taken for the next calls (spare.go); its own lock
	q       *queue      // the local queue in Queue mode, or nil; its own lock
	closed  atomic.Bool // Close was called
	work    running     // the calls Do and Go run, and the goroutines it starts: Close waits for them

	freed *freed // signals a concurrency slot freed in this process: the limiter's own, or its group's (policies.Shared)

	room roomNews // tells the calls sleeping towards their slots of units given back (move.go); its own lock

	sleepers sync.Map // *sleeper: the calls asleep towards their slots in Redis, for a late call to take one (place.go)
}

// compiled is what New derives from the rules: the same for every call.
type compiled struct {
	rules       []policies.Rule
	base        string                     // start of every key: prefix:{name}:
	policyID    string                     // names the set of rules, whatever their order
	description string                     // the policy described, for the quota's meta (describe.go)
	minMargin   time.Duration              // the smallest margin configured, or the default
	guardMin    time.Duration              // the smallest configured margin that guards its calls (see late), 0 for none
	shared      []string                   // the Redis keys of a call with no key; per-key rules get the key appended
	sharedAll   map[*redis.Script][]string // for each script, shared and the keys it may build from them (declared)
	perKey      bool                       // some rule is per key
	hasShared   bool                       // some rule is shared by all keys
	hasConc     bool                       // some rule is a Concurrency
	hasBucket   bool                       // some rule is a TokenBucket
	unitRules   bool                       // some rule counts the units calls cost
	callRules   bool                       // some rule counts calls (policies.PerCall)
	maxCost     int
	maxCostIs   string         // the limit maxCost comes from, as the user set it
	group       string         // the Name of the quota's policies.Shared rules, or ""
	groupKey    string         // the key, and the channel, of the group's state (lua/lib.lua, Groups), or ""
	longest     time.Duration  // the longest window of the rules, at least a second
	units       []string       // the named units the rules count (policies.Unit), in their order
	unitMax     map[string]int // the smallest limit of each named unit's rules
}

// view is what this limiter last saw of the quota in Redis, as every reply
// told it: atomics and a sync.Map, read and written without a lock.
type view struct {
	epoch       atomic.Int64  // the quota's epoch as last seen; 0 before the first decision
	replied     atomic.Int64  // the quota's epoch in this limiter's latest reply, 0 before it (hiddenStep)
	scripts     atomic.Int64  // the quota's count of scripts run, as last seen in that epoch
	pauses      sync.Map      // scope pause key -> local time.Time the pause ends
	pausesAdded atomic.Uint64 // pauses noted since the last sweep of the map
	gaps        atomic.Uint64 // the gaps in the quota's news (news.go), and switches to the Local fallback
	asleep      atomic.Int64  // calls sleeping towards slots booked in Redis
	listening   sync.Once     // subscribed to the quota's news (news.go)
	others      atomic.Int64  // units the quota's rules leave other consumers of the key, as last told
	measuring   atomic.Int64  // until then (Unix ns), every count the vendor gives goes to Redis (see tell)
	lowered     atomic.Int64  // the Redis time (µs) a limit in force last dropped, as last told (see overtaken)
	described   atomic.Int64  // the epoch whose meta holds this limiter's description, as far as it knows (describe.go)

	ran       atomic.Pointer[scriptsRan] // this limiter's acquire scripts Redis answered, and in which epoch
	counted   atomic.Bool                // the vendor's counts reached this limiter: its calls may go out as scouts (lua/lib.lua, Scouts)
	reads     atomic.Bool                // a Transport reads every answer of this limiter's calls (Limiter.scouts)
	countTold atomic.Int64               // the epoch in which a count was last passed on to the quota (Limiter.firstCount)
}

// failover is what keeps calls going while Redis cannot decide them.
type failover struct {
	brk   *breaker // keeps calls away from a failing Redis; its own lock
	local *local   // the Local fallback, or nil; its own lock
}

// New returns a Limiter for the quota called name on rdb (a Client,
// ClusterClient or FailoverClient), enforcing policy. It validates every
// argument and returns an error naming the first bad one. It does not contact
// Redis.
func New(rdb redis.UniversalClient, name string, policy policies.Policy, opts ...Options) (*Limiter, error) {
	if rdb == nil {
		return nil, errors.New("throttle: New: redis client is nil")
	}
	if offErr != nil {
		return nil, offErr
	}
	if err := validName("name", name); err != nil {
		return nil, err
	}
	rules, err := policies.Rules(policy)
	if err != nil {
		return nil, fmt.Errorf("throttle: quota %q: %w", name, err)
	}
	if isOff(offSpreadParts) {
		rules = slices.DeleteFunc(rules, func(r policies.Rule) bool { return r.Paces })
	}
	s, err := newSettings(name, opts)
	if err != nil {
		return nil, err
	}
	warnIgnoredSwitches(s.logger)
	l := &Limiter{rdb: rdb, name: name, s: s, id: newID(), timing: timingFor(rdb, s.clock)}
	l.room.work = &l.work
	l.cfg.rules, l.failover.brk = rules, newBreaker()
	l.born = time.Now()
	// The steps of Redis's clock that the process's other limiters on the
	// server saw before this one existed are theirs to tell their quotas;
	// told again by a new limiter, one long past would hold its quota full
	// for a window.
	seq, _, _ := l.timing.step()
	l.seenStep.Store(seq)
	if s.onRedisError == Local {
		if l.failover.local, err = newLocal(rules, s.replicas, l.noticeWithin()); err != nil {
			return nil, fmt.Errorf("throttle: quota %q: %w", name, err)
		}
	}
	l.compile()
	if l.cfg.group != "" && s.onRedisError == Local {
		return nil, fmt.Errorf("throttle: quota %q: OnRedisError Local cannot divide the policies.Shared rules of %q among the quotas that share them: use FailClosed or FailOpen", name, l.cfg.group)
	}
	l.freed = l.freedFor()
	if s.mode == Queue {
		l.q = newQueue(s.maxQueue, s.overflow, min(l.cfg.maxCost, maxDispatched))
	}
	return l, nil
}

// compile derives from the limiter's rules what every call needs: the keys
// of the shared rules, the policy's id, the smallest margin, the largest
// cost, and which kinds of rule the quota has.
func (l *Limiter) compile() {
	rules := l.cfg.rules
	sharedBase := l.bases()
	l.cfg.shared = []string{l.cfg.base + "meta", l.cfg.base + "meta"}
	// Cost counts under the rules that count units: it may not exceed the
	// smallest of their limits. Under rules that count calls it is 1.
	l.cfg.maxCost = maxRemaining
	seen := map[string]int{}
	var ids []string
	for _, r := range rules {
		id := r.ID()
		if r.PerKey {
			id = "key:" + id
		}
		base := l.cfg.base
		if r.Shared != "" {
			id, base = "shared:"+id, sharedBase
		}
		if seen[id]++; seen[id] > 1 {
			id += "#" + strconv.Itoa(seen[id])
		}
		ids = append(ids, id)
		l.cfg.shared = append(l.cfg.shared, base+strings.TrimPrefix(id, "shared:"))
	}
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	sum := sha256.Sum256([]byte(strings.Join(sorted, ",")))
	l.cfg.policyID = base64.RawURLEncoding.EncodeToString(sum[:9])
	l.cfg.description = l.describe()
	l.cfg.sharedAll = map[*redis.Script][]string{}
	for s := range suffixes {
		l.cfg.sharedAll[s] = declared(s, l.cfg.shared, l.cfg.rules, l.cfg.groupKey)
	}
	l.cfg.minMargin = policies.DefaultMargin
	l.cfg.longest = time.Second
	for _, r := range rules {
		if r.Kind == policies.KindSlidingLog || r.Kind == policies.KindSlidingCounter {
			l.cfg.longest = max(l.cfg.longest, r.Window)
		}
		if (r.Kind == policies.KindSlidingLog || r.Kind == policies.KindSlidingCounter) && r.Margin < l.cfg.minMargin {
			l.cfg.minMargin = max(r.Margin, minStep)
		}
		if r.Kind != policies.KindConcurrency && r.Margin >= minGuardedMargin && (l.cfg.guardMin == 0 || r.Margin < l.cfg.guardMin) {
			l.cfg.guardMin = r.Margin
		}
		l.cfg.perKey = l.cfg.perKey || r.PerKey
		l.cfg.hasShared = l.cfg.hasShared || !r.PerKey
		l.cfg.hasConc = l.cfg.hasConc || r.Kind == policies.KindConcurrency
		l.cfg.hasBucket = l.cfg.hasBucket || r.Kind == policies.KindTokenBucket
		l.cfg.callRules = l.cfg.callRules || r.PerCall
		l.cfg.unitRules = l.cfg.unitRules || !r.PerCall && r.Kind != policies.KindConcurrency && r.Unit == ""
		if r.Unit != "" {
			l.countUnit(r)
		} else if !r.PerCall && r.Limit < l.cfg.maxCost {
			l.cfg.maxCost = r.Limit
			l.cfg.maxCostIs = limitName(r)
		}
	}
}

// bases sets the start of the quota's own keys, and returns that of its
// policies.Shared rules' keys, or "". A quota with Shared rules keeps every
// key under the hash tag of their Name: its own after "/" and its name,
// the shared ones after "//", which no quota's name makes.
func (l *Limiter) bases() (shared string) {
	for _, r := range l.cfg.rules {
		if r.Shared != "" {
			l.cfg.group = r.Shared
			shared = l.s.keyPrefix() + ":{" + r.Shared + "}//"
			l.cfg.groupKey = shared + "group"
		}
	}
	l.cfg.base = quotaBase(l.s.keyPrefix(), l.name, l.cfg.group)
	return shared
}

// quotaBase is the start of the keys of quota name, of policies.Shared
// group ("" for none), under prefix (see bases; quotaOfMeta reads a meta
// key back).
func quotaBase(prefix, name, group string) string {
	if group != "" {
		return prefix + ":{" + group + "}/" + name + ":"
	}
	return prefix + ":{" + name + "}:"
}

// countUnit notes that rule r counts a named unit.
func (l *Limiter) countUnit(r policies.Rule) {
	if l.cfg.unitMax == nil {
		l.cfg.unitMax = map[string]int{}
	}
	if most, ok := l.cfg.unitMax[r.Unit]; !ok || r.Limit < most {
		if !ok {
			l.cfg.units = append(l.cfg.units, r.Unit)
		}
		l.cfg.unitMax[r.Unit] = r.Limit
	}
}

// newID returns a random prefix that makes this process's entries unique in
// every log, whatever the other processes do and whenever they do it.
func newID() string {
	var b [9]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// Name returns the quota's name.
func (l *Limiter) Name() string { return l.name }

// mode returns how the limiter takes its calls: its Options.Mode, FailFast
// in shadow mode, which decides every call at once and waits for nothing,
// and Block for a nil Limiter.
func (l *Limiter) mode() Mode {
	switch {
	case l.made() != nil:
		return Block
	case l.s.shadow:
		return FailFast
	}
	return l.s.mode
}

// Rules returns the rules the quota's policy compiles to, as
// policies.Rules gives them and Usage reports them: their limits as
// configured, not as the vendor taught them. It returns nil for a nil
// Limiter.
func (l *Limiter) Rules() []policies.Rule {
	if l.made() != nil {
		return nil
	}
	return slices.Clone(l.cfg.rules)
}

// logger returns where the limiter logs what it cannot return: its
// Options.Logger, or slog.Default().
func (l *Limiter) logger() *slog.Logger {
	if l.made() != nil || l.s.logger == nil {
		return slog.Default()
	}
	return l.s.logger
}

// Decision is the answer of Allow.
type Decision struct {
	// OK reports whether the call was admitted, and counted, now.
	OK bool
	// RetryAfter is how long until the call would fit, when it was not admitted.
	RetryAfter time.Duration
	// Remaining is how many units are still free now under the tightest limit,
	// for calls of the call's class: a share held for other classes is not free.
	Remaining int
}

// Allow admits the call now if it fits, and counts it; it never waits for
// the quota. When this process reads Redis's replies later than the margin
// allows a call to start, it asks again for the moment that much ahead,
// and sleeps those few milliseconds: the call starts on time. Limits are reported in the Decision, not as an error;
// the error is for bad options and Redis failures. Under a
// policies.Concurrency limit, a call Allow admits holds its slots until the
// lease runs out, since no Permit releases them: use Acquire there.
func (l *Limiter) Allow(ctx context.Context, opts ...CallOption) (Decision, error) {
	c, err := l.newCall(opts)
	if err != nil {
		return Decision{}, err
	}

	r, err := l.now(ctx, c)
	if err != nil {
		return Decision{}, err
	}
	d := Decision{OK: r.admitted, Remaining: r.remaining}
	if r.admitted {
		l.emitOutcome(c, l.permit(c, r, 0), nil, false)
	} else {
		d.RetryAfter = max(r.wait, 0)
		l.emitOutcome(c, nil, l.refused(r, "Allow"), false)
	}
	return d, nil
}

// Acquire takes a call through the limiter in its Mode. It returns a Permit
// once the call may run; the caller runs the call and then calls Release.
// In Block mode it waits for its slot, and fails at once with ErrLimited when
// the slot lies beyond the context's deadline or Options.MaxWait, as
// golang.org/x/time/rate's Wait does for a deadline; a slot within half the
// smallest margin of the deadline counts as beyond it, since the call may
// start that late. Unlike Wait, a call whose context has no deadline waits
// a minute at most when MaxWait is not set. If the context ends while it
// waits, or as it wakes, it gives its slot back and returns the context's
// error.
func (l *Limiter) Acquire(ctx context.Context, opts ...CallOption) (*Permit, error) {
	p, err := l.acquirePermit(ctx, opts)
	if err == nil {
		p.markStart()
	}
	return p, err
}

// acquirePermit is Acquire without reading how late the call would start
// now: Do and Go note it themselves, right before the call.
func (l *Limiter) acquirePermit(ctx context.Context, opts []CallOption) (*Permit, error) {
	c, err := l.newCall(opts)
	if err != nil {
		return nil, err
	}
	return l.dispatch(ctx, c, nil)
}

// Close stops the limiter from taking calls: later calls get ErrClosed. It
// then drains: in Queue mode it waits until every queued call has had its
// turn, and in every mode until the functions that Do and Go run have
// returned. Permits from Acquire are the caller's: Close does not wait for
// their Release. If ctx ends first, the calls still queued get ErrClosed and
// Close returns ctx's error; no call is dropped without an error. It ends
// the limiter's subscription to its quota's news (what other replicas learn
// of pauses and losses), which the last limiter on a client closes, and
// gives back the spare admissions the limiter holds. When it returns nil,
// no goroutine the limiter started is left, and no timer it set. Close
// does not close the Redis client, which belongs to the caller.
func (l *Limiter) Close(ctx context.Context) error {
	if err := l.made(); err != nil {
		return err
	}
	first := !l.closed.Swap(true)
	var err error
	if l.q != nil {
		err = l.q.close(ctx, l.name)
	}
	if err == nil {
		err = l.work.close(ctx)
	}
	if first {
		l.leaveGroup()
		l.dropAllSpares(ctx)
		if done := l.unlisten(); done != nil && err == nil {
			err = wait(ctx, done)
		}
	}
	if err != nil {
		return err
	}
	// What giving the spares back started.
	return l.work.close(ctx)
}

// enter counts a call of Do or Go in, for Close to wait for; it fails
// once Close began, or for a Limiter that New did not make.
func (l *Limiter) enter() error {
	if err := l.made(); err != nil {
		return err
	}
	if !l.work.enter() {
		return quotaErr(l.name, ErrClosed, "limiter closed")
	}
	return nil
}

// Do acquires a permit from l, runs fn, and releases the permit. It returns
// fn's result, or the error that kept fn from running. fn finds its permit
// in its context with PermitFrom: to settle the call's actual cost, or to
// tell the quota that the vendor refused it.
func Do[T any](ctx context.Context, l *Limiter, fn func(context.Context) (T, error), opts ...CallOption) (T, error) {
	var zero T
	if err := l.enter(); err != nil {
		return zero, err
	}
	defer l.work.leave()
	p, err := l.acquirePermit(ctx, opts)
	if err != nil {
		return zero, err
	}
	defer p.releaseWithin(ctx)
	p.Start()
	return fn(withPermit(ctx, p))
}

// Future is the outcome of a call submitted with Go.
type Future[T any] struct {
	done chan struct{}
	v    T
	err  error
}

// Wait waits for the call and returns fn's result, or the error that kept fn
// from running (ErrQueueFull, ErrLimited, the context's error, ...).
func (f *Future[T]) Wait() (T, error) {
	<-f.done
	return f.v, f.err
}

// Go submits fn to l and returns at once: it starts a goroutine that takes
// the call through l as Do does, then runs fn. In Queue mode the call takes
// its place in the queue before Go returns, so calls submitted one after
// another keep their order; a full queue answers through the Future at
// once. Close waits for the functions Go runs. A job's ctx bounds its wait
// and its run: give Go a context that a shutdown signal does not cancel,
// and Close the limiter on the signal, to let the queued jobs drain.
func Go[T any](ctx context.Context, l *Limiter, fn func(context.Context) (T, error), opts ...CallOption) *Future[T] {
	f := &Future[T]{done: make(chan struct{})}
	if f.err = l.enter(); f.err != nil {
		close(f.done)
		return f
	}
	c, err := l.newCall(opts)
	var w *waiter
	if err == nil && l.s.mode == Queue && !l.s.shadow {
		// Queued now, so that the calls of one goroutine keep their order
		// and a full queue answers at once.
		if w, err = l.q.enqueue(c.priority, l.name); err != nil {
			l.emitOutcome(c, nil, err, false)
		}
	}
	if err != nil {
		f.err = err
		close(f.done)
		l.work.leave()
		return f
	}
	go func() {
		defer close(f.done)
		defer l.work.leave()
		var p *Permit
		p, f.err = l.dispatch(ctx, c, w)
		if f.err != nil {
			return
		}
		defer p.releaseWithin(ctx)
		p.Start()
		f.v, f.err = fn(withPermit(ctx, p))
	}()
	return f
}

// made reports a Limiter that New did not make: a nil one, or a zero value.
func (l *Limiter) made() error {
	if l == nil || l.rdb == nil {
		return errors.New("throttle: the Limiter is nil or a zero value: make it with throttle.New")
	}
	return nil
}
