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

	"github.com/throttlekit/throttle/internal/lua"
	"github.com/throttlekit/throttle/policies"
)

// Mode says what a call does when the quota is full.
type Mode int

const (
	// Block books the earliest slot in which the call fits and waits for it,
	// within the context's deadline and the limiter's MaxWait. Waiters are
	// served in arrival order across the fleet. It is the default.
	Block Mode = iota
	// FailFast runs the call only if it fits now, and otherwise returns an
	// error matching ErrLimited at once.
	FailFast
	// Queue puts the call in a bounded local queue, served by Priority and
	// then in arrival order; the calls at the head book their slots as in
	// Block. A full queue answers ErrQueueFull at once (see Options.Overflow).
	// Close drains the queue.
	Queue
)

// String returns the mode's name.
func (m Mode) String() string {
	switch m {
	case Block:
		return "Block"
	case FailFast:
		return "FailFast"
	case Queue:
		return "Queue"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// Defaults of a Limiter (see Options).
const (
	defaultMaxWait      = time.Minute
	defaultPrefix       = "throttle"
	defaultMaxQueue     = 10_000
	defaultRedisTimeout = time.Second
	// maxNameLen is the longest quota name or Prefix New accepts, in bytes.
	maxNameLen = 128
)

// ErrUnavailable is matched, through errors.Is, by the error of a call that
// could not be decided because Redis failed, answered too late, or could not
// be reached. The call was not made. The error is an *UnavailableError.
var ErrUnavailable = errors.New("throttle: redis unavailable")

// UnavailableError is returned when Redis could not decide a call.
type UnavailableError struct {
	// Quota is the limiter's name.
	Quota string
	// Err is what went wrong.
	Err error
}

// Error describes the failure. When Redis refused a command a script calls
// without naming it (Redis before 7.2), it names the command.
func (e *UnavailableError) Error() string {
	if c := lua.CommandAt(e.Err.Error()); c != "" {
		return fmt.Sprintf("throttle: quota %q: redis unavailable: %v (the script calls %s there)", e.Quota, e.Err, c)
	}
	return fmt.Sprintf("throttle: quota %q: redis unavailable: %v", e.Quota, e.Err)
}

// Is reports whether target is ErrUnavailable.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

// Unwrap returns what went wrong.
func (e *UnavailableError) Unwrap() error { return e.Err }

// ErrLimited is matched, through errors.Is, by every error that refuses a
// call because the quota is full. The error is a *LimitedError, which says
// when to retry.
var ErrLimited = errors.New("throttle: rate limited")

// LimitedError is returned when a call does not fit the quota now (FailFast),
// or could not get a slot within its context deadline or MaxWait (Block).
type LimitedError struct {
	// Quota is the limiter's name.
	Quota string
	// RetryAfter is how long until the call would fit, as Redis saw it.
	RetryAfter time.Duration
	// Reason says why the call was refused, when the quota being full now
	// is not the whole story: the slot lay beyond MaxWait or the context's
	// deadline, or every slot came too late to start in. Empty otherwise.
	Reason string
}

// Error describes the refusal.
func (e *LimitedError) Error() string {
	if e.Reason != "" {
		return fmt.Sprintf("throttle: quota %q: rate limited (%s), retry after %v", e.Quota, e.Reason, e.RetryAfter)
	}
	return fmt.Sprintf("throttle: quota %q: rate limited, retry after %v", e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrLimited.
func (e *LimitedError) Is(target error) bool { return target == ErrLimited }

// Options tune a Limiter in New. The zero value of every field picks its
// default, so Options{} is a limiter in Block mode that fails closed.
type Options struct {
	// Mode is what a call does when the quota is full. The default is Block.
	Mode Mode
	// MaxWait bounds how long a call may wait for its slot in Block and
	// Queue mode: a call whose slot lies further away fails at once with
	// ErrLimited instead of sleeping; the context's deadline, when earlier,
	// bounds the wait too. When 0, a call waits for any slot before its
	// context's deadline, and a minute at most when its context has none.
	MaxWait time.Duration
	// MaxQueue bounds the local queue of a limiter in Queue mode. The
	// default is 10,000 calls.
	MaxQueue int
	// Overflow says which call a full queue turns away. The default is
	// RejectNew.
	Overflow Overflow

	// OnRedisError is what a call does when Redis cannot decide it. The
	// default is FailClosed. Whatever the choice, a breaker stops sending
	// calls to a Redis that keeps failing (three failures in a row, over
	// 50ms at least), probes it with a growing, jittered backoff, and
	// returns to it by itself once it answers; each switch is logged.
	OnRedisError OnRedisError
	// ExpectedReplicas is how many processes share the quota, for the Local
	// fallback: each then admits Limit/n per window, so that the fleet
	// stays under the cap even when every replica has lost Redis. Local
	// needs it.
	ExpectedReplicas int
	// RedisTimeout bounds how long a decision waits for Redis, apart from
	// the caller's context, so that a hung Redis cannot hang every outbound
	// call: past it the call fails with ErrUnavailable. The default is one
	// second.
	//
	// go-redis stops reading a reply at a context's deadline only when its
	// Options.ContextTimeoutEnabled is set; otherwise its ReadTimeout (3s by
	// default) bounds the call that is talking to Redis, while the calls
	// queued behind it still give up at this timeout. Set
	// ContextTimeoutEnabled on the client you pass to New.
	RedisTimeout time.Duration
	// Prefix starts every Redis key the limiter writes, so that several
	// applications can share one Redis. The default is "throttle".
	Prefix string

	// Observer is told of every decision, Redis round trip and change of
	// state (see Event). The default is none.
	Observer Observer
	// Logger is where the limiter reports what it changes by itself: Redis
	// losing a quota's data, switching to and from a fallback. The default
	// is slog.Default().
	Logger *slog.Logger
	// Shadow puts the limiter in shadow mode: it decides and reports every
	// call as usual (to its Observer, see Event.Shadow), records the calls
	// that fit, and lets every call through at once, refused or not. Roll a
	// limiter out in front of a live vendor this way, and watch what it
	// would have done.
	Shadow bool
	// WithoutLearning keeps the configured limits whatever the vendor says:
	// its refusals pause the fleet, but never teach the quota a lower cap
	// (see Permit.Refused). Its remaining counts are still heeded.
	WithoutLearning bool
	// Clock makes the limiter pass the time from Clock() to the script
	// instead of letting the script read Redis TIME. Use it only for hosted
	// services that refuse TIME in scripts, and only when every replica's
	// clock is synchronised: a replica whose clock runs ahead admits calls
	// early by that much. Tests use it to drive time.
	Clock func() time.Time
}

type settings struct {
	observer     Observer
	shadow       bool
	onRedisError OnRedisError
	replicas     int
	logger       *slog.Logger
	redisTimeout time.Duration
	mode         Mode
	maxWait      time.Duration
	clock        func() time.Time
	prefix       string
	maxQueue     int
	overflow     Overflow
	noLearning   bool
	maxWaitSet   bool
}

// A CallOption describes one call: who it is for and what it costs.
type CallOption func(*call)

// Key names who the call is for: a tenant, a user, an API token. It selects
// the quota of every policies.PerKey limit; limits that are not per key ignore
// it. The key is hashed before it reaches Redis, so it may hold secrets and
// be of any length.
func Key(k string) CallOption { return func(c *call) { c.key, c.hasKey = k, true } }

// Cost makes the call count as n units (a batch of n messages, n tokens).
// The default is 1; n must be between 1 and the smallest Limit of the quota.
func Cost(n int) CallOption { return func(c *call) { c.cost = n } }

// Priority orders calls in the queue of a limiter in Queue mode: higher
// values run first, calls of equal priority in arrival order. The default is
// 0. Other modes ignore it.
func Priority(p int) CallOption { return func(c *call) { c.priority = p } }

type call struct {
	key      string
	hasKey   bool
	cost     int
	priority int
	// lead is how far ahead of now the call asks for its slot: a slot
	// whose reply came back too late to start in is booked again this much
	// later, so that the next reply arrives before it.
	lead time.Duration
}

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
// A Limiter is safe for concurrent use.
type Limiter struct {
	rdb         redis.UniversalClient
	name        string
	rules       []policies.Rule
	base        string        // start of every key: prefix:{name}:
	policyID    string        // names the set of rules, whatever their order
	minMargin   time.Duration // the smallest margin configured, or the default
	seenStep    atomic.Uint64 // the timing's forward steps already told to the script
	shared      []string      // the Redis keys of a call with no key; per-key rules get the key appended
	perKey      bool          // some rule is per key
	hasShared   bool          // some rule is shared by all keys
	hasConc     bool          // some rule is a Concurrency
	unitRules   bool          // some rule counts the units calls cost
	callRules   bool          // some rule counts calls (policies.PerCall)
	maxCost     int
	maxCostIs   string       // the limit maxCost comes from, as the user set it
	timing      *timing      // how late calls start, shared with the process's other limiters on the same server
	lates       lates        // how late this limiter's calls started since its last report
	epoch       atomic.Int64 // the quota's epoch as last seen; 0 before the first decision
	listening   sync.Once    // subscribed to the quota's news (news.go)
	scripts     atomic.Int64 // the quota's count of scripts run, as last seen in that epoch
	s           settings
	id          string
	seq         atomic.Uint64
	pauses      sync.Map // scope pause key -> local time.Time the pause ends
	pausesAdded atomic.Uint64
	freed       chan struct{}
	freedMu     sync.Mutex
	q           *queue
	closed      atomic.Bool
	batches                  // calls waiting for a shared script call
	brk         *breaker     // keeps calls away from a failing Redis
	local       *local       // the Local fallback, or nil
	localNow    atomic.Bool  // the Local fallback decides calls now
	horizon     atomic.Int64 // local Unix nanoseconds of the latest slot booked in Redis
}

// New returns a Limiter for the quota called name on rdb (a Client,
// ClusterClient or FailoverClient), enforcing policy. It validates every
// argument and returns an error naming the first bad one. It does not contact
// Redis.
func New(rdb redis.UniversalClient, name string, policy policies.Policy, opts ...Options) (*Limiter, error) {
	if rdb == nil {
		return nil, errors.New("throttle: New: redis client is nil")
	}
	if err := validName("name", name); err != nil {
		return nil, err
	}
	rules, err := policies.Rules(policy)
	if err != nil {
		return nil, fmt.Errorf("throttle: quota %q: %w", name, err)
	}
	s, err := newSettings(name, opts)
	if err != nil {
		return nil, err
	}
	l := &Limiter{rdb: rdb, name: name, rules: rules, s: s, id: newID(), freed: make(chan struct{}), brk: newBreaker(), timing: timingFor(rdb, s.clock)}
	if s.onRedisError == Local {
		if l.local, err = newLocal(rules, s.replicas); err != nil {
			return nil, fmt.Errorf("throttle: quota %q: %w", name, err)
		}
	}
	l.lanes = map[string]*lane{}
	l.compile()
	if s.mode == Queue {
		l.q = newQueue(s.maxQueue, s.overflow, min(l.maxCost, maxDispatched))
	}
	return l, nil
}

// newSettings applies opts to the defaults and checks the result, naming
// the first bad option.
func newSettings(name string, opts []Options) (settings, error) {
	if len(opts) > 1 {
		return settings{}, fmt.Errorf("throttle: quota %q: New takes one Options at most, got %d", name, len(opts))
	}
	var o Options
	if len(opts) == 1 {
		o = opts[0]
	}
	s := settings{
		observer: o.Observer, shadow: o.Shadow, onRedisError: o.OnRedisError, replicas: o.ExpectedReplicas,
		logger: o.Logger, redisTimeout: o.RedisTimeout, mode: o.Mode, maxWait: o.MaxWait, clock: o.Clock,
		prefix: o.Prefix, maxQueue: o.MaxQueue, overflow: o.Overflow, noLearning: o.WithoutLearning,
		maxWaitSet: o.MaxWait > 0,
	}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	if s.maxWait == 0 {
		s.maxWait = defaultMaxWait
	}
	if s.prefix == "" {
		s.prefix = defaultPrefix
	}
	if s.maxQueue == 0 {
		s.maxQueue = defaultMaxQueue
	}
	if s.redisTimeout == 0 {
		s.redisTimeout = defaultRedisTimeout
	}
	var err error
	switch {
	case s.mode != Block && s.mode != FailFast && s.mode != Queue:
		err = fmt.Errorf("throttle: quota %q: Options.Mode: unknown mode %v", name, s.mode)
	case s.maxWait < 0:
		err = fmt.Errorf("throttle: quota %q: Options.MaxWait must not be negative, got %v", name, s.maxWait)
	case s.onRedisError != FailClosed && s.onRedisError != FailOpen && s.onRedisError != Local:
		err = fmt.Errorf("throttle: quota %q: Options.OnRedisError: unknown policy %v", name, s.onRedisError)
	case s.replicas < 0:
		err = fmt.Errorf("throttle: quota %q: Options.ExpectedReplicas must not be negative, got %d", name, s.replicas)
	case s.onRedisError == Local && s.replicas == 0:
		err = fmt.Errorf("throttle: quota %q: Options.OnRedisError Local needs Options.ExpectedReplicas, to divide the quota among the replicas", name)
	case s.redisTimeout < 0:
		err = fmt.Errorf("throttle: quota %q: Options.RedisTimeout must not be negative, got %v", name, s.redisTimeout)
	case s.maxQueue < 0:
		err = fmt.Errorf("throttle: quota %q: Options.MaxQueue must not be negative, got %d", name, s.maxQueue)
	case s.overflow != RejectNew && s.overflow != ShedOldest && s.overflow != ShedLowest:
		err = fmt.Errorf("throttle: quota %q: Options.Overflow: unknown overflow %v", name, s.overflow)
	default:
		err = validName("Options.Prefix", s.prefix)
	}
	return s, err
}

// compile derives from the limiter's rules what every call needs: the keys
// of the shared rules, the policy's id, the smallest margin, the largest
// cost, and which kinds of rule the quota has.
func (l *Limiter) compile() {
	rules := l.rules
	l.base = l.s.prefix + ":{" + l.name + "}:"
	l.shared = []string{l.base + "pause", l.base + "pause"}
	// Cost counts under the rules that count units: it may not exceed the
	// smallest of their limits. Under rules that count calls it is 1.
	l.maxCost = maxRemaining
	seen := map[string]int{}
	var ids []string
	for _, r := range rules {
		id := r.ID()
		if r.PerKey {
			id = "key:" + id
		}
		if seen[id]++; seen[id] > 1 {
			id += "#" + strconv.Itoa(seen[id])
		}
		ids = append(ids, id)
		l.shared = append(l.shared, l.base+id)
	}
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	sum := sha256.Sum256([]byte(strings.Join(sorted, ",")))
	l.policyID = base64.RawURLEncoding.EncodeToString(sum[:9])
	l.minMargin = policies.DefaultMargin
	for _, r := range rules {
		if (r.Kind == policies.KindSlidingLog || r.Kind == policies.KindSlidingCounter) && r.Margin < l.minMargin {
			l.minMargin = max(r.Margin, minStep)
		}
		l.perKey = l.perKey || r.PerKey
		l.hasShared = l.hasShared || !r.PerKey
		l.hasConc = l.hasConc || r.Kind == policies.KindConcurrency
		l.callRules = l.callRules || r.PerCall
		l.unitRules = l.unitRules || !r.PerCall && r.Kind != policies.KindConcurrency
		if !r.PerCall && r.Limit < l.maxCost {
			l.maxCost = r.Limit
			l.maxCostIs = limitName(r)
		}
	}
}

// validName rejects names that would break the hash tag or bloat every key.
func validName(field, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("throttle: %s must not be empty", field)
	case len(v) > maxNameLen:
		return fmt.Errorf("throttle: %s must be at most %d bytes, got %d", field, maxNameLen, len(v))
	case strings.ContainsAny(v, "{}"):
		return fmt.Errorf("throttle: %s must not contain '{' or '}' (they would break the Redis Cluster hash tag), got %q", field, v)
	}
	return nil
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

// Decision is the answer of Allow.
type Decision struct {
	// OK reports whether the call was admitted, and counted, now.
	OK bool
	// RetryAfter is how long until the call would fit, when it was not admitted.
	RetryAfter time.Duration
	// Remaining is how many units are still free now under the tightest limit.
	Remaining int
}

// Allow admits the call now if it fits, and counts it; it never waits and
// never books a slot. Limits are reported in the Decision, not as an error;
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
		d.RetryAfter = r.wait
		l.emitOutcome(c, nil, l.refused(r), false)
	}
	return d, nil
}

// Acquire takes a call through the limiter in its Mode. It returns a Permit
// once the call may run; the caller runs the call and then calls Release.
// In Block mode it waits for its slot, and fails at once with ErrLimited when
// the slot lies beyond the context's deadline or MaxWait, as
// golang.org/x/time/rate's Wait does. If the context ends while it waits, it
// gives its slot back and returns the context's error.
func (l *Limiter) Acquire(ctx context.Context, opts ...CallOption) (*Permit, error) {
	p, err := l.acquirePermit(ctx, opts)
	if err == nil {
		p.start()
	}
	return p, err
}

// acquirePermit is Acquire without noting when the call starts: Do, Go and the
// Transport note it themselves, right before the call.
func (l *Limiter) acquirePermit(ctx context.Context, opts []CallOption) (*Permit, error) {
	c, err := l.newCall(opts)
	if err != nil {
		return nil, err
	}
	return l.dispatch(ctx, c, nil)
}

// dispatch decides call c as the limiter's mode says, reports the outcome
// to the Observer, and in shadow mode lets the call through whatever the
// decision. Every entry point (Acquire, Do, Go, the Transport) goes through
// it. w, when not nil, is the call's place in the queue, taken already: Go
// queues a call before it returns.
func (l *Limiter) dispatch(ctx context.Context, c call, w *waiter) (*Permit, error) {
	if w == nil {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	if l.s.shadow {
		return l.shadow(ctx, c)
	}
	var (
		p   *Permit
		err error
	)
	switch l.s.mode {
	case FailFast:
		var r result
		if r, err = l.now(ctx, c); err == nil {
			if r.admitted {
				p = l.permit(c, r, 0)
			} else {
				err = l.refused(r)
			}
		}
	case Queue:
		if w == nil {
			w, err = l.q.enqueue(c.priority, l.name)
		}
		if err == nil {
			p, err = l.fromQueue(ctx, c, w)
		}
	default:
		p, err = l.wait(ctx, c)
	}
	l.emitOutcome(c, p, err, false)
	return p, err
}

// shadow decides a call as FailFast would, records it when it fits, reports
// the decision, and lets the call through either way.
func (l *Limiter) shadow(ctx context.Context, c call) (*Permit, error) {
	r, err := l.now(ctx, c)
	if err == nil && r.admitted {
		p := l.permit(c, r, 0)
		l.emitOutcome(c, p, nil, false)
		return p, nil
	}
	if err == nil {
		err = l.refused(r)
	} else if ctx.Err() != nil {
		return nil, err
	}
	l.emitOutcome(c, nil, err, true)
	// Nothing was recorded: the permit holds nothing to give back.
	return l.permit(c, result{local: true}, 0), nil
}

// fromQueue waits for a queued call's turn, then books its slot as Block does.
func (l *Limiter) fromQueue(ctx context.Context, c call, w *waiter) (*Permit, error) {
	if err := l.q.await(ctx, w); err != nil {
		return nil, err
	}
	defer l.q.done()
	return l.wait(ctx, c)
}

// Queued returns how many calls wait in the local queue (Queue mode).
func (l *Limiter) Queued() int {
	if l == nil || l.q == nil {
		return 0
	}
	return l.q.len()
}

// Close stops the limiter from taking calls: later calls get ErrClosed. In
// Queue mode it then drains the queue: it waits until every queued call has
// had its turn. If ctx ends first, the calls still queued get ErrClosed and
// Close returns ctx's error; no call is dropped without an error. It ends
// the limiter's subscription to its quota's news (what other replicas learn
// of pauses and losses), which the last limiter on a client closes. Close
// does not close the Redis client, which belongs to the caller.
func (l *Limiter) Close(ctx context.Context) error {
	if err := l.made(); err != nil {
		return err
	}
	if !l.closed.Swap(true) {
		defer l.unlisten()
	}
	if l.q != nil {
		return l.q.close(ctx, l.name)
	}
	return nil
}

// Do acquires a permit from l, runs fn, and releases the permit. It returns
// fn's result, or the error that kept fn from running. fn finds its permit
// in its context with PermitFrom: to settle the call's actual cost, or to
// tell the quota that the vendor refused it.
func Do[T any](ctx context.Context, l *Limiter, fn func(context.Context) (T, error), opts ...CallOption) (T, error) {
	p, err := l.acquirePermit(ctx, opts)
	if err != nil {
		var zero T
		return zero, err
	}
	defer p.Release()
	p.start()
	return fn(withPermit(ctx, p))
}

type permitKey struct{}

func withPermit(ctx context.Context, p *Permit) context.Context {
	return context.WithValue(ctx, permitKey{}, p)
}

// PermitFrom returns the permit of the call that Do or Go runs with ctx, or
// nil for a context they did not make.
//
//	reply, err := throttle.Do(ctx, lim, func(ctx context.Context) (*Reply, error) {
//		reply, err := llm.Complete(ctx, prompt)
//		if err == nil {
//			err = throttle.PermitFrom(ctx).Settle(ctx, reply.Usage.TotalTokens)
//		}
//		return reply, err
//	}, throttle.Cost(estimate))
func PermitFrom(ctx context.Context) *Permit {
	p, _ := ctx.Value(permitKey{}).(*Permit)
	return p
}

// Future is the outcome of a call submitted with Go.
type Future[T any] struct {
	done chan struct{}
	v    T
	err  error
}

// Done is closed when the call has run or failed.
func (f *Future[T]) Done() <-chan struct{} { return f.done }

// Wait waits for the call and returns fn's result, or the error that kept fn
// from running (ErrQueueFull, ErrLimited, the context's error, ...).
func (f *Future[T]) Wait() (T, error) {
	<-f.done
	return f.v, f.err
}

// Go submits fn to l and returns at once: fn runs in its own goroutine when
// l admits it, as Do would run it. In Queue mode the call takes its place in
// the queue before Go returns, so calls submitted one after another keep
// their order; a full queue answers through the Future at once. Job workers
// use it to hand work over without a goroutine of their own per job.
func Go[T any](ctx context.Context, l *Limiter, fn func(context.Context) (T, error), opts ...CallOption) *Future[T] {
	f := &Future[T]{done: make(chan struct{})}
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
		return f
	}
	go func() {
		defer close(f.done)
		var p *Permit
		p, f.err = l.dispatch(ctx, c, w)
		if f.err != nil {
			return
		}
		defer p.Release()
		p.start()
		f.v, f.err = fn(withPermit(ctx, p))
	}()
	return f
}

// Permit is the right to make one call. Release it when the call is done.
type Permit struct {
	l        *Limiter
	call     call
	r        result
	held     int // concurrency units taken, whatever Settle does to the cost
	waited   time.Duration
	released atomic.Bool
}

func (l *Limiter) permit(c call, r result, waited time.Duration) *Permit {
	return &Permit{l: l, call: c, r: r, held: c.cost, waited: waited}
}

// Waited returns how long Acquire waited for the call's slot.
func (p *Permit) Waited() time.Duration { return p.waited }

// Cost returns the units the call counts for: its Cost, or what Settle set.
func (p *Permit) Cost() int { return p.call.cost }

// Release ends the call. It frees the call's slots under a
// policies.Concurrency; a sliding window or a token bucket counts the call
// whatever happens, so for them Release only marks the permit used. Calling
// it more than once is harmless.
func (p *Permit) Release() {
	if p == nil || p.l == nil || p.released.Swap(true) || !p.l.hasConc {
		return
	}
	if p.r.local {
		p.l.cancel(context.Background(), p.call, p.r)
		p.l.signalFreed()
		return
	}
	ctx, stop := context.WithTimeout(context.Background(), cleanupTimeout)
	defer stop()
	// If Redis cannot be reached, the slots free themselves when the lease ends.
	_ = p.l.run(ctx, lua.Release, p.r.scope, p.l.args(p.r.member, p.held, 0, 0, 0)).Err()
	p.l.signalFreed()
}

// Cancel gives the call back when it was not made after all (the request
// never left, the job was dropped before it ran): its units, and its call
// under policies.PerCall limits, no longer count, and its concurrency slots
// are free. A call that reached the vendor must not be cancelled, since the
// vendor counted it; use Settle for what it cost. Cancel releases the
// permit; calling it again, or after Release, does nothing more.
func (p *Permit) Cancel(ctx context.Context) error {
	if p == nil || p.l == nil {
		return errors.New("throttle: Cancel: the permit is nil")
	}
	if p.released.Swap(true) {
		return nil
	}
	defer p.l.signalFreed()
	if p.r.local {
		if p.l.local != nil {
			p.l.local.forget(p.r.scope, p.r.member)
		}
		return nil
	}
	if err := p.l.run(ctx, lua.Cancel, p.r.scope, p.l.args(p.r.member, p.call.cost, p.r.slot().Microseconds(), p.r.epoch, 0)).Err(); err != nil {
		return p.l.unavailable(err)
	}
	if p.l.hasConc && p.held != p.call.cost {
		// Settle changed the cost: the slots held are still the first.
		_ = p.l.run(ctx, lua.Release, p.r.scope, p.l.args(p.r.member, p.held, 0, 0, 0)).Err()
	}
	return nil
}

// Extend renews the lease of the call's concurrency slots for a call that
// runs longer than policies.Concurrency.Lease: the slots stay taken for
// lease from now. It does nothing for a quota without a Concurrency policy.
func (p *Permit) Extend(ctx context.Context, lease time.Duration) error {
	if p == nil || p.l == nil {
		return errors.New("throttle: Extend: the permit is nil")
	}
	if !p.l.hasConc {
		return nil
	}
	if lease < time.Millisecond {
		return fmt.Errorf("throttle: quota %q: Extend: lease must be at least 1ms, got %v", p.l.name, lease)
	}
	if p.released.Load() {
		return fmt.Errorf("throttle: quota %q: Extend: permit already released", p.l.name)
	}
	if p.r.local {
		return nil // a slot held without Redis lasts until Release
	}
	held, err := p.l.run(ctx, lua.Release, p.r.scope, p.l.args(p.r.member, p.held, lease.Microseconds(), 0, 0)).Int64()
	if err != nil {
		return p.l.unavailable(err)
	}
	if held == 0 {
		return fmt.Errorf("throttle: quota %q: Extend: the lease had already run out", p.l.name)
	}
	return nil
}

// Settle replaces the cost the call was admitted with by the cost the vendor
// actually counted, for costs known only afterwards (LLM tokens, GraphQL
// points). The difference is refunded or charged in the same windows, at the
// call's slot, so that the shared count matches the vendor's. A charge may
// take a window past its limit, since the vendor counted those units
// already: later calls then wait for them. Settle can be called again; each
// call replaces the cost before it. The actual cost must be between 0 and
// the quota's smallest limit. A Permit's methods are for the goroutine that
// holds it; Release alone may be called from anywhere.
func (p *Permit) Settle(ctx context.Context, actual int) error {
	if p == nil || p.l == nil {
		return errors.New("throttle: Settle: the permit is nil")
	}
	if actual < 0 || actual > p.l.maxCost {
		return fmt.Errorf("throttle: quota %q: Settle: actual cost must be between 0 and %d, got %d", p.l.name, p.l.maxCost, actual)
	}
	if actual == p.call.cost || p.r.local {
		// A call decided without Redis has nothing in Redis to settle.
		return nil
	}
	args := p.l.args(p.r.member, p.call.cost, p.r.slot().Microseconds(), int64(actual), p.r.epoch)
	if err := p.l.run(ctx, lua.Settle, p.r.scope, args).Err(); err != nil {
		return p.l.unavailable(err)
	}
	p.call.cost = actual
	return nil
}

// callOf applies a call's options to the defaults.
func callOf(opts []CallOption) call {
	c := call{cost: 1}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	return c
}

// newCall reads and checks a call's options.
func (l *Limiter) newCall(opts []CallOption) (call, error) {
	c := callOf(opts)
	if err := l.made(); err != nil {
		return c, err
	}
	switch {
	case c.cost <= 0:
		return c, fmt.Errorf("throttle: quota %q: Cost must be > 0, got %d", l.name, c.cost)
	case c.cost > l.maxCost:
		return c, fmt.Errorf("throttle: quota %q: Cost %d exceeds %s and could never run", l.name, c.cost, l.maxCostIs)
	case l.perKey && !c.hasKey:
		return c, fmt.Errorf("throttle: quota %q has a per-key limit: the call needs a Key", l.name)
	case c.hasKey && !l.perKey:
		return c, fmt.Errorf("throttle: quota %q: Key %q given, but no policy is a policies.PerKey: every key would share one quota", l.name, redactKey(c.key))
	case l.closed.Load():
		return c, quotaErr(l.name, ErrClosed, "limiter closed")
	}
	return c, nil
}

// made reports a Limiter that New did not make: a nil one, or a zero value.
func (l *Limiter) made() error {
	if l == nil || l.rdb == nil {
		return errors.New("throttle: the Limiter is nil or a zero value: make it with throttle.New")
	}
	return nil
}

// redactKey shows the start of a key, which may be a secret (an API token).
func redactKey(k string) string {
	if len(k) <= 4 {
		return strings.Repeat("*", len(k))
	}
	return k[:4] + "…"
}

func (l *Limiter) limited(retryAfter time.Duration, reason string) error {
	return &LimitedError{Quota: l.name, RetryAfter: retryAfter, Reason: reason}
}

// refused returns the error of a call that Redis did not admit now.
func (l *Limiter) refused(r result) error {
	switch {
	case r.reason == reasonLate:
		return l.limited(r.wait, lateReason)
	case r.reason == reasonBusy:
		return l.limited(r.wait, "every concurrency slot is taken")
	case r.pause > r.now:
		return l.limited(r.wait, "the vendor asked the fleet to pause")
	}
	return l.limited(r.wait, "the quota is full now, and the call does not wait")
}

// limitName names the field a rule's limit comes from, with its value.
func limitName(r policies.Rule) string {
	switch r.Kind {
	case policies.KindTokenBucket:
		return fmt.Sprintf("TokenBucket.Burst %d (by default Rate)", r.Limit)
	case policies.KindConcurrency:
		return fmt.Sprintf("Concurrency.Max %d", r.Limit)
	case policies.KindSlidingCounter:
		return fmt.Sprintf("SlidingCounter.Limit %d", r.Limit)
	}
	return fmt.Sprintf("SlidingLog.Limit %d", r.Limit)
}
