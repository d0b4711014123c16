package bench

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
)

// warmups are untimed calls before a latency benchmark: they load the
// script and open the connection.
const warmups = 200

// BenchmarkAcquireUncontended measures the latency of one Acquire (Block
// mode, a limit that never binds) from one goroutine, call after call, and
// reports the p50 and p99 of the per-call durations.
//
// To compare it with a bare round trip under the same conditions, every
// iteration also sends one PING on the same client, timed apart: the
// latency of a loopback round trip on a shared 2-core VM moves between runs
// by several times (about 9 µs in one mode, 60-75 µs in the other), so a
// PING measured in another benchmark or another phase would not be
// comparable. ns/op is overridden with the mean Acquire alone.
// script-in-redis-µs and ping-in-redis-µs are Redis's own mean time per
// EVALSHA and per PING (INFO commandstats).
func BenchmarkAcquireUncontended(b *testing.B) {
	s := newServer(b)
	rdb := s.Client(b)
	ctx := context.Background()
	acquire := acquirer(b, rdb, "uncontended")
	for range warmups {
		acquire()
		ping(b, ctx, rdb)
	}

	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	var samples, ref []time.Duration
	var total time.Duration
	for b.Loop() {
		t := time.Now()
		ping(b, ctx, rdb)
		u := time.Now()
		acquire()
		d := time.Since(u)
		ref = append(ref, u.Sub(t))
		samples = append(samples, d)
		total += d
	}

	samples, ref = sortedCopy(samples), sortedCopy(ref)
	p50, p99 := percentile(samples, 0.50), percentile(samples, 0.99)
	r50, r99 := percentile(ref, 0.50), percentile(ref, 0.99)
	b.ReportMetric(float64(total)/float64(len(samples)), "ns/op")
	b.ReportMetric(us(p50), "p50-µs")
	b.ReportMetric(us(p99), "p99-µs")
	b.ReportMetric(us(r50), "ping-p50-µs")
	b.ReportMetric(us(r99), "ping-p99-µs")
	b.ReportMetric(ratio(p50, r50), "p50/ping-p50")
	b.ReportMetric(ratio(p99, r99), "p99/ping-p99")
	// The ratio swings with the machine's wake-up latency, which both pay;
	// the difference is what Acquire adds to a round trip.
	b.ReportMetric(us(p50-r50), "p50-minus-ping-p50-µs")
	stats := commandStats(b, ctx, rdb)
	b.ReportMetric(stats["evalsha"], "script-in-redis-µs")
	b.ReportMetric(stats["ping"], "ping-in-redis-µs")
	b.ReportMetric(commandCalls(b, ctx, rdb)["evalsha"]/float64(len(samples)), "scripts/call")
}

// BenchmarkAcquireSpaced is BenchmarkAcquireUncontended with the calls 20 ms
// apart: too far apart for spare admissions (a pool lives a quarter of the
// 30 ms margin), so every call runs its own script, as a process that calls
// a quota now and then does. Run it with a fixed count (-benchtime 500x):
// each iteration sleeps.
func BenchmarkAcquireSpaced(b *testing.B) {
	s := newServer(b)
	rdb := s.Client(b)
	ctx := context.Background()
	acquire := acquirer(b, rdb, "spaced")
	for range 20 {
		acquire()
		ping(b, ctx, rdb)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	var samples, ref []time.Duration
	for b.Loop() {
		time.Sleep(20 * time.Millisecond)
		t := time.Now()
		ping(b, ctx, rdb)
		u := time.Now()
		acquire()
		samples = append(samples, time.Since(u))
		ref = append(ref, u.Sub(t))
	}
	samples, ref = sortedCopy(samples), sortedCopy(ref)
	p50, r50 := percentile(samples, 0.50), percentile(ref, 0.50)
	b.ReportMetric(us(p50), "p50-µs")
	b.ReportMetric(us(percentile(samples, 0.99)), "p99-µs")
	b.ReportMetric(us(r50), "ping-p50-µs")
	b.ReportMetric(ratio(p50, r50), "p50/ping-p50")
	b.ReportMetric(commandStats(b, ctx, rdb)["evalsha"], "script-in-redis-µs")
	b.ReportMetric(commandCalls(b, ctx, rdb)["evalsha"]/float64(len(samples)), "scripts/call")
}

// acquirer returns a function that takes one call through a limiter on
// quota name whose limit never binds, and releases it.
func acquirer(b *testing.B, rdb *redis.Client, name string) func() {
	lim, err := throttle.New(rdb, name, logNeverBinds)
	if err != nil {
		b.Fatal(err)
	}
	return func() {
		p, err := lim.Acquire(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		p.Release()
	}
}

// commandStats returns Redis's own mean execution time in microseconds of
// each command since the last CONFIG RESETSTAT, by lower-case name.
func commandStats(b *testing.B, ctx context.Context, rdb *redis.Client) map[string]float64 {
	return commandField(b, ctx, rdb, "usec_per_call")
}

// commandCalls returns how many times Redis ran each command since the
// last CONFIG RESETSTAT, by lower-case name.
func commandCalls(b *testing.B, ctx context.Context, rdb *redis.Client) map[string]float64 {
	return commandField(b, ctx, rdb, "calls")
}

// commandField returns one field of INFO commandstats for each command.
func commandField(b *testing.B, ctx context.Context, rdb *redis.Client, field string) map[string]float64 {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	m := map[string]float64{}
	for line := range strings.Lines(info) {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		name, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd {
			continue
		}
		for f := range strings.SplitSeq(rest, ",") {
			if v, ok := strings.CutPrefix(f, field+"="); ok {
				m[name], _ = strconv.ParseFloat(v, 64)
			}
		}
	}
	return m
}

// BenchmarkPing measures a plain PING, call after call from one goroutine:
// the floor any Redis round trip pays on this machine.
func BenchmarkPing(b *testing.B) {
	s := newServer(b)
	rdb := s.Client(b)
	ctx := context.Background()
	for range warmups {
		ping(b, ctx, rdb)
	}
	var samples []time.Duration
	for b.Loop() {
		t := time.Now()
		ping(b, ctx, rdb)
		samples = append(samples, time.Since(t))
	}
	samples = sortedCopy(samples)
	b.ReportMetric(us(percentile(samples, 0.50)), "p50-µs")
	b.ReportMetric(us(percentile(samples, 0.99)), "p99-µs")
}

func ping(b *testing.B, ctx context.Context, rdb *redis.Client) {
	if err := rdb.Ping(ctx).Err(); err != nil {
		b.Fatal(err)
	}
}
