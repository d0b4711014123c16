package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// decisionKeys is how many keys the PerKey case spreads its goroutines
// over: 4 goroutines per key.
const decisionKeys = 16

// logNeverBinds is a sliding log that never binds at the rates measured
// here: a SlidingLog takes at most 100,000 units per window
// (policies.MaxLogLimit), and 100,000 per 130 ms (100 ms and the default
// margin) is some 770,000 per second.
var logNeverBinds = policies.SlidingLog{Limit: 100_000, Window: 100 * time.Millisecond}

// BenchmarkPolicyDecisions measures, for each kind of policy, how many
// decisions per second one Redis gives 64 goroutines asking at once, with
// limits that never bind, as BenchmarkDecisions does for SlidingLog (here
// logNeverBinds, since SlidingLog.Limit is bounded).
//
// throttle decides the concurrent calls of one process for the same keys in
// one script call, so the rate depends on how many calls each script call
// decides: decisions/script-call reports it, and script-in-redis-µs, Redis's
// mean time per EVALSHA, is the time of such a batch, not of one decision.
// redis-script-busy is the share of the wall time Redis spent in scripts: near
// 1, Redis's single thread is the limit.
func BenchmarkPolicyDecisions(b *testing.B) {
	s := newServer(b)
	ctx := context.Background()
	cases := []struct {
		name   string
		policy policies.Policy
		mode   throttle.Mode
		keys   int // 0: calls carry no key; else goroutine w uses key w%keys
	}{
		{name: "SlidingLog", policy: logNeverBinds},
		{name: "SlidingCounter", policy: policies.SlidingCounter{Limit: neverBinds, Window: time.Second, Buckets: 10}},
		// Rate is at its most (one unit per µs); the burst never empties.
		{name: "TokenBucket", policy: policies.TokenBucket{Rate: 1_000_000, Per: time.Second, Burst: neverBinds}},
		// Each call takes a slot and gives it back at once: Acquire + Release.
		{name: "Concurrency", policy: policies.Concurrency{Max: 100_000}, mode: throttle.FailFast},
		{name: "All", policy: policies.All(logNeverBinds, policies.SlidingCounter{Limit: neverBinds, Window: time.Minute})},
		{name: "PerKey", policy: policies.PerKey{Policy: logNeverBinds}, keys: decisionKeys},
		// Each key a class of the global log (docs/PROTOCOL.md 3.13).
		{name: "PerKeyUnderGlobal", policy: policies.All(logNeverBinds, policies.PerKey{Policy: logNeverBinds}), keys: decisionKeys},
		// A log shared by a group of quotas, whose state the group's key
		// keeps (docs/PROTOCOL.md 3.12).
		{name: "Shared", policy: policies.Shared{Name: "decisions", Policy: logNeverBinds}},
	}
	for _, c := range cases {
		rdb := s.Client(b)
		lim, err := throttle.New(rdb, "decisions-"+c.name, c.policy, throttle.Options{Mode: c.mode})
		if err != nil {
			b.Fatal(err)
		}
		var keyOpts [][]throttle.CallOption
		for i := range c.keys {
			keyOpts = append(keyOpts, []throttle.CallOption{throttle.Key("tenant-" + strconv.Itoa(i))})
		}
		opts := func(w int) []throttle.CallOption {
			if c.keys == 0 {
				return nil
			}
			return keyOpts[w%c.keys]
		}
		decide := func(w int) error {
			d, err := lim.Allow(ctx, opts(w)...)
			if err == nil && !d.OK {
				err = fmt.Errorf("refused: %+v", d)
			}
			return err
		}
		if c.mode == throttle.FailFast {
			decide = func(w int) error {
				p, err := lim.Acquire(ctx, opts(w)...)
				if err != nil {
					return err
				}
				p.Release()
				return nil
			}
		}
		b.Run(c.name, func(b *testing.B) { runPolicyDecisions(b, rdb, decide) })
	}
}

// runPolicyDecisions is runDecisions with the goroutine's index passed to
// decide, so that each goroutine can keep to its own key, and with the
// script calls counted.
func runPolicyDecisions(b *testing.B, rdb *redis.Client, decide func(worker int) error) {
	ctx := context.Background()
	// Load the scripts and open a connection before the clock starts.
	if err := decide(0); err != nil {
		b.Fatal(err)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	var (
		next     atomic.Int64
		failures atomic.Int64
		errOnce  sync.Once
		firstErr error
		wg       sync.WaitGroup
	)
	b.ResetTimer()
	start := time.Now()
	for w := range decisionWorkers {
		wg.Go(func() {
			for next.Add(1) <= int64(b.N) {
				if err := decide(w); err != nil {
					failures.Add(1)
					errOnce.Do(func() { firstErr = err })
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if n := failures.Load(); n > 0 {
		b.Fatalf("%d of %d decisions failed; first: %v", n, b.N, firstErr)
	}
	st := scriptStats(b, ctx, rdb)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
	b.ReportMetric(decisionWorkers, "goroutines")
	b.ReportMetric(st.evalshaMean, "script-in-redis-µs")
	if st.calls > 0 {
		b.ReportMetric(float64(b.N)/float64(st.calls), "decisions/script-call")
	}
	b.ReportMetric(st.usec/us(elapsed), "redis-script-busy")
}

// redisScripts is what INFO commandstats says of the script commands since
// the last CONFIG RESETSTAT.
type redisScripts struct {
	calls       int64   // EVALSHA and EVAL
	usec        float64 // their total time in Redis
	evalshaMean float64 // mean µs per EVALSHA
}

func scriptStats(b *testing.B, ctx context.Context, rdb *redis.Client) redisScripts {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	var st redisScripts
	for line := range strings.Lines(info) {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "cmdstat_evalsha" && name != "cmdstat_eval") {
			continue
		}
		for field := range strings.SplitSeq(rest, ",") {
			k, v, _ := strings.Cut(field, "=")
			x, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "calls":
				st.calls += int64(x)
			case "usec":
				st.usec += x
			case "usec_per_call":
				if name == "cmdstat_evalsha" {
					st.evalshaMean = x
				}
			}
		}
	}
	return st
}

// BenchmarkPolicyFleet runs the saturated fleet of BenchmarkFleetSaturated
// (3 replicas x 20 goroutines, Block mode, the context's deadline at the end
// of the 3 s run) under other policies of a vendor-like 100 calls per second.
//
// utilization is admitted / (100 x 3 s / 1 s) = admitted / 300 for every
// policy: the vendor's limit over the run, margins aside. The ideal each
// is compared with is a first-come-first-served limiter of the same
// algorithm facing the same arrivals, as in BenchmarkFleetSaturated.
func BenchmarkPolicyFleet(b *testing.B) {
	capacity := int(fleetLimit * fleetRun / fleetWindow)

	b.Run("SlidingCounter", func(b *testing.B) {
		p := policies.SlidingCounter{Limit: fleetLimit, Window: fleetWindow}
		rules, err := policies.Rules(p)
		if err != nil {
			b.Fatal(err)
		}
		r := rules[0]
		// Buckets follow Redis's clock, so the ideal needs to know where in
		// its bucket each run started.
		var phases []time.Duration
		runPolicyFleet(b, p, capacity, func(arrivals []time.Duration) []time.Duration {
			phase := phases[0]
			phases = phases[1:]
			return idealCounterWaits(arrivals, r.Limit, r.Window, r.Bucket, phase)
		}, func(start time.Time) {
			phases = append(phases, time.Duration(start.UnixMicro()%r.Bucket.Microseconds())*time.Microsecond)
		})
	})

	b.Run("TokenBucket", func(b *testing.B) {
		p := policies.TokenBucket{Rate: fleetLimit, Per: fleetWindow, Burst: 1}
		limit := redis_rate.Limit{Rate: fleetLimit, Burst: 1, Period: fleetWindow}
		runPolicyFleet(b, p, capacity, func(arrivals []time.Duration) []time.Duration {
			return idealGCRAWaits(arrivals, limit)
		}, nil)
	})

	b.Run("All", func(b *testing.B) {
		logPolicy := policies.SlidingLog{Limit: fleetLimit, Window: fleetWindow}
		p := policies.All(logPolicy, policies.TokenBucket{Rate: 2 * fleetLimit, Per: fleetWindow})
		gap := fleetWindow / (2 * fleetLimit)
		runPolicyFleet(b, p, capacity, func(arrivals []time.Duration) []time.Duration {
			return idealPacedLogWaits(arrivals, fleetLimit, logPolicy.EffectiveWindow(), gap)
		}, nil)
	})
}

// runPolicyFleet runs the fleet under p until the benchmark time is spent
// (once at -benchtime 2s), reports the figures of BenchmarkFleetSaturated,
// and the median wait. started, when set, is told each run's start, as the
// first call into the limiter saw it.
func runPolicyFleet(b *testing.B, p policies.Policy, capacity int, ideal func([]time.Duration) []time.Duration, started func(time.Time)) {
	s := newServer(b)
	var runs []fleetResult
	for b.Loop() {
		name := fmt.Sprintf("fleet-%d", len(runs))
		var first atomic.Int64 // earliest call into a limiter, Unix ns
		first.Store(math.MaxInt64)
		runs = append(runs, runFleet(b, s, func(rdb *redis.Client) acquireFunc {
			lim, err := throttle.New(rdb, name, p)
			if err != nil {
				b.Fatal(err)
			}
			return func(ctx context.Context) (time.Duration, error) {
				asked := time.Now()
				for old := first.Load(); asked.UnixNano() < old && !first.CompareAndSwap(old, asked.UnixNano()); old = first.Load() {
				}
				p, err := lim.Acquire(ctx)
				if le, ok := errors.AsType[*throttle.LimitedError](err); ok {
					// endOfRun counts RetryAfter from the call's arrival, but a
					// call that woke too late gave its slot back and booked
					// again, and was refused that much later.
					le.RetryAfter += time.Since(asked)
				}
				if err != nil {
					return 0, err
				}
				p.Release()
				return time.Since(asked), nil
			}
		}))
		if started != nil {
			started(time.Unix(0, first.Load()))
		}
	}
	report(b, runs, fleetModel{ideal: ideal, capacity: capacity})
	var waits []time.Duration
	for _, run := range runs {
		for _, q := range run.reqs {
			if q.err == nil {
				waits = append(waits, q.waited)
			}
		}
	}
	b.ReportMetric(ms(percentile(sortedCopy(waits), 0.50)), "wait-p50-ms")
}

// idealCounterWaits is idealWaits for a sliding counter, as lua/acquire.lua
// counts one: buckets of width, phase into its bucket at arrival 0, and a
// window of length window that touches buckets j-m .. j, each counted in
// full, where m = ceil(window/width). Call i starts, not before call i-1,
// in the first bucket where every window that holds it has room.
func idealCounterWaits(arrivals []time.Duration, limit int, window, width, phase time.Duration) []time.Duration {
	m := int64(math.Ceil(float64(window) / float64(width)))
	counts := map[int64]int{}
	waits := make([]time.Duration, len(arrivals))
	var prev time.Duration // previous start, in bucket time
	for i, a := range arrivals {
		t := max(a+phase, prev)
		for {
			k := int64(t / width)
			fits := true
			for j := k; j <= k+m && fits; j++ {
				sum := 0
				for x := j - m; x <= j; x++ {
					sum += counts[x]
				}
				fits = sum < limit
			}
			if fits {
				break
			}
			t = time.Duration(k+1) * width
		}
		counts[int64(t/width)]++
		prev = t
		waits[i] = t - phase - a
	}
	return waits
}

// idealPacedLogWaits is idealWaits for a sliding log combined with a token
// bucket of burst 1: call i starts at
// max(arrival_i, start_{i-1} + gap, start_{i-limit} + window).
func idealPacedLogWaits(arrivals []time.Duration, limit int, window, gap time.Duration) []time.Duration {
	starts := make([]time.Duration, len(arrivals))
	waits := make([]time.Duration, len(arrivals))
	for i, a := range arrivals {
		s := a
		if i > 0 {
			s = max(s, starts[i-1]+gap)
		}
		if i >= limit {
			s = max(s, starts[i-limit]+window)
		}
		starts[i] = s
		waits[i] = s - a
	}
	return waits
}

func TestIdealCounterWaits(t *testing.T) {
	ms := time.Millisecond
	// 2 per 100ms in buckets of 50ms: a window touches 3 buckets, so the
	// third call goes once bucket 0 has left every window, at 150ms.
	got := idealCounterWaits([]time.Duration{0, 0, 0}, 2, 100*ms, 50*ms, 0)
	want := []time.Duration{0, 0, 150 * ms}
	if !slices.Equal(got, want) {
		t.Errorf("idealCounterWaits = %v, want %v", got, want)
	}
	// A run that starts 30ms into its bucket waits 30ms less.
	got = idealCounterWaits([]time.Duration{0, 0, 0}, 2, 100*ms, 50*ms, 30*ms)
	want = []time.Duration{0, 0, 120 * ms}
	if !slices.Equal(got, want) {
		t.Errorf("idealCounterWaits with phase = %v, want %v", got, want)
	}
}

func TestIdealPacedLogWaits(t *testing.T) {
	ms := time.Millisecond
	// 2 per 100ms, 10ms apart.
	got := idealPacedLogWaits([]time.Duration{0, 0, 0, 0}, 2, 100*ms, 10*ms)
	want := []time.Duration{0, 10 * ms, 100 * ms, 110 * ms}
	if !slices.Equal(got, want) {
		t.Errorf("idealPacedLogWaits = %v, want %v", got, want)
	}
}

// memoryLimits are the limits at which BenchmarkMemoryPerKey fills the
// policies whose memory might grow with the limit.
var memoryLimits = []int{100, 1_000, 10_000, 100_000}

// memoryWindow is the window of every quota BenchmarkMemoryPerKey fills: a
// vendor's "tokens per minute" is where large limits occur.
const memoryWindow = time.Minute

// memoryQuotas numbers the quotas BenchmarkMemoryPerKey fills.
var memoryQuotas atomic.Int64

// memoryBuckets is the Buckets of the sliding counters it fills.
const memoryBuckets = 10

// A memoryFill fills a fresh quota called name exactly to its limit, and
// returns its limiter and what undoes the fill once measured.
type memoryFill func(b *testing.B, ctx context.Context, rdb *redis.Client, name string) (lim *throttle.Limiter, undo func())

// memoryCase is one quota size BenchmarkMemoryPerKey fills.
type memoryCase struct {
	label   string // prefix of its metrics: "limit-100-"
	limit   int
	members bool // its rule is a sorted set with one member per unit
	fill    memoryFill
}

// BenchmarkMemoryPerKey measures the Redis memory a quota takes when it is
// exactly full: MEMORY USAGE key SAMPLES 0, which counts every element, of
// each key the limiter wrote (found by SCAN on throttle:{name}:*). One
// iteration fills a fresh quota of each size, measures it, checks that one
// more unit is refused, and deletes its keys; the figures are the same in
// every iteration. The sizes of a policy share one sub-benchmark, each
// reported under its own prefix, so that the run stays short.
//
// Limits are large, so calls carry Cost up to the limit: one call fills a
// SlidingLog, TokenBucket or Concurrency. A SlidingCounter gets Limit/10
// units in each of its 10 buckets, one call per bucket on a clock that the
// benchmark moves (throttle.Options.Clock), since a full window spread over its
// buckets is the most fields its hash holds.
func BenchmarkMemoryPerKey(b *testing.B) {
	s := newServer(b)
	rdb := s.Client(b)
	var logs, counters, buckets []memoryCase
	for _, n := range memoryLimits {
		label := fmt.Sprintf("limit-%d-", n)
		logs = append(logs, memoryCase{label, n, true, fillAtOnce(policies.SlidingLog{Limit: n, Window: memoryWindow}, n, false)})
		counters = append(counters, memoryCase{label, n, false, fillCounter(n)})
	}
	for _, n := range []int{100, 100_000} {
		p := policies.TokenBucket{Rate: n, Per: memoryWindow, Burst: n}
		buckets = append(buckets, memoryCase{fmt.Sprintf("limit-%d-", n), n, false, fillAtOnce(p, n, false)})
	}
	b.Run("SlidingLog", func(b *testing.B) { measureMemory(b, rdb, logs) })
	b.Run("SlidingCounter", func(b *testing.B) { measureMemory(b, rdb, counters) })
	b.Run("TokenBucket", func(b *testing.B) { measureMemory(b, rdb, buckets) })
	b.Run("Concurrency", func(b *testing.B) {
		measureMemory(b, rdb, []memoryCase{{"max-100-", 100, true, fillAtOnce(policies.Concurrency{Max: 100}, 100, true)}})
	})
}

// fillAtOnce fills p with one call of cost n: through Allow, or, when hold
// is set (a concurrency slot, which Allow would never give back), through
// Acquire in FailFast mode, holding the permit until undo.
func fillAtOnce(p policies.Policy, n int, hold bool) memoryFill {
	return func(b *testing.B, ctx context.Context, rdb *redis.Client, name string) (*throttle.Limiter, func()) {
		// The clock stands still, so that nothing leaks out between the fill
		// and the check that the quota is full: a token bucket of 100,000
		// per minute frees a unit every 600 µs. The fill of a 100,000-unit
		// log is one long script: give it time.
		now := time.Now()
		lim, err := throttle.New(rdb, name, p, throttle.Options{
			Mode:         throttle.FailFast,
			Clock:        func() time.Time { return now },
			RedisTimeout: 10 * time.Second,
		})
		if err != nil {
			b.Fatal(err)
		}
		if hold {
			permit, err := lim.Acquire(ctx, throttle.Cost(n))
			if err != nil {
				b.Fatal(err)
			}
			return lim, permit.Release
		}
		d, err := lim.Allow(ctx, throttle.Cost(n))
		if err != nil || !d.OK {
			b.Fatalf("fill of %d units: %+v, %v", n, d, err)
		}
		return lim, func() {}
	}
}

// fillCounter fills a sliding counter of limit n with n/memoryBuckets units
// in each bucket, a bucket apart on the limiter's clock.
func fillCounter(n int) memoryFill {
	p := policies.SlidingCounter{Limit: n, Window: memoryWindow, Buckets: memoryBuckets}
	return func(b *testing.B, ctx context.Context, rdb *redis.Client, name string) (*throttle.Limiter, func()) {
		rules, err := policies.Rules(p)
		if err != nil {
			b.Fatal(err)
		}
		var now atomic.Int64
		now.Store(time.Now().UnixNano())
		clock := func() time.Time { return time.Unix(0, now.Load()) }
		lim, err := throttle.New(rdb, name, p, throttle.Options{Clock: clock})
		if err != nil {
			b.Fatal(err)
		}
		for i := range memoryBuckets {
			if i > 0 {
				now.Add(int64(rules[0].Bucket))
			}
			d, err := lim.Allow(ctx, throttle.Cost(n/memoryBuckets))
			if err != nil || !d.OK {
				b.Fatalf("fill of bucket %d: %+v, %v", i, d, err)
			}
		}
		return lim, func() {}
	}
}

// memoryFigures adds up what the iterations measured of one memoryCase.
type memoryFigures struct {
	ruleBytes, ruleKeys, zcard int64
	filling                    time.Duration
}

// measureMemory fills a fresh quota of each case per iteration and reports
// the memory of the keys it wrote. A rule's state is a sorted set or a hash:
// its bytes are what each active key of a quota costs. The quota's string
// keys (its meta key) are reported apart, since a quota has one whatever its
// number of keys. A case with members must hold exactly limit members.
func measureMemory(b *testing.B, rdb *redis.Client, cases []memoryCase) {
	ctx := context.Background()
	figs := make([]memoryFigures, len(cases))
	var iters, quotas, otherBytes, otherKeys int64
	for b.Loop() {
		for i, c := range cases {
			// Names of one length, since MEMORY USAGE counts the key's name.
			name := fmt.Sprintf("mem-%06d", memoryQuotas.Add(1))
			t := time.Now()
			lim, undo := c.fill(b, ctx, rdb, name)
			f := &figs[i]
			f.filling += time.Since(t)

			written := quotaKeys(b, ctx, rdb, name)
			m := measureKeys(b, ctx, rdb, written)
			n, rules := m.members, m.ruleKeys
			f.ruleBytes += m.ruleBytes
			otherBytes += m.otherBytes
			otherKeys += m.otherKeys
			if rules == 0 {
				b.Fatalf("quota %q wrote no rule key, only %v", name, written)
			}
			if c.members && n != int64(c.limit) {
				b.Fatalf("quota %q holds %d members, want exactly its limit %d", name, n, c.limit)
			}
			if d, err := lim.Allow(ctx); err != nil || d.OK {
				b.Fatalf("quota %q is not full: one more unit gave %+v, %v", name, d, err)
			}
			undo()
			if err := rdb.Unlink(ctx, written...).Err(); err != nil {
				b.Fatal(err)
			}
			f.ruleKeys += rules
			f.zcard += n
			quotas++
		}
		iters++
	}
	for i, c := range cases {
		f := figs[i]
		b.ReportMetric(float64(f.ruleBytes)/float64(f.ruleKeys), c.label+"bytes/key")
		if c.members {
			b.ReportMetric(float64(f.ruleBytes)/float64(f.zcard), c.label+"bytes/member")
		}
		b.ReportMetric(ms(f.filling)/float64(iters), c.label+"fill-ms")
	}
	if otherKeys > 0 {
		b.ReportMetric(float64(otherBytes)/float64(otherKeys), "meta-bytes/key")
	}
	b.ReportMetric(float64(otherKeys)/float64(quotas), "meta-keys/quota")
}

// keysMemory is the memory of a quota's keys: its rules' sorted sets and
// hashes, their members, and its other keys.
type keysMemory struct {
	ruleBytes, ruleKeys, members int64
	otherBytes, otherKeys        int64
}

// measureKeys reads the memory, type and members of each of keys.
func measureKeys(b *testing.B, ctx context.Context, rdb *redis.Client, keys []string) keysMemory {
	var m keysMemory
	for _, k := range keys {
		used, err := rdb.MemoryUsage(ctx, k, 0).Result()
		if err != nil {
			b.Fatal(err)
		}
		typ, err := rdb.Type(ctx, k).Result()
		if err != nil {
			b.Fatal(err)
		}
		switch typ {
		case "zset":
			n, err := rdb.ZCard(ctx, k).Result()
			if err != nil {
				b.Fatal(err)
			}
			m.members += n
			fallthrough
		case "hash":
			m.ruleBytes += used
			m.ruleKeys++
		default:
			m.otherBytes += used
			m.otherKeys++
		}
	}
	return m
}

// quotaKeys returns every key of the quota name under the default prefix.
func quotaKeys(b *testing.B, ctx context.Context, rdb *redis.Client, name string) []string {
	var keys []string
	it := rdb.Scan(ctx, 0, keyPrefix+":{"+name+"}:*", 1000).Iterator()
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		b.Fatal(err)
	}
	return keys
}
