package prometheus_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	throttleprom "github.com/throttlekit/throttle/observe/prometheus"
	"github.com/throttlekit/throttle/policies"
)

func newRedis(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	return mr, rdb
}

func TestLimiter_FailFastCountsMatchTheCallsMade(t *testing.T) {
	_, rdb := newRedis(t)
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	// What the limiter told of its script calls, to hold the exported
	// figures to: a call whose reply came too late to start in asks again
	// (beside CI's race run, 7 script calls for 6 calls).
	var mu sync.Mutex
	scripts, decided := 0, 0
	observe := func(e throttle.Event) {
		obs.Observe(e)
		if e.Kind == throttle.EventRedis {
			mu.Lock()
			scripts, decided = scripts+1, decided+e.Calls
			mu.Unlock()
		}
	}
	lim, err := throttle.New(rdb, "vendor", policies.SlidingLog{Limit: 5, Window: time.Minute},
		throttle.Options{Mode: throttle.FailFast, Observer: observe})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	admitted, limited, units := 0, 0, 0
	// Six calls: a cost-2 call, then cost 1; the fifth unit fills the quota.
	for i := range 6 {
		cost := 1
		if i == 0 {
			cost = 2
		}
		p, err := lim.Acquire(ctx, throttle.Cost(cost))
		switch {
		case err == nil:
			admitted++
			units += cost
			p.Release()
		case errors.Is(err, throttle.ErrLimited):
			limited++
		default:
			t.Fatal(err)
		}
	}
	if admitted != 4 || limited != 2 {
		t.Fatalf("admitted %d, limited %d; want 4 and 2", admitted, limited)
	}

	_, fams := scrape(t, reg)
	if got := counter(t, fams, "throttle_calls_total", "outcome=admitted", "quota=vendor", "shadow=false"); got != float64(admitted) {
		t.Errorf("admitted calls: exported %v, made %d", got, admitted)
	}
	if got := counter(t, fams, "throttle_calls_total", "outcome=limited", "quota=vendor", "shadow=false"); got != float64(limited) {
		t.Errorf("limited calls: exported %v, made %d", got, limited)
	}
	if got := counter(t, fams, "throttle_units_total", "quota=vendor"); got != float64(units) {
		t.Errorf("units: exported %v, admitted %d", got, units)
	}
	if got := histogram(t, fams, "throttle_wait_seconds", "quota=vendor").GetSampleCount(); got != uint64(admitted) {
		t.Errorf("waits observed: %d, want one per admitted call, %d", got, admitted)
	}
	// Calls made one after another each take a script call of their own.
	mu.Lock()
	defer mu.Unlock()
	if scripts < 6 || decided != scripts {
		t.Errorf("the limiter told of %d script calls deciding %d calls, want 6 at least, one call each", scripts, decided)
	}
	per := histogram(t, fams, "throttle_redis_calls_per_script", "quota=vendor")
	if per.GetSampleCount() != uint64(scripts) || per.GetSampleSum() != float64(decided) {
		t.Errorf("calls per script: %d script calls deciding %v calls, want %d and %d", per.GetSampleCount(), per.GetSampleSum(), scripts, decided)
	}
	if got := histogram(t, fams, "throttle_redis_round_trip_seconds", "quota=vendor").GetSampleCount(); got != uint64(scripts) {
		t.Errorf("round trips observed: %d, want %d", got, scripts)
	}
	if got := counter(t, fams, "throttle_redis_errors_total", "quota=vendor"); got != 0 {
		t.Errorf("redis errors: %v, want 0", got)
	}
}

func TestLimiter_BlockCountsEveryConcurrentCall(t *testing.T) {
	_, rdb := newRedis(t)
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	lim, err := throttle.New(rdb, "burst", policies.SlidingLog{Limit: 10, Window: 200 * time.Millisecond}, throttle.Options{Observer: obs.Observe})
	if err != nil {
		t.Fatal(err)
	}
	const n = 25
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			_, err := throttle.Do(ctx, lim, func(context.Context) (struct{}, error) { return struct{}{}, nil })
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}

	_, fams := scrape(t, reg)
	if got := counter(t, fams, "throttle_calls_total", "outcome=admitted", "quota=burst", "shadow=false"); got != n {
		t.Errorf("admitted calls: exported %v, made %d", got, n)
	}
	wait := histogram(t, fams, "throttle_wait_seconds", "quota=burst")
	if wait.GetSampleCount() != n {
		t.Errorf("waits observed: %d, want %d", wait.GetSampleCount(), n)
	}
	// 25 calls at 10 per 200ms: the last ones waited two windows.
	if wait.GetSampleSum() < 0.2 {
		t.Errorf("the waits add up to %vs, want at least 0.2s", wait.GetSampleSum())
	}
	// A call that woke too late books again, so a call may be decided
	// more than once, never less.
	if got := histogram(t, fams, "throttle_redis_calls_per_script", "quota=burst").GetSampleSum(); got < n {
		t.Errorf("script calls decided %v calls, want at least %d", got, n)
	}
}

func TestLimiter_RedisDownThenBack(t *testing.T) {
	mr, rdb := newRedis(t)
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	lim, err := throttle.New(rdb, "flaky", policies.SlidingLog{Limit: 100, Window: time.Second},
		throttle.Options{
			Mode:         throttle.FailFast,
			Observer:     obs.Observe,
			RedisTimeout: 200 * time.Millisecond,
			Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := lim.Acquire(ctx); err != nil {
		t.Fatal(err)
	}

	mr.Close()
	// The breaker opens after a few failures; later calls fail without
	// asking Redis.
	const down = 5
	for range down {
		if _, err := lim.Acquire(ctx); !errors.Is(err, throttle.ErrUnavailable) {
			t.Fatalf("with Redis down: err = %v, want ErrUnavailable", err)
		}
	}
	checkExportedWhileDown(t, reg, down)

	if err := mr.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if _, err := lim.Acquire(ctx); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the limiter did not return to Redis")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, fams := scrape(t, reg)
	if got := gauge(t, fams, "throttle_fallback_active", "quota=flaky"); got != 0 {
		t.Errorf("throttle_fallback_active = %v once Redis answers, want 0", got)
	}
	if got := counter(t, fams, "throttle_fallback_switches_total", "quota=flaky", "to=redis"); got != 1 {
		t.Errorf("switches back to Redis: %v, want 1", got)
	}
}

// checkExportedWhileDown checks what reg exports of quota flaky while Redis
// is down, after down calls failed: those calls, the fallback active and
// switched to once, and every round trip but the first failed.
func checkExportedWhileDown(t *testing.T, reg *prometheus.Registry, down int) {
	t.Helper()
	_, fams := scrape(t, reg)
	if got := counter(t, fams, "throttle_calls_total", "outcome=unavailable", "quota=flaky", "shadow=false"); got != float64(down) {
		t.Errorf("unavailable calls: exported %v, made %d", got, down)
	}
	if got := gauge(t, fams, "throttle_fallback_active", "quota=flaky"); got != 1 {
		t.Errorf("throttle_fallback_active = %v with Redis down, want 1", got)
	}
	if got := counter(t, fams, "throttle_fallback_switches_total", "quota=flaky", "to=fallback"); got != 1 {
		t.Errorf("switches to the fallback: %v, want 1", got)
	}
	errs := counter(t, fams, "throttle_redis_errors_total", "quota=flaky")
	rts := histogram(t, fams, "throttle_redis_round_trip_seconds", "quota=flaky").GetSampleCount()
	if errs < 1 || uint64(errs) != rts-1 {
		t.Errorf("%v Redis errors in %d round trips, want every round trip but the first to fail", errs, rts)
	}
}
