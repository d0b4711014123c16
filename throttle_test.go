package throttle

import (
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

var perSecond = policies.SlidingLog{Limit: 5, Window: time.Second}

// fixedClock is a clock that only moves when a test moves it.
type fixedClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fixedClock { return &fixedClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fixedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fixedClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newLimiter(t *testing.T, rdb redis.UniversalClient, p policies.Policy, opts ...Options) *Limiter {
	t.Helper()
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, strings.NewReplacer("/", "-", " ", "-").Replace(t.Name()), p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// forgetTimingAtEnd drops, when the test ends, what the process learned of
// the timing of rdb's server: the next test's server may get the same
// port, with a clock of its own (a test's given time), and the readings of
// this one would look like a step of its clock to the limiters made there.
func forgetTimingAtEnd(t *testing.T, rdb redis.UniversalClient) {
	if c, ok := rdb.(*redis.Client); ok {
		o := c.Options()
		t.Cleanup(func() { timings.Delete(o.Network + "/" + o.Addr) })
	}
}

func TestNew_RejectsBadConfiguration(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	long := strings.Repeat("n", maxNameLen+1)
	tests := []struct {
		name   string
		rdb    redis.UniversalClient
		quota  string
		policy policies.Policy
		opts   []Options
		want   []string // every piece must appear in the error
	}{
		{"nil client", nil, "q", perSecond, nil, []string{"redis client is nil"}},
		{"empty name", rdb, "", perSecond, nil, []string{"name must not be empty"}},
		{"oversized name", rdb, long, perSecond, nil, []string{"name", "129"}},
		{"name with brace", rdb, "a{b", perSecond, nil, []string{"name", `"a{b"`}},
		{"nil policy", rdb, "q", nil, nil, []string{"policy is nil"}},
		{"zero limit", rdb, "q", policies.SlidingLog{Window: time.Second}, nil, []string{"SlidingLog.Limit", "got 0"}},
		{"negative limit", rdb, "q", policies.SlidingLog{Limit: -3, Window: time.Second}, nil, []string{"SlidingLog.Limit", "got -3"}},
		{"short window", rdb, "q", policies.SlidingLog{Limit: 1, Window: time.Microsecond}, nil, []string{"SlidingLog.Window", "1µs"}},
		{"negative margin", rdb, "q", policies.SlidingLog{Limit: 1, Window: time.Second, Margin: -time.Millisecond}, nil, []string{"SlidingLog.Margin", "-1ms"}},
		{"empty All", rdb, "q", policies.All(), nil, []string{"All needs at least one policy"}},
		{"nil in All", rdb, "q", policies.All(perSecond, nil), nil, []string{"All policy 1 is nil"}},
		{"bad limit in All", rdb, "q", policies.All(perSecond, policies.SlidingLog{Limit: 1}), nil, []string{"All policy 1", "SlidingLog.Window", "0s"}},
		{"nil PerKey", rdb, "q", policies.PerKey{}, nil, []string{"PerKey.Policy is nil"}},
		{"nested PerKey", rdb, "q", policies.PerKey{Policy: policies.PerKey{Policy: perSecond}}, nil, []string{"another PerKey"}},
		{"two Options", rdb, "q", perSecond, []Options{{Mode: FailFast}, {MaxWait: -time.Second}}, []string{"one Options value", "got 2"}},
		{"unknown mode", rdb, "q", perSecond, []Options{{Mode: "Sideways"}}, []string{"Options.Mode", `"Sideways"`, "Block, FailFast or Queue"}},
		{"negative max wait", rdb, "q", perSecond, []Options{{MaxWait: -time.Second}}, []string{"Options.MaxWait must not be negative", "-1s"}},
		{"negative max queue", rdb, "q", perSecond, []Options{{Mode: Queue, MaxQueue: -1}}, []string{"Options.MaxQueue", "got -1"}},
		{"unknown overflow", rdb, "q", perSecond, []Options{{Mode: Queue, Overflow: "ShedAll"}}, []string{"Options.Overflow", `"ShedAll"`}},
		{"unknown OnRedisError", rdb, "q", perSecond, []Options{{OnRedisError: "FailMaybe"}}, []string{"Options.OnRedisError", `"FailMaybe"`}},
		{"negative replicas", rdb, "q", perSecond, []Options{{ExpectedReplicas: -2}}, []string{"Options.ExpectedReplicas must not be negative", "got -2"}},
		{"negative redis timeout", rdb, "q", perSecond, []Options{{RedisTimeout: -time.Second}}, []string{"Options.RedisTimeout", "-1s"}},
		{"prefix with brace", rdb, "q", perSecond, []Options{{Prefix: "a{b"}}, []string{"Options.Prefix", `"a{b"`}},
		{"oversized prefix", rdb, "q", perSecond, []Options{{Prefix: long}}, []string{"Options.Prefix", "129"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lim, err := New(tt.rdb, tt.quota, tt.policy, tt.opts...)
			if err == nil {
				t.Fatalf("New returned a limiter %v, want an error", lim)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// The zero value of every field of Options picks its default: an empty
// Prefix, a zero RedisTimeout, MaxWait or MaxQueue and a nil Logger are not
// errors, and one Options{} is the same as none.
func TestNew_ZeroOptionsPickTheDefaults(t *testing.T) {
	s := redistest.Mini(t)
	rdb := s.Client(t)
	for name, opts := range map[string][]Options{
		"no Options":  nil,
		"Options{}":   {{}},
		"zero fields": {{Mode: Queue, MaxWait: 0, MaxQueue: 0, RedisTimeout: 0, Prefix: "", Logger: nil}},
	} {
		t.Run(name, func(t *testing.T) {
			lim, err := New(rdb, "defaults", perSecond, opts...)
			if err != nil {
				t.Fatalf("New: %v, want the defaults", err)
			}
			t.Cleanup(func() { _ = lim.Close(context.Background()) })
			got := lim.s
			if got.maxWait != defaultMaxWait || got.maxWaitSet {
				t.Errorf("max wait %v (set %v), want the default %v, not set", got.maxWait, got.maxWaitSet, defaultMaxWait)
			}
			if got.prefix != defaultPrefix || !strings.HasPrefix(lim.cfg.base, defaultPrefix+":{defaults}:") {
				t.Errorf("prefix %q, keys start %q; want the default %q", got.prefix, lim.cfg.base, defaultPrefix)
			}
			if got.maxQueue != defaultMaxQueue {
				t.Errorf("max queue %d, want the default %d", got.maxQueue, defaultMaxQueue)
			}
			if got.redisTimeout != defaultRedisTimeout {
				t.Errorf("redis timeout %v, want the default %v", got.redisTimeout, defaultRedisTimeout)
			}
			if got.logger != slog.Default() {
				t.Errorf("logger %v, want slog.Default()", got.logger)
			}
			if got.onRedisError != FailClosed || got.overflow != RejectNew || got.shadow || got.noLearning || got.clock != nil || got.observer != nil {
				t.Errorf("settings %+v, want FailClosed, RejectNew, no shadow, learning, no clock, no observer", got)
			}
			if len(opts) == 1 && opts[0].Mode == Queue {
				if got.mode != Queue || lim.q == nil || lim.q.max != defaultMaxQueue {
					t.Errorf("a Queue limiter with MaxQueue 0: mode %v, queue %+v; want a queue of %d", got.mode, lim.q, defaultMaxQueue)
				}
			} else if got.mode != Block {
				t.Errorf("mode %v, want Block", got.mode)
			}
			// The defaults work: a call is decided in Redis, under the
			// default prefix.
			if d, err := lim.Allow(context.Background()); err != nil || !d.OK {
				t.Fatalf("Allow: %+v, %v", d, err)
			}
			if keys := rdb.Keys(context.Background(), defaultPrefix+":{defaults}:*").Val(); len(keys) == 0 {
				t.Errorf("no key under the default prefix %q", defaultPrefix)
			}
			rdb.FlushAll(context.Background())
		})
	}
}

func TestCall_RejectsBadOptions(t *testing.T) {
	s := redistest.Mini(t)
	rdb := s.Client(t)
	global := newLimiter(t, rdb, perSecond)
	keyed := newLimiter(t, rdb, policies.All(perSecond, policies.PerKey{Policy: policies.SlidingLog{Limit: 2, Window: time.Second}}))
	tests := []struct {
		name string
		lim  *Limiter
		opts []CallOption
		want string
	}{
		{"zero cost", global, []CallOption{Cost(0)}, "Cost must be > 0, got 0"},
		{"negative cost", global, []CallOption{Cost(-2)}, "Cost must be > 0, got -2"},
		{"cost over limit", global, []CallOption{Cost(6)}, "Cost 6 exceeds SlidingLog.Limit 5 and could never run"},
		{"cost over per-key limit", keyed, []CallOption{Key("a"), Cost(3)}, "Cost 3 exceeds SlidingLog.Limit 2 and could never run"},
		{"missing key", keyed, nil, "needs a Key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if _, err := tt.lim.Allow(ctx, tt.opts...); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Allow: error %v, want one containing %q", err, tt.want)
			}
			if _, err := tt.lim.Acquire(ctx, tt.opts...); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Acquire: error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestAllow_RecordsOnlyAdmittedCalls(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		clock := newClock()
		lim := newLimiter(t, rdb, perSecond, Options{Clock: clock.Now})
		ctx := context.Background()
		for i := range 5 {
			d, err := lim.Allow(ctx)
			if err != nil || !d.OK || d.Remaining != 4-i {
				t.Fatalf("call %d: %+v, %v; want OK with %d remaining", i, d, err, 4-i)
			}
		}
		clock.Add(300 * time.Millisecond)
		for range 100 {
			d, err := lim.Allow(ctx)
			if err != nil || d.OK {
				t.Fatalf("call over the limit: %+v, %v; want refused", d, err)
			}
			if want := time.Second + warmingMargin - 300*time.Millisecond; d.RetryAfter != want {
				t.Fatalf("RetryAfter %v, want %v", d.RetryAfter, want)
			}
		}
		if n := rdb.ZCard(ctx, lim.cfg.shared[2]).Val(); n != 5 {
			t.Errorf("log holds %d members after 5 admitted and 100 refused calls, want 5", n)
		}
		ttl := rdb.PTTL(ctx, lim.cfg.shared[2]).Val()
		if ttl <= 0 || ttl > 3*time.Second {
			t.Errorf("log TTL %v, want about one window", ttl)
		}
	})
}

func TestAllow_MembersUniqueWithinOneMicrosecond(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		policy := policies.SlidingLog{Limit: 1000, Window: time.Second}
		// Two limiters stand for two processes calling in the same microsecond.
		a := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		b := newLimiter(t, s.Client(t), policy, Options{Clock: clock.Now})
		var wg sync.WaitGroup
		for _, lim := range []*Limiter{a, b} {
			for range 4 {
				wg.Go(func() {
					for range 25 {
						if d, err := lim.Allow(context.Background(), Cost(2)); err != nil || !d.OK {
							t.Errorf("Allow: %+v, %v", d, err)
						}
					}
				})
			}
		}
		wg.Wait()
		// Closed, they give back the spare admissions they took (spare.go).
		for _, lim := range []*Limiter{a, b} {
			if err := lim.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		if n := s.Client(t).ZCard(context.Background(), a.cfg.shared[2]).Val(); n != 400 {
			t.Errorf("log holds %d members, want 400 (200 calls of cost 2)", n)
		}
	})
}

func TestFailFast_RefusesWithRetryAfter(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), perSecond, Options{Mode: FailFast, Clock: clock.Now})
		ctx := context.Background()
		for range 5 {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			p.Release()
		}
		clock.Add(100 * time.Millisecond)
		_, err := lim.Acquire(ctx)
		var le *LimitedError
		if !errors.Is(err, ErrLimited) || !errors.As(err, &le) {
			t.Fatalf("Acquire on a full quota: %v, want a *LimitedError", err)
		}
		if want := time.Second + warmingMargin - 100*time.Millisecond; le.RetryAfter != want || le.Quota != lim.name {
			t.Errorf("got %+v, want RetryAfter %v for quota %q", le, want, lim.name)
		}
		if !strings.Contains(err.Error(), "FailFast mode does not wait") {
			t.Errorf("the refusal says %q, want it to name the FailFast mode that refused it", err)
		}
		clock.Add(le.RetryAfter)
		if _, err := lim.Acquire(ctx); err != nil {
			t.Errorf("Acquire after RetryAfter: %v", err)
		}
	})
}

func TestBlock_WaitsForItsSlot(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		window := 200 * time.Millisecond
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 2, Window: window, Margin: time.Nanosecond})
		ctx := context.Background()
		start := time.Now()
		var slots [6]time.Duration
		for i := range slots {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// A sequential caller fills the window, waits for it to pass,
			// and fills it again: each call's slot (Redis's time, which a
			// stall of this process does not move) is a window after the
			// slot of the call two before it, and the call returns no
			// earlier than its slot (the same machine's clock; a
			// millisecond for the reading of Redis's).
			slots[i] = p.r.slot()
			if i >= 2 && slots[i]-slots[i-2] < window {
				t.Errorf("call %d booked %v after call %d, want at least %v", i, slots[i]-slots[i-2], i-2, window)
			}
			if early := slots[i] - time.Duration(time.Now().UnixMicro())*time.Microsecond; early > time.Millisecond {
				t.Errorf("call %d returned %v before its slot", i, early)
			}
			p.Release()
		}
		if took := time.Since(start); took < 2*window-time.Millisecond {
			t.Errorf("6 calls at 2 per %v took %v, want at least two windows", window, took)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("6 calls at 2 per %v took %v", window, took)
		}
	})
}

func TestBlock_FailsAtOnceWhenDeadlineTooShort(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 1, Window: time.Hour})
		if _, err := lim.Acquire(context.Background()); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		start := time.Now()
		_, err := lim.Acquire(ctx)
		var le *LimitedError
		if !errors.As(err, &le) || le.RetryAfter < 59*time.Minute {
			t.Fatalf("Acquire with a 10s deadline for a slot an hour away: %v, want ErrLimited with RetryAfter about 1h", err)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("Acquire took %v to fail; it must fail at once", took)
		}
		if n := rdb.ZCard(ctx, lim.cfg.shared[2]).Val(); n != 1 {
			t.Errorf("log holds %d members, want 1: a refused call must not book", n)
		}
	})
}

func TestBlock_MaxWaitBoundsTheWait(t *testing.T) {
	s := redistest.Mini(t)
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: time.Minute}, Options{MaxWait: time.Second})
	if _, err := lim.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Acquire(context.Background()); !errors.Is(err, ErrLimited) {
		t.Fatalf("Acquire past MaxWait: %v, want ErrLimited", err)
	}
}

func TestBlock_CancelledWaiterGivesSlotBack(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		window := 5 * time.Second
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 1, Window: window})
		bg := context.Background()
		if _, err := lim.Acquire(bg); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(bg)
		done := make(chan error, 1)
		go func() {
			_, err := lim.Acquire(ctx)
			done <- err
		}()
		waitFor(t, func() bool { return rdb.ZCard(bg, lim.cfg.shared[2]).Val() == 2 }, "the waiter's booking")
		// A third call now queues behind the waiter: two windows away.
		if d, _ := lim.Allow(bg); d.OK || d.RetryAfter < window*3/2 {
			t.Fatalf("with a booking ahead, Allow = %+v, want RetryAfter near two windows", d)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled waiter returned %v, want context.Canceled", err)
		}
		// Given back as the waiter leaves, or within a Redis round trip
		// after it on a slow machine (see within).
		waitFor(t, func() bool { return rdb.ZCard(bg, lim.cfg.shared[2]).Val() == 1 }, "the log to hold 1 member after the waiter gave up")
		// The freed slot goes to the next caller: one window away, not two.
		if d, _ := lim.Allow(bg); d.OK || d.RetryAfter > window+warmMargin(window) {
			t.Errorf("after the cancel, Allow = %+v, want RetryAfter within one window", d)
		}
	})
}

func TestDo_RunsFnOnlyWhenAdmitted(t *testing.T) {
	s := redistest.Mini(t)
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: time.Second}, Options{Mode: FailFast, Clock: clock.Now})
	ctx := context.Background()
	ran := 0
	fn := func(context.Context) (string, error) { ran++; return "sent", nil }
	if v, err := Do(ctx, lim, fn); v != "sent" || err != nil {
		t.Fatalf("Do = %q, %v; want sent", v, err)
	}
	if v, err := Do(ctx, lim, fn); v != "" || !errors.Is(err, ErrLimited) {
		t.Fatalf("Do on a full quota = %q, %v; want ErrLimited", v, err)
	}
	if ran != 1 {
		t.Errorf("fn ran %d times, want 1", ran)
	}
	wantErr := errors.New("vendor down")
	clock.Add(2 * time.Second)
	if _, err := Do(ctx, lim, func(context.Context) (int, error) { return 0, wantErr }); err != wantErr {
		t.Errorf("Do returned %v, want fn's error", err)
	}
}

func TestPerKey_SubLimitUnderSharedLimit(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.All(
			policies.SlidingLog{Limit: 10, Window: time.Second},
			policies.PerKey{Policy: policies.SlidingLog{Limit: 3, Window: time.Second}},
		), Options{Clock: clock.Now})
		admitted := map[string]int{}
		total := 0
		for _, tenant := range []string{"a", "b", "c", "d", "e"} {
			for range 5 {
				d, err := lim.Allow(context.Background(), Key(tenant))
				if err != nil {
					t.Fatal(err)
				}
				if d.OK {
					admitted[tenant]++
					total++
				}
			}
		}
		want := map[string]int{"a": 3, "b": 3, "c": 3, "d": 1}
		if total != 10 || len(admitted) != len(want) {
			t.Fatalf("admitted %v (%d), want %v", admitted, total, want)
		}
		for k, n := range want {
			if admitted[k] != n {
				t.Errorf("tenant %s: %d admitted, want %d", k, admitted[k], n)
			}
		}
	})
}

func TestPerKey_IndependentQuotas(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 4, Window: time.Hour}}, Options{Clock: clock.Now})
		for _, token := range []string{"token-1", "token-2", "token-3"} {
			for i := range 6 {
				d, err := lim.Allow(context.Background(), Key(token))
				if err != nil {
					t.Fatal(err)
				}
				if d.OK != (i < 4) {
					t.Errorf("%s call %d: OK=%v", token, i, d.OK)
				}
			}
		}
	})
}

func TestPerKey_KeysAreHashed(t *testing.T) {
	s := redistest.Mini(t)
	rdb := s.Client(t)
	lim := newLimiter(t, rdb, policies.PerKey{Policy: perSecond})
	secret := "sk_live_" + strings.Repeat("x", 5000)
	if _, err := lim.Allow(context.Background(), Key(secret)); err != nil {
		t.Fatal(err)
	}
	for _, k := range rdb.Keys(context.Background(), "*").Val() {
		if strings.Contains(k, "sk_live") || len(k) > 100 {
			t.Errorf("Redis key %q holds the raw key", k)
		}
		if !strings.HasPrefix(k, defaultPrefix+":{"+lim.name+"}:") {
			t.Errorf("Redis key %q lacks the quota's hash tag", k)
		}
	}
}

func TestCost_CountsUnits(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Second}, Options{Clock: clock.Now})
		ctx := context.Background()
		for _, tc := range []struct {
			cost      int
			ok        bool
			remaining int
		}{{4, true, 6}, {4, true, 2}, {3, false, 2}, {2, true, 0}, {1, false, 0}} {
			d, err := lim.Allow(ctx, Cost(tc.cost))
			if err != nil || d.OK != tc.ok || d.Remaining != tc.remaining {
				t.Fatalf("Cost(%d): %+v, %v; want OK=%v remaining %d", tc.cost, d, err, tc.ok, tc.remaining)
			}
		}
	})
}

func TestTTL_FollowsLatestBooking(t *testing.T) {
	s := redistest.New(t)
	rdb := s.Client(t)
	lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 1, Window: 2 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 3 {
		go func() { _, _ = lim.Acquire(ctx) }()
	}
	waitFor(t, func() bool { return rdb.ZCard(ctx, lim.cfg.shared[2]).Val() == 3 }, "three bookings")
	// The last booking is two windows ahead; it must outlive it by a window.
	if ttl := rdb.PTTL(ctx, lim.cfg.shared[2]).Val(); ttl < 5*time.Second {
		t.Errorf("TTL %v, want at least three windows", ttl)
	}
}

// Every key a quota writes expires: the rule keys of every kind, shared and
// per key, a log's hint, a learned cap, the meta key and a key's pause. A
// key without a TTL would outlive the quota forever.
func TestTTL_EveryKeyExpires(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		ctx := context.Background()
		lim := newLimiter(t, rdb, policies.All(
			policies.SlidingLog{Limit: 2, Window: time.Second},
			policies.SlidingCounter{Limit: 4, Window: time.Second},
			policies.TokenBucket{Rate: 4, Per: time.Second, Burst: 4},
			policies.Concurrency{Max: 5},
			policies.PerKey{Policy: policies.SlidingLog{Limit: 4, Window: time.Second}},
			policies.PerKey{Policy: policies.SlidingCounter{Limit: 4, Window: time.Second}},
		), Options{Mode: FailFast, Logger: quiet()})
		var permits []*Permit
		for range 2 {
			p, err := lim.Acquire(ctx, Key("tenant"))
			if err != nil {
				t.Fatal(err)
			}
			permits = append(permits, p)
		}
		// A booking ahead, a learned cap and a key's pause; and a log too
		// long to be searched in memory, which keeps a hint.
		if _, err := lim.acquire(ctx, call{cost: 1, key: "tenant", hasKey: true}, 5*time.Second, nil); err != nil {
			t.Fatal(err)
		}
		longLim, err := New(rdb, lim.name+"-long", policies.SlidingLog{Limit: 1100, Window: time.Second}, Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		// A quota of a group, whose group keeps a key of its own.
		grouped, err := New(rdb, "grouped", policies.Shared{Name: lim.name + "-group", Policy: policies.SlidingLog{Limit: 2, Window: time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := grouped.Allow(ctx); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := longLim.acquire(ctx, call{cost: 1100}, 5*time.Second, nil); err != nil {
				t.Fatal(err)
			}
		}
		if err := permits[0].refused(ctx, time.Second); err != nil {
			t.Fatal(err)
		}
		if err := lim.Pause(ctx, time.Second, Key("tenant")); err != nil {
			t.Fatal(err)
		}
		checkEveryKeyExpires(t, rdb, lim.name)
		for _, p := range permits {
			p.Release()
		}
	})
}

// keyKinds are the kinds of key a quota writes, as their names show them.
var keyKinds = []string{"log", "counter", "bucket", "concurrency", ":next", ":cap", ":meta", "//group"}

// checkEveryKeyExpires checks that every key of quota name, and of the
// quotas named after it, has a TTL, and that they hold every kind of key.
func checkEveryKeyExpires(t *testing.T, rdb redis.UniversalClient, name string) {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, defaultPrefix+":{"+name+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	for _, k := range keys {
		for _, kind := range keyKinds {
			if strings.Contains(k, kind) {
				kinds[kind] = true
			}
		}
		if ttl := rdb.PTTL(ctx, k).Val(); ttl <= 0 {
			t.Errorf("key %s has no TTL (PTTL %v)", k, ttl)
		}
	}
	for _, kind := range keyKinds {
		if !kinds[kind] {
			t.Errorf("no %q key among %v: the test no longer covers it", kind, keys)
		}
	}
	if len(keys) < 10 {
		t.Errorf("%d keys %v, want the shared and per-key rule keys, a hint, caps and pauses", len(keys), keys)
	}
}

// SCRIPT FLUSH (a new Redis, a failover) costs no call: each script call
// that meets NOSCRIPT sends the script again, and every call runs. The
// margin is wide: beside CI's race run, the replies of a Redis flushed
// without a pause came later than a 30 ms margin allows, and 77 of 800
// calls were refused as late, which is not what this test measures.
func TestScriptFlush_CostsNoCall(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		noscript := &noscriptCounter{}
		rdb.AddHook(noscript)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 100_000, Window: time.Second, Margin: 400 * time.Millisecond})
		var ran atomic.Int64
		ctx := context.Background()
		stop := make(chan struct{})
		var flusher sync.WaitGroup
		flusher.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					if err := rdb.ScriptFlush(ctx).Err(); err != nil {
						t.Errorf("SCRIPT FLUSH: %v", err)
						return
					}
				}
			}
		})
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 100 {
					if _, err := Do(ctx, lim, func(context.Context) (int, error) { ran.Add(1); return 0, nil }); err != nil {
						t.Errorf("Do during SCRIPT FLUSH: %v", err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(stop)
		flusher.Wait()
		if n := ran.Load(); n != 800 {
			t.Errorf("%d of 800 calls ran", n)
		}
		if noscript.n.Load() == 0 {
			t.Error("no script call met NOSCRIPT: the flushes never struck, and the test tested nothing")
		}
	})
}

// noscriptCounter counts the script calls Redis answered NOSCRIPT.
type noscriptCounter struct{ n atomic.Int64 }

func (*noscriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *noscriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			h.n.Add(1)
		}
		return err
	}
}
func (*noscriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// waitFor polls cond for up to 10 seconds; it is for state that another
// goroutine reaches at an unknown moment, never for timing.
func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestContext_CancelledBeforeTheCallOnEveryPath(t *testing.T) {
	s := redistest.Mini(t)
	rdb := s.Client(t)
	block := newLimiter(t, rdb, perSecond)
	failFast, err := New(rdb, "fail-fast", perSecond, Options{Mode: FailFast})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	paths := map[string]func() error{
		"Allow":            func() error { _, err := block.Allow(ctx); return err },
		"Acquire Block":    func() error { _, err := block.Acquire(ctx); return err },
		"Acquire FailFast": func() error { _, err := failFast.Acquire(ctx); return err },
		"Do": func() error {
			_, err := Do(ctx, block, func(context.Context) (int, error) {
				t.Error("Do ran fn with a cancelled context")
				return 0, nil
			})
			return err
		},
	}
	for name, path := range paths {
		if err := path(); !errors.Is(err, context.Canceled) {
			t.Errorf("%s: %v, want context.Canceled", name, err)
		}
	}
	if keys := rdb.Keys(context.Background(), "*").Val(); len(keys) != 0 {
		t.Errorf("cancelled calls wrote %v", keys)
	}
}

// New takes one Options value: two are an error naming the count, since
// nothing could say which of their fields wins (a later one could not turn
// Shadow off, say). None gives every default.
func TestNew_TakesOneOptions(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	_, err := New(rdb, "q", policies.SlidingLog{Limit: 1, Window: time.Second}, Options{Shadow: true}, Options{Mode: Queue})
	if err == nil || !strings.Contains(err.Error(), "one Options value, got 2") {
		t.Errorf("New with two Options: %v, want an error naming the count", err)
	}
	lim, err := New(rdb, "q", policies.SlidingLog{Limit: 10, Window: time.Second}, Options{Mode: Queue, MaxQueue: 5, Prefix: "b", Shadow: true})
	if err != nil || lim.s.mode != Queue || lim.s.maxQueue != 5 || lim.s.prefix != "b" || !lim.s.shadow {
		t.Errorf("one Options: %v, %+v; want each field as set", err, lim.s)
	}
	lim, err = New(rdb, "q", policies.SlidingLog{Limit: 10, Window: time.Second})
	if err != nil || lim.mode() != Block || lim.s.onRedisError != FailClosed || lim.s.overflow != RejectNew {
		t.Errorf("no Options: %v, %v, %v, %v; want Block, FailClosed, RejectNew", err, lim.mode(), lim.s.onRedisError, lim.s.overflow)
	}
}
