package throttle

import (
	"context"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// Faults the simulation found (sim_regress_test.go keeps the schedules
// that found them), each shown here on its own.

// simClient returns a client of replica i of the simulated Redis r, closed
// with the test; both must live in the test's bubble.
func simClient(t *testing.T, r *sim.Redis, i int) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: simAddr(simRuns.Add(1), i), Dialer: r.Dialer(i), ContextTimeoutEnabled: true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// closeInBubble closes lim, and waits for the goroutines it leaves (the
// subscription's) to see it, so that the bubble can end.
func closeInBubble(lim *Limiter) {
	_ = lim.Close(context.Background())
	time.Sleep(2 * defaultRedisTimeout)
}

// A forward step of Redis's clock counts as a loss under a new epoch: the
// calls booked ahead by the old clock would otherwise still run at their
// slots while the token bucket, counting as empty from the step on, hands
// the same times out again (seed 10462: two calls every 100 ms of a bucket
// of 10 a second). Booked in the old epoch, they book again.
func TestClockStep_ForwardStepBooksAgainTheCallsBookedAhead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		defer r.Close()
		policy := policies.TokenBucket{Rate: 10, Per: time.Second, Burst: 10}
		// Two processes: a's calls sleep towards their slots and hear of
		// the step from the quota's news; b's calls see it in their replies.
		a, err := New(simClient(t, r, 0), "step", policy, Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		defer closeInBubble(a)
		b, err := New(simClient(t, r, 1), "step", policy, Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		defer closeInBubble(b)
		start := time.Now()
		var mu sync.Mutex
		var starts []time.Duration
		var wg sync.WaitGroup
		call := func(l *Limiter) {
			p, err := l.Acquire(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			starts = append(starts, time.Since(start))
			mu.Unlock()
			p.Release()
		}
		call(b)
		for range 14 { // the rest of a burst of 10, and 5 booked 100 to 500 ms ahead
			wg.Go(func() { call(a) })
		}
		time.Sleep(20 * time.Millisecond)
		r.Step(time.Hour)
		for range 5 {
			wg.Go(func() { call(b) })
		}
		wg.Wait()
		slices.Sort(starts)
		// At most the burst and what the rate adds over any span of starts.
		for i := range starts {
			for j := i; j < len(starts); j++ {
				span := starts[j] - starts[i]
				if n, allowed := j-i+1, 10+int((span+policies.DefaultMargin)/(100*time.Millisecond)); n > allowed {
					t.Fatalf("%d calls started within %v (from %v), a bucket of 10 a second allows %d: %v", n, span, starts[i], allowed, starts)
				}
			}
		}
	})
}
