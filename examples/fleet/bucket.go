package main

import (
	"math"
	"sync"
	"time"
)

// bucket is an in-process token bucket, the limiter most replicas use on
// their own: it behaves like golang.org/x/time/rate's
// rate.NewLimiter(rate.Limit(limit/window), limit). It fills at rate tokens a
// second up to burst, starts full, and a call takes one token: now if there
// is one, or, when it reserves, the next one to come, waiting for it.
type bucket struct {
	mu     sync.Mutex
	rate   float64 // tokens per second
	burst  float64
	tokens float64 // negative when callers have reserved tokens yet to come
	last   time.Time
}

// newBucket returns a full bucket allowing limit calls per window on
// average, with a burst of one window's worth.
func newBucket(limit float64, window time.Duration, now time.Time) *bucket {
	burst := max(1, math.Floor(limit))
	return &bucket{rate: limit / window.Seconds(), burst: burst, tokens: burst, last: now}
}

// fill adds the tokens earned since the last call. b.mu must be held.
func (b *bucket) fill(now time.Time) {
	if now.After(b.last) {
		b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
		b.last = now
	}
}

// reserve takes a token, borrowing the next one to come when none is left,
// and returns how long the caller must wait before using it.
func (b *bucket) reserve(now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fill(now)
	b.tokens--
	if b.tokens >= 0 {
		return 0
	}
	return seconds(-b.tokens / b.rate)
}

// allow takes a token if there is one now; otherwise it reports how long
// until there is.
func (b *bucket) allow(now time.Time) (bool, time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fill(now)
	if b.tokens >= 1 {
		b.tokens--
		return true, 0
	}
	return false, seconds((1 - b.tokens) / b.rate)
}

// unreserve gives back a token reserved by a caller that stopped waiting.
func (b *bucket) unreserve() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokens = min(b.burst, b.tokens+1)
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
