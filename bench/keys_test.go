package bench

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// manyKeys is how many keys (tenants, API tokens) share one quota.
const manyKeys = 10_000

// BenchmarkManyKeys measures a quota with a limit per key and manyKeys
// active keys: 64 goroutines take the keys in turn, each call a different
// key from the last, so every key stays in use. throttle runs
// PerKey{SlidingLog{Limit: 100, Window: 1s}} and redis_rate PerSecond(100)
// with the same keys, against the same redis-server in the same run; the
// limits bind for neither (each key sees a call every manyKeys/rate).
//
// Before the clock starts, one pass calls every key once (the connection
// pool opens, every key is in Redis). Besides decisions/s and Redis's time
// per script call, it reports Redis's memory per key (used_memory after
// that pass, less what it was before, over manyKeys) and the process's heap
// in use after that pass and after the last call, each after a garbage
// collection, and the most it was when read every ten seconds during the
// run: a limiter keeps no state per key but a bounded few (the spare pools
// of at most 1,024 keys called lately), so the heap stays flat however many
// calls and keys go by. -benchtime 600s makes it a ten-minute run.
func BenchmarkManyKeys(b *testing.B) {
	s := newServer(b)
	ctx := context.Background()
	keys := make([]string, manyKeys)
	for i := range keys {
		keys[i] = "tenant-" + strconv.Itoa(i)
	}
	b.Run("throttle", func(b *testing.B) {
		rdb := s.Client(b)
		lim, err := throttle.New(rdb, "many-keys", policies.PerKey{Policy: policies.SlidingLog{Limit: 100, Window: time.Second}})
		if err != nil {
			b.Fatal(err)
		}
		runManyKeys(b, rdb, func(key string) error {
			d, err := lim.Allow(ctx, throttle.Key(key))
			if err == nil && !d.OK {
				err = fmt.Errorf("refused: %+v", d)
			}
			return err
		}, keys)
	})
	b.Run("redis_rate", func(b *testing.B) {
		rdb := s.Client(b)
		rl := redis_rate.NewLimiter(rdb)
		limit := redis_rate.PerSecond(100)
		runManyKeys(b, rdb, func(key string) error {
			r, err := rl.Allow(ctx, key, limit)
			if err == nil && r.Allowed != 1 {
				err = fmt.Errorf("refused: %+v", r)
			}
			return err
		}, keys)
	})
}

func runManyKeys(b *testing.B, rdb *redis.Client, decide func(key string) error, keys []string) {
	ctx := context.Background()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	if err := decide(keys[0]); err != nil { // load the script, open a connection
		b.Fatal(err)
	}
	before := usedMemory(b, rdb)
	callKeys(b, decide, keys, int64(len(keys)))
	perKey := float64(usedMemory(b, rdb)-before) / float64(len(keys))
	heapWarm := heapInUse()
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	peak := sampleHeap(heapWarm)
	callKeys(b, decide, keys, int64(b.N))
	elapsed := time.Since(start)
	heapMax := peak()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
	b.ReportMetric(commandStats(b, ctx, rdb)["evalsha"], "script-in-redis-µs")
	b.ReportMetric(perKey, "redis-bytes/key")
	b.ReportMetric(float64(heapWarm)/1e6, "heap-warm-MB")
	b.ReportMetric(float64(heapMax)/1e6, "heap-max-MB")
	b.ReportMetric(float64(heapInUse())/1e6, "heap-end-MB")
}

// heapSampleEvery is how often sampleHeap reads the heap during a run.
const heapSampleEvery = 10 * time.Second

// sampleHeap reads the heap in use after a collection every
// heapSampleEvery until the returned function is called, which returns the
// most it read (at least floor): a heap that grows during a long run and is
// freed at its end still shows.
func sampleHeap(floor uint64) func() uint64 {
	done, most := make(chan struct{}), make(chan uint64)
	go func() {
		m := floor
		t := time.NewTicker(heapSampleEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				m = max(m, heapInUse())
			case <-done:
				most <- m
				return
			}
		}
	}()
	return func() uint64 {
		close(done)
		return <-most
	}
}

// callKeys makes n calls of decide, the keys in turn, from
// decisionWorkers goroutines.
func callKeys(b *testing.B, decide func(key string) error, keys []string, n int64) {
	callAll(b, n, func(i int64) error { return decide(keys[i%int64(len(keys))]) })
}

// usedMemory returns Redis's used_memory, in bytes.
func usedMemory(b *testing.B, rdb *redis.Client) int64 {
	b.Helper()
	info, err := rdb.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal("no used_memory in INFO memory")
	return 0
}

// heapInUse returns the bytes of the heap in use after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}
