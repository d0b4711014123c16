package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// A replica is this program started by the parent with replicaFlag first.
// It writes one JSON message a line on stdout: {"ready":true} once its
// limiters are made and its pools are open, then {"report":...} at the end.
// The parent writes "go <end>" on stdin, the end of the run in Unix
// nanoseconds; a replica whose stdin closes stops, so it never outlives the
// parent.
const (
	replicaFlag = "-replica"
	// spinFlag starts a process that only burns a core, for the busy
	// scenario.
	spinFlag = "-spin"

	// redisTimeout is every limiter's Options.RedisTimeout, the default:
	// how long a decision waits for Redis.
	redisTimeout = time.Second
	// callTimeout bounds one HTTP call to the vendor.
	callTimeout = 10 * time.Second
	// failurePause keeps a worker whose calls fail at once from spinning.
	failurePause = 10 * time.Millisecond
	// headerStarted carries, to the vendor, the Unix time in nanoseconds
	// at which fn started the call, so that the way from the limiter to the
	// vendor can be measured.
	headerStarted = "X-Conditions-Started"
	// usageTimeout bounds the Usage read at the end.
	usageTimeout = 5 * time.Second
)

// replicaConfig is what the parent tells one replica, as flags.
type replicaConfig struct {
	ID       int
	Redis    string // host:port, directly or through the proxy
	Vendor   string // the vendor's URL
	Quota    string
	Limit    int
	Window   time.Duration
	Limiters int           // limiters in this process, each with its own client
	Workers  int           // worker goroutines per limiter
	Pool     int           // PoolSize of each client
	Margin   time.Duration // the SlidingLog's Margin; 0: the default
	// Dial, when set, sends the workers' calls through a throttle.Transport
	// (one per limiter), not Do, whose base http.Transport opens a connection
	// for every call, taking from nothing to Dial at random.
	Dial time.Duration
}

// args returns the command line that parseReplicaArgs reads back.
func (rc replicaConfig) args() []string {
	return []string{
		replicaFlag,
		"-id", strconv.Itoa(rc.ID),
		"-redis", rc.Redis,
		"-vendor", rc.Vendor,
		"-quota", rc.Quota,
		"-limit", strconv.Itoa(rc.Limit),
		"-window", rc.Window.String(),
		"-limiters", strconv.Itoa(rc.Limiters),
		"-workers", strconv.Itoa(rc.Workers),
		"-pool", strconv.Itoa(rc.Pool),
		"-margin", rc.Margin.String(),
		"-dial", rc.Dial.String(),
	}
}

func parseReplicaArgs(args []string) (replicaConfig, error) {
	var rc replicaConfig
	fs := flag.NewFlagSet("conditions replica", flag.ContinueOnError)
	fs.IntVar(&rc.ID, "id", 0, "")
	fs.StringVar(&rc.Redis, "redis", "", "")
	fs.StringVar(&rc.Vendor, "vendor", "", "")
	fs.StringVar(&rc.Quota, "quota", "", "")
	fs.IntVar(&rc.Limit, "limit", 0, "")
	fs.DurationVar(&rc.Window, "window", 0, "")
	fs.IntVar(&rc.Limiters, "limiters", 0, "")
	fs.IntVar(&rc.Workers, "workers", 0, "")
	fs.IntVar(&rc.Pool, "pool", 0, "")
	fs.DurationVar(&rc.Margin, "margin", 0, "")
	fs.DurationVar(&rc.Dial, "dial", 0, "")
	if err := fs.Parse(args); err != nil {
		return rc, err
	}
	switch {
	case rc.Redis == "" || rc.Vendor == "" || rc.Quota == "":
		return rc, errors.New("-redis, -vendor and -quota are required")
	case rc.Limiters < 1 || rc.Workers < 1 || rc.Pool < 1:
		return rc, fmt.Errorf("-limiters, -workers and -pool must be at least 1, got %d, %d, %d", rc.Limiters, rc.Workers, rc.Pool)
	}
	return rc, nil
}

// message is one line a replica writes on stdout.
type message struct {
	Ready  bool    `json:"ready,omitempty"`
	Report *report `json:"report,omitempty"`
}

// report is what one replica measured.
type report struct {
	Admitted int `json:"admitted"`
	// Calls that failed because the run ended, by how.
	EndLimited     int `json:"end_limited"`
	EndContext     int `json:"end_context"`
	EndUnavailable int `json:"end_unavailable"`
	// Calls that failed for another reason: ErrUnavailable (of which
	// TimedOut after waiting at least redisTimeout, that is
	// when Redis answered too late), or anything else.
	Unavailable      int    `json:"unavailable"`
	TimedOut         int    `json:"timed_out"`
	FirstUnavailable string `json:"first_unavailable,omitempty"`
	// Errors counts the other failures, of which Late the calls refused
	// with ErrLimited before the end (every slot came too late to start
	// in).
	Errors     int    `json:"errors"`
	Late       int    `json:"late"`
	FirstError string `json:"first_error,omitempty"`

	ScriptCalls int64   `json:"script_calls"`
	WaitsMicros []int64 `json:"waits_us"`
	// RoundTripsMicros are the script calls' round trips, as the limiters'
	// Observer saw them.
	RoundTripsMicros []int64 `json:"round_trips_us"`

	SpreadMicros int64  `json:"spread_us"`
	MarginMicros int64  `json:"margin_us"`
	UsageError   string `json:"usage_error,omitempty"`
}

func replicaMain(args []string) int {
	rc, err := parseReplicaArgs(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "replica:", err)
		return 2
	}
	rep, err := runReplica(rc, os.Stdin, os.Stdout)
	if err != nil {
		fmt.Fprintf(os.Stderr, "replica %d: %v\n", rc.ID, err)
		return 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(message{Report: &rep}); err != nil {
		fmt.Fprintf(os.Stderr, "replica %d: %v\n", rc.ID, err)
		return 1
	}
	return 0
}

// runReplica makes the limiters, says it is ready, waits for the word to go,
// runs the workers until the end, and returns what they saw.
func runReplica(rc replicaConfig, stdin io.Reader, stdout io.Writer) (report, error) {
	var scripts atomic.Int64
	var t tally
	lims, closeClients, err := newLimiters(rc, &t, &scripts)
	if err != nil {
		return report{}, err
	}
	defer closeClients()
	if err := json.NewEncoder(stdout).Encode(message{Ready: true}); err != nil {
		return report{}, err
	}
	ctx, cancel, err := awaitGo(stdin)
	if err != nil {
		return report{}, err
	}
	defer cancel()
	runWorkers(ctx, rc, lims, &t)

	rep := t.report()
	// Read before Usage, whose own script call is not the fleet's.
	rep.ScriptCalls = scripts.Load()
	noteUsage(&rep, lims[0])
	return rep, nil
}

// newLimiters makes rc.Limiters limiters of the quota, each with a client of
// its own that counts its scripts, and opens their pools. closeClients
// closes the clients; on an error they are closed already.
func newLimiters(rc replicaConfig, t *tally, scripts *atomic.Int64) (lims []*throttle.Limiter, closeClients func(), err error) {
	clients := make([]*redis.Client, rc.Limiters)
	closeClients = func() {
		for _, c := range clients {
			if c != nil {
				_ = c.Close()
			}
		}
	}
	lims = make([]*throttle.Limiter, rc.Limiters)
	for i := range clients {
		clients[i] = redis.NewClient(&redis.Options{Addr: rc.Redis, ContextTimeoutEnabled: true, PoolSize: rc.Pool})
		clients[i].AddHook(scriptHook{scripts})
		lims[i], err = throttle.New(clients[i], rc.Quota, policies.SlidingLog{Limit: rc.Limit, Window: rc.Window, Margin: rc.Margin},
			throttle.Options{Observer: t.observe, RedisTimeout: redisTimeout})
		if err != nil {
			closeClients()
			return nil, nil, err
		}
	}
	if err := openPools(clients, min(rc.Pool, rc.Workers)); err != nil {
		closeClients()
		return nil, nil, err
	}
	return lims, closeClients, nil
}

// awaitGo reads the word to go from stdin and returns a context that ends
// at the end of the run it names, or when stdin closes: the parent is gone.
func awaitGo(stdin io.Reader) (context.Context, context.CancelFunc, error) {
	in := bufio.NewReader(stdin)
	line, err := in.ReadString('\n')
	if err != nil {
		return nil, nil, fmt.Errorf("waiting for the word to go: %w", err)
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(strings.TrimPrefix(line, "go")), 10, 64)
	if err != nil {
		return nil, nil, fmt.Errorf("bad word to go %q", line)
	}
	ctx, cancel := context.WithDeadline(context.Background(), time.Unix(0, ns))
	go func() {
		_, _ = io.Copy(io.Discard, in)
		cancel()
	}()
	return ctx, cancel, nil
}

// runWorkers runs rc.Workers workers on each limiter until ctx ends: through
// Do, or through a throttle.Transport over slow dials when rc.Dial is set.
func runWorkers(ctx context.Context, rc replicaConfig, lims []*throttle.Limiter, t *tally) {
	httpc := &http.Client{Transport: &http.Transport{
		MaxIdleConns:        rc.Limiters * rc.Workers,
		MaxIdleConnsPerHost: rc.Limiters * rc.Workers,
	}}
	defer httpc.CloseIdleConnections()
	var wg sync.WaitGroup
	for _, lim := range lims {
		if rc.Dial > 0 {
			base := slowDials(rc.Dial)
			defer base.CloseIdleConnections()
			c := &http.Client{Transport: &throttle.Transport{Limiter: lim, Base: stamper{base}}}
			for range rc.Workers {
				wg.Go(func() { work(ctx, t, viaTransport(ctx, c, rc.Vendor)) })
			}
			continue
		}
		for range rc.Workers {
			wg.Go(func() { work(ctx, t, viaDo(ctx, lim, httpc, rc.Vendor)) })
		}
	}
	wg.Wait()
}

// noteUsage reads the quota's Usage into rep: the fleet's spread, and the
// widest margin in force of its rules.
func noteUsage(rep *report, lim *throttle.Limiter) {
	ctx, cancel := context.WithTimeout(context.Background(), usageTimeout)
	defer cancel()
	u, err := lim.Usage(ctx)
	if err != nil {
		rep.UsageError = err.Error()
	}
	rep.SpreadMicros = u.Spread.Microseconds()
	for _, r := range u.Rules {
		rep.MarginMicros = max(rep.MarginMicros, r.Margin.Microseconds())
	}
}

// openPools opens n connections on each client, as on a replica that has
// been running a while.
func openPools(clients []*redis.Client, n int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(clients)*n)
	for _, c := range clients {
		for range n {
			wg.Go(func() {
				if err := c.Ping(ctx).Err(); err != nil {
					errs <- err
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return fmt.Errorf("open the connection pools: %w", err)
	}
	return nil
}

// work calls the vendor, one call after another through call, until ctx
// ends or the limiter refuses a call for want of time before the end. call
// makes one call through the limiter and reports how long after asked the
// limiter let it go, whether it did, and the call's error.
func work(ctx context.Context, t *tally, call func(asked time.Time) (waited time.Duration, ran bool, err error)) {
	for ctx.Err() == nil {
		asked := time.Now()
		waited, ran, err := call(asked)
		o := classify(ctx, err, time.Now())
		if ran {
			t.admitted(waited)
			if err != nil {
				o = failed // the vendor call itself failed
			}
		}
		t.note(o, err, time.Since(asked))
		switch o {
		case endLimited, endContext, endUnavailable:
			return
		case unavailable, limitedEarly, failed:
			sleep(ctx, failurePause)
		}
	}
}

// viaDo returns work's call through throttle.Do on lim, whose fn makes one
// GET to url with httpc.
func viaDo(ctx context.Context, lim *throttle.Limiter, httpc *http.Client, url string) func(time.Time) (time.Duration, bool, error) {
	return func(asked time.Time) (waited time.Duration, ran bool, err error) {
		_, err = throttle.Do(ctx, lim, func(ctx context.Context) (int, error) {
			waited, ran = time.Since(asked), true
			// An admitted call completes, even as the run ends.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
			defer cancel()
			return get(cctx, httpc, url, time.Now())
		})
		return waited, ran, err
	}
}

// viaTransport returns work's call as one GET to url with c, whose
// transport is a throttle.Transport over a stamper.
func viaTransport(ctx context.Context, c *http.Client, url string) func(time.Time) (time.Duration, bool, error) {
	return func(asked time.Time) (time.Duration, bool, error) {
		var st stamp
		req, err := http.NewRequestWithContext(context.WithValue(ctx, stampKey{}, &st), http.MethodGet, url, nil)
		if err != nil {
			return 0, false, err
		}
		resp, err := c.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return st.at.Sub(asked), !st.at.IsZero(), err
	}
}

// stamp is when the throttle.Transport handed a worker's request to its
// base: when the limiter let it go.
type stamp struct{ at time.Time }

type stampKey struct{}

// stamper is the base of a worker's throttle.Transport: it notes when the
// limiter let a request go (the stamp in its context, and the vendor's
// started header), and sends it to the vendor on a context the end of the
// run does not cancel, as work's calls: an admitted call completes. The
// trace the throttle.Transport put in the context still runs.
type stamper struct{ base http.RoundTripper }

func (s stamper) RoundTrip(req *http.Request) (*http.Response, error) {
	now := time.Now()
	if st, ok := req.Context().Value(stampKey{}).(*stamp); ok && st.at.IsZero() {
		st.at = now
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.Context()), callTimeout)
	out := req.Clone(ctx)
	out.Header.Set(headerStarted, strconv.FormatInt(now.UnixNano(), 10))
	resp, err := s.base.RoundTrip(out)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = cancelOnClose{resp.Body, cancel}
	return resp, nil
}

// cancelOnClose ends a response's context when its body is closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// slowDials returns an http.Transport that opens a connection for every
// request (no keep-alives), taking from nothing to d at random, as TLS
// handshakes with a distant vendor would.
func slowDials(d time.Duration) *http.Transport {
	var dialer net.Dialer
	return &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		timer := time.NewTimer(rand.N(d))
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return dialer.DialContext(ctx, network, addr)
	}}
}

// outcome is how a call through the limiter ended.
type outcome int

const (
	succeeded outcome = iota
	// The call failed because the run ends: its slot lies past the end, or
	// the end came while it waited (through a Redis round trip, too).
	endLimited
	endContext
	endUnavailable
	// unavailable is ErrUnavailable before the end: Redis failed or
	// answered too late.
	unavailable
	// limitedEarly is ErrLimited before the end: in Block mode, a call
	// whose every slot came too late to start in.
	limitedEarly
	// failed is any other failure.
	failed
)

// classify tells how a call that returned err at now ended, ctx being the
// worker's context, whose deadline is the run's end.
func classify(ctx context.Context, err error, now time.Time) outcome {
	end, _ := ctx.Deadline()
	var le *throttle.LimitedError
	switch {
	case err == nil:
		return succeeded
	case errors.As(err, &le) && !now.Add(le.RetryAfter).Before(end):
		return endLimited
	case ctx.Err() != nil && errors.Is(err, ctx.Err()) && errors.Is(err, throttle.ErrUnavailable):
		return endUnavailable
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return endContext
	case errors.Is(err, throttle.ErrUnavailable):
		return unavailable
	case errors.Is(err, throttle.ErrLimited):
		return limitedEarly
	}
	return failed
}

// tally adds up the calls of a replica's workers.
type tally struct {
	mu  sync.Mutex
	rep report
}

func (t *tally) admitted(wait time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rep.Admitted++
	t.rep.WaitsMicros = append(t.rep.WaitsMicros, wait.Microseconds())
}

// note counts a call that ended as o with err after took.
func (t *tally) note(o outcome, err error, took time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch o {
	case endLimited:
		t.rep.EndLimited++
	case endContext:
		t.rep.EndContext++
	case endUnavailable:
		t.rep.EndUnavailable++
	case unavailable:
		t.rep.Unavailable++
		// Told by the time it took, whatever the error says: the breaker's
		// refusals come at once.
		if took >= redisTimeout {
			t.rep.TimedOut++
		}
		if t.rep.FirstUnavailable == "" {
			t.rep.FirstUnavailable = err.Error()
		}
	case limitedEarly, failed:
		t.rep.Errors++
		if o == limitedEarly {
			t.rep.Late++
		}
		if t.rep.FirstError == "" {
			t.rep.FirstError = err.Error()
		}
	}
}

// observe notes the round trip of each script call.
func (t *tally) observe(e throttle.Event) {
	if e.Kind != throttle.EventRedis {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rep.RoundTripsMicros = append(t.rep.RoundTripsMicros, e.Duration.Microseconds())
}

func (t *tally) report() report {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.rep
}

// get calls the vendor, telling it when the call started.
func get(ctx context.Context, c *http.Client, url string, started time.Time) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set(headerStarted, strconv.FormatInt(started.UnixNano(), 10))
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

func sleep(ctx context.Context, d time.Duration) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-ctx.Done():
	}
}

// spin burns one core until its stdin closes or it is killed.
func spin() {
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	for n := 0; ; n++ {
		spinSink.Store(int64(n))
	}
}

var spinSink atomic.Int64
