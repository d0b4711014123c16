package throttle

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/lua"
)

// OnRedisError says what a call does when Redis cannot decide it: Redis is
// down, slow past the Redis timeout, or answers an error.
type OnRedisError int

const (
	// FailClosed does not make the call: it gets an error matching
	// ErrUnavailable. The vendor is never called over the cap. The default.
	FailClosed OnRedisError = iota
	// FailOpen makes the call as if Redis had admitted it. The fleet keeps
	// working, and may go over the vendor's cap while Redis is away.
	FailOpen
	// Local decides the call in this process, under the quota's limits
	// divided by the number of replicas (see Options.ExpectedReplicas): the fleet
	// stays under the cap, at the price of the quota a shared Redis would
	// have spread better.
	Local
)

// String returns the policy's name.
func (o OnRedisError) String() string {
	switch o {
	case FailClosed:
		return "FailClosed"
	case FailOpen:
		return "FailOpen"
	case Local:
		return "Local"
	}
	return "OnRedisError(" + strconv.Itoa(int(o)) + ")"
}

// Breaker timing: consecutive failures that open it, over at least how
// long (the calls that were on connections a Redis restart or CLIENT KILL
// closed fail at one instant, which is no sign of a Redis down), and the
// backoff between probes.
const (
	breakerFailures = 3
	breakerSpan     = 50 * time.Millisecond
	probeFirst      = 100 * time.Millisecond
	probeMax        = 10 * time.Second
)

// errBreakerOpen is the cause of a call decided without asking Redis.
var errBreakerOpen = errors.New("redis failed repeatedly; waiting to probe it again")

// breaker counts Redis failures and keeps calls away from a Redis that keeps
// failing, letting one call through now and then to see whether it is back.
type breaker struct {
	mu       sync.Mutex
	failures int
	first    time.Time // the first failure of the current run
	open     bool
	probing  bool
	next     time.Time
	bo       *backoff.ExponentialBackOff
}

func newBreaker() *breaker {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = probeFirst
	bo.MaxInterval = probeMax
	bo.MaxElapsedTime = 0 // probe for as long as Redis is away
	return &breaker{bo: bo}
}

// allow reports whether the call may ask Redis: always while the breaker is
// closed, and one call at a time once a probe is due.
func (b *breaker) allow() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return true
	}
	if b.probing || time.Now().Before(b.next) {
		return false
	}
	b.probing = true
	return true
}

// success records an answer from Redis, and reports whether it closed the
// breaker.
func (b *breaker) success() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failures = 0
	if !b.open {
		return false
	}
	b.open, b.probing = false, false
	b.bo.Reset()
	return true
}

// failure records a failure, and reports whether it opened the breaker.
func (b *breaker) failure() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.failures++; b.failures == 1 {
		b.first = time.Now()
	}
	if b.open {
		b.probing = false
		b.next = time.Now().Add(b.bo.NextBackOff())
		return false
	}
	if b.failures < breakerFailures || time.Since(b.first) < breakerSpan {
		return false
	}
	b.open = true
	b.bo.Reset()
	b.next = time.Now().Add(b.bo.NextBackOff())
	return true
}

// abort ends a probe that got no verdict (the caller's context ended).
func (b *breaker) abort() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing = false
}

// acquire decides one call: in Redis while Redis answers, and otherwise as
// the limiter's OnRedisError says.
//
// giveBack, when not nil, is a booking of the call to give back in the same
// script call: it came too late to start in.
func (l *Limiter) acquire(ctx context.Context, c call, maxWait time.Duration, giveBack *result) (result, error) {
	if err := ctx.Err(); err != nil {
		return result{}, err
	}
	sc := l.scopeFor(c)
	if !l.brk.allow() {
		return l.fallback(sc, c, maxWait, l.unavailable(errBreakerOpen))
	}
	if giveBack != nil && giveBack.local {
		l.cancel(ctx, c, *giveBack)
		giveBack = nil
	}
	if l.localNow.Load() {
		// Back from the fallback: Redis learns of the calls decided without
		// it before it decides any more.
		if err := l.handBack(ctx); err != nil {
			l.reloadSlots(err)
			l.brk.failure()
			return l.fallback(sc, c, maxWait, err)
		}
		l.localNow.Store(false)
	}
	r, err := l.decideInRedis(ctx, sc, c, maxWait, giveBack)
	if err == nil {
		if l.brk.success() {
			l.s.logger.Info("throttle: Redis answers again; deciding in Redis", "quota", l.name)
			l.emit(Event{Kind: EventRecovered})
		}
		return r, nil
	}
	if !errors.Is(err, ErrUnavailable) {
		l.brk.abort()
		return r, err
	}
	if refusedByConfiguration(err) {
		// Not an outage: no fallback would be right, and no probe will fix it.
		l.brk.abort()
		return r, err
	}
	l.reloadSlots(err)
	if l.brk.failure() {
		l.s.logger.Warn("throttle: Redis keeps failing; deciding without it until it answers a probe",
			"quota", l.name, "on_redis_error", l.s.onRedisError.String(), "err", err)
		l.emit(Event{Kind: EventFallback, Err: err})
	}
	return l.fallback(sc, c, maxWait, err)
}

// fallback decides a call that Redis could not.
func (l *Limiter) fallback(sc scope, c call, maxWait time.Duration, cause error) (result, error) {
	switch l.s.onRedisError {
	case FailOpen:
		return result{admitted: true, local: true, scope: sc}, nil
	case Local:
		if !l.localNow.Swap(true) {
			l.local.takeOver(time.Unix(0, l.horizon.Load()))
		}
		member := l.newMember()
		r := l.local.decide(sc, c, member, maxWait)
		r.scope, r.member = sc, member
		return r, nil
	}
	return result{}, cause
}

// refusedByConfiguration reports whether Redis refused the script for a
// reason only its configuration can change: a user without the rights the
// scripts need, a password refused, a key of another type. Such a call fails
// with the error whatever Options.OnRedisError says: FailOpen must not turn a
// missing right into no limit at all.
func refusedByConfiguration(err error) bool {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return false
	}
	msg := reply.Error()
	for _, p := range []string{"NOPERM", "NOAUTH", "WRONGPASS", "WRONGTYPE"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	// Redis 7.0's words for a command a user may not run inside a script.
	return strings.Contains(msg, "can't run this command")
}

// reloadSlots asks a ClusterClient to reload its slot map when a decision
// failed for want of a node rather than with an error reply. go-redis
// otherwise learns of a failover only from a MOVED reply, which a dead master
// never sends, or after ClusterStateReloadInterval (a minute by default). The
// reload is lazy and coalesced by go-redis.
func (l *Limiter) reloadSlots(err error) {
	cc, ok := l.rdb.(*redis.ClusterClient)
	var reply redis.Error
	if !ok || errors.As(err, &reply) {
		return
	}
	cc.ReloadState(context.Background())
}

// handBack tells Redis, back from a failure, of the calls the Local
// fallback admitted that still count in a window, at their own times, so
// that the fleet deciding in Redis again does not admit them a second time;
// and reserves the quota for the replicas that may still decide without
// Redis: until their probes have found it and their calls have left the
// windows, Redis admits only the share none of them takes.
func (l *Limiter) handBack(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	charges := l.local.charges()
	byScope := map[string][]charge{}
	scopes := map[string]scope{"": l.scopeFor(call{})}
	for _, c := range charges {
		byScope[c.scope.id] = append(byScope[c.scope.id], c)
		scopes[c.scope.id] = c.scope
	}
	var span time.Duration
	for _, r := range l.rules {
		span = max(span, r.Window, time.Duration(r.Limit)*r.Every, r.Lease)
	}
	span += probeMax
	if _, ok := byScope[""]; !ok {
		byScope[""] = nil
	}
	for id, cs := range byScope {
		args := l.args(l.newMember(), 0, int64(l.s.replicas), span.Microseconds(), int64(len(cs)))
		for _, c := range cs {
			// Placed no earlier than they happened, as Redis's clock goes:
			// late units stay in the windows a little longer, never shorter;
			// at Redis's now when this process no longer knows its clock.
			var at time.Duration
			if t, ok := l.timing.redisAt(c.at); ok {
				at = t
			}
			args = append(args, c.rule+1, at.Microseconds(), c.units, l.newMember())
		}
		if err := l.run(ctx, lua.Handback, scopes[id], args).Err(); err != nil {
			return l.unavailable(err)
		}
	}
	l.local.handedBack()
	return nil
}
