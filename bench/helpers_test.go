package bench

import (
	"context"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
)

// keyPrefix starts every Redis key a limiter writes when its
// Options.Prefix is left at its default.
const keyPrefix = "throttle"

// newServer starts a throwaway redis-server on a free 127.0.0.1 port (never
// the machine's shared 6379), killed at cleanup. It skips the benchmark when
// redis-server is not installed.
func newServer(tb testing.TB) *redistest.Server {
	tb.Helper()
	return redistest.Real(tb)
}

// scriptCounter counts the script calls (EVALSHA, EVAL and their _RO forms)
// a client sends, NOSCRIPT fallbacks included: go-redis's Script.Run sends
// EVALSHA and, when Redis answers NOSCRIPT, EVAL, and both count.
type scriptCounter struct {
	calls    atomic.Int64 // every script command sent
	noscript atomic.Int64 // EVALSHA answered NOSCRIPT
}

// reqKey carries a per-request scriptCounter in the context, so that the
// hook can charge each script call to the request that made it.
type reqKey struct{}

func withRequestCounter(ctx context.Context, c *scriptCounter) context.Context {
	return context.WithValue(ctx, reqKey{}, c)
}

func isScriptCmd(name string) bool {
	switch name {
	case "evalsha", "eval", "evalsha_ro", "eval_ro":
		return true
	}
	return false
}

// observe counts cmd, which Redis answered with err. (In go-redis v9.23 a
// hook sees the NOSCRIPT error in next's result, not in cmd.Err.)
func (c *scriptCounter) observe(ctx context.Context, cmd redis.Cmder, err error) {
	if !isScriptCmd(cmd.Name()) {
		return
	}
	if err == nil {
		err = cmd.Err()
	}
	noscript := err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
	for _, c := range []*scriptCounter{c, requestCounter(ctx)} {
		if c == nil {
			continue
		}
		c.calls.Add(1)
		if noscript {
			c.noscript.Add(1)
		}
	}
}

func requestCounter(ctx context.Context) *scriptCounter {
	c, _ := ctx.Value(reqKey{}).(*scriptCounter)
	return c
}

// scriptHook is a redis.Hook feeding a scriptCounter.
type scriptHook struct{ c *scriptCounter }

func (h scriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.c.observe(ctx, cmd, err)
		return err
	}
}

func (h scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			h.c.observe(ctx, cmd, cmd.Err())
		}
		return err
	}
}

// percentile returns the nearest-rank q-quantile (0 < q <= 1) of sorted.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func sortedCopy(d []time.Duration) []time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// idealWaits returns, for arrivals sorted in ascending order, the waits of
// an ideal first-come-first-served limiter that admits at most limit calls
// in any window of length window: call i starts at
// max(arrival[i], start[i-limit] + window), the earliest time at which it
// neither overtakes an earlier arrival nor puts limit+1 calls in one window.
// It costs nothing to ask and wakes exactly on time.
func idealWaits(arrivals []time.Duration, limit int, window time.Duration) []time.Duration {
	starts := make([]time.Duration, len(arrivals))
	waits := make([]time.Duration, len(arrivals))
	for i, a := range arrivals {
		s := a
		if i >= limit {
			s = max(s, starts[i-limit]+window)
		}
		starts[i] = s
		waits[i] = s - a
	}
	return waits
}
