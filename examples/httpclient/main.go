// Command httpclient shows throttle.Transport wrapping the http.Client of a
// few replicas that share one vendor quota.
//
// It starts a strict fake vendor that allows -limit requests per -window and
// answers 429 with Retry-After past it, and an embedded Redis (or uses
// -redis). Each replica has its own Redis client, limiter and http.Client, as
// separate processes would. Part-way through, the vendor lowers its cap to
// -lowered. Its answers state the new limit in X-RateLimit-Limit: the first
// that says none of it is left teaches every replica the lowered cap, a 429
// (one per call in flight at most) pauses the whole fleet until the vendor's
// Retry-After, and the fleet runs on at what the vendor accepts. The program
// prints the vendor's arrivals over time and a summary.
//
//	go run ./examples/httpclient
//	go run ./examples/httpclient -replicas 4 -workers 5 -limit 40 -lowered 15
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/examples/fakeapi"
	"github.com/throttlekit/throttle/policies"
)

type config struct {
	Replicas int
	Workers  int
	Limit    int
	Lowered  int
	Window   time.Duration
	LowerAt  time.Duration
	Duration time.Duration
	Step     time.Duration
	Redis    string
}

func main() {
	var cfg config
	flag.IntVar(&cfg.Replicas, "replicas", 3, "replicas sharing the quota")
	flag.IntVar(&cfg.Workers, "workers", 3, "concurrent requests per replica")
	flag.IntVar(&cfg.Limit, "limit", 20, "the vendor's cap, and the quota the fleet is configured with")
	flag.IntVar(&cfg.Lowered, "lowered", 10, "the cap the vendor lowers to part-way through; 0 keeps it")
	flag.DurationVar(&cfg.Window, "window", time.Second, "the vendor's sliding window")
	flag.DurationVar(&cfg.LowerAt, "lower-at", 2*time.Second, "when the vendor lowers its cap")
	flag.DurationVar(&cfg.Duration, "duration", 5*time.Second, "how long the fleet runs")
	flag.DurationVar(&cfg.Step, "step", 250*time.Millisecond, "the time step of the printed timeline")
	flag.StringVar(&cfg.Redis, "redis", "", "host:port of a Redis to use instead of an embedded one")
	flag.Parse()
	if _, err := run(context.Background(), cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "httpclient:", err)
		os.Exit(1)
	}
}

// result sums up a run.
type result struct {
	BeforeOverCap int // arrivals over the cap before the vendor lowered it
	Refused       int // 429s the vendor answered
	Pauses        int // runs of 429s, each of which paused the fleet
	InPause       int // arrivals during a pause, after the 429 that started it
	OK            int // requests the clients saw succeed
	Gave429       int // requests the clients saw end in 429: retries spent, or the run ending first
	Errors        int // requests that ended in an error: cut short by the end of the run
}

// run runs the fleet against the vendor for cfg.Duration, prints the
// vendor's arrivals over time and the summary to out, and returns it.
func run(ctx context.Context, cfg config, out io.Writer) (result, error) {
	if err := cfg.validate(); err != nil {
		return result{}, err
	}
	addr, where, stopRedis, err := startRedis(cfg.Redis)
	if err != nil {
		return result{}, err
	}
	defer stopRedis()

	vendor := fakeapi.New(fakeapi.Config{Limit: cfg.Limit, Window: cfg.Window, RetryAfter: true})
	var rec recorder
	srv := httptest.NewServer(rec.wrap(vendor))
	defer srv.Close()
	printSetup(out, cfg, where)

	var t tally
	start, err := runFleet(ctx, cfg, addr, srv.URL, vendor, &t)
	if err != nil {
		return result{}, err
	}
	res := rec.report(out, start, cfg)
	res.OK, res.Gave429, res.Errors = int(t.ok.Load()), int(t.gave429.Load()), int(t.failed.Load())
	fmt.Fprintf(out, "\nvendor: %d over its cap before it lowered it; then %d answered 429 in %d pauses, %d arrivals during a pause\n",
		res.BeforeOverCap, res.Refused, res.Pauses, res.InPause)
	fmt.Fprintf(out, "clients: %d ok, %d got the vendor's 429 back (retries spent, or the run ending first), %d cut short by the end of the run\n",
		res.OK, res.Gave429, res.Errors)
	return res, nil
}

func (cfg config) validate() error {
	if cfg.Replicas < 1 || cfg.Workers < 1 || cfg.Limit < 1 || cfg.Lowered < 0 || cfg.Window <= 0 || cfg.Duration <= 0 || cfg.Step <= 0 {
		return errors.New("every flag must be positive (-lowered may be 0)")
	}
	return nil
}

// startRedis returns the address of the Redis at addr, or of an embedded
// one when addr is empty, with words for the header and a stop.
func startRedis(addr string) (at, where string, stop func(), err error) {
	if addr != "" {
		return addr, "Redis at " + addr, func() {}, nil
	}
	mr, err := miniredis.Run()
	if err != nil {
		return "", "", nil, err
	}
	return mr.Addr(), "an embedded miniredis", mr.Close, nil
}

func printSetup(out io.Writer, cfg config, where string) {
	fmt.Fprintf(out, "vendor: %d requests per %v, answering 429 with Retry-After past it", cfg.Limit, cfg.Window)
	if cfg.Lowered > 0 {
		fmt.Fprintf(out, "; lowers its cap to %d at %v", cfg.Lowered, cfg.LowerAt)
	}
	fmt.Fprintf(out, "\nfleet: %d replicas × %d workers, one quota of %d per %v on %s\n\n",
		cfg.Replicas, cfg.Workers, cfg.Limit, cfg.Window, where)
}

// tally counts how the clients' requests ended.
type tally struct {
	ok, gave429, failed atomic.Int64
}

// runFleet runs every replica's workers against url until cfg.Duration has
// passed, lowering the vendor's cap on the way, and returns their start.
func runFleet(ctx context.Context, cfg config, addr, url string, vendor *fakeapi.Vendor, t *tally) (time.Time, error) {
	// A fresh quota name per run, so that a shared Redis holds nothing from
	// an earlier run.
	quota := "httpclient-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	var wg sync.WaitGroup
	for i := range cfg.Replicas {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		defer rdb.Close()
		lim, err := throttle.New(rdb, quota, policies.SlidingLog{Limit: cfg.Limit, Window: cfg.Window})
		if err != nil {
			return time.Time{}, err
		}
		client := replicaClient("r"+strconv.Itoa(i+1), lim)
		defer client.CloseIdleConnections()
		for range cfg.Workers {
			wg.Go(func() { t.work(runCtx, client, url) })
		}
	}
	start := time.Now()
	if cfg.Lowered > 0 {
		go lowerCap(runCtx, vendor, cfg.Lowered, cfg.LowerAt)
	}
	wg.Wait()
	return start, nil
}

// work is one worker: it sends a request after another until ctx ends.
func (t *tally) work(ctx context.Context, client *http.Client, url string) {
	for ctx.Err() == nil {
		switch status, err := get(ctx, client, url); {
		case err != nil:
			t.failed.Add(1)
			return // the run ended while the request waited for its slot
		case status == http.StatusTooManyRequests:
			t.gave429.Add(1)
		default:
			t.ok.Add(1)
		}
	}
}

// lowerCap lowers the vendor's cap to limit after d, unless ctx ends first.
func lowerCap(ctx context.Context, vendor *fakeapi.Vendor, limit int, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		vendor.SetLimit(limit)
	case <-ctx.Done():
	}
}

// replicaClient is one replica's http.Client. Its base RoundTripper tags
// each request with the replica's name, for the timeline only.
func replicaClient(name string, lim *throttle.Limiter) *http.Client {
	base := &http.Transport{MaxIdleConnsPerHost: 16}
	tagged := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		r.Header.Set("X-Replica", name)
		return base.RoundTrip(r)
	})
	return &http.Client{Transport: &throttle.Transport{Base: tagged, Limiter: lim}}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func get(ctx context.Context, c *http.Client, url string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

// recorder keeps every arrival at the vendor.
type recorder struct {
	mu       sync.Mutex
	arrivals []arrival
}

type arrival struct {
	at         time.Time
	replica    string
	status     int
	retryAfter time.Duration
	limit      int
}

func (rc *recorder) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := arrival{at: time.Now(), replica: r.Header.Get("X-Replica")}
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		h.ServeHTTP(sw, r)
		a.status = sw.status
		secs, _ := strconv.Atoi(w.Header().Get("Retry-After"))
		a.retryAfter = time.Duration(secs) * time.Second
		a.limit, _ = strconv.Atoi(w.Header().Get(fakeapi.HeaderLimit))
		rc.mu.Lock()
		rc.arrivals = append(rc.arrivals, a)
		rc.mu.Unlock()
	})
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// report prints the arrivals per step and sums them up. A pause starts at a
// 429 after the end of the previous pause, and lasts its Retry-After.
func (rc *recorder) report(out io.Writer, start time.Time, cfg config) result {
	rc.mu.Lock()
	log := slices.Clone(rc.arrivals)
	rc.mu.Unlock()
	slices.SortFunc(log, func(x, y arrival) int { return x.at.Compare(y.at) })

	res, pauses := refusals(log, cfg.Limit)
	res.InPause = inPause(log, pauses)
	fmt.Fprintf(out, "%7s %5s %5s %5s  %s\n", "time", "sent", "ok", "429", "from")
	end := start.Add(cfg.Duration)
	for t := start; t.Before(end); t = t.Add(cfg.Step) {
		printStep(out, log, pauses, start, t, t.Add(cfg.Step))
	}
	return res
}

// span is a stretch of time, from its start up to its end.
type span struct{ from, to time.Time }

// refusals counts the 429s of log, those before the vendor lowered its cap
// from limit apart, and returns the pauses they started.
func refusals(log []arrival, limit int) (result, []span) {
	var res result
	var pauses []span
	for _, a := range log {
		if a.status != http.StatusTooManyRequests {
			continue
		}
		if a.limit == limit {
			res.BeforeOverCap++
		}
		res.Refused++
		if len(pauses) == 0 || a.at.After(pauses[len(pauses)-1].to) {
			pauses = append(pauses, span{a.at, a.at.Add(a.retryAfter)})
		}
	}
	res.Pauses = len(pauses)
	return res, pauses
}

// inPause counts the arrivals during a pause, after the 429 that started it.
func inPause(log []arrival, pauses []span) int {
	// Requests already on their way when the 429 came back are not counted.
	const inFlight = 100 * time.Millisecond
	n := 0
	for _, a := range log {
		for _, p := range pauses {
			if a.at.After(p.from.Add(inFlight)) && a.at.Before(p.to) {
				n++
			}
		}
	}
	return n
}

// printStep prints one line of the timeline: the arrivals from t up to
// next, and the replicas that sent them or the pause that stopped them.
func printStep(out io.Writer, log []arrival, pauses []span, start, t, next time.Time) {
	var sent, okN, refused int
	from := map[string]bool{}
	for _, a := range log {
		if a.at.Before(t) || !a.at.Before(next) {
			continue
		}
		sent++
		from[a.replica] = true
		if a.status == http.StatusTooManyRequests {
			refused++
		} else {
			okN++
		}
	}
	note := strings.Join(slices.Sorted(maps.Keys(from)), " ")
	for _, p := range pauses {
		if sent == 0 && !t.Before(p.from) && t.Before(p.to) {
			note = "(fleet paused until the vendor's Retry-After)"
		}
	}
	fmt.Fprintf(out, "%6.2fs %5d %5d %5d  %s\n", t.Sub(start).Seconds(), sent, okN, refused, note)
}
