package throttle

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// deadRedis is a client of a port where no Redis listens.
func deadRedis(t testing.TB) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// syncBuffer is a log sink for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestOnRedisError_FailClosedRefusesTheCall(t *testing.T) {
	lim := newLimiter(t, deadRedis(t), perSecond)
	ran := false
	_, err := Do(context.Background(), lim, func(context.Context) (int, error) { ran = true; return 0, nil })
	var ue *unavailableError
	if !errors.Is(err, ErrUnavailable) || !errors.As(err, &ue) || ue.Quota != lim.Name() || ran {
		t.Fatalf("Do on a dead Redis: %v (ran %v), want ErrUnavailable and no call", err, ran)
	}
}

func TestOnRedisError_FailOpenMakesTheCall(t *testing.T) {
	t.Parallel()
	lim := newLimiter(t, deadRedis(t), perSecond, Options{OnRedisError: FailOpen})
	for range 20 {
		if _, err := Do(context.Background(), lim, func(context.Context) (int, error) { return 0, nil }); err != nil {
			t.Fatalf("Do with FailOpen on a dead Redis: %v", err)
		}
	}
}

func TestOnRedisError_LocalDividesTheQuota(t *testing.T) {
	long(t)
	// Long enough that the round trips to a dead Redis, before the breaker
	// opens, stay within one window.
	window := 3 * time.Second
	lim := newLimiter(t, deadRedis(t), policies.SlidingLog{Limit: 10, Window: window},
		Options{OnRedisError: Local, ExpectedReplicas: 3, Mode: FailFast, Logger: slog.New(slog.DiscardHandler)})
	ctx := context.Background()
	// Redis may have admitted a whole window before it failed: the fallback
	// waits one out first.
	_, err := lim.Acquire(ctx)
	var le *LimitedError
	if !errors.As(err, &le) || le.RetryAfter < window/2 || le.RetryAfter > window+policies.DefaultMargin+lim.noticeWithin() {
		t.Fatalf("first call of the fallback: %v, want ErrLimited for about a window and the time the fleet takes to notice", err)
	}
	time.Sleep(le.RetryAfter)
	admitted := 0
	for range 10 {
		if p, err := lim.Acquire(ctx); err == nil {
			admitted++
			p.Release()
		} else if !errors.Is(err, ErrLimited) {
			t.Fatalf("Acquire: %v", err)
		}
	}
	if admitted != 3 {
		t.Errorf("%d calls admitted by the local fallback, want 10/3 = 3", admitted)
	}
}

// The Local fallback waits out a window before it admits its share: with
// an hourly window, an hour and the time the fleet takes to notice the
// failure, as Local's documentation says.
func TestOnRedisError_LocalWaitsOutAnHourlyWindowFirst(t *testing.T) {
	lim := newLimiter(t, deadRedis(t), policies.SlidingLog{Limit: 5000, Window: time.Hour},
		Options{OnRedisError: Local, ExpectedReplicas: 3, Mode: FailFast, Logger: slog.New(slog.DiscardHandler)})
	_, err := lim.Acquire(context.Background())
	var le *LimitedError
	if !errors.As(err, &le) || le.RetryAfter < time.Hour || le.RetryAfter > time.Hour+policies.DefaultMargin+lim.noticeWithin() {
		t.Fatalf("first call of the fallback: %v; want ErrLimited for an hour and %v", err, lim.noticeWithin())
	}
}

func TestOnRedisError_LocalNeedsReplicas(t *testing.T) {
	_, err := New(deadRedis(t), "q", perSecond, Options{OnRedisError: Local})
	if err == nil || !strings.Contains(err.Error(), "Options.ExpectedReplicas") {
		t.Errorf("Local without replicas: %v", err)
	}
	_, err = New(deadRedis(t), "q", perSecond, Options{OnRedisError: Local, ExpectedReplicas: 6})
	if err == nil || !strings.Contains(err.Error(), "less than one unit") {
		t.Errorf("Local with more replicas than the limit: %v", err)
	}
	// The error names the rule by the policy that made it, and what to do.
	perKey := policies.All(policies.SlidingLog{Limit: 100, Window: time.Second}, policies.PerKey{Policy: policies.SlidingLog{Limit: 5, Window: time.Second}})
	_, err = New(deadRedis(t), "q", perKey, Options{OnRedisError: Local, ExpectedReplicas: 6})
	for _, want := range []string{"PerKey{SlidingLog.Limit 5}", "raise that limit to 6", "ExpectedReplicas to 5 at most", "FailClosed"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Local with more replicas than a per-key limit: %v; want it to say %q", err, want)
		}
	}
}

func TestBreaker_StopsAskingADeadRedisAndComesBack(t *testing.T) {
	t.Parallel()
	s := redistest.New(t)
	rdb := s.Client(t)
	var logs syncBuffer
	var scripts atomic.Int64
	rdb.AddHook(countScripts{&scripts})
	lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 100_000, Window: time.Second},
		Options{OnRedisError: FailOpen, RedisTimeout: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx := context.Background()
	if _, err := lim.Allow(ctx); err != nil {
		t.Fatal(err)
	}
	if s.Real {
		s.Kill()
	} else {
		s.Mini.Close()
	}
	for range 50 {
		if d, err := lim.Allow(ctx); err != nil || !d.OK {
			t.Fatalf("Allow with FailOpen while Redis is down: %+v, %v", d, err)
		}
	}
	if n := scripts.Load(); n > 10 {
		t.Errorf("%d script calls reached a dead Redis for 50 decisions; the breaker should stop them", n)
	}
	if !strings.Contains(logs.String(), "Redis keeps failing") {
		t.Errorf("no log line for the switch to the fallback:\n%s", logs.String())
	}
	if !s.Real {
		return // miniredis cannot come back on the same port
	}
	s.Restart(t)
	waitFor(t, func() bool {
		_, _ = lim.Allow(ctx)
		return strings.Contains(logs.String(), "Redis answers again")
	}, "the breaker to close")
}

func TestDataLoss_CountsTheQuotaFullForOneWindow(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Clock: clock.Now, Logger: slog.New(slog.DiscardHandler)})
		ctx := context.Background()
		if d, _ := lim.Allow(ctx, Cost(4)); !d.OK {
			t.Fatal("first call refused")
		}
		// Redis restarts empty; the vendor still counts those 4 calls.
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		clock.Add(time.Second)
		d, err := lim.Allow(ctx)
		if err != nil || d.OK {
			t.Fatalf("first call after the loss: %+v, %v; want refused for a window", d, err)
		}
		if want := time.Minute + policies.DefaultMargin; d.RetryAfter != want {
			t.Errorf("RetryAfter %v, want one window, %v", d.RetryAfter, want)
		}
		// Another process that never knew the old data is held back too.
		other := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Clock: clock.Now})
		if d, _ := other.Allow(ctx); d.OK {
			t.Errorf("another replica was admitted in the window after the loss")
		}
		clock.Add(time.Minute + policies.DefaultMargin)
		if d, _ := lim.Allow(ctx, Cost(10)); !d.OK {
			t.Errorf("a window after the loss, a full call was refused: %+v", d)
		}
	})
}
