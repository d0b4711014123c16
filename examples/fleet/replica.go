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
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// A replica is this program started by the parent with replicaFlag first.
// It talks to the parent through its standard streams: the parent writes
// "go" on stdin to start the calls and closes stdin to stop them, and the
// replica writes one JSON message a line on stdout. A replica whose parent
// dies sees stdin close, so it never outlives the demo.
const (
	replicaFlag = "-replica"
	// replicaEnv is set in every replica's environment, so that a test
	// binary, which cannot take replicaFlag, knows to act as a replica.
	replicaEnv = "THROTTLE_FLEET_REPLICA"
	// Headers that tell the vendor's recorder who made a call.
	headerReplica = "X-Fleet-Replica"
	headerTenant  = "X-Fleet-Tenant"

	progressEvery = 200 * time.Millisecond
	callTimeout   = 10 * time.Second
	// failurePause keeps a worker from spinning when Redis or the vendor
	// cannot be reached.
	failurePause = 100 * time.Millisecond
)

// replicaConfig is what the parent tells one replica, as flags.
type replicaConfig struct {
	ID          int
	Gate        variant
	Vendor      string
	Redis       string
	Cluster     bool
	Quota       string
	Limit       int
	LocalLimit  float64 // calls per window of the local bucket (split, naive)
	Window      time.Duration
	Margin      time.Duration
	Mode        throttle.Mode
	Workers     int
	Tenants     int
	TenantLimit int
	Rate        float64 // calls per second asked of this replica; 0 for as many as admitted
}

// args returns the command line that parseReplicaArgs reads back.
func (rc replicaConfig) args() []string {
	return []string{
		replicaFlag,
		"-id", strconv.Itoa(rc.ID),
		"-gate", rc.Gate.String(),
		"-vendor", rc.Vendor,
		"-redis", rc.Redis,
		"-cluster=" + strconv.FormatBool(rc.Cluster),
		"-quota", rc.Quota,
		"-limit", strconv.Itoa(rc.Limit),
		"-local-limit", strconv.FormatFloat(rc.LocalLimit, 'g', -1, 64),
		"-window", rc.Window.String(),
		"-margin", rc.Margin.String(),
		"-mode", modeFlag(rc.Mode),
		"-workers", strconv.Itoa(rc.Workers),
		"-tenants", strconv.Itoa(rc.Tenants),
		"-tenant-limit", strconv.Itoa(rc.TenantLimit),
		"-rate", strconv.FormatFloat(rc.Rate, 'g', -1, 64),
	}
}

// parseReplicaArgs reads the flags that follow replicaFlag.
func parseReplicaArgs(args []string) (replicaConfig, error) {
	var rc replicaConfig
	fs := flag.NewFlagSet("fleet replica", flag.ContinueOnError)
	fs.IntVar(&rc.ID, "id", 0, "")
	gate := fs.String("gate", "", "")
	fs.StringVar(&rc.Vendor, "vendor", "", "")
	fs.StringVar(&rc.Redis, "redis", "", "")
	fs.BoolVar(&rc.Cluster, "cluster", false, "")
	fs.StringVar(&rc.Quota, "quota", "", "")
	fs.IntVar(&rc.Limit, "limit", 0, "")
	fs.Float64Var(&rc.LocalLimit, "local-limit", 0, "")
	fs.DurationVar(&rc.Window, "window", 0, "")
	fs.DurationVar(&rc.Margin, "margin", 0, "")
	mode := fs.String("mode", "block", "")
	fs.IntVar(&rc.Workers, "workers", 0, "")
	fs.IntVar(&rc.Tenants, "tenants", 0, "")
	fs.IntVar(&rc.TenantLimit, "tenant-limit", 0, "")
	fs.Float64Var(&rc.Rate, "rate", 0, "")
	if err := fs.Parse(args); err != nil {
		return rc, err
	}
	var err error
	if rc.Gate, err = parseVariant(*gate); err != nil {
		return rc, err
	}
	if rc.Mode, err = parseMode(*mode); err != nil {
		return rc, err
	}
	switch {
	case rc.Vendor == "":
		return rc, errors.New("-vendor is required")
	case rc.Workers < 1:
		return rc, fmt.Errorf("-workers must be at least 1, got %d", rc.Workers)
	case rc.Window <= 0:
		return rc, fmt.Errorf("-window must be positive, got %v", rc.Window)
	case rc.Gate != shared && rc.LocalLimit <= 0:
		return rc, fmt.Errorf("-local-limit must be positive, got %v", rc.LocalLimit)
	}
	return rc, nil
}

// message is one line a replica writes on stdout for the parent.
type message struct {
	Kind    string         `json:"kind"` // "ready", "progress" or "done"
	Waiting int64          `json:"waiting,omitempty"`
	Totals  *totals        `json:"totals,omitempty"` // with "progress" and "done"
	Report  *replicaReport `json:"report,omitempty"`
}

// totals are a replica's running counts, for the parent's -metrics.
type totals struct {
	Admitted    int64 `json:"admitted"`
	Limited     int64 `json:"limited"`  // refusals by the gate, retried after RetryAfter
	Rejected    int64 `json:"rejected"` // vendor 429s
	Failed      int64 `json:"failed"`
	ScriptCalls int64 `json:"script_calls"`
	// Waits counts the admitted calls by their wait for a slot, in the
	// buckets of waitBounds, each bucket on its own (not cumulative); the
	// last one is past the last bound. WaitSum adds the waits up.
	Waits   []int64 `json:"waits"`
	WaitSum float64 `json:"wait_sum_s"`
}

// replicaReport is what one replica saw of its calls.
type replicaReport struct {
	Admitted    int     `json:"admitted"`     // calls its gate let go to the vendor
	Rejected    int     `json:"rejected"`     // of those, answered 429
	Failed      int     `json:"failed"`       // calls lost to Redis or network errors
	FirstError  string  `json:"first_error"`  // the first of those errors
	WaitsMicros []int64 `json:"waits_us"`     // how long each admitted call waited for its slot
	ScriptCalls int64   `json:"script_calls"` // Redis scripts run (EVALSHA, EVAL)
	Unfinished  int     `json:"unfinished"`   // calls still waiting when told to stop
}

// replicaMain runs a replica with the flags after replicaFlag and returns
// the process's exit code.
func replicaMain(args []string) int {
	// A Ctrl-C in the terminal reaches the whole process group; the parent
	// decides when to stop, so that every replica still reports.
	signal.Ignore(os.Interrupt)
	rc, err := parseReplicaArgs(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleet replica:", err)
		return 2
	}
	if err := runReplica(context.Background(), rc, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "fleet replica %d: %v\n", rc.ID, err)
		return 1
	}
	return 0
}

// A gate decides when a call may go to the vendor.
type gate interface {
	// run waits until the call may go, then runs it. It returns an error
	// matching throttle.ErrLimited when the call was refused, and then
	// the call has not run.
	run(ctx context.Context, tenant string, call func()) error
}

// sharedGate is throttle: one quota in Redis for the whole fleet.
type sharedGate struct {
	lim    *throttle.Limiter
	perKey bool
}

func (g sharedGate) run(ctx context.Context, tenant string, call func()) error {
	var opts []throttle.CallOption
	if g.perKey {
		opts = append(opts, throttle.Key(tenant))
	}
	_, err := throttle.Do(ctx, g.lim, func(context.Context) (struct{}, error) {
		call()
		return struct{}{}, nil
	}, opts...)
	return err
}

// localGate is a limiter that knows only its own replica's calls.
type localGate struct {
	b    *bucket
	mode throttle.Mode
}

func (g localGate) run(ctx context.Context, _ string, call func()) error {
	if g.mode == throttle.FailFast {
		if ok, retry := g.b.allow(time.Now()); !ok {
			return &throttle.LimitedError{Quota: "local", RetryAfter: retry}
		}
		call()
		return nil
	}
	if d := g.b.reserve(time.Now()); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			g.b.unreserve()
			return ctx.Err()
		}
	}
	call()
	return nil
}

// replica is the running state of one replica.
type replica struct {
	rc      replicaConfig
	gate    gate
	client  *http.Client
	scripts *scriptCounter

	waiting atomic.Int64 // calls that want to go and have not been admitted
	limited atomic.Int64 // refusals by the gate

	mu      sync.Mutex
	rep     replicaReport
	waits   []int64 // admitted calls per bucket of waitBounds
	waitSum time.Duration
}

// totals returns the replica's counts so far.
func (r *replica) totals() *totals {
	r.mu.Lock()
	defer r.mu.Unlock()
	return &totals{
		Admitted:    int64(r.rep.Admitted),
		Limited:     r.limited.Load(),
		Rejected:    int64(r.rep.Rejected),
		Failed:      int64(r.rep.Failed),
		ScriptCalls: r.scripts.n.Load(),
		Waits:       slices.Clone(r.waits),
		WaitSum:     r.waitSum.Seconds(),
	}
}

// newGate builds the gate rc asks for; release frees what it holds.
func newGate(ctx context.Context, rc replicaConfig) (g gate, scripts *scriptCounter, release func(), err error) {
	scripts = &scriptCounter{}
	if rc.Gate != shared {
		return localGate{b: newBucket(rc.LocalLimit, rc.Window, time.Now()), mode: rc.Mode}, scripts, func() {}, nil
	}
	rdb, err := newRedis(rc.Redis, rc.Cluster)
	if err != nil {
		return nil, nil, nil, err
	}
	rdb.AddHook(scripts)
	pctx, cancel := context.WithTimeout(ctx, redisTimeout)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		return nil, nil, nil, fmt.Errorf("redis %s: %w", rc.Redis, err)
	}
	var policy policies.Policy = policies.SlidingLog{Limit: rc.Limit, Window: rc.Window, Margin: rc.Margin}
	if rc.Tenants > 0 {
		policy = policies.All(policy, policies.PerKey{
			Policy: policies.SlidingLog{Limit: rc.TenantLimit, Window: rc.Window, Margin: rc.Margin},
		})
	}
	lim, err := throttle.New(rdb, rc.Quota, policy, throttle.Options{Mode: rc.Mode})
	if err != nil {
		rdb.Close()
		return nil, nil, nil, err
	}
	return sharedGate{lim: lim, perKey: rc.Tenants > 0}, scripts, func() { rdb.Close() }, nil
}

// runReplica gets ready, waits for "go" on in, runs the workers until in
// closes, and writes its messages to out.
func runReplica(ctx context.Context, rc replicaConfig, in io.Reader, out io.Writer) error {
	g, scripts, release, err := newGate(ctx, rc)
	if err != nil {
		return err
	}
	defer release()
	r := newReplica(rc, g, scripts)
	defer r.client.CloseIdleConnections()

	send := messenger(out)
	if err := send(message{Kind: "ready"}); err != nil {
		return err
	}
	stdin := bufio.NewReader(in)
	if line, _ := stdin.ReadString('\n'); line != "go\n" {
		return nil // the parent gave up before the start
	}

	ctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		stop()
	}()
	r.runWorkers(ctx, stop, send)
	return send(r.done())
}

func newReplica(rc replicaConfig, g gate, scripts *scriptCounter) *replica {
	return &replica{
		rc:      rc,
		gate:    g,
		scripts: scripts,
		waits:   make([]int64, len(waitBounds)+1),
		client: &http.Client{
			Timeout: callTimeout,
			// Keep one connection per worker, rather than the default
			// two, so that calls do not queue for new connections.
			Transport: &http.Transport{MaxIdleConnsPerHost: rc.Workers},
		},
	}
}

// messenger returns a send that writes one message a line on out; the
// workers' progress and the end may be sent at once.
func messenger(out io.Writer) func(message) error {
	var mu sync.Mutex
	enc := json.NewEncoder(out)
	return func(m message) error {
		mu.Lock()
		defer mu.Unlock()
		return enc.Encode(m)
	}
}

// runWorkers runs the workers until ctx ends, and sends the replica's
// progress meanwhile. A parent that no longer reads stops them.
func (r *replica) runWorkers(ctx context.Context, stop func(), send func(message) error) {
	var wg sync.WaitGroup
	for w := range r.rc.Workers {
		wg.Go(func() { r.work(ctx, uint64(r.rc.ID)<<32|uint64(w)) })
	}
	tick := time.NewTicker(progressEvery)
	defer tick.Stop()
	for running := true; running; {
		select {
		case <-ctx.Done():
			running = false
		case <-tick.C:
			if err := send(message{Kind: "progress", Waiting: r.waiting.Load(), Totals: r.totals()}); err != nil {
				stop()
			}
		}
	}
	wg.Wait()
}

// done is the replica's last message: its report and its counts.
func (r *replica) done() message {
	r.mu.Lock()
	rep := r.rep
	r.mu.Unlock()
	rep.ScriptCalls = r.scripts.n.Load()
	return message{Kind: "done", Report: &rep, Totals: r.totals()}
}

// work is one worker: it makes a call every Workers/Rate seconds, or one
// after another when the replica is asked for as many as admitted.
func (r *replica) work(ctx context.Context, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(time.Now().UnixNano())))
	var interval time.Duration
	next := time.Now()
	if r.rc.Rate > 0 {
		interval = seconds(float64(r.rc.Workers) / r.rc.Rate)
		// Spread the workers' first calls, as independent clients would be.
		next = next.Add(time.Duration(rng.Int64N(int64(interval) + 1)))
	}
	for {
		if !sleepUntil(ctx, next) {
			return
		}
		tenant := ""
		if r.rc.Tenants > 0 {
			tenant = strconv.Itoa(rng.IntN(r.rc.Tenants))
		}
		r.job(ctx, tenant)
		// A worker that fell behind does not catch up in a burst: the
		// demand is a rate, not a backlog.
		next = later(next.Add(interval), time.Now())
	}
}

// job takes one call through the gate, retrying refusals after their
// RetryAfter, and makes the call once admitted.
func (r *replica) job(ctx context.Context, tenant string) {
	start := time.Now()
	r.waiting.Add(1)
	admitted := false
	call := func() {
		admitted = true
		r.waiting.Add(-1)
		r.call(ctx, tenant, time.Since(start))
	}
	for !admitted {
		err := r.gate.run(ctx, tenant, call)
		var limited *throttle.LimitedError
		switch {
		case admitted:
		case ctx.Err() != nil:
			r.waiting.Add(-1)
			r.mu.Lock()
			r.rep.Unfinished++
			r.mu.Unlock()
			return
		case errors.As(err, &limited):
			r.limited.Add(1)
			sleepUntil(ctx, time.Now().Add(max(limited.RetryAfter, time.Millisecond)))
		default:
			r.waiting.Add(-1)
			r.fail(err)
			sleepUntil(ctx, time.Now().Add(failurePause))
			return
		}
	}
}

// call makes one admitted call to the vendor and records it. A call once
// admitted is finished even when the replica is told to stop.
func (r *replica) call(ctx context.Context, tenant string, waited time.Duration) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
	defer cancel()
	status, err := r.get(ctx, tenant)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rep.Admitted++
	r.rep.WaitsMicros = append(r.rep.WaitsMicros, waited.Microseconds())
	r.waits[waitBucket(waited)]++
	r.waitSum += waited
	switch {
	case err != nil:
		r.failLocked(err)
	case status == http.StatusTooManyRequests:
		r.rep.Rejected++
	case status != http.StatusOK:
		r.failLocked(fmt.Errorf("vendor answered %d", status))
	}
}

func (r *replica) get(ctx context.Context, tenant string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.rc.Vendor, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set(headerReplica, strconv.Itoa(r.rc.ID))
	if tenant != "" {
		req.Header.Set(headerTenant, tenant)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

func (r *replica) fail(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failLocked(err)
}

func (r *replica) failLocked(err error) {
	r.rep.Failed++
	if r.rep.FirstError == "" {
		r.rep.FirstError = err.Error()
	}
}

// sleepUntil sleeps until t and reports whether ctx is still live.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
