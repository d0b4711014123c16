package throttle

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/policies"
)

// Any configuration either fails in New with an error, or gives a limiter
// whose calls are decided without a panic, with a known error, and without
// an error from the script.
func FuzzConfiguration(f *testing.F) {
	f.Add(100, int64(time.Second), int64(0), 10, 3, 2, int64(time.Minute), 1, "tenant", uint8(0))
	f.Add(0, int64(0), int64(-1), -1, 0, 0, int64(-5), 0, "", uint8(3))
	f.Add(1<<40, int64(1<<62), int64(1<<62), 1<<30, 1<<20, 7, int64(1), 1<<31, "\x00{}\xff", uint8(9))
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(mr.Close)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	f.Cleanup(func() { rdb.Close() })
	f.Fuzz(func(t *testing.T, limit int, window, margin int64, buckets, rate, burst int, maxWait int64, cost int, key string, kind uint8) {
		var p policies.Policy
		switch kind % 5 {
		case 0:
			p = policies.SlidingLog{Limit: limit, Window: time.Duration(window), Margin: time.Duration(margin)}
		case 1:
			p = policies.SlidingCounter{Limit: limit, Window: time.Duration(window), Buckets: buckets, Margin: time.Duration(margin)}
		case 2:
			p = policies.TokenBucket{Rate: rate, Per: time.Duration(window), Burst: burst}
		case 3:
			p = policies.Concurrency{Max: limit, Lease: time.Duration(window)}
		default:
			p = policies.All(
				policies.SlidingLog{Limit: limit, Window: time.Duration(window)},
				policies.PerKey{Policy: policies.TokenBucket{Rate: rate, Per: time.Duration(window), Burst: burst}},
			)
		}
		lim, err := New(rdb, "fuzz", p, Options{Mode: []Mode{"", Block, FailFast, Queue}[kind%4], MaxWait: time.Duration(maxWait)})
		if err != nil {
			return
		}
		// A window too long for Redis's clock arithmetic must still not panic.
		// The deadline is the machine's: CI fuzzes at the lowest priority,
		// where a call waited over a second for a core.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		opts := []CallOption{Cost(cost)}
		if lim.cfg.perKey {
			opts = append(opts, Key(key))
		}
		d, err := lim.Allow(ctx, opts...)
		if err != nil && !errors.Is(err, ErrUnavailable) && ctx.Err() == nil && cost > 0 && cost <= lim.cfg.maxCost {
			t.Fatalf("Allow(Cost(%d)) on %#v: %v", cost, p, err)
		}
		// Redis is up: ErrUnavailable may come from the deadline (a call
		// that takes the log's bound), never from an error the script hit.
		var reply redis.Error
		if errors.As(err, &reply) {
			t.Fatalf("Allow(Cost(%d)) on %#v: the script failed: %v", cost, p, err)
		}
		if err == nil && d.Remaining < 0 {
			t.Fatalf("negative remaining %+v", d)
		}
	})
}
