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
