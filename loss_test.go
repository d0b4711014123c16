package throttle

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// quiet is a logger that drops what it is told.
func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// A new replica may meet the empty Redis first and write a fresh epoch. The
// replica that knew the old one still finds out, and pauses the quota for a
// window from the new epoch: what Redis forgot is still counted at the
// vendor.
func TestDataLoss_NoticedAfterANewReplicaWroteAFreshEpoch(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		policy := policies.SlidingLog{Limit: 10, Window: time.Minute}
		a := newLimiter(t, rdb, policy, Options{Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if d, _ := a.Allow(ctx, Cost(10)); !d.OK {
			t.Fatal("first call refused")
		}
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		clock.Add(time.Second)
		b, err := New(rdb, a.Name(), policy, Options{Clock: clock.Now, Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		// B cannot tell a loss from a new quota: it admits a window's limit
		// beside the 10 units of A's call the vendor still counts, 20 in a
		// window of 10 (docs/FAILURES.md, Left), and not a unit more.
		if d, _ := b.Allow(ctx, Cost(10)); !d.OK {
			t.Fatal("the new replica was refused on what looks like a new quota")
		}
		if d, _ := b.Allow(ctx); d.OK {
			t.Fatal("the new replica admitted more than a window's limit on what looks like a new quota")
		}
		clock.Add(time.Second)
		d, err := a.Allow(ctx)
		if err != nil || d.OK {
			t.Fatalf("the old replica after the loss: %+v, %v; want refused for a window from the new epoch", d, err)
		}
		// A new epoch is a new quota: its first call was held as a warming
		// quota's are (see warmMargin).
		if want := time.Minute + warmMargin(time.Minute) - time.Second; d.RetryAfter != want {
			t.Errorf("RetryAfter %v, want %v", d.RetryAfter, want)
		}
		if d, _ := b.Allow(ctx); d.OK {
			t.Error("the new replica was admitted after the loss was found")
		}
	})
}

// A vendor's 429 that is the first script on an empty Redis does not hide
// the loss: the pause is set, and the quota counts as full for a window.
func TestDataLoss_NoticedByAPause(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if d, _ := lim.Allow(ctx, Cost(10)); !d.OK {
			t.Fatal("first call refused")
		}
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if err := lim.Pause(ctx, 100*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		clock.Add(200 * time.Millisecond)
		if d, _ := lim.Allow(ctx, Cost(10)); d.OK {
			t.Error("after the loss and a short pause, a full window was admitted again")
		}
	})
}

// Concurrency holders keep running through a loss: their slots count as
// taken until a lease has run out.
func TestDataLoss_ConcurrencySlotsCountAsTakenForALease(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, policies.Concurrency{Max: 2, Lease: 10 * time.Second}, Options{Mode: FailFast, Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		for range 2 {
			if _, err := lim.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		clock.Add(time.Second)
		if _, err := lim.Acquire(ctx); !errors.Is(err, ErrLimited) {
			t.Fatalf("after the loss, with 2 of 2 slots held: %v, want ErrLimited", err)
		}
		clock.Add(10 * time.Second)
		if _, err := lim.Acquire(ctx); err != nil {
			t.Errorf("a lease after the loss: %v, want a slot", err)
		}
	})
}

// A token bucket counts as empty at the loss, and refills at its rate: a
// loss does not stop a quota for the bucket's whole refill time, and a log
// beside it resumes after its window.
func TestDataLoss_TokenBucketRefillsFromEmpty(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		every := 24 * time.Hour / 1000
		lim := newLimiter(t, rdb, policies.All(
			policies.SlidingLog{Limit: 10, Window: time.Second},
			policies.TokenBucket{Rate: 1000, Per: 24 * time.Hour, Burst: 1000},
		), Options{Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if d, _ := lim.Allow(ctx); !d.OK {
			t.Fatal("first call refused")
		}
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		d, err := lim.Allow(ctx)
		if err != nil || d.OK {
			t.Fatalf("right after the loss: %+v, %v; want refused", d, err)
		}
		if d.RetryAfter > every+time.Second {
			t.Errorf("RetryAfter %v, want about one emission interval (%v), not the bucket's refill time", d.RetryAfter, every)
		}
		clock.Add(every + time.Second)
		if d, _ := lim.Allow(ctx); !d.OK {
			t.Errorf("one interval after the loss: %+v, want one call admitted", d)
		}
		if d, _ := lim.Allow(ctx); d.OK {
			t.Error("a second call right after: admitted, want the bucket still refilling")
		}
	})
}

func TestTokenBucket_RefusesABurstThatTakesOverAYearToRefill(t *testing.T) {
	_, err := policies.Rules(policies.TokenBucket{Rate: 1, Per: policies.MaxWindow, Burst: 1 << 30})
	if err == nil || !containsAll(err.Error(), "TokenBucket.Burst", "1073741824") {
		t.Errorf("err %v, want one naming TokenBucket.Burst and its value", err)
	}
}

// A quota with windows of months keeps its meta key as long as its data:
// an idle month is not a data loss.
func TestMeta_OutlivesTheLongestWindow(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: 60 * 24 * time.Hour})
		ctx := context.Background()
		if _, err := lim.Allow(ctx); err != nil {
			t.Fatal(err)
		}
		ttl, err := rdb.PTTL(ctx, lim.cfg.shared[0]).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl < 120*24*time.Hour {
			t.Errorf("meta key lives %v, want at least two 60-day windows", ttl)
		}
	})
}

// Pauses of many keys that have ended do not stay in memory.
func TestPauses_EndedOnesAreForgotten(t *testing.T) {
	s := redistest.Mini(t)
	lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}})
	sc := func(i int) scope {
		return lim.scopeFor(call{key: string(rune('a'+i%26)) + string(rune(i)), hasKey: true})
	}
	for i := range 2000 {
		lim.notePause(sc(i), 0, time.Microsecond) // ends at once
	}
	n := 0
	lim.view.pauses.Range(func(any, any) bool { n++; return true })
	if n > pauseSweep {
		t.Errorf("%d pauses remembered after they all ended, want at most %d", n, pauseSweep)
	}
}

// slowScripts delays every script reply, as a Redis that is slow but
// answers.
type slowScripts struct{ d time.Duration }

func (slowScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h slowScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			time.Sleep(h.d)
		}
		return next(ctx, cmd)
	}
}
func (slowScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A call that waits for another call's script before its own is sent is
// not failed by that wait: the Redis timeout runs from its own script call.
func TestRedisTimeout_RunsFromTheCallsOwnScript(t *testing.T) {
	t.Parallel()
	s := redistest.New(t)
	rdb := s.Client(t)
	lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{Logger: quiet()})
	ctx := context.Background()
	if _, err := lim.Allow(ctx); err != nil { // Redis learns the script
		t.Fatal(err)
	}
	rdb.AddHook(slowScripts{d: 600 * time.Millisecond})
	var failed atomic.Int32
	done := make(chan struct{})
	for range 3 {
		go func() {
			defer func() { done <- struct{}{} }()
			if _, err := lim.Allow(ctx); err != nil {
				t.Logf("Allow: %v", err)
				failed.Add(1)
			}
		}()
		time.Sleep(50 * time.Millisecond)
	}
	for range 3 {
		<-done
	}
	if n := failed.Load(); n != 0 {
		t.Errorf("%d of 3 calls failed behind a Redis that answers each script in 600ms, within the 1s timeout", n)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// A deploy that changes a quota's policy: a rule of another kind or window
// gets a key of its own (no WRONGTYPE from the old data), and the quota
// pauses once for the new policy's windows, since the calls the old rule
// admitted are not in the new rule's data. Reordering the rules, or changing
// a limit, keeps the data and does not pause.
func TestDeploy_ChangedPolicyTakesOverCleanly(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		ctx := context.Background()
		name := "deploy-" + s.Addr
		version := func(p policies.Policy) *Limiter {
			t.Helper()
			lim, err := New(rdb, name, p, Options{Clock: clock.Now, Logger: quiet()})
			if err != nil {
				t.Fatal(err)
			}
			return lim
		}
		log := policies.SlidingLog{Limit: 10, Window: time.Second}
		bucket := policies.TokenBucket{Rate: 100, Per: time.Second, Burst: 10}
		v1 := version(policies.All(log, bucket))
		if d, err := v1.Allow(ctx, Cost(10)); err != nil || !d.OK {
			t.Fatalf("v1: %+v, %v", d, err)
		}
		clock.Add(200 * time.Millisecond)
		// The same rules in another order, and a higher limit: the same data.
		v2 := version(policies.All(bucket, policies.SlidingLog{Limit: 12, Window: time.Second}))
		if d, err := v2.Allow(ctx, Cost(2)); err != nil || !d.OK {
			t.Fatalf("v2, reordered with a higher limit: %+v, %v; want the 2 units the new limit leaves", d, err)
		}
		if d, err := v2.Allow(ctx); err != nil || d.OK {
			t.Fatalf("v2: %+v, %v; want the log full with v1's calls", d, err)
		}
		// The log becomes a counter: no error, and no call until a window
		// of the new policy has passed.
		v3 := version(policies.All(bucket, policies.SlidingCounter{Limit: 12, Window: time.Second}))
		d, err := v3.Allow(ctx)
		if err != nil {
			t.Fatalf("v3, a counter where a log was: %v", err)
		}
		if d.OK {
			t.Fatal("v3 admitted a call while the vendor still counts v1's and v2's")
		}
		clock.Add(time.Second + policies.DefaultMargin)
		if d, err := v3.Allow(ctx); err != nil || !d.OK {
			t.Errorf("v3 a window later: %+v, %v", d, err)
		}
		// Both versions running side by side do not pause each other again.
		if d, err := v2.Allow(ctx); err != nil || !d.OK {
			t.Errorf("v2 beside v3: %+v, %v", d, err)
		}
		if d, err := v3.Allow(ctx); err != nil || !d.OK {
			t.Errorf("v3 beside v2: %+v, %v", d, err)
		}
	})
}

// Redis's clock stepping forward (NTP, a failover to a master whose clock
// is ahead) ends every window early by the step: a step larger than the
// margin is treated as a loss. Only miniredis can step its clock.
func TestClockStep_ForwardStepCountsAsALoss(t *testing.T) {
	s := redistest.Mini(t)
	s.SetClock(0)
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Logger: quiet()})
	ctx := context.Background()
	if d, _ := lim.Allow(ctx, Cost(10)); !d.OK {
		t.Fatal("first call refused")
	}
	if d, _ := lim.Allow(ctx); d.OK {
		t.Fatal("a call over the limit admitted")
	}
	// Redis's clock jumps past the window: by it, the window is empty.
	s.SetClock(61 * time.Second)
	d, err := lim.Allow(ctx, Cost(10))
	// Full for a window: refused as late (every reply stale, the step never
	// counted) would ask to retry at once.
	if err != nil || d.OK || d.RetryAfter < 30*time.Second {
		t.Errorf("after the clock stepped a minute forward: %+v, %v; want refused for about a window, the quota counting as full", d, err)
	}
}

// Redis's clock stepping back (NTP, a failover to a host whose clock is
// behind) puts every call admitted before the step ahead of the clock, as
// if booked, and past the step's length from every window the script fills
// now, while the vendor still counts them: a step back larger than the
// margin counts as a loss, and the quota as full for a window. Only
// miniredis can step its clock.
func TestClockStep_BackwardStepCountsAsALoss(t *testing.T) {
	s := redistest.Mini(t)
	s.SetClock(0)
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Logger: quiet()})
	ctx := context.Background()
	if d, _ := lim.Allow(ctx, Cost(10)); !d.OK {
		t.Fatal("first call refused")
	}
	s.SetClock(-time.Hour)
	d, err := lim.Allow(ctx)
	if err != nil || d.OK {
		t.Fatalf("after the clock stepped an hour back: %+v, %v; want refused, the quota counting as full", d, err)
	}
	// Full for a window, not for the hour of the step.
	if d.RetryAfter > time.Minute+time.Second {
		t.Errorf("after the clock stepped an hour back: retry after %v; want at most a window and its margin", d.RetryAfter)
	}
}

// A step is told once to each quota the process's limiters on the server
// were using when it came: a limiter that saw none of it (another quota's
// call did) still tells its own quota, and a limiter made after it tells
// nobody, or its first call would find its new quota held full for a
// window by a step long past.
func TestClockStep_ToldByTheLimitersThatLivedThroughIt(t *testing.T) {
	s := redistest.Mini(t)
	s.SetClock(0)
	policy := policies.SlidingLog{Limit: 10, Window: time.Minute}
	ctx := context.Background()
	mk := func(name string) *Limiter {
		l, err := New(s.Client(t), t.Name()+"-"+name, policy, Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	a, b := mk("a"), mk("b")
	for _, l := range []*Limiter{a, b} {
		if d, err := l.Allow(ctx); err != nil || !d.OK {
			t.Fatalf("%s before the step: %+v, %v", l.Name(), d, err)
		}
	}
	s.SetClock(61 * time.Second)
	// a's reply shows the step, and a tells its quota.
	if d, err := a.Allow(ctx); err != nil || d.OK {
		t.Errorf("a after the step: %+v, %v; want refused, its quota counting as full", d, err)
	}
	// b lived through the step too: its quota is told at its next call.
	if d, err := b.Allow(ctx); err != nil || d.OK {
		t.Errorf("b after the step: %+v, %v; want refused, its quota counting as full", d, err)
	}
	// c was made after it: its quota's calls all came after the step.
	c := mk("c")
	if d, err := c.Allow(ctx); err != nil || !d.OK {
		t.Errorf("c, made after the step: %+v, %v; want admitted", d, err)
	}
}

// A Redis that goes back in time (a failover to a replica that missed the
// latest writes, a restart from an old snapshot) keeps the quota's meta key
// and its epoch, but not its count of scripts run: the fleet's count is
// ahead, and the data counts as lost.
func TestDataLoss_NoticedWhenRedisGoesBackInTime(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Minute}, Options{Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if d, _ := lim.Allow(ctx, Cost(2)); !d.OK {
			t.Fatal("first call refused")
		}
		snapshot, err := rdb.HGetAll(ctx, lim.cfg.shared[0]).Result()
		if err != nil {
			t.Fatal(err)
		}
		if d, _ := lim.Allow(ctx, Cost(8)); !d.OK {
			t.Fatal("second call refused")
		}
		// The snapshot comes back: the 8 units are gone from Redis.
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if err := rdb.HSet(ctx, lim.cfg.shared[0], snapshot).Err(); err != nil {
			t.Fatal(err)
		}
		clock.Add(time.Second)
		if d, err := lim.Allow(ctx); err != nil || d.OK {
			t.Errorf("after Redis went back in time: %+v, %v; want refused, the quota counting as full", d, err)
		}
	})
}

// A token bucket's share, while other replicas may still decide without
// Redis, is a share of its burst as well as of its rate: a longer interval
// alone would let a burst of the whole size in, spread over a longer span.
func TestLocal_BackOnRedisReservesABucketsShareOfItsBurst(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.TokenBucket{Rate: 9, Per: time.Second, Burst: 9},
			Options{OnRedisError: Local, ExpectedReplicas: 3, Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if _, err := lim.handBack(); err != nil {
			t.Fatal(err)
		}
		admitted := 0
		for range 9 {
			if d, err := lim.Allow(ctx); err != nil {
				t.Fatal(err)
			} else if d.OK {
				admitted++
			}
		}
		if admitted != 3 {
			t.Errorf("%d of a burst of 9 admitted at once while 3 replicas share it, want 3", admitted)
		}
	})
}

// A call the fallback admits while its calls are on their way to Redis is
// not forgotten when they arrive: the hand-back does not end, and the next
// one hands it back with the others.
func TestLocal_ACallAdmittedDuringTheHandBackIsHandedBackToo(t *testing.T) {
	lo, err := newLocal([]policies.Rule{{Kind: policies.KindSlidingLog, Limit: 10, Window: time.Second}}, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	lo.begin()
	lo.full = time.Now().Add(-time.Second) // a window after the turn began
	sc := scope{}
	if r := decided(lo, sc, call{cost: 1}, "a", time.Second); !r.admitted || r.wait != 0 {
		t.Fatalf("first call: %+v", r)
	}
	charges, admits := lo.charges()
	if len(charges) != 1 {
		t.Fatalf("charges %v, want the first call", charges)
	}
	if r := decided(lo, sc, call{cost: 1}, "b", time.Second); !r.admitted {
		t.Fatalf("a call during the hand-back: %+v", r)
	}
	if lo.handedBack(admits) {
		t.Fatal("the hand-back ended with a call Redis does not know of")
	}
	if charges, _ := lo.charges(); len(charges) != 2 {
		t.Errorf("the next hand-back's charges %v, want both calls", charges)
	}
}

// A token bucket's charge counts every unit whose interval has not run
// out, a part of one as a whole: the vendor still counts its token.
func TestLocal_ABucketsChargeCountsAUnitStillRunning(t *testing.T) {
	lo, err := newLocal([]policies.Rule{{Kind: policies.KindTokenBucket, Limit: 10, Every: 100 * time.Millisecond}}, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	lo.begin()
	lo.full = time.Now().Add(-time.Second) // a burst's span after the turn began
	if r := decided(lo, scope{}, call{cost: 1}, "a", time.Second); !r.admitted || r.wait != 0 {
		t.Fatalf("the call: %+v", r)
	}
	charges, _ := lo.charges()
	if len(charges) != 1 || charges[0].units != 1 {
		t.Errorf("charges %+v, want the call's unit", charges)
	}
}

// Back on Redis, the fallback hands back the calls it admitted, and not
// those it booked ahead that have not begun: Redis, deciding again, may
// have admitted other replicas' calls into the windows of their slots
// before this process could tell it of them (seed 10833: a replica that
// never lost Redis booked into them while the hand-back was on its way).
// Those book again in Redis; a call that began is handed back at its time.
func TestLocal_HandsBackTheCallsThatBeganNotThoseBookedAhead(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 2, Window: time.Second},
			Options{OnRedisError: Local, ExpectedReplicas: 1, Logger: quiet()})
		ctx := context.Background()
		lim.failover.local.begin()
		lim.failover.local.full = time.Now().Add(-2 * time.Second)
		sc := lim.scopeFor(call{})
		now := decided(lim.failover.local, sc, call{cost: 1}, "now", 5*time.Second)
		began := decided(lim.failover.local, sc, call{cost: 1}, "began", 5*time.Second)
		ahead := decided(lim.failover.local, sc, call{cost: 1}, "ahead", 5*time.Second)
		if !now.admitted || now.wait != 0 || !began.admitted || began.wait != 0 {
			t.Fatalf("the fallback's first calls: %+v, %+v; want admitted now", now, began)
		}
		if !ahead.admitted || ahead.wait < 900*time.Millisecond {
			t.Fatalf("the fallback's third call: %+v, want booked a window ahead", ahead)
		}
		began.member = "began"
		if !lim.failover.local.claim(began) {
			t.Fatal("a call of the turn on could not begin")
		}
		if _, err := lim.handBack(); err != nil {
			t.Fatal(err)
		}
		entries, err := rdb.ZRangeWithScores(ctx, sc.keys[2], 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(entries) != 2 {
			t.Fatalf("the log holds %v, want the 2 calls admitted now, not the one booked ahead", entries)
		}
		ahead.member = "ahead"
		if lim.failover.local.claim(ahead) {
			t.Error("a call booked ahead began after its turn ended, unknown to Redis")
		}
	})
}

// Back on Redis from the Local fallback, a replica reserves the quota for
// the others, which may still decide without Redis at 1/n of each limit:
// until they can all have found Redis again and their calls have left the
// windows, Redis admits only the share none of them takes.
func TestLocal_BackOnRedisReservesTheOthersShare(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Second},
			Options{OnRedisError: Local, ExpectedReplicas: 2, Clock: clock.Now, Logger: quiet()})
		ctx := context.Background()
		if _, err := lim.handBack(); err != nil {
			t.Fatal(err)
		}
		// Usage reads the limit in force as the calls meet it.
		if u, err := lim.Usage(ctx); err != nil || u.Rules[0].Limit != 5 || u.Remaining != 5 {
			t.Errorf("Usage during the reserve: %+v, %v; want a limit in force of 5, 5 remaining", u, err)
		}
		for i := range 5 {
			if d, err := lim.Allow(ctx); err != nil || !d.OK {
				t.Fatalf("call %d of the reserved share of 5: %+v, %v", i+1, d, err)
			}
		}
		if d, _ := lim.Allow(ctx); d.OK {
			t.Fatal("a sixth call admitted while the other replica may still take its 5")
		}
		d, err := lim.Allow(ctx, Cost(6))
		if err != nil || d.OK {
			t.Fatalf("a call larger than the share: %+v, %v; want refused until the reserve ends", d, err)
		}
		if want := time.Second + policies.DefaultMargin + probeLongest; d.RetryAfter != want {
			t.Errorf("RetryAfter %v, want the reserve's end, %v", d.RetryAfter, want)
		}
		clock.Add(time.Second + policies.DefaultMargin + probeLongest)
		if d, err := lim.Allow(ctx, Cost(10)); err != nil || !d.OK {
			t.Errorf("after the reserve, a full window: %+v, %v", d, err)
		}
	})
}

// The late-start guard holds for the Local fallback too: a call that wakes
// later after its local slot than half the margin gives it back and is
// decided again, as through Redis; FailOpen has no slot to be late for.
func TestLocal_LateStartGuard(t *testing.T) {
	lim := newLimiter(t, deadRedis(t), policies.SlidingLog{Limit: 10, Window: time.Second},
		Options{OnRedisError: Local, ExpectedReplicas: 2, Logger: quiet()})
	lim.failover.local.begin()
	lim.failover.local.full = time.Now().Add(-2 * time.Second) // a window after it took over
	r := decided(lim.failover.local, lim.scopeFor(call{}), call{cost: 1}, "m", 0)
	if !r.admitted || r.margin != policies.DefaultMargin {
		t.Fatalf("local decision %+v, want admitted with the default margin", r)
	}
	if late, tooLate := lim.late(r); tooLate {
		t.Errorf("a call starting at once is %v late", late)
	}
	r.now, r.done = r.now-20*time.Millisecond, r.done-20*time.Millisecond
	if late, tooLate := lim.late(r); !tooLate || late < 20*time.Millisecond {
		t.Errorf("a call starting 20ms after its local slot: %v, %v; want too late for a 30ms margin", late, tooLate)
	}
	if _, tooLate := lim.late(result{admitted: true, local: true}); tooLate {
		t.Error("a FailOpen admission was judged late")
	}
}

// The Local fallback does not hand out concurrency slots that the fleet
// may hold through Redis: none until a lease after it took over. Back on
// Redis, the slots it handed out are taken there until their leases end.
func TestLocal_ConcurrencySlotsHeldThroughRedisStayTaken(t *testing.T) {
	s := redistest.New(t)
	lim := newLimiter(t, s.Client(t), policies.Concurrency{Max: 4, Lease: time.Second},
		Options{OnRedisError: Local, ExpectedReplicas: 2, Mode: FailFast, Logger: quiet()})
	ctx := context.Background()
	for range 2 {
		if _, err := lim.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	lim.failover.local.begin()
	r := decided(lim.failover.local, lim.scopeFor(call{}), call{cost: 1}, "m", 0)
	if r.admitted || r.wait < 900*time.Millisecond {
		t.Fatalf("the fallback right after it took over: %+v, want no slot for about a lease", r)
	}
	lim.failover.local.full = time.Now().Add(-time.Second) // a lease later (and the time to notice)
	if r := decided(lim.failover.local, lim.scopeFor(call{}), call{cost: 2}, "m", 0); !r.admitted {
		t.Fatalf("a lease later: %+v, want the replica's 2 slots", r)
	}
	// Back on Redis: 2 held before the failure, 2 by the fallback.
	if _, err := lim.handBack(); err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if used := u.Rules[0].Used; used != 4 {
		t.Errorf("Redis counts %d slots taken, want 4", used)
	}
}

// A call sleeping towards its slot in one replica learns what another
// replica learned meanwhile, though its own process makes no call: a pause
// the vendor asked for, a loss of the quota's data. It books again rather
// than call into the pause, or with a booking the new data knows nothing of.
func TestNews_SleepingCallsLearnWhatOtherReplicasLearned(t *testing.T) {
	long(t)
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		policy := policies.SlidingLog{Limit: 1, Window: 300 * time.Millisecond}
		t.Run("Pause", func(t *testing.T) {
			a, b := twoReplicas(t, s, s.Client(t), policy)
			if d, _ := a.Allow(ctx); !d.OK {
				t.Fatal("first call refused")
			}
			done := acquireInBackground(t, b) // books ~330ms ahead, sleeps
			time.Sleep(100 * time.Millisecond)
			if err := a.Pause(ctx, 1500*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			if took := <-done; took < 1500*time.Millisecond {
				t.Errorf("B's call started %v after it asked, inside the 1.5s pause A set at 100ms", took)
			}
		})
		t.Run("Loss", func(t *testing.T) {
			rdb := s.Client(t)
			a, b := twoReplicas(t, s, rdb, policy)
			if d, _ := b.Allow(ctx); !d.OK {
				t.Fatal("first call refused")
			}
			if d, _ := a.Allow(ctx); d.OK {
				t.Fatal("a second call admitted")
			}
			done := acquireInBackground(t, b) // books ~330ms ahead, sleeps
			time.Sleep(100 * time.Millisecond)
			if err := rdb.FlushAll(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			// A finds the loss: the quota counts as full for a window from now.
			if d, _ := a.Allow(ctx); d.OK {
				t.Fatal("admitted right after the loss")
			}
			if took := <-done; took < 100*time.Millisecond+policy.EffectiveWindow() {
				t.Errorf("B's call, booked before the loss, started %v after it asked, inside the window after the loss", took)
			}
		})
	})
}

// twoReplicas returns two limiters of one quota of policy: a on rdb, b on
// a client of its own; both are closed at the end of the test.
func twoReplicas(t *testing.T, s *redistest.Server, rdb redis.UniversalClient, policy policies.Policy) (a, b *Limiter) {
	t.Helper()
	a = newLimiter(t, rdb, policy, Options{Logger: quiet()})
	b, err := New(s.Client(t), a.Name(), policy, Options{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close(context.Background()) })
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return a, b
}

// acquireInBackground starts a call of lim that may wait, and returns
// where the time it took from now is sent when it returns.
func acquireInBackground(t *testing.T, lim *Limiter) <-chan time.Duration {
	done := make(chan time.Duration)
	start := time.Now()
	go func() {
		if _, err := lim.Acquire(context.Background()); err != nil {
			t.Error(err)
		}
		done <- time.Since(start)
	}()
	return done
}

// The Local fallback admits its share of the limit at once, exactly: the
// call that fills the share fits now, the one after it waits a window.
func TestLocal_AdmitsItsShareExactly(t *testing.T) {
	lim := newLimiter(t, deadRedis(t), policies.SlidingLog{Limit: 10, Window: time.Second},
		Options{OnRedisError: Local, ExpectedReplicas: 2, Logger: quiet()})
	lim.failover.local.begin()
	lim.failover.local.full = time.Now().Add(-2 * time.Second) // a window after it took over
	sc := lim.scopeFor(call{})
	for i := range 5 {
		if r := decided(lim.failover.local, sc, call{cost: 1}, "m"+strconv.Itoa(i), 0); !r.admitted || r.wait != 0 {
			t.Fatalf("call %d of a share of 5: %+v, want admitted now", i+1, r)
		}
	}
	r := decided(lim.failover.local, sc, call{cost: 1}, "m5", 0)
	if r.admitted || r.wait < 500*time.Millisecond || r.wait > time.Second+policies.DefaultMargin {
		t.Errorf("the 6th call of a share of 5: %+v, want refused for about a window", r)
	}
}

// A call that meets a hand-back on its way to a Redis that does not answer
// (frozen, or just back and slow) leaves it when its context ends: the
// hand-back goes on without it.
func TestLocal_ACallLeavesAHangingHandBackAtItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		defer r.Close()
		lim, err := New(simClient(t, r, 0), "handback", policies.SlidingLog{Limit: 10, Window: time.Second},
			Options{OnRedisError: Local, ExpectedReplicas: 1, Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close(context.Background())
		lim.failover.local.begin() // back from the fallback, with a call to hand back
		lim.failover.local.full = time.Now().Add(-time.Second)
		if res := decided(lim.failover.local, lim.scopeFor(call{}), call{cost: 1}, "m", time.Second); !res.admitted {
			t.Fatalf("the fallback's call: %+v", res)
		}
		r.Freeze()
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err = lim.Allow(ctx)
		if took := time.Since(start); took > 200*time.Millisecond || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("a call with 200 ms to go returned after %v with %v, want its context's error at its deadline", took, err)
		}
		r.Thaw()
		time.Sleep(2 * time.Second) // the hand-back ends, and the subscription's goroutine sees Close
	})
}

// decided is local.decide for a test that does not ask whether it began a
// turn.
func decided(lo *local, sc scope, c call, member string, maxWait time.Duration) result {
	r, _ := lo.decide(sc, c, member, maxWait)
	return r
}

// Under the Local fallback, releasing a call frees its concurrency slots
// only: the call ran, and its units still count in every window. (Release
// once forgot them under every rule, and a policy with a concurrency rule
// admitted a call per slot freed, without bound.)
func TestLocal_ReleaseFreesTheSlotNotTheWindow(t *testing.T) {
	t.Parallel()
	lim := newLimiter(t, deadRedis(t), policies.All(
		policies.SlidingLog{Limit: 4, Window: time.Second},
		policies.Concurrency{Max: 4, Lease: time.Minute},
	), Options{OnRedisError: Local, ExpectedReplicas: 1, Mode: FailFast, Logger: quiet()})
	ctx := context.Background()
	lim.failover.local.begin()
	lim.failover.local.full = time.Now().Add(-2 * time.Minute) // a window and a lease after the turn began
	for i := range 4 {
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatalf("call %d of 4: %v", i+1, err)
		}
		p.Release()
	}
	if p, err := lim.Acquire(ctx); err == nil {
		p.Release()
		t.Fatal("a fifth call admitted in a window of 4: releasing the others forgot their units")
	}
}

// A call that begins after the hand-back took its charges makes the
// hand-back try again; one the charges already counted does not.
func TestLocal_ACallBegunAfterTheChargesMakesTheHandBackTryAgain(t *testing.T) {
	lo, err := newLocal([]policies.Rule{{Kind: policies.KindSlidingLog, Limit: 10, Window: time.Second}}, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	lo.begin()
	lo.full = time.Now().Add(-time.Second)
	sc := scope{}
	now := decided(lo, sc, call{cost: 1}, "now", time.Second)
	now.member = "now"
	_, admits := lo.charges()
	if !lo.claim(now) {
		t.Fatal("a call of the turn on could not begin")
	}
	if !lo.handedBack(admits) {
		t.Error("a call the charges counted, begun after them, made the hand-back try again")
	}
	lo.begin()
	lo.full = time.Now().Add(-time.Second)
	_, admits = lo.charges()
	ahead := decided(lo, sc, call{cost: 1}, "ahead", 5*time.Second)
	ahead.member = "ahead"
	lo.charged = time.Now().Add(-time.Hour) // the charges were taken before its slot
	lo.admits = admits
	if !lo.claim(ahead) || lo.handedBack(admits) {
		t.Error("a call begun after the charges were taken did not make the hand-back try again")
	}
}

// A reply decided by Redis's clock after a forward step is stale until the
// quota's data has counted the step, whether or not this reply was the one
// that showed it: two quotas of one process share what it knows of the
// server's clock, and b's script, sent before a's reply showed the step and
// answered after it, read windows the step had ended early.
func TestClockStep_AReplyAnsweredAfterAnotherShowedTheStepIsStale(t *testing.T) {
	s := redistest.Mini(t)
	s.SetClock(0)
	rdb := s.Client(t)
	var hold atomic.Bool
	ran, release := make(chan struct{}), make(chan struct{})
	rdb.AddHook(holdHook{hold: &hold, name: t.Name() + "-b", ran: ran, release: release})
	// A margin of 10 s: b's reply, held while a asks, is not too late to
	// start by (5 s), however busy the machine; a late one would ask again.
	policy := policies.SlidingLog{Limit: 10, Window: time.Minute, Margin: 10 * time.Second}
	ctx := context.Background()
	mk := func(name string) *Limiter {
		l, err := New(rdb, t.Name()+"-"+name, policy, Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	a, b := mk("a"), mk("b")
	for _, l := range []*Limiter{a, b} {
		if d, err := l.Allow(ctx, Cost(10)); err != nil || !d.OK {
			t.Fatalf("%s before the step: %+v, %v", l.Name(), d, err)
		}
	}
	s.SetClock(2 * time.Minute) // past the window and its margin
	hold.Store(true)
	got := make(chan Decision, 1)
	go func() {
		d, err := b.Allow(ctx, Cost(10))
		if err != nil {
			t.Errorf("b after the step: %v", err)
		}
		got <- d
	}()
	<-ran // b's script ran by the new clock; its reply is held
	hold.Store(false)
	if d, err := a.Allow(ctx); err != nil || d.OK {
		t.Errorf("a after the step: %+v, %v; want refused, its quota counting as full", d, err)
	}
	close(release)
	if d := <-got; d.OK {
		t.Errorf("b's call, decided after the step and read after a's reply showed it, was admitted: 20 in a window of 10 at the vendor")
	}
}

// holdHook holds the reply of the first script call of quota name made
// while hold is set: it tells ran once Redis answered, and hands the reply
// on once release is closed.
type holdHook struct {
	hold         *atomic.Bool
	name         string
	ran, release chan struct{}
}

func (holdHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (holdHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h holdHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		mine := scriptOf(cmd) == "acquire" && slices.ContainsFunc(cmd.Args(), func(a any) bool {
			s, _ := a.(string)
			return strings.Contains(s, "{"+h.name+"}")
		})
		if !mine || !h.hold.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		err := next(ctx, cmd)
		close(h.ran)
		<-h.release
		return err
	}
}
