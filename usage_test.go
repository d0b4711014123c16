package throttle

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

func TestUsage_ReadsEveryRuleWithoutChangingIt(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, policies.All(
			policies.SlidingLog{Limit: 10, Window: time.Second, Margin: time.Nanosecond},
			policies.SlidingCounter{Limit: 100, Window: time.Second, Buckets: 10, Margin: time.Nanosecond},
			policies.TokenBucket{Rate: 10, Per: time.Second, Burst: 20},
			policies.Concurrency{Max: 50, Lease: time.Minute},
		), Options{Clock: clock.Now})
		ctx := context.Background()
		if d, err := lim.Allow(ctx, Cost(6)); err != nil || !d.OK {
			t.Fatalf("Allow: %+v, %v", d, err)
		}
		clock.Add(300 * time.Millisecond)
		if d, _ := lim.Allow(ctx, Cost(4)); !d.OK {
			t.Fatal("second call refused")
		}
		// A waiting call books a slot: the log frees 6 units at 1s.
		r, err := lim.acquire(ctx, call{cost: 2}, time.Minute, nil)
		if err != nil || !r.admitted || r.wait != 700*time.Millisecond {
			t.Fatalf("booking: %+v, %v", r, err)
		}
		before := dump(t, rdb)
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if after := dump(t, rdb); after != before {
			t.Errorf("Usage changed Redis:\nbefore %s\nafter  %s", before, after)
		}
		want := []RuleUsage{
			{Used: 10, Booked: 2, Remaining: 0, NextFree: 700 * time.Millisecond, Limit: 10},
			{Used: 10, Booked: 2, Remaining: 88, Limit: 100},
			// 12 units at 100ms each from the first call: 900ms of them
			// are still to drain, 9 units.
			{Used: 9, Booked: 0, Remaining: 11, Limit: 20},
			{Used: 12, Booked: 0, Remaining: 38, Limit: 50},
		}
		for i, w := range want {
			got := u.Rules[i]
			got.Rule = policies.Rule{}
			if got != w {
				t.Errorf("rule %d (%v): %+v, want %+v", i, u.Rules[i].Rule.Kind, got, w)
			}
		}
		if u.Remaining != 0 {
			t.Errorf("Remaining %d, want 0", u.Remaining)
		}
	})
}

// dump renders every key the test's Redis holds, with its value.
func dump(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		switch rdb.Type(ctx, k).Val() {
		case "zset":
			fmt.Fprintln(&b, k, rdb.ZRangeWithScores(ctx, k, 0, -1).Val())
		case "hash":
			fmt.Fprintln(&b, k, rdb.HGetAll(ctx, k).Val())
		default:
			fmt.Fprintln(&b, k, rdb.Get(ctx, k).Val())
		}
	}
	return b.String()
}
