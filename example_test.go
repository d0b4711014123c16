package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// exampleRedis stands in for the Redis that the whole fleet shares.
func exampleRedis() (*redis.Client, func()) {
	mr, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	return rdb, func() { rdb.Close(); mr.Close() }
}

// Every replica that builds this limiter on the same Redis shares one
// quota of 100 SMS per second.
func ExampleNew() {
	rdb, done := exampleRedis()
	defer done()

	lim, err := throttle.New(rdb, "twilio-sms", policies.SlidingLog{Limit: 100, Window: time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(lim.Name())
	// Output: twilio-sms
}

// Bad configuration fails at construction, naming the field and its value.
func ExampleNew_badConfiguration() {
	rdb, done := exampleRedis()
	defer done()

	_, err := throttle.New(rdb, "twilio-sms", policies.SlidingLog{Limit: 0, Window: time.Second})
	fmt.Println(err)
	// Output: throttle: quota "twilio-sms": policies: SlidingLog.Limit must be > 0, got 0
}

// Do waits for a slot in the quota, runs the call, and returns its result.
func ExampleDo() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "sms", policies.SlidingLog{Limit: 100, Window: time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}

	id, err := throttle.Do(context.Background(), lim, func(ctx context.Context) (string, error) {
		return "SM123", nil // send the message here
	})
	fmt.Println(id, err)
	// Output: SM123 <nil>
}

// Acquire is the lower level of Do: the caller runs the call between
// Acquire and Release. A call that waits further once admitted (here for a
// connection of its own pool) calls Start when it leaves, so that the
// fleet's margin sees how late it really started.
func ExampleLimiter_Acquire() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "sms", policies.SlidingLog{Limit: 100, Window: time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	conns := make(chan struct{}, 1) // a pool of one connection
	conns <- struct{}{}

	p, err := lim.Acquire(context.Background())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Release()
	<-conns // the connection is ours
	p.Start()
	fmt.Println("sent")
	conns <- struct{}{}
	// Output: sent
}

// A vendor allows 100 calls per second in all, and each tenant 10 of them.
// Both limits are checked and recorded in one script call.
func ExampleKey() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "vendor", policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
	), throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	sent := 0
	for range 12 {
		if _, err := throttle.Do(ctx, lim, func(context.Context) (bool, error) { return true, nil }, throttle.Key("tenant-42")); err == nil {
			sent++
		}
	}
	fmt.Println("tenant-42 sent", sent)
	// Output: tenant-42 sent 10
}

// Allow never waits: it admits the call now or says when to retry.
func ExampleLimiter_Allow() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "github-search", policies.SlidingLog{Limit: 30, Window: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}

	d, err := lim.Allow(context.Background(), throttle.Cost(30))
	fmt.Println(d.OK, d.Remaining, err)
	d, _ = lim.Allow(context.Background())
	fmt.Println(d.OK, d.RetryAfter > 59*time.Second)
	// Output:
	// true 0 <nil>
	// false true
}

// In FailFast mode a full quota is an error that says when to retry.
func ExampleLimitedError() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "stripe", policies.SlidingLog{Limit: 1, Window: time.Hour},
		throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	p, err := lim.Acquire(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	p.Release()

	_, err = lim.Acquire(ctx)
	var le *throttle.LimitedError
	if errors.Is(err, throttle.ErrLimited) && errors.As(err, &le) {
		fmt.Println("limited; retry after about", le.RetryAfter.Round(time.Second))
	}
	// Output: limited; retry after about 1h0m0s
}

// An LLM call is admitted with an estimate of its tokens, and settled with
// what it used; a refusal by the vendor teaches the whole fleet its cap.
func ExamplePermitFrom() {
	rdb, done := exampleRedis()
	defer done()
	lim, err := throttle.New(rdb, "llm-tokens", policies.SlidingCounter{Limit: 200_000, Window: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx := context.Background()
	used, err := throttle.Do(ctx, lim, func(ctx context.Context) (int, error) {
		used := 1200 // as the vendor's reply says
		return used, throttle.PermitFrom(ctx).Settle(ctx, throttle.Cost(used))
	}, throttle.Cost(4000))
	fmt.Println(used, err)

	_, err = throttle.Do(ctx, lim, func(ctx context.Context) (int, error) {
		// The vendor answered 429 for its rate: the fleet pauses, and learns its cap.
		_, _, err := throttle.PermitFrom(ctx).Heard(ctx, throttle.Answer{
			Status: http.StatusTooManyRequests, RetryAfter: time.Second, HasRetryAfter: true, AboutRate: true})
		return 0, err
	}, throttle.Cost(10))
	u, _ := lim.Usage(ctx)
	fmt.Println(err, u.Rules[0].Limit, u.Paused > 0)
	// Output:
	// 1200 <nil>
	// <nil> 100000 true
}

// A client that is not an http.Client (a vendor's SDK, a gRPC stub) goes
// through the limiter with Acquire and makes what the vendor answered known
// to the fleet with Heard, as Transport does with each response.
func ExamplePermit_Heard() {
	rdb, done := exampleRedis()
	defer done()
	ctx := context.Background()
	lim, err := throttle.New(rdb, "sdk", policies.SlidingLog{Limit: 100, Window: time.Minute}, throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}
	p, err := lim.Acquire(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Release()
	// The SDK reports a refusal that asks for 30 seconds of quiet (over
	// gRPC, a RESOURCE_EXHAUSTED with a RetryInfo).
	pause, refused, err := p.Heard(ctx, throttle.Answer{
		Status:        http.StatusTooManyRequests,
		RetryAfter:    30 * time.Second,
		HasRetryAfter: true,
	})
	fmt.Println(pause, refused, err)
	// Every replica now waits out the pause.
	_, err = lim.Acquire(ctx)
	var limited *throttle.LimitedError
	if errors.As(err, &limited) {
		fmt.Println("next call in", limited.RetryAfter.Round(time.Second))
	}
	// Output:
	// 30s true <nil>
	// next call in 30s
}

// A tool reads the quotas a Redis holds without being told their
// policies: each quota stored its own with its data on its first call.
func ExampleOpen() {
	rdb, done := exampleRedis()
	defer done()
	ctx := context.Background()

	// Somewhere in the fleet:
	lim, _ := throttle.New(rdb, "github-api", policies.SlidingLog{Limit: 5000, Window: time.Hour})
	_, _ = lim.Allow(ctx)

	// In the tool:
	quotas, err := throttle.Quotas(ctx, rdb, "")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, q := range quotas {
		view, err := throttle.Open(ctx, rdb, q)
		if err != nil {
			fmt.Println(err)
			continue
		}
		u, err := view.Usage(ctx)
		if err != nil {
			fmt.Println(err)
			continue
		}
		r := u.Rules[0]
		fmt.Printf("%s: %d of %d per %v\n", q.Name, r.Used, r.Limit, r.Rule.Window-r.Rule.Margin)
	}
	// Output: github-api: 1 of 5000 per 1h0m0s
}
