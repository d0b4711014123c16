package throttle

import (
	"errors"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Breaker timing: consecutive failures that open it, over at least how
// long (the calls that were on connections a Redis restart or CLIENT KILL
// closed fail at one instant, which is no sign of a Redis down), and the
// backoff between probes. The backoff stays short: a probe costs one
// failed dial, while a long one keeps the fleet refusing calls long after
// Redis (or a Cluster's new master) answers. probeMax is the longest
// interval before jitter (±50%).
const (
	breakerFailures = 3
	breakerSpan     = 50 * time.Millisecond
	probeFirst      = 100 * time.Millisecond
	probeMax        = 250 * time.Millisecond
)

// probeLongest is the longest a breaker waits between two probes, jitter
// included.
const probeLongest = probeMax * 3 / 2

// errBreakerOpen is the cause of a call decided without asking Redis.
var errBreakerOpen = errors.New("redis failed repeatedly; waiting to probe it again")

// breaker counts Redis failures and keeps calls away from a Redis that keeps
// failing, letting one call through now and then to see whether it is back.
//
// Probes go out on a schedule of their own, whatever became of the ones
// before: a failure never moves the next probe out. The calls that were on
// their way to Redis when the breaker opened fail too, each at its
// timeout; were each of them to draw the next backoff, they would drive it
// to its maximum and keep the process away from a Redis that is back. And a
// probe may take as long as the Redis timeout to fail (a ClusterClient
// dials a dead master, and redials it, before it reloads its slot map), so
// the next one does not wait for it: the first probe sent after the
// failover finds the new master.
type breaker struct {
	mu       sync.Mutex
	failures int
	first    time.Time // the first failure of the current run
	open     bool
	next     time.Time // when the next probe may go
	bo       *backoff.ExponentialBackOff
}

// pass is what allow grants a call: to ask Redis at all, and whether the
// call is one of the breaker's probes.
type pass struct {
	ok, probe bool
}

func newBreaker() *breaker {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = probeFirst
	bo.MaxInterval = probeMax
	bo.MaxElapsedTime = 0 // probe for as long as Redis is away
	return &breaker{bo: bo}
}

// allow reports whether the call may ask Redis: always while the breaker is
// closed, and once it is open, one call each time a probe is due.
func (b *breaker) allow() pass {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open || isOff(offBreaker) {
		return pass{ok: true}
	}
	now := time.Now()
	if now.Before(b.next) {
		return pass{}
	}
	b.next = now.Add(b.bo.NextBackOff())
	return pass{ok: true, probe: true}
}

// nextProbe returns how long until the breaker lets its next probe go;
// probeFirst while it is closed, when every call may ask Redis, for a
// caller that tries on its own schedule (see Limiter.watchForRedis).
func (b *breaker) nextProbe() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return probeFirst
	}
	return max(time.Until(b.next), 0)
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
	b.open = false
	b.bo.Reset()
	return true
}

// failure records a failure, and reports whether it opened the breaker.
// While the breaker is open, failures change nothing: the probes keep
// their schedule.
func (b *breaker) failure() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.open {
		return false
	}
	if b.failures++; b.failures == 1 {
		b.first = time.Now()
	}
	if b.failures < breakerFailures || time.Since(b.first) < breakerSpan {
		return false
	}
	b.open = true
	b.bo.Reset()
	b.next = time.Now().Add(b.bo.NextBackOff())
	return true
}

// abort ends a call that p let through without a verdict on Redis (the
// caller's context ended, Redis refused the call for a reason of its
// configuration, the call needed no script): the next call probes at once.
func (b *breaker) abort(p pass) {
	if !p.probe {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.next = time.Now()
}
