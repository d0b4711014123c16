package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/protocol"
	"github.com/throttlekit/throttle/policies"
)

// Redis runs one script at a time, so one slow decision stalls every client
// of that Redis. The target is under 1 ms of Redis time per script call at
// each policy's bounds.
const worstTarget = time.Millisecond

const (
	// worstRuns is how often each case is measured, each run from the same
	// state; a case stops early once its runs have taken worstCaseBudget, so
	// that slow cases keep the whole benchmark under a minute.
	worstRuns       = 5
	worstCaseBudget = 3 * time.Second
	// worstMaxWait is the MaxWait up to which sliding logs are booked
	// ahead. Each window booked ahead of a log of 100,000 is 100,000
	// entries: at the default MaxWait of a minute, 58 windows of 1.03 s and
	// 5.9 million entries, the state alone takes a minute to build.
	worstMaxWait = 5 * time.Second
	// worstBatch is how many calls queue behind a first one in the batch
	// cases: the most one script call decides.
	worstBatch = 128
	// worstFillCalls is how many calls fill one window of a sliding log of
	// 100,000, spread evenly over it.
	worstFillCalls = 100
)

// BenchmarkWorstCase measures Redis's time for one decision of each policy
// at its bounds: the largest limits, full quotas, bookings up to MaxWait.
// Each case builds its state through the public API with the limiters'
// clock standing still (Options.Clock), keeps a DUMP of every key of the quota,
// and restores it before each run. Redis's own time of each script call
// comes from SLOWLOG (slowlog-log-slower-than 0, every command logged with
// its duration), and the calls each script call decided from the limiter's
// Observer (EventRedis.Calls). It prints a table; see README.md.
func BenchmarkWorstCase(b *testing.B) {
	s := newServer(b)
	// A decision may keep Redis busy for seconds: it is measured, not cut
	// off (the limiters get a long Options.RedisTimeout too).
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, ReadTimeout: 2 * time.Minute})
	b.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	for k, v := range map[string]string{"slowlog-log-slower-than": "0", "slowlog-max-len": "100000"} {
		if err := rdb.ConfigSet(ctx, k, v).Err(); err != nil {
			b.Fatal(err)
		}
	}

	var rows []worstRow
	for b.Loop() {
		w := &worstBench{b: b, rdb: rdb, t0: time.Now().Truncate(time.Second)}
		rows = w.runAll()
	}
	printWorstTable(rows)
	var worst time.Duration
	over := 0
	for _, r := range rows {
		worst = max(worst, r.max)
		if r.err != nil || r.median > worstTarget {
			over++
		}
	}
	b.ReportMetric(us(worst), "max-redis-µs/script-call")
	b.ReportMetric(float64(over), "cases-over-1ms")
}

// worstBench builds the states and measures the decisions. Every limiter
// reads the same clock, which stands where at puts it.
type worstBench struct {
	b   *testing.B
	rdb *redis.Client
	t0  time.Time    // the time every decision is measured at
	now atomic.Int64 // the limiters' clock, Unix µs

	mu      sync.Mutex
	batches []int              // calls decided by each script call, in order
	stop    context.CancelFunc // ends a single measured call soon after its decision
}

// Observe keeps the number of calls each script call decided.
func (w *worstBench) Observe(e throttle.Event) {
	if e.Kind != throttle.EventRedis {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.batches = append(w.batches, e.Calls)
	if w.stop != nil {
		// Should a measured Block call book a slot, it gives it back soon
		// instead of sleeping towards it, and the run fails; the delay
		// leaves the decision time to reach the caller first.
		time.AfterFunc(100*time.Millisecond, w.stop)
	}
}

func (w *worstBench) at(t time.Time) { w.now.Store(t.UnixMicro()) }

// limiter returns a limiter of quota with opts, on the bench's clock, with
// a long Redis timeout, and observed by w.
func (w *worstBench) limiter(quota string, p policies.Policy, opts throttle.Options) *throttle.Limiter {
	w.b.Helper()
	opts.Clock = func() time.Time { return time.UnixMicro(w.now.Load()) }
	opts.RedisTimeout = 2 * time.Minute
	opts.Observer = w.Observe
	lim, err := throttle.New(w.rdb, quota, p, opts)
	if err != nil {
		w.b.Fatal(err)
	}
	return lim
}

// worstCase is one row of the table: a quota brought to a state, and the
// calls measured on it.
type worstCase struct {
	name   string
	quota  string
	policy policies.Policy
	opts   throttle.Options
	// build brings the quota to its state at t0. Each run's calls are made
	// by a new limiter with opts, which knows no epoch of the quota yet.
	build  func(quota string)
	decide decision
	// batch: decide makes many calls at once, and the row reports the
	// script call that decided the most of them.
	batch bool
}

type worstRow struct {
	name    string
	entries int64 // elements in the quota's keys before the calls
	runs    int
	median  time.Duration // Redis time of the reported script call
	max     time.Duration
	calls   int    // calls decided by the reported script call
	outcome string // what became of the calls
	err     error  // the decision failed in Redis
}

// The quotas of the table, each at its largest.
var (
	worstLog        = policies.SlidingLog{Limit: policies.MaxLogLimit, Window: time.Second}
	worstLog40k     = policies.SlidingLog{Limit: 40_000, Window: time.Second}
	worstCounter    = policies.SlidingCounter{Limit: 1, Window: time.Second, Buckets: policies.MaxBuckets}
	worstFastBucket = policies.TokenBucket{Rate: 1_000_000, Per: time.Second, Burst: 1 << 30}
	// The largest burst that refills within policies.MaxWindow, at the
	// slowest rate that allows it.
	worstSlowBucket  = policies.TokenBucket{Rate: 1 << 30, Per: policies.MaxWindow, Burst: 1 << 30}
	worstConcurrency = policies.Concurrency{Max: policies.MaxLogLimit}
	worstFailFast    = throttle.Options{Mode: throttle.FailFast}
	worstBlock       = throttle.Options{MaxWait: worstMaxWait}
)

// bookedTo is the end of the slots booked ahead: MaxWait after t0.
func (w *worstBench) bookedTo() time.Time { return w.t0.Add(worstMaxWait) }

// runAll builds each case's state, measures its calls, and returns the rows.
func (w *worstBench) runAll() []worstRow {
	ctx := context.Background()
	cases := slices.Concat(w.logCases(), w.ruleCases(), w.combinedCases())
	var rows []worstRow
	for _, c := range cases {
		start := time.Now()
		w.at(w.t0)
		c.build(c.quota)
		q := w.snapshot(ctx, c.quota)
		built := time.Since(start)
		rows = append(rows, w.measure(ctx, c, q))
		w.drop(ctx, q)
		w.b.Logf("%s: built in %v, measured in %v", c.name, built.Round(time.Millisecond), (time.Since(start) - built).Round(time.Millisecond))
	}
	return rows
}

// logCases are the sliding logs, full and booked ahead.
func (w *worstBench) logCases() []worstCase {
	return []worstCase{
		{
			name:   "SlidingLog 100k/1s full; Allow",
			quota:  "log-full",
			policy: worstLog,
			opts:   worstFailFast,
			build:  func(q string) { w.buildLog(q, worstLog, worstFillCalls, 0, w.t0) },
			decide: allow(1),
		},
		{
			name:   fmt.Sprintf("SlidingLog 100k/1s full, booked ahead to MaxWait %v; Block", worstMaxWait),
			quota:  "log-ahead",
			policy: worstLog,
			opts:   worstBlock,
			build:  func(q string) { w.buildLog(q, worstLog, worstFillCalls, 0, w.bookedTo()) },
			decide: acquire,
		},
		{
			// The booking given back leaves room now, in front of the
			// window booked ahead.
			name:   "SlidingLog 40k/1s full, 1 window booked ahead, a booking of 4,000 given back now; Allow of 4,000",
			quota:  "log-gap",
			policy: worstLog40k,
			opts:   worstFailFast,
			build: func(q string) {
				w.buildLog(q, worstLog40k, 10, 1, w.t0.Add(worstLog40k.EffectiveWindow()+time.Microsecond))
			},
			decide: allow(4000),
		},
	}
}

// ruleCases are the other kinds of rule at their largest.
func (w *worstBench) ruleCases() []worstCase {
	return []worstCase{
		{
			name:   "SlidingCounter 1/1s, 1000 buckets, booked ahead to MaxWait 10s; Block",
			quota:  "counter-10s",
			policy: worstCounter,
			opts:   throttle.Options{MaxWait: 10 * time.Second},
			build:  func(q string) { w.buildCounter(q, worstCounter, 10*time.Second) },
			decide: acquire,
		},
		{
			name:   "SlidingCounter 1/1s, 1000 buckets, booked ahead to MaxWait 1m (the default); Block",
			quota:  "counter-1m",
			policy: worstCounter,
			// The default Options.MaxWait is a minute.
			build:  func(q string) { w.buildCounter(q, worstCounter, time.Minute) },
			decide: acquire,
		},
		{
			name:   "TokenBucket 1e6/s, Burst 2^30, emptied; Allow",
			quota:  "bucket-fast",
			policy: worstFastBucket,
			opts:   worstFailFast,
			build:  func(q string) { w.buildBucket(q, worstFastBucket) },
			decide: allow(1),
		},
		{
			name:   "TokenBucket 2^30 per 366 days, Burst 2^30, full; Allow of 2^30",
			quota:  "bucket-slow",
			policy: worstSlowBucket,
			opts:   worstFailFast,
			build:  func(string) {},
			decide: allow(worstSlowBucket.Burst),
		},
		{
			name:   "Concurrency 100k full; FailFast Acquire",
			quota:  "conc-full",
			policy: worstConcurrency,
			opts:   worstFailFast,
			build:  func(q string) { w.buildConcurrency(q, worstConcurrency) },
			decide: acquire,
		},
	}
}

// combinedCases are every kind of rule in one quota, and batches of calls.
func (w *worstBench) combinedCases() []worstCase {
	return []worstCase{
		{
			name:   fmt.Sprintf("All(counter 1/1s/1000, log 100k/1s, bucket 1e6/s), each full and booked ahead to MaxWait %v; Block", worstMaxWait),
			quota:  "all",
			policy: policies.All(worstCounter, worstLog, worstFastBucket),
			opts:   worstBlock,
			build: func(q string) {
				w.buildAll(q,
					func(q string) { w.buildCounter(q, worstCounter, worstMaxWait) },
					func(q string) { w.buildLog(q, worstLog, worstFillCalls, 0, w.bookedTo()) },
					func(q string) { w.buildBucket(q, worstFastBucket) })
			},
			decide: acquire,
		},
		{
			name:   fmt.Sprintf("Batch: 1 + %d Allow on SlidingLog 100k/1s full", worstBatch),
			quota:  "batch-full",
			policy: worstLog,
			opts:   worstFailFast,
			build:  func(q string) { w.buildLog(q, worstLog, worstFillCalls, 0, w.t0) },
			decide: batchOf(worstBatch, allow(1)),
			batch:  true,
		},
		{
			name:   fmt.Sprintf("Batch: 1 + %d Block on SlidingLog 100k/1s full, booked ahead to MaxWait %v", worstBatch, worstMaxWait),
			quota:  "batch-ahead",
			policy: worstLog,
			opts:   worstBlock,
			build:  func(q string) { w.buildLog(q, worstLog, worstFillCalls, 0, w.bookedTo()) },
			decide: batchOf(worstBatch, acquire),
			batch:  true,
		},
	}
}

// A decision makes the measured calls, and returns how many there were and
// how many of them were admitted.
type decision func(context.Context, *throttle.Limiter) (calls, admitted int, err error)

// allow decides a call of cost by Allow.
func allow(cost int) decision {
	return func(ctx context.Context, lim *throttle.Limiter) (int, int, error) {
		d, err := lim.Allow(ctx, throttle.Cost(cost))
		if err != nil || !d.OK {
			return 1, 0, err
		}
		return 1, 1, nil
	}
}

// acquire decides a call by Acquire, in the limiter's mode. Block calls are
// measured where every slot within MaxWait is booked: one that books a slot
// fails, since it would otherwise sleep towards it.
func acquire(ctx context.Context, lim *throttle.Limiter) (int, int, error) {
	_, err := lim.Acquire(ctx)
	switch {
	case err == nil:
		// The permit is not released: the next run restores the state.
		return 1, 1, nil
	case errors.Is(err, throttle.ErrLimited):
		return 1, 0, nil
	case errors.Is(err, context.Canceled):
		return 1, 0, fmt.Errorf("Acquire booked a slot within MaxWait, where the state should leave none: %w", err)
	}
	return 1, 0, err
}

// batchOf makes n+1 calls of one at once: the first goes alone, and the n
// that queue behind it while it is decided share the next script call.
func batchOf(n int, one decision) decision {
	return func(ctx context.Context, lim *throttle.Limiter) (int, int, error) {
		admitted := make([]int, n+1)
		errs := make([]error, n+1)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				<-start
				_, admitted[i], errs[i] = one(ctx, lim)
			})
		}
		close(start)
		wg.Wait()
		total := 0
		for _, a := range admitted {
			total += a
		}
		return n + 1, total, errors.Join(errs...)
	}
}

// measure restores q's state before each run, makes c's calls, and reads
// Redis's time of each script call they caused.
func (w *worstBench) measure(ctx context.Context, c worstCase, q quotaState) worstRow {
	w.b.Helper()
	row := worstRow{name: c.name, entries: q.entries}
	var times []time.Duration
	start := time.Now()
	for row.runs < worstRuns && (row.runs == 0 || time.Since(start) < worstCaseBudget) {
		w.freshRun(ctx, q)
		runCtx, cancel := context.WithCancel(ctx)
		w.mu.Lock()
		w.batches, w.stop = nil, nil
		if !c.batch {
			w.stop = cancel
		}
		w.mu.Unlock()
		calls, admitted, err := c.decide(runCtx, w.limiter(c.quota, c.policy, c.opts))
		cancel()
		if errors.Is(err, throttle.ErrUnavailable) {
			// The script failed: a finding for the table, not a fault of
			// the benchmark.
			w.b.Logf("%s: %v", c.name, err)
			row.err = err
			return row
		}
		if err != nil {
			w.b.Fatalf("%s: %v", c.name, err)
		}
		scripts := w.scriptCalls(ctx)
		w.mu.Lock()
		batches := slices.Clone(w.batches)
		w.mu.Unlock()
		if len(scripts) != len(batches) || (!c.batch && len(scripts) != 1) {
			w.b.Fatalf("%s: Redis ran %d script calls %v, the limiter reported %d deciding %v calls", c.name, len(scripts), scripts, len(batches), batches)
		}
		// The reported script call: the only one, or the largest batch.
		i := 0
		for j := range batches {
			if batches[j] > batches[i] || (batches[j] == batches[i] && scripts[j] > scripts[i]) {
				i = j
			}
		}
		times = append(times, scripts[i])
		row.calls = batches[i]
		row.outcome = outcome(calls, admitted)
		row.runs++
	}
	slices.Sort(times)
	row.median, row.max = times[(len(times)-1)/2], times[len(times)-1]
	return row
}

// freshRun restores q's state and the clock at t0, and gives Redis a new
// Lua interpreter, so that no run pays for collecting the garbage of the
// scripts before it; the scripts are loaded again before the run, as a
// Redis that has met the fleet before has them.
func (w *worstBench) freshRun(ctx context.Context, q quotaState) {
	w.b.Helper()
	w.restore(ctx, q)
	w.at(w.t0)
	errs := []error{w.rdb.ScriptFlush(ctx).Err()}
	for _, s := range throttleScripts(w.b) {
		errs = append(errs, s.Load(ctx, w.rdb).Err())
	}
	errs = append(errs, w.rdb.SlowLogReset(ctx).Err())
	for _, err := range errs {
		if err != nil {
			w.b.Fatal(err)
		}
	}
}

// scriptCalls returns Redis's own time of each script call since the last
// SLOWLOG RESET, oldest first. The commands a script runs are logged apart,
// under their own names.
func (w *worstBench) scriptCalls(ctx context.Context) []time.Duration {
	logs, err := w.rdb.SlowLogGet(ctx, -1).Result()
	if err != nil {
		w.b.Fatal(err)
	}
	var d []time.Duration
	for _, l := range slices.Backward(logs) {
		if len(l.Args) > 0 && isScriptCmd(strings.ToLower(l.Args[0])) {
			d = append(d, l.Duration)
		}
	}
	return d
}

// quotaState is every key of a quota, as DUMP gave it.
type quotaState struct {
	pattern string
	dumps   map[string]string
	entries int64 // elements in all the keys; a string counts one
}

// quotaPattern matches every key of quota, as throttle.New names them:
// <prefix>:{<quota>}:pause, <prefix>:{<quota>}:<rule id> (see
// policies.Rule.ID), a log's <rule id>:next, and the same with a suffix for
// per-key rules.
func quotaPattern(quota string) string { return keyPrefix + ":{" + quota + "}:*" }

// ruleKey is the key of rule r of a quota without per-key rules.
func ruleKey(quota string, r policies.Rule) string {
	return fmt.Sprintf("%s:{%s}:%s", keyPrefix, quota, r.ID())
}

// metaKey is the key of a quota's meta hash: its epoch, pause and timing.
func metaKey(quota string) string { return keyPrefix + ":{" + quota + "}:meta" }

func (w *worstBench) keys(ctx context.Context, pattern string) []string {
	keys, err := w.rdb.Keys(ctx, pattern).Result()
	if err != nil {
		w.b.Fatal(err)
	}
	return keys
}

// snapshot dumps every key of quota and counts the elements they hold.
func (w *worstBench) snapshot(ctx context.Context, quota string) quotaState {
	q := quotaState{pattern: quotaPattern(quota), dumps: map[string]string{}}
	for _, k := range w.keys(ctx, q.pattern) {
		v, err := w.rdb.Dump(ctx, k).Result()
		if err != nil {
			w.b.Fatalf("DUMP %s: %v", k, err)
		}
		q.dumps[k] = v
		q.entries += w.elements(ctx, k)
	}
	return q
}

// elements is how many elements key holds, whatever its type.
func (w *worstBench) elements(ctx context.Context, key string) int64 {
	typ, err := w.rdb.Type(ctx, key).Result()
	if err != nil {
		w.b.Fatal(err)
	}
	var n *redis.IntCmd
	switch typ {
	case "zset":
		n = w.rdb.ZCard(ctx, key)
	case "hash":
		n = w.rdb.HLen(ctx, key)
	case "set":
		n = w.rdb.SCard(ctx, key)
	case "list":
		n = w.rdb.LLen(ctx, key)
	default:
		return 1
	}
	if err := n.Err(); err != nil {
		w.b.Fatal(err)
	}
	return n.Val()
}

// restore puts q's keys back as they were dumped, without expiry, and
// deletes any other key of the quota.
func (w *worstBench) restore(ctx context.Context, q quotaState) {
	for _, k := range w.keys(ctx, q.pattern) {
		if _, ok := q.dumps[k]; !ok {
			w.del(ctx, k)
		}
	}
	for k, v := range q.dumps {
		if err := w.rdb.RestoreReplace(ctx, k, 0, v).Err(); err != nil {
			w.b.Fatalf("RESTORE %s: %v", k, err)
		}
	}
}

func (w *worstBench) drop(ctx context.Context, q quotaState) {
	w.del(ctx, w.keys(ctx, q.pattern)...)
}

func (w *worstBench) del(ctx context.Context, keys ...string) {
	if len(keys) == 0 {
		return
	}
	if err := w.rdb.Del(ctx, keys...).Err(); err != nil {
		w.b.Fatal(err)
	}
}

// persist takes the expiry off every key of quota. The scripts set expiries
// from the limiters' clock, so a key written with the clock a minute ahead
// would still live only about a window of Redis's time.
func (w *worstBench) persist(ctx context.Context, quota string) {
	for _, k := range w.keys(ctx, quotaPattern(quota)) {
		if err := w.rdb.Persist(ctx, k).Err(); err != nil {
			w.b.Fatal(err)
		}
	}
}

// admit makes lim admit a call of cost now at t: the states are built of
// nothing else.
func (w *worstBench) admit(lim *throttle.Limiter, t time.Time, cost int) {
	w.b.Helper()
	w.at(t)
	d, err := lim.Allow(context.Background(), throttle.Cost(cost))
	if err == nil && !d.OK {
		err = fmt.Errorf("refused, retry after %v", d.RetryAfter)
	}
	if err != nil {
		w.b.Fatalf("building %s: cost %d at t0%+v: %v", lim.Name(), cost, t.Sub(w.t0), err)
	}
}

// buildLog brings quota's sliding log to where a saturated queue leaves it
// at t0: the window ending at t0 full of admitted calls, less its last given
// calls (bookings given back), and every slot booked after it up to until,
// each window the one before it replayed a window and a microsecond later
// (no two entries lie exactly a window apart, which a script may count as
// within one window or not). A window is calls calls of Limit/calls units,
// spread evenly over it.
//
// The windows booked ahead are written by limiters of quotas of their own,
// then merged into quota's log with ZUNIONSTORE: through quota itself they
// would be admitted from the last back, each in front of the ones after it,
// which the scripts up to commit 5a2c012 did in time quadratic in the
// entries (over a minute for one window of 100,000). The merge needs the log
// to be a sorted set with members unique to each call, as the scripts keep
// it; it fails otherwise.
func (w *worstBench) buildLog(quota string, p policies.SlidingLog, calls, given int, until time.Time) {
	w.b.Helper()
	ctx := context.Background()
	e := p.EffectiveWindow()
	fill := func(quota string, from time.Time, n int) {
		lim := w.limiter(quota, p, throttle.Options{Mode: throttle.FailFast})
		for i := range n {
			t := from.Add(e * time.Duration(i+1) / time.Duration(calls))
			if t.After(until) {
				break
			}
			w.admit(lim, t, p.Limit/calls)
		}
		w.persist(ctx, quota)
	}
	fill(quota, w.t0.Add(-e), calls-given)
	var helpers []string
	for from := w.t0.Add(time.Microsecond); from.Before(until); from = from.Add(e + time.Microsecond) {
		helpers = append(helpers, fmt.Sprintf("%s-ahead-%d", quota, len(helpers)+1))
		fill(helpers[len(helpers)-1], from, calls)
	}
	if len(helpers) == 0 {
		return
	}
	rules, err := policies.Rules(p)
	if err != nil {
		w.b.Fatal(err)
	}
	keys := []string{ruleKey(quota, rules[0])}
	for _, h := range helpers {
		keys = append(keys, ruleKey(h, rules[0]))
	}
	for _, k := range keys {
		if typ := w.rdb.Type(ctx, k).Val(); typ != "zset" {
			w.b.Fatalf("%s is a %s, not a sorted set: buildLog cannot merge the windows booked ahead", k, typ)
		}
	}
	if err := w.rdb.ZUnionStore(ctx, keys[0], &redis.ZStore{Keys: keys}).Err(); err != nil {
		w.b.Fatal(err)
	}
	for _, h := range helpers {
		w.del(ctx, w.keys(ctx, quotaPattern(h))...)
	}
}

// buildCounter brings quota's sliding counter of limit 1 to where a
// saturated queue leaves it: one unit admitted at t0, and one booked in
// every later window up to maxWait, each in the first bucket whose windows
// have room (as many buckets on as a window touches, and one). The
// bookings are written from the last back, the clock standing at each.
func (w *worstBench) buildCounter(quota string, p policies.SlidingCounter, maxWait time.Duration) {
	w.b.Helper()
	rules, err := policies.Rules(p)
	if err != nil {
		w.b.Fatal(err)
	}
	r := rules[0]
	m := (r.Window + r.Bucket - 1) / r.Bucket
	step := (m + 1) * r.Bucket
	lim := w.limiter(quota, p, throttle.Options{Mode: throttle.FailFast})
	// Latest first, each at its own time (the buckets before a call's
	// window would go with it), as if all were booked at t0: before each,
	// the quota's last script ran no later than it, lest Redis's clock
	// read as gone back (a loss, and a pause of a window).
	ctx := context.Background()
	for k := int(maxWait / step); k >= 0; k-- {
		t := w.t0.Add(time.Duration(k) * step)
		if err := w.rdb.HSet(ctx, metaKey(quota), "last_acquire", t.UnixMicro()).Err(); err != nil {
			w.b.Fatal(err)
		}
		w.admit(lim, t, p.Limit)
	}
	w.persist(ctx, quota)
}

// buildBucket empties quota's token bucket at t0.
func (w *worstBench) buildBucket(quota string, p policies.TokenBucket) {
	w.b.Helper()
	w.admit(w.limiter(quota, p, throttle.Options{Mode: throttle.FailFast}), w.t0, p.Burst)
	w.persist(context.Background(), quota)
}

// buildConcurrency takes every slot of quota at t0, and never gives them back.
func (w *worstBench) buildConcurrency(quota string, p policies.Concurrency) {
	w.b.Helper()
	lim := w.limiter(quota, p, throttle.Options{Mode: throttle.FailFast})
	w.at(w.t0)
	if _, err := lim.Acquire(context.Background(), throttle.Cost(p.Max)); err != nil {
		w.b.Fatal(err)
	}
	w.persist(context.Background(), quota)
}

// buildAll builds each rule of quota in a quota of its own, and copies in
// that quota's keys but its meta key (throttle.New names a rule's keys by
// the rule, not by its place in the policy), and the first one's meta key as
// quota's.
func (w *worstBench) buildAll(quota string, rules ...func(quota string)) {
	w.b.Helper()
	ctx := context.Background()
	for i, build := range rules {
		helper := fmt.Sprintf("%s-rule-%d", quota, i)
		build(helper)
		var copies [][2]string
		for _, k := range w.keys(ctx, quotaPattern(helper)) {
			if k != metaKey(helper) {
				copies = append(copies, [2]string{k, strings.Replace(k, "{"+helper+"}", "{"+quota+"}", 1)})
			}
		}
		if i == 0 {
			copies = append(copies, [2]string{metaKey(helper), metaKey(quota)})
		}
		for _, c := range copies {
			if err := w.rdb.Copy(ctx, c[0], c[1], 0, true).Err(); err != nil {
				w.b.Fatalf("COPY %s %s: %v", c[0], c[1], err)
			}
		}
		w.del(ctx, w.keys(ctx, quotaPattern(helper))...)
	}
	w.persist(ctx, quota)
}

func printWorstTable(rows []worstRow) {
	fmt.Printf("\n| case | entries in Redis | runs | outcome | Redis µs per script call, median / max | calls per script call | Redis µs per call |\n")
	fmt.Printf("| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, r := range rows {
		if r.err != nil {
			fmt.Printf("| %s | %s | %d | fails in Redis: %v | | | |\n", r.name, thousands(r.entries), r.runs, redisError(r.err))
			continue
		}
		flag := ""
		if r.median > worstTarget {
			flag = " **over 1 ms**"
		}
		fmt.Printf("| %s | %s | %d | %s | %s / %s%s | %d | %s |\n", r.name, thousands(r.entries), r.runs, r.outcome,
			thousands(int64(us(r.median))), thousands(int64(us(r.max))), flag, r.calls,
			perCall(r.median, r.calls))
	}
	fmt.Println()
}

// outcome says what became of calls, of which admitted were admitted.
func outcome(calls, admitted int) string {
	switch {
	case calls == 1 && admitted == 1:
		return "admitted"
	case calls == 1:
		return "refused"
	case admitted == 0:
		return fmt.Sprintf("%d refused", calls)
	case admitted == calls:
		return fmt.Sprintf("%d admitted", calls)
	}
	return fmt.Sprintf("%d admitted, %d refused", admitted, calls-admitted)
}

// redisError is what Redis answered when a decision failed there.
func redisError(err error) error {
	if u, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range u.Unwrap() {
			if e != throttle.ErrUnavailable {
				return e
			}
		}
	}
	return err
}

func perCall(d time.Duration, calls int) string {
	x := us(d) / float64(max(calls, 1))
	if x >= 100 {
		return thousands(int64(math.Round(x)))
	}
	return fmt.Sprintf("%.1f", x)
}

// thousands writes n with a comma between groups of three digits.
func thousands(n int64) string {
	if n < 0 {
		return "-" + thousands(-n)
	}
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// throttleScripts returns the scripts of ../lua as the throttle package
// sends them (see script in lua.go): each after consts.lua and lib.lua,
// without the lines that hold only a comment, so that their SHA1s are the
// ones its EVALSHA asks for.
func throttleScripts(tb testing.TB) []*redis.Script {
	tb.Helper()
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join("..", "lua", name))
		if err != nil {
			tb.Fatal(err)
		}
		return string(b)
	}
	lib := read("consts.lua") + read("lib.lua")
	off := luaOff(tb, read)
	var out []*redis.Script
	for _, name := range []string{"acquire.lua", "cancel.lua", "settle.lua", "release.lua", "feedback.lua", "usage.lua", "handback.lua"} {
		var b strings.Builder
		for _, line := range strings.Split(lib+read(name), "\n") {
			if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
				continue
			}
			if line == "local OFF = {}" {
				line = off
			}
			b.WriteString(line)
			b.WriteByte('\n')
		}
		text, err := protocol.Fold(b.String())
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, redis.NewScript(text))
	}
	return out
}

// luaOff returns the scripts' OFF table as the throttle package writes it
// for the switches THROTTLE_OFF turns off (see ../switches.go): those of
// the scripts, in the order of its luaMechanisms; none in a build without
// the tag throttle_switches, as in the throttle package.
func luaOff(tb testing.TB, read func(string) string) string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("..", "switches.go"))
	if err != nil {
		tb.Fatal(err)
	}
	src := string(b)
	start := strings.Index(src, "var luaMechanisms = []mechanism{")
	end := strings.Index(src[max(start, 0):], "\n}")
	if start < 0 || end < 0 {
		tb.Fatal("../switches.go: no luaMechanisms")
	}
	off := map[string]bool{}
	for _, m := range strings.Split(switchedOff(), ",") {
		off[strings.TrimSpace(m)] = true
	}
	var on []string
	for _, line := range strings.Split(src[start:start+end], "\n")[1:] {
		name := strings.Trim(strings.TrimSpace(strings.SplitN(line, ",", 2)[0]), `"`)
		if off[name] {
			on = append(on, name+" = true")
		}
	}
	return "local OFF = {" + strings.Join(on, ", ") + "}"
}
