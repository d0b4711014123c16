package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
)

// decisionWorkers is how many goroutines ask for decisions at once.
const decisionWorkers = 64

// neverBinds is a rate no benchmark comes near, so that every call is
// admitted and only the cost of deciding is measured.
const neverBinds = 1_000_000_000

// BenchmarkDecisions measures how many decisions per second one Redis gives
// 64 concurrent goroutines, for throttle's Allow and for redis_rate's Allow,
// against the same redis-server in the same run. Each limiter has its own
// go-redis client with the default pool (10 connections per GOMAXPROCS).
// The limit never binds, so every call is admitted. script-in-redis-µs is
// Redis's own mean time per EVALSHA (INFO commandstats): one Redis runs one
// script at a time, so it bounds the rate at 1e6/script-in-redis-µs.
func BenchmarkDecisions(b *testing.B) {
	s := newServer(b)
	ctx := context.Background()
	throttleRDB, rateRDB := s.Client(b), s.Client(b)
	lim, err := throttle.New(throttleRDB, "decisions",
		logNeverBinds)
	if err != nil {
		b.Fatal(err)
	}
	rl := redis_rate.NewLimiter(rateRDB)
	limit := redis_rate.PerSecond(neverBinds)

	b.Run("throttle", func(b *testing.B) {
		runDecisions(b, s.Pid(), throttleRDB, func() error {
			d, err := lim.Allow(ctx)
			if err == nil && !d.OK {
				err = fmt.Errorf("refused: %+v", d)
			}
			return err
		})
	})

	b.Run("redis_rate", func(b *testing.B) {
		runDecisions(b, s.Pid(), rateRDB, func() error {
			r, err := rl.Allow(ctx, "decisions", limit)
			if err == nil && r.Allowed != 1 {
				err = fmt.Errorf("refused: %+v", r)
			}
			return err
		})
	})
}

// runDecisions splits b.N calls of decide among decisionWorkers goroutines
// and reports the rate, the time Redis itself spent in each script call,
// and the CPU time of the redis-server process pid per decision.
func runDecisions(b *testing.B, pid int, rdb *redis.Client, decide func() error) {
	ctx := context.Background()
	// Load the script and open a connection before the clock starts.
	if err := decide(); err != nil {
		b.Fatal(err)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	cpu, cpuOK := cpuTime(pid)
	b.ResetTimer()
	start := time.Now()
	callAll(b, int64(b.N), func(int64) error { return decide() })
	elapsed := time.Since(start)
	b.StopTimer()
	if cpuEnd, ok := cpuTime(pid); ok && cpuOK {
		// The whole process: its network and system calls as well as the
		// scripts, as a host counts Redis's CPU.
		b.ReportMetric(float64((cpuEnd-cpu).Microseconds())/float64(b.N), "redis-cpu-µs/decision")
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
	b.ReportMetric(decisionWorkers, "goroutines")
	b.ReportMetric(commandStats(b, ctx, rdb)["evalsha"], "script-in-redis-µs")
	// Redis's time in every command of the run (scripts, and what else the
	// limiter asks), per decision: the Redis CPU a decision costs.
	var usec float64
	for name, u := range commandField(b, ctx, rdb, "usec") {
		if name != "info" && name != "config|resetstat" {
			usec += u
		}
	}
	b.ReportMetric(usec/float64(b.N), "redis-µs/decision")
}

// callAll makes n calls of call, numbered 1 to n, from decisionWorkers
// goroutines, and fails the benchmark if any fails.
func callAll(b *testing.B, n int64, call func(i int64) error) {
	var (
		next     atomic.Int64
		failures atomic.Int64
		errOnce  sync.Once
		firstErr error
		wg       sync.WaitGroup
	)
	for range decisionWorkers {
		wg.Go(func() {
			for i := next.Add(1); i <= n; i = next.Add(1) {
				if err := call(i); err != nil {
					failures.Add(1)
					errOnce.Do(func() { firstErr = err })
				}
			}
		})
	}
	wg.Wait()
	if f := failures.Load(); f > 0 {
		b.Fatalf("%d of %d calls failed; first: %v", f, n, firstErr)
	}
}
