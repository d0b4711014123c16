package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/policies"
)

const (
	// replicaCount is the number of replicas of every run.
	replicaCount = 3
	// callTimeout bounds one call's wait for its slot; the run's end does
	// not cut it short.
	callTimeout = 30 * time.Second
	// failurePause keeps a worker whose calls fail at once from spinning.
	failurePause = 10 * time.Millisecond
	// closeTimeout bounds the closing of a run's limiters.
	closeTimeout = 10 * time.Second
)

// replicas are the limiters of one run, one a replica, each on a go-redis
// client of its own.
type replicas struct {
	clients []*redis.Client
	lims    []*throttle.Limiter
}

// newReplicas makes replicaCount limiters of quota on the Redis at addr.
func newReplicas(ctx context.Context, addr, quota string, policy policies.Policy, opts throttle.Options) (*replicas, error) {
	r := &replicas{}
	for range replicaCount {
		c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
		r.clients = append(r.clients, c)
		if err := c.Ping(ctx).Err(); err != nil {
			r.close()
			return nil, fmt.Errorf("reach Redis: %w", err)
		}
		lim, err := throttle.New(c, quota, policy, opts)
		if err != nil {
			r.close()
			return nil, err
		}
		r.lims = append(r.lims, lim)
	}
	return r, nil
}

// close closes the limiters, then their clients.
func (r *replicas) close() {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	for _, lim := range r.lims {
		_ = lim.Close(ctx)
	}
	for _, c := range r.clients {
		_ = c.Close()
	}
}

// caller returns one call through lim, with opts, that fn notes at ven as
// who's; the call returns how long it waited for its slot.
func caller(ctx context.Context, lim *throttle.Limiter, ven *vendor, who string, opts ...throttle.CallOption) func() (time.Duration, error) {
	return func() (time.Duration, error) {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		defer cancel()
		asked := time.Now()
		var waited time.Duration
		_, err := throttle.Do(cctx, lim, func(context.Context) (struct{}, error) {
			now := time.Now()
			waited = now.Sub(asked)
			ven.note(who, now)
			return struct{}{}, nil
		}, opts...)
		return waited, err
	}
}

// loop makes calls one after another, as a closed-loop worker, until end
// or until ctx ends, and tallies them in t.
func loop(ctx context.Context, end time.Time, t *tally, call func() (time.Duration, error)) {
	for ctx.Err() == nil && time.Now().Before(end) {
		if err := t.add(call()); err != nil {
			sleep(ctx, failurePause)
		}
	}
}

// every makes a call at first and then every period until end, each in a
// goroutine of its own, whether the ones before have run or not; it
// tallies them in t and returns once they all have returned.
func every(ctx context.Context, first time.Time, period time.Duration, end time.Time, t *tally, call func() (time.Duration, error)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	sleep(ctx, time.Until(first))
	tick := time.NewTicker(period)
	defer tick.Stop()
	for ctx.Err() == nil && time.Now().Before(end) {
		wg.Go(func() { _ = t.add(call()) })
		select {
		case <-tick.C:
		case <-ctx.Done():
		}
	}
}

// sleep sleeps for d, or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-ctx.Done():
	}
}

// tally collects the calls of one class or tenant: how many were asked
// for, how long the admitted ones waited, and how many failed.
type tally struct {
	// start is when the run began, slowAfter the wait past which a call
	// counts as slow (0 for none).
	start     time.Time
	slowAfter time.Duration

	mu       sync.Mutex
	asked    int
	waits    []time.Duration
	failed   int
	first    error         // the first failure
	slow     int           // the calls that waited longer than slowAfter
	lastSlow time.Duration // when the last of them was asked, from start
}

// add counts one call that waited for waited and returned err, and returns
// err.
func (t *tally) add(waited time.Duration, err error) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.asked++
	if err != nil {
		t.failed++
		if t.first == nil {
			t.first = err
		}
		return err
	}
	t.waits = append(t.waits, waited)
	if t.slowAfter > 0 && waited > t.slowAfter {
		t.slow++
		t.lastSlow = max(t.lastSlow, time.Since(t.start)-waited)
	}
	return nil
}

// summary returns what t counted, once its calls are done.
func (t *tally) summary() summary {
	t.mu.Lock()
	defer t.mu.Unlock()
	w := slices.Clone(t.waits)
	slices.Sort(w)
	s := summary{asked: t.asked, admitted: len(w), failed: t.failed, first: t.first, slow: t.slow, lastSlow: t.lastSlow}
	if len(w) > 0 {
		s.p50, s.p99, s.max = durations.Percentile(w, 0.50), durations.Percentile(w, 0.99), w[len(w)-1]
	}
	return s
}

// summary is what a tally counted.
type summary struct {
	asked, admitted, failed int
	p50, p99, max           time.Duration // of the admitted calls' waits
	first                   error
	slow                    int           // the calls that waited longer than the tally's slowAfter
	lastSlow                time.Duration // when the last of them was asked, from the run's start
}

// slowCalls formats the slow calls of s: how many, and when the last one
// was asked.
func (s summary) slowCalls() string {
	if s.slow == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (last asked at %.1fs)", s.slow, s.lastSlow.Seconds())
}
