package throttle

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A deploy that adds a rule starts that rule alone blind, for its own
// window (a Concurrency rule counts as taken for a lease): the rules whose
// data is intact keep deciding, with that data. GitHub's hourly quota per
// token, redeployed with its secondary limit (at most 8 requests in
// flight), paused every call for an hour.
func TestDeploy_ANewRuleStartsBlindAlone(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		ctx := context.Background()
		name := "blind-deploy-" + s.Addr
		hourly := policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}
		lease := 10 * time.Second
		v1 := deployed(t, rdb, name, hourly, clock)
		for range 3 {
			if d, err := v1.Allow(ctx, Key("token")); err != nil || !d.OK {
				t.Fatalf("v1: %+v, %v", d, err)
			}
		}
		clock.Add(time.Second)
		v2 := deployed(t, rdb, name, policies.All(hourly, policies.Concurrency{Max: 8, Lease: lease}), clock)
		_, err := v2.Acquire(ctx, Key("token"))
		var le *LimitedError
		if !errors.As(err, &le) || le.RetryAfter > lease || le.PausedBy != PausedByPolicy {
			t.Fatalf("v2's first call: %v (%+v); want refused for the new rule's lease, %v at most, by %q", err, le, lease, PausedByPolicy)
		}
		// The hourly log's data is intact: its calls go on.
		if d, err := v1.Allow(ctx, Key("token")); err != nil || !d.OK {
			t.Fatalf("v1 beside v2: %+v, %v; want admitted, the log's data intact", d, err)
		}
		clock.Add(lease - 2*time.Millisecond)
		if _, err := v2.Acquire(ctx, Key("token")); !errors.Is(err, ErrLimited) {
			t.Fatalf("v2 within the new rule's lease: %v, want ErrLimited", err)
		}
		clock.Add(2 * time.Millisecond)
		p, err := v2.Acquire(ctx, Key("token"))
		if err != nil {
			t.Fatalf("v2 a lease after the deploy: %v, want admitted", err)
		}
		p.Release()
		u, err := v2.Usage(ctx, Key("token"))
		if err != nil {
			t.Fatal(err)
		}
		// Spare admissions v1 took count too.
		if got := u.Rules[0].Used; got < 5 {
			t.Errorf("the hourly log counts %d calls, want the 5 of both versions at least: its data kept", got)
		}
		if u.Paused != 0 {
			t.Errorf("Usage.Paused %v by %q a lease after the deploy, want 0", u.Paused, u.PausedBy)
		}
	})
}

// A new log beside an intact one waits out its own window, not the
// longest of the policy, and a deploy that removes a rule resets none of
// the others: the rules left keep their data.
func TestDeploy_ANewLogWaitsItsOwnWindow(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		ctx := context.Background()
		name := "blind-log-" + s.Addr
		minute := policies.SlidingLog{Limit: 5, Window: time.Minute}
		hourly := policies.SlidingLog{Limit: 5000, Window: time.Hour}
		v1 := deployed(t, rdb, name, policies.All(minute, hourly), clock)
		if d, err := v1.Allow(ctx, Cost(5)); err != nil || !d.OK {
			t.Fatalf("v1: %+v, %v", d, err)
		}
		// v2 drops the hourly log: the minute's stays full.
		v2 := deployed(t, rdb, name, minute, clock)
		if d, err := v2.Allow(ctx); err != nil || d.OK {
			t.Fatalf("v2, the hourly log removed: %+v, %v; want refused, the minute's log still full", d, err)
		}
		clock.Add(time.Minute + time.Second)
		// v3 adds a log of 10 s: blind for 10 s, the minute's deciding.
		tens := policies.SlidingLog{Limit: 100, Window: 10 * time.Second}
		v3 := deployed(t, rdb, name, policies.All(minute, tens), clock)
		d, err := v3.Allow(ctx)
		if err != nil || d.OK || d.RetryAfter > 11*time.Second {
			t.Fatalf("v3's first call: %+v, %v; want refused for the new log's window", d, err)
		}
		if d, err := v2.Allow(ctx, Cost(5)); err != nil || !d.OK {
			t.Fatalf("v2 beside v3: %+v, %v; want the minute's log free again", d, err)
		}
		clock.Add(10*time.Second + policies.DefaultMargin)
		if d, err := v3.Allow(ctx); err != nil || d.OK {
			t.Errorf("v3 after the new log's window: %+v, %v; want refused by the minute's log, which v2 filled", d, err)
		}
	})
}

// deployed returns a FailFast limiter of quota name with policy p, on clock.
func deployed(t *testing.T, rdb redis.UniversalClient, name string, p policies.Policy, clock *fixedClock) *Limiter {
	t.Helper()
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, name, p, Options{Mode: FailFast, Clock: clock.Now, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// A Redis that went back in time (a failover to a copy that lagged) may
// lose the scripts of one process while the others' calls make the
// quota's count of scripts up again: the process whose scripts were lost
// finds it at its next call, by its own count (count_own in acquire.lua),
// where the quota's count no longer shows it.
func TestDataLoss_NoticedByTheProcessWhoseScriptsWereLost(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		rdb := s.Client(t)
		clock := newClock()
		name := "own-" + s.Addr
		policy := policies.SlidingLog{Limit: 10, Window: time.Minute}
		a, b := deployed(t, rdb, name, policy, clock), deployed(t, rdb, name, policy, clock)
		for _, lim := range []*Limiter{a, b} {
			if d, err := lim.Allow(ctx, Cost(2)); err != nil || !d.OK {
				t.Fatalf("before: %+v, %v", d, err)
			}
		}
		before := copyQuota(t, rdb, name)
		if d, err := a.Allow(ctx, Cost(5)); err != nil || !d.OK {
			t.Fatalf("a's call the copy misses: %+v, %v", d, err)
		}
		// The copy takes over: a's 5 units and its script are gone.
		restoreQuota(t, rdb, before)
		clock.Add(time.Second)
		if d, err := b.Allow(ctx); err != nil || !d.OK {
			t.Fatalf("b's call, which makes the quota's count up again: %+v, %v", d, err)
		}
		if d, err := a.Allow(ctx, Cost(5)); err != nil || d.OK {
			t.Errorf("a after the copy took over: %+v, %v; want refused, its own scripts lost (15 in a window of 10)", d, err)
		}
	})
}

// copied is a key of a quota as Redis held it: a hash, a sorted set or a
// string.
type copied struct {
	hash  map[string]string
	zset  []redis.Z
	value string
}

// copyQuota returns the keys of quota name as Redis holds them now.
func copyQuota(t *testing.T, rdb redis.UniversalClient, name string) map[string]copied {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "*{"+name+"}*").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]copied{}
	for _, k := range keys {
		var c copied
		switch typ := rdb.Type(ctx, k).Val(); typ {
		case "hash":
			c.hash, err = rdb.HGetAll(ctx, k).Result()
		case "zset":
			c.zset, err = rdb.ZRangeWithScores(ctx, k, 0, -1).Result()
		case "string":
			c.value, err = rdb.Get(ctx, k).Result()
		default:
			t.Fatalf("%s: a key of type %s", k, typ)
		}
		if err != nil {
			t.Fatal(err)
		}
		out[k] = c
	}
	return out
}

// restoreQuota makes the keys of Redis those of keys, and only those.
func restoreQuota(t *testing.T, rdb redis.UniversalClient, keys map[string]copied) {
	t.Helper()
	ctx := context.Background()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for k, c := range keys {
		var err error
		switch {
		case c.hash != nil:
			err = rdb.HSet(ctx, k, c.hash).Err()
		case c.zset != nil:
			err = rdb.ZAdd(ctx, k, c.zset...).Err()
		default:
			err = rdb.Set(ctx, k, c.value, 0).Err()
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}
