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
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// The saturated fleet: 3 replicas, each with its own go-redis client and
// its own limiter of the same quota, 20 goroutines per replica, each asking
// again as soon as it is let through, against 100 calls per second, for 3 s.
const (
	fleetReplicas = 3
	fleetWorkers  = 20 // goroutines per replica
	fleetLimit    = 100
	fleetWindow   = time.Second
	fleetRun      = 3 * time.Second
	// overtakeSlack is how much later than a later arrival a call may be
	// let through before it counts as overtaken. Calls made within the same
	// few milliseconds by different goroutines on 2 cores reach Redis on
	// different connections in whatever order the schedulers and Redis's
	// event loop give them, not in the order they were made.
	overtakeSlack = 5 * time.Millisecond
)

// fleetPolicy is the quota of the throttle fleet. Its window is widened by
// policies.DefaultMargin, to 1.02 s.
var fleetPolicy = policies.SlidingLog{Limit: fleetLimit, Window: fleetWindow}

// acquireFunc takes one call through one replica's limiter, waiting as the
// limiter's users would, and returns how long it waited.
type acquireFunc func(ctx context.Context) (time.Duration, error)

// request is one call of one goroutine in a fleet run.
type request struct {
	replica  int
	arrival  time.Duration // since the run's start, when the goroutine asked
	done     time.Duration // since the run's start, when the call returned
	waited   time.Duration // the wait measured around Acquire
	calls    int64         // script calls the request sent, NOSCRIPT fallbacks included
	noscript int64         // of which EVALSHA answered NOSCRIPT
	err      error         // nil when admitted
}

type fleetResult struct {
	reqs     []request
	calls    int64 // every script call of the run
	noscript int64 // EVALSHA answered NOSCRIPT
	commands int64 // every command Redis ran during the run (INFO commandstats)
	usec     int64 // Redis's time in those commands, in microseconds
}

// runFleet runs the saturated fleet once against s, each replica's
// acquireFunc made by newReplica from the replica's own client, and returns
// every call it made. It always lasts fleetRun.
//
// The replicas' connection pools are opened first, as those of replicas
// that have been running a while are; the script cache is flushed, so the
// run starts as a fleet does after a Redis restart and pays its NOSCRIPT
// fallbacks.
func runFleet(b *testing.B, s *redistest.Server, newReplica func(rdb *redis.Client) acquireFunc) fleetResult {
	b.Helper()
	counters := make([]*scriptCounter, fleetReplicas)
	acquires := make([]acquireFunc, fleetReplicas)
	for i := range fleetReplicas {
		rdb := s.Client(b)
		warmPool(b, rdb, fleetWorkers)
		if i == 0 {
			if err := rdb.ScriptFlush(context.Background()).Err(); err != nil {
				b.Fatal(err)
			}
		}
		counters[i] = &scriptCounter{}
		rdb.AddHook(scriptHook{counters[i]})
		acquires[i] = newReplica(rdb)
	}

	stats := s.Client(b)
	if err := stats.ConfigResetStat(context.Background()).Err(); err != nil {
		b.Fatal(err)
	}
	reqs := driveFleet(acquires)

	run := fleetResult{reqs: reqs}
	usec := commandField(b, context.Background(), stats, "usec")
	for name, n := range commandCalls(b, context.Background(), stats) {
		if name != "info" && name != "config|resetstat" {
			run.commands += int64(n)
			run.usec += int64(usec[name])
		}
	}
	for _, c := range counters {
		run.calls += c.calls.Load()
		run.noscript += c.noscript.Load()
	}
	for _, q := range reqs {
		if q.err != nil && !endOfRun(q) {
			b.Fatalf("call arriving at %v failed before the end of the run: %v", q.arrival, q.err)
		}
	}
	return run
}

// driveFleet runs fleetWorkers goroutines of each replica, each calling
// its replica's acquire until its first failure, for fleetRun, and
// returns every call they made.
func driveFleet(acquires []acquireFunc) []request {
	var (
		mu     sync.Mutex
		reqs   []request
		wg     sync.WaitGroup
		begin  = make(chan struct{})
		start  time.Time
		ctx    context.Context
		cancel context.CancelFunc
	)
	for r := range fleetReplicas {
		for range fleetWorkers {
			wg.Go(func() {
				<-begin
				var mine []request
				for ctx.Err() == nil {
					var n scriptCounter
					arrival := time.Since(start)
					waited, err := acquires[r](withRequestCounter(ctx, &n))
					mine = append(mine, request{
						replica:  r,
						arrival:  arrival,
						done:     time.Since(start),
						waited:   waited,
						calls:    n.calls.Load(),
						noscript: n.noscript.Load(),
						err:      err,
					})
					if err != nil {
						break // the run is over for this goroutine
					}
				}
				mu.Lock()
				reqs = append(reqs, mine...)
				mu.Unlock()
			})
		}
	}
	start = time.Now()
	ctx, cancel = context.WithDeadline(context.Background(), start.Add(fleetRun))
	defer cancel()
	close(begin)
	wg.Wait()
	// A goroutine stops at its first refusal, which for a limiter that books
	// ahead comes as soon as its slot lies past the deadline; the run lasts
	// its full length all the same.
	<-ctx.Done()
	return reqs
}

// endOfRun reports whether a failed call failed because the run ended: the
// deadline came while it waited, or a refusal said that its slot lay past
// the deadline.
func endOfRun(q request) bool {
	const slack = 50 * time.Millisecond
	if le, ok := errors.AsType[*throttle.LimitedError](q.err); ok {
		return q.arrival+le.RetryAfter > fleetRun-slack
	}
	return q.done > fleetRun-slack
}

// warmPool opens n connections in rdb's pool, so that the run does not start
// with a storm of dials that lets some goroutines reach Redis long before
// others.
func warmPool(b *testing.B, rdb *redis.Client, n int) {
	ctx := context.Background()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			// Hold a connection for 50 ms, so that each goroutine needs
			// its own. (BLPop itself rounds timeouts up to a second.)
			if err := rdb.Do(ctx, "BLPOP", "warm-pool", "0.05").Err(); err != nil && err != redis.Nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
}

// fleetModel is what the figures of a fleet are compared with.
type fleetModel struct {
	// ideal returns the waits of an ideal first-come-first-served limiter
	// of the same quota for arrivals sorted in ascending order.
	ideal func(arrivals []time.Duration) []time.Duration
	// capacity is the most calls the quota lets through in one run.
	capacity int
}

// report computes and reports the figures of the fleet runs.
//
// Which calls count: every goroutine's last call fails because the run
// ends (its slot lies past the deadline, or the deadline comes while it
// waits). Failed calls are left out of the script-call and wait figures:
// script-calls/admitted charges each admitted call the script calls it
// made itself, and the ideal limiter is fed the arrivals of the admitted
// calls only, so that it serves exactly the calls that were served. The
// failed calls are described apart: how many; how many of them failed
// although a call that arrived more than overtakeSlack after them was
// admitted (failed-then-overtaken); and how long the longest of them was
// held before it failed (failed-wait-max-ms), which shows a starved poller.
func report(b *testing.B, runs []fleetResult, m fleetModel) {
	var f fleetFigures
	for _, run := range runs {
		f.add(b, run, m)
	}
	if f.admitted == 0 {
		b.Fatal("no call was admitted")
	}
	f.report(b, float64(len(runs)), m.capacity)
}

// fleetFigures adds up the figures of fleet runs.
type fleetFigures struct {
	actual, best           []time.Duration
	admitted, failed       int
	overtaken, failedAhead int
	admittedCalls          int64
	admittedNoscript       int64
	allCalls, noscript     int64
	commands, usec         int64
	failedWait             time.Duration
}

// add adds one run: its calls, admitted and failed, its waits beside the
// ideal limiter's for the same arrivals, and the calls overtaken.
func (f *fleetFigures) add(b *testing.B, run fleetResult, m fleetModel) {
	f.allCalls += run.calls
	f.noscript += run.noscript
	f.commands += run.commands
	f.usec += run.usec
	reqs := slices.Clone(run.reqs)
	slices.SortStableFunc(reqs, func(x, y request) int { return int(x.arrival - y.arrival) })

	var ok []request
	for _, q := range reqs {
		if q.err != nil {
			f.failed++
			f.failedWait = max(f.failedWait, q.done-q.arrival)
			continue
		}
		ok = append(ok, q)
		f.admitted++
		f.admittedCalls += q.calls
		f.admittedNoscript += q.noscript
	}
	arrivals := make([]time.Duration, len(ok))
	for i, q := range ok {
		arrivals[i] = q.arrival
		f.actual = append(f.actual, q.waited)
	}
	ideal := m.ideal(arrivals)
	f.best = append(f.best, ideal...)
	dumpRun(b, ok, ideal)
	f.addOvertaken(reqs, ok)
}

// addOvertaken counts the calls of a run overtaken by later ones, of reqs
// sorted by arrival and ok those of them admitted.
func (f *fleetFigures) addOvertaken(reqs, ok []request) {
	// An admitted call is overtaken when a call that arrived after it
	// was let through more than overtakeSlack before it.
	firstLater := time.Duration(math.MaxInt64) // earliest done among later arrivals
	for i := len(ok) - 1; i >= 0; i-- {
		if ok[i].done > firstLater+overtakeSlack {
			f.overtaken++
		}
		firstLater = min(firstLater, ok[i].done)
	}
	// A failed call is overtaken when a call that arrived more than
	// overtakeSlack after it was admitted.
	if len(ok) > 0 {
		lastArrival := ok[len(ok)-1].arrival
		for _, q := range reqs {
			if q.err != nil && q.arrival+overtakeSlack < lastArrival {
				f.failedAhead++
			}
		}
	}
}

// report reports the figures of n runs of a quota that lets capacity calls
// through in one run.
func (f *fleetFigures) report(b *testing.B, n float64, capacity int) {
	admitted := f.admitted
	actual, best := sortedCopy(f.actual), sortedCopy(f.best)
	// throttle decides concurrent calls of a process in one script call, so
	// script calls cannot be charged to single calls: the fleet's total,
	// refusals at the end of the run included, is divided by its admitted
	// calls. The per-call figures hold for redis_rate, one script per ask.
	b.ReportMetric(float64(f.allCalls)/float64(admitted), "script-calls/admitted")
	b.ReportMetric(float64(f.commands)/float64(admitted), "redis-commands/admitted")
	b.ReportMetric(float64(f.usec)/float64(admitted), "redis-µs/admitted")
	if f.admittedCalls > 0 {
		b.ReportMetric(float64(f.admittedCalls)/float64(admitted), "charged-script-calls/admitted")
		b.ReportMetric(float64(f.admittedCalls-f.admittedNoscript)/float64(admitted), "charged-excl-noscript/admitted")
	}
	b.ReportMetric(float64(f.noscript)/n, "noscript-fallbacks")
	b.ReportMetric(float64(admitted)/n, "admitted")
	b.ReportMetric(float64(admitted)/(n*float64(capacity)), "utilization")
	b.ReportMetric(float64(f.overtaken)/n, "overtaken")
	b.ReportMetric(float64(f.failed)/n, "failed-at-end")
	b.ReportMetric(float64(f.failedAhead)/n, "failed-then-overtaken")
	b.ReportMetric(ms(f.failedWait), "failed-wait-max-ms")

	p99, ip99 := percentile(actual, 0.99), percentile(best, 0.99)
	mx, imx := actual[len(actual)-1], best[len(best)-1]
	b.ReportMetric(ms(p99), "wait-p99-ms")
	b.ReportMetric(ms(mx), "wait-max-ms")
	b.ReportMetric(ms(ip99), "ideal-wait-p99-ms")
	b.ReportMetric(ms(imx), "ideal-wait-max-ms")
	b.ReportMetric(ratio(p99, ip99), "p99/ideal-p99")
	b.ReportMetric(ratio(mx, imx), "max/ideal-max")
}

func ratio(x, y time.Duration) float64 {
	if y <= 0 {
		return 0
	}
	return float64(x) / float64(y)
}

// BenchmarkFleetSaturated runs a saturated fleet (3 replicas x 20
// goroutines, 100 calls per second) for 3 s, with throttle in Block mode and
// with redis_rate's poll-and-sleep loop, and reports how many Redis script
// calls each admitted call cost and how its waits compare with an ideal
// first-come-first-served limiter of the same algorithm facing the same
// arrivals.
//
// One iteration is one whole 3 s fleet run; b.N is not used. With
// -benchtime 2s (or 1x) the fleet runs exactly once; a -benchtime above
// 3.3 s runs it again and pools the calls of all runs.
func BenchmarkFleetSaturated(b *testing.B) {
	b.Run("throttle", func(b *testing.B) {
		s := newServer(b)
		window := fleetPolicy.EffectiveWindow()
		var runs []fleetResult
		for b.Loop() {
			name := fmt.Sprintf("fleet-%d", len(runs))
			runs = append(runs, runFleet(b, s, func(rdb *redis.Client) acquireFunc {
				lim, err := throttle.New(rdb, name, fleetPolicy)
				if err != nil {
					b.Fatal(err)
				}
				return func(ctx context.Context) (time.Duration, error) {
					asked := time.Now()
					p, err := lim.Acquire(ctx)
					if err != nil {
						return 0, err
					}
					p.Release()
					return time.Since(asked), nil
				}
			}))
		}
		report(b, runs, fleetModel{
			ideal: func(arrivals []time.Duration) []time.Duration {
				return idealWaits(arrivals, fleetLimit, window)
			},
			// Windows start at 0, 1.02 s and 2.04 s.
			capacity: fleetLimit * int(math.Ceil(float64(fleetRun)/float64(window))),
		})
	})

	b.Run("redis_rate", func(b *testing.B) {
		s := newServer(b)
		limit := redis_rate.PerSecond(fleetLimit)
		var runs []fleetResult
		for b.Loop() {
			key := fmt.Sprintf("fleet-%d", len(runs))
			runs = append(runs, runFleet(b, s, func(rdb *redis.Client) acquireFunc {
				rl := redis_rate.NewLimiter(rdb)
				return func(ctx context.Context) (time.Duration, error) {
					return pollRedisRate(ctx, rl, key, limit)
				}
			}))
		}
		report(b, runs, fleetModel{
			ideal: func(arrivals []time.Duration) []time.Duration {
				return idealGCRAWaits(arrivals, limit)
			},
			// A full bucket, then one call per emission interval.
			capacity: limit.Burst + int(fleetRun/(limit.Period/time.Duration(limit.Rate))),
		})
	})
}

// pollRedisRate is redis_rate's usual blocking pattern: ask, and when
// refused sleep RetryAfter and ask again, until the context ends.
func pollRedisRate(ctx context.Context, rl *redis_rate.Limiter, key string, limit redis_rate.Limit) (time.Duration, error) {
	start := time.Now()
	for {
		res, err := rl.AllowN(ctx, key, limit, 1)
		if err != nil {
			return 0, err
		}
		if res.Allowed > 0 {
			return time.Since(start), nil
		}
		t := time.NewTimer(max(res.RetryAfter, time.Microsecond))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, ctx.Err()
		}
	}
}

// idealGCRAWaits is idealWaits for redis_rate's algorithm (GCRA: a bucket of
// limit.Burst tokens refilled at limit.Rate per limit.Period): call i starts
// at the earliest time, not before call i-1, at which the bucket holds a
// token.
func idealGCRAWaits(arrivals []time.Duration, limit redis_rate.Limit) []time.Duration {
	interval := limit.Period / time.Duration(limit.Rate)
	burst := interval * time.Duration(limit.Burst)
	waits := make([]time.Duration, len(arrivals))
	var tat, prev time.Duration // theoretical arrival time; previous start
	for i, a := range arrivals {
		s := max(a, prev)
		if tat > s {
			// Admitted at s when max(tat, s) + interval - s <= burst.
			s = max(s, tat+interval-burst)
		}
		tat = max(tat, s) + interval
		prev = s
		waits[i] = s - a
	}
	return waits
}

// dumpRun writes one CSV line per admitted call of a run to the directory
// named by $FLEET_CSV, when it is set: a way to look at a run beyond its
// figures.
func dumpRun(b *testing.B, ok []request, ideal []time.Duration) {
	dir := os.Getenv("FLEET_CSV")
	if dir == "" {
		return
	}
	var sb strings.Builder
	sb.WriteString("replica,arrival_ms,done_ms,waited_ms,ideal_wait_ms,script_calls\n")
	for i, q := range ok {
		fmt.Fprintf(&sb, "%d,%.3f,%.3f,%.3f,%.3f,%d\n", q.replica, ms(q.arrival), ms(q.done), ms(q.waited), ms(ideal[i]), q.calls)
	}
	name := filepath.Join(dir, strings.ReplaceAll(b.Name(), "/", "_")+".csv")
	if err := os.WriteFile(name, []byte(sb.String()), 0o644); err != nil {
		b.Log(err)
	}
}
