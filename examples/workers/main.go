// Command workers runs background job workers that share one SMS
// provider's quota: three worker processes (here, three limiters on three
// Redis clients) send messages for several tenants in Queue mode, one-time
// passwords before newsletters, each tenant within its own share, the
// provider within its cap. On a signal, or when the jobs run out, the
// workers stop taking jobs and drain their queues: every job is sent or
// reported, none is dropped.
//
//	go run ./examples/workers
//	go run ./examples/workers -jobs 600 -limit 50 -tenant-limit 20
//	go run ./examples/workers -redis redis://127.0.0.1:6379
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/examples/fakeapi"
	"github.com/throttlekit/throttle/policies"
)

type config struct {
	Redis       string
	Jobs        int
	Workers     int
	Tenants     int
	Limit       int
	TenantLimit int
	Window      time.Duration
}

func main() {
	var cfg config
	flag.StringVar(&cfg.Redis, "redis", "", "Redis URL (default: an embedded Redis)")
	flag.IntVar(&cfg.Jobs, "jobs", 300, "messages to send")
	flag.IntVar(&cfg.Workers, "workers", 3, "worker processes sharing the quota")
	flag.IntVar(&cfg.Tenants, "tenants", 4, "tenants sending messages")
	flag.IntVar(&cfg.Limit, "limit", 50, "the provider's cap per window")
	flag.IntVar(&cfg.TenantLimit, "tenant-limit", 20, "each tenant's share per window")
	flag.DurationVar(&cfg.Window, "window", time.Second, "the provider's window")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if _, err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "workers:", err)
		os.Exit(1)
	}
}

// report is what a run did.
type report struct {
	Submitted, Sent, Failed int
	OverCap                 int
	PerTenant               map[string]int
}

// run sends cfg.Jobs messages through cfg.Workers limiters sharing one quota,
// stops when the jobs are done or ctx ends, and drains every queue.
func run(ctx context.Context, cfg config, out io.Writer) (report, error) {
	addr := cfg.Redis
	if addr == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return report{}, err
		}
		defer mr.Close()
		addr = "redis://" + mr.Addr()
	}
	opt, err := redis.ParseURL(addr)
	if err != nil {
		return report{}, fmt.Errorf("-redis %q: %w", cfg.Redis, err)
	}
	provider := fakeapi.New(fakeapi.Config{Limit: cfg.Limit, Window: cfg.Window})
	workers, closeClients, err := newWorkers(opt, cfg)
	defer closeClients()
	if err != nil {
		return report{}, err
	}
	start := time.Now()
	fmt.Fprintf(out, "sending %d messages for %d tenants through %d workers; provider cap %d per %v, %d per tenant\n",
		cfg.Jobs, cfg.Tenants, cfg.Workers, cfg.Limit, cfg.Window, cfg.TenantLimit)
	rep := report{PerTenant: map[string]int{}}
	jobs := submit(ctx, cfg, workers, provider, &rep)

	// Wait for every job. A queued call fails only when the quota cannot
	// take it (ErrLimited: its every slot came too late on a machine this
	// slow, say): the job goes again after the wait the error gives, as a
	// job runner would, a few times at most.
	for _, j := range jobs {
		_, err := j.sent.Wait()
		var limited *throttle.LimitedError
		for again := 0; again < 3 && errors.As(err, &limited); again++ {
			time.Sleep(limited.RetryAfter)
			_, err = j.send().Wait()
		}
		if err != nil {
			rep.Failed++
			fmt.Fprintln(out, "not sent:", err)
		} else {
			rep.Sent++
		}
	}

	// Stop taking jobs; every queue has drained.
	drain, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, lim := range workers {
		if err := lim.Close(drain); err != nil {
			fmt.Fprintln(out, "drain:", err)
		}
	}
	rep.OverCap = provider.Stats().OverCap
	printReport(out, rep, time.Since(start))
	return rep, nil
}

// newWorkers returns the limiters of cfg.Workers processes sharing the
// provider's quota, each on a Redis client of its own, and a function that
// closes the clients.
func newWorkers(opt *redis.Options, cfg config) ([]*throttle.Limiter, func(), error) {
	policy := policies.All(
		policies.SlidingLog{Limit: cfg.Limit, Window: cfg.Window},
		policies.PerKey{Policy: policies.SlidingLog{Limit: cfg.TenantLimit, Window: cfg.Window}},
	)
	var workers []*throttle.Limiter
	var clients []*redis.Client
	closeAll := func() {
		for _, c := range clients {
			_ = c.Close()
		}
	}
	for range cfg.Workers {
		rdb := redis.NewClient(opt)
		clients = append(clients, rdb)
		lim, err := throttle.New(rdb, "sms-provider", policy, throttle.Options{Mode: throttle.Queue, MaxQueue: cfg.Jobs})
		if err != nil {
			return nil, closeAll, err
		}
		workers = append(workers, lim)
	}
	return workers, closeAll, nil
}

// job is one message handed to a worker: its future, and how to hand it
// over again.
type job struct {
	sent *throttle.Future[string]
	send func() *throttle.Future[string]
}

// submit hands cfg.Jobs messages to the workers in turn until ctx ends, and
// returns them.
func submit(ctx context.Context, cfg config, workers []*throttle.Limiter, provider *fakeapi.Vendor, rep *report) []job {
	var mu sync.Mutex
	var jobs []job
	// A signal stops the submitting, not the jobs already queued: they run
	// with a context the signal does not cancel, and run sees each done.
	queued := context.WithoutCancel(ctx)
	for i := range cfg.Jobs {
		if ctx.Err() != nil {
			break
		}
		tenant := fmt.Sprintf("tenant-%d", i%cfg.Tenants)
		// One-time passwords cannot wait behind a newsletter.
		priority := 0
		if i%5 == 0 {
			priority = 10
		}
		send := func(context.Context) (string, error) {
			if !provider.Arrive() {
				return "", errors.New("provider answered 429")
			}
			mu.Lock()
			rep.PerTenant[tenant]++
			mu.Unlock()
			return tenant, nil
		}
		lim := workers[i%len(workers)]
		again := func() *throttle.Future[string] {
			return throttle.Go(queued, lim, send, throttle.Key(tenant), throttle.Priority(priority))
		}
		jobs = append(jobs, job{sent: again(), send: again})
		rep.Submitted++
	}
	return jobs
}

// printReport writes what each tenant sent, and the run's totals.
func printReport(out io.Writer, rep report, took time.Duration) {
	tenants := make([]string, 0, len(rep.PerTenant))
	for t := range rep.PerTenant {
		tenants = append(tenants, t)
	}
	sort.Strings(tenants)
	fmt.Fprintf(out, "\n%-10s %6s\n", "tenant", "sent")
	for _, t := range tenants {
		fmt.Fprintf(out, "%-10s %6d\n", t, rep.PerTenant[t])
	}
	fmt.Fprintf(out, "\nsubmitted %d, sent %d, not sent %d (each with its error), provider 429s %d, in %v\n",
		rep.Submitted, rep.Sent, rep.Failed, rep.OverCap, took.Round(time.Millisecond))
}
