package main

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
)

// The quota -demo shows, unless -quota and -policy say otherwise: 20 calls a
// second in all, 4 in flight, and 8 a second for each tenant.
const (
	demoQuota  = "demo"
	demoPolicy = "log:20/1s+concurrency:4+key:log:8/1s"
	// demoWorkers ask for more than the quota allows, so that calls wait
	// and book slots.
	demoWorkers = 8
	// demoPauseEvery is how often the demo pauses the quota, as a Transport
	// does when the vendor answers 429, so that the display shows a pause.
	demoPauseEvery = 10 * time.Second
	demoPause      = 2 * time.Second
)

// demoKeys are the tenants of the demo traffic; the first gets half of it
// and is the one shown.
var demoKeys = []string{"tenant-1", "tenant-2", "tenant-3"}

// startDemo starts an embedded Redis and a limiter on it, in this process
// but with a client of its own as another replica would have, and runs
// traffic through it until ctx ends or stop is called.
func startDemo(ctx context.Context, cfg config) (addr string, stop func(), err error) {
	mr, err := miniredis.Run()
	if err != nil {
		return "", nil, err
	}
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	quiet := slog.New(slog.DiscardHandler) // the display is the output
	lim, err := throttle.New(rdb, cfg.Quota, cfg.Policy, throttle.Options{
		Prefix: cfg.Prefix, MaxWait: 2 * time.Second, Logger: quiet,
	})
	if err != nil {
		rdb.Close()
		mr.Close()
		return "", nil, err
	}
	// A first call before the display starts: it stores the quota's
	// description, which the display reads the quota by.
	if _, err := lim.Allow(ctx, throttle.Key(demoKeys[0])); err != nil {
		rdb.Close()
		mr.Close()
		return "", nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for w := range demoWorkers {
		wg.Go(func() { demoWorker(ctx, lim, uint64(w)) })
	}
	wg.Go(func() {
		tick := time.NewTicker(demoPauseEvery)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				_ = lim.Pause(ctx, demoPause)
			}
		}
	})
	return mr.Addr(), func() {
		cancel()
		wg.Wait()
		rdb.Close()
		mr.Close()
	}, nil
}

// demoWorker makes calls one after another, each for a tenant and holding
// its slot for a while, as a call to a vendor would.
func demoWorker(ctx context.Context, lim *throttle.Limiter, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(time.Now().UnixNano())))
	for ctx.Err() == nil {
		key := demoKeys[0]
		if rng.IntN(2) == 1 {
			key = demoKeys[1+rng.IntN(len(demoKeys)-1)]
		}
		work := time.Duration(50+rng.IntN(150)) * time.Millisecond
		_, err := throttle.Do(ctx, lim, func(ctx context.Context) (struct{}, error) {
			sleep(ctx, work)
			return struct{}{}, nil
		}, throttle.Key(key))
		if err != nil {
			// Refused or paused: back off a little, as a client would.
			sleep(ctx, 100*time.Millisecond)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
