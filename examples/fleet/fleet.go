package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/throttlekit/throttle/examples/fakeapi"
)

const (
	// vendorWork is how long the vendor takes to answer an accepted call,
	// so that calls overlap as they do against a real API.
	vendorWork = 10 * time.Millisecond
	// readyTimeout bounds the start of the replicas.
	readyTimeout = 30 * time.Second
	// exitTimeout bounds the wait for a replica to finish its calls and
	// report after it was told to stop; it is then killed.
	exitTimeout = 15 * time.Second
	// stderrKeep is how much of a replica's stderr is kept for errors.
	stderrKeep = 8 << 10
)

// variant is how the replicas of a run limit themselves.
type variant int

const (
	// shared is throttle: one quota in Redis for the whole fleet.
	shared variant = iota
	// split gives each replica its own token bucket at limit/procs.
	split
	// naive gives each replica its own token bucket at the whole limit.
	naive
)

var variantNames = [...]string{shared: "shared", split: "split", naive: "naive"}

func (v variant) String() string { return variantNames[v] }

func parseVariant(s string) (variant, error) {
	for v, name := range variantNames {
		if s == name {
			return variant(v), nil
		}
	}
	return 0, fmt.Errorf("unknown gate %q", s)
}

// title names the run in its table and on the chart.
func (v variant) title(cfg config) string {
	switch v {
	case split:
		return fmt.Sprintf("split: each replica its own token bucket at %d/%d", cfg.Limit, cfg.Procs)
	case naive:
		return fmt.Sprintf("naive: each replica its own token bucket at %d", cfg.Limit)
	}
	return "throttle: one shared quota in Redis"
}

// short names the run in the side-by-side table.
func (v variant) short(cfg config) string {
	switch v {
	case split:
		return fmt.Sprintf("split (%d/%d each)", cfg.Limit, cfg.Procs)
	case naive:
		return fmt.Sprintf("naive (%d each)", cfg.Limit)
	}
	return "throttle (shared)"
}

// localLimit is the calls per window of each replica's own bucket.
func (v variant) localLimit(cfg config) float64 {
	if v == split {
		return float64(cfg.Limit) / float64(cfg.Procs)
	}
	return float64(cfg.Limit)
}

// fleetEnv is what every run of one invocation shares.
type fleetEnv struct {
	exe     string
	redis   string
	cluster bool
	metrics *fleetMetrics // nil without -metrics
}

// runFleet runs the fleet once against a fresh vendor and returns what the
// vendor and the replicas saw.
func runFleet(ctx context.Context, cfg config, v variant, env fleetEnv, stderr io.Writer) (Result, error) {
	vendor := fakeapi.New(fakeapi.Config{Limit: cfg.Limit, Window: cfg.Window, Work: vendorWork})
	rec := &recorder{vendor: vendor}
	url, stopVendor, err := serveVendor(rec)
	if err != nil {
		return Result{}, err
	}
	defer stopVendor()

	quota := "fleet-demo-" + randomHex(6) // a fresh quota, whatever earlier runs left in Redis
	children := make([]*child, cfg.Procs)
	defer killAll(children)
	if err := startReplicas(children, cfg, v, env, url, quota); err != nil {
		return Result{}, err
	}
	if err := awaitReady(ctx, children); err != nil {
		return Result{}, err
	}
	if env.metrics != nil {
		env.metrics.add(&runMetrics{gate: v, quota: quota, window: cfg.Window, vendor: vendor, children: children})
	}

	start := time.Now()
	rec.begin(start)
	if err := tellGo(children); err != nil {
		return Result{}, err
	}
	showProgress(ctx, cfg, v, start, vendor, children, stderr)
	ran := time.Since(start)
	reports, err := stopReplicas(children)
	if err != nil {
		return Result{}, err
	}
	stopVendor()
	return summarize(cfg, v, ran, vendor.Stats(), rec.snapshot(), reports), nil
}

// serveVendor serves rec on a free local port and returns the URL of its
// calls, and a stop that may be called again.
func serveVendor(rec *recorder) (url string, stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, fmt.Errorf("vendor: %w", err)
	}
	srv := &http.Server{Handler: rec, ReadHeaderTimeout: callTimeout}
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String() + "/call", func() { _ = srv.Close() }, nil
}

// startReplicas starts a replica process in each place of children, each
// calling the vendor at url under quota as cfg and v ask.
func startReplicas(children []*child, cfg config, v variant, env fleetEnv, url, quota string) error {
	for i := range children {
		rc := replicaConfig{
			ID: i, Gate: v, Vendor: url,
			Redis: env.redis, Cluster: env.cluster, Quota: quota,
			Limit: cfg.Limit, LocalLimit: v.localLimit(cfg), Window: cfg.Window, Margin: cfg.Margin,
			Mode: cfg.Mode, Workers: cfg.Workers, Tenants: cfg.Tenants, TenantLimit: cfg.TenantLimit,
			Rate: cfg.replicaRate(i),
		}
		c, err := startChild(env.exe, i, rc.args())
		if err != nil {
			return err
		}
		children[i] = c
	}
	return nil
}

// tellGo tells every replica to start its calls.
func tellGo(children []*child) error {
	for _, c := range children {
		if _, err := io.WriteString(c.stdin, "go\n"); err != nil {
			return fmt.Errorf("start replica %d: %w", c.id, err)
		}
	}
	return nil
}

// stopReplicas tells every replica to stop, and returns their reports once
// all have exited.
func stopReplicas(children []*child) ([]replicaReport, error) {
	for _, c := range children {
		c.stdin.Close()
	}
	reports := make([]replicaReport, len(children))
	var errs []error
	for i, c := range children {
		rep, err := c.finish()
		reports[i] = rep
		errs = append(errs, err)
	}
	return reports, errors.Join(errs...)
}

// killAll ends the replicas that a failed run left behind.
func killAll(children []*child) {
	for _, c := range children {
		if c != nil {
			c.kill()
		}
	}
}

// showProgress rewrites one line on stderr until the run's time is up or
// ctx ends: elapsed time, the rate the vendor accepts against the cap, the
// calls waiting for a slot, and the 429s so far.
func showProgress(ctx context.Context, cfg config, v variant, start time.Time, vendor *fakeapi.Vendor, children []*child, stderr io.Writer) {
	end := time.NewTimer(cfg.Duration)
	defer end.Stop()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	perSecond := func(n int) float64 { return float64(n) / cfg.Window.Seconds() }
	width := 0
	draw := func() {
		var waiting int64
		for _, c := range children {
			waiting += c.waiting.Load()
		}
		line := fmt.Sprintf("[%s] %5.1fs  admitted %s/s (cap %s/s)  waiting %3d  429s %d",
			v, time.Since(start).Seconds(), rate(perSecond(vendor.InWindow())), rate(perSecond(cfg.Limit)),
			waiting, vendor.Stats().OverCap)
		// Pad over the previous line, which may have been longer.
		fmt.Fprintf(stderr, "\r%-*s", width, line)
		width = len(line)
	}
	defer fmt.Fprintln(stderr)
	for {
		select {
		case <-ctx.Done():
			draw()
			return
		case <-end.C:
			draw()
			return
		case <-tick.C:
			draw()
		}
	}
}

func rate(r float64) string {
	if r < 10 {
		return strconv.FormatFloat(r, 'f', 1, 64)
	}
	return strconv.FormatFloat(r, 'f', 0, 64)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}

// child is one replica process as the parent sees it.
type child struct {
	id      int
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	stderr  *tailBuffer
	ready   chan struct{} // closed when the replica is ready
	exited  chan struct{} // closed when its stdout ends
	waiting atomic.Int64  // its calls waiting for a slot, as last reported

	totalsMu sync.Mutex
	totals   totals // its counts, as last reported

	// Set before exited is closed.
	report  *replicaReport
	readErr error
	waited  bool
}

func startChild(exe string, id int, args []string) (*child, error) {
	c := &child{id: id, stderr: &tailBuffer{max: stderrKeep}, ready: make(chan struct{}), exited: make(chan struct{})}
	c.cmd = exec.Command(exe, args...)
	c.cmd.Env = append(os.Environ(), replicaEnv+"=1")
	c.cmd.Stderr = c.stderr
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start replica %d: %w", id, err)
	}
	go c.read(stdout)
	return c, nil
}

// read takes the replica's messages until its stdout ends.
func (c *child) read(stdout io.Reader) {
	defer close(c.exited)
	dec := json.NewDecoder(stdout)
	readyOnce := sync.OnceFunc(func() { close(c.ready) })
	for {
		var m message
		if err := dec.Decode(&m); err != nil {
			if !errors.Is(err, io.EOF) {
				c.readErr = err
			}
			// Drain, so that a replica stuck writing can still exit.
			_, _ = io.Copy(io.Discard, stdout)
			return
		}
		if m.Totals != nil {
			c.totalsMu.Lock()
			c.totals = *m.Totals
			c.totalsMu.Unlock()
		}
		switch m.Kind {
		case "ready":
			readyOnce()
		case "progress":
			c.waiting.Store(m.Waiting)
		case "done":
			c.report = m.Report
		}
	}
}

func awaitReady(ctx context.Context, children []*child) error {
	timeout := time.NewTimer(readyTimeout)
	defer timeout.Stop()
	for _, c := range children {
		select {
		case <-c.ready:
		case <-c.exited:
			return c.failure("exited before it was ready")
		case <-timeout.C:
			return c.failure(fmt.Sprintf("not ready after %v", readyTimeout))
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// finish waits for the replica to report and exit, killing it if it takes
// too long, and returns its report.
func (c *child) finish() (replicaReport, error) {
	select {
	case <-c.exited:
	case <-time.After(exitTimeout):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	err := c.cmd.Wait()
	c.waited = true
	switch {
	case err != nil:
		return replicaReport{}, c.failure(err.Error())
	case c.readErr != nil:
		return replicaReport{}, c.failure("bad message: " + c.readErr.Error())
	case c.report == nil:
		return replicaReport{}, c.failure("exited without a report")
	}
	return *c.report, nil
}

// counts returns the replica's counts, as last reported.
func (c *child) counts() totals {
	c.totalsMu.Lock()
	defer c.totalsMu.Unlock()
	return c.totals
}

// kill ends a replica that a failed run left behind.
func (c *child) kill() {
	if c.waited {
		return
	}
	_ = c.stdin.Close()
	_ = c.cmd.Process.Kill()
	<-c.exited
	_ = c.cmd.Wait()
	c.waited = true
}

func (c *child) failure(what string) error {
	msg := fmt.Sprintf("replica %d: %s", c.id, what)
	if s := strings.TrimSpace(c.stderr.String()); s != "" {
		msg += "\n" + s
	}
	return errors.New(msg)
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = bytes.Clone(b.buf[over:])
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// arrival is one call as the vendor saw it.
type arrival struct {
	at      time.Duration // since the fleet was told to start
	replica int
	tenant  int // -1 when the call named none
	ok      bool
}

// recorder serves the vendor and notes every arrival, so that the results
// can be broken down by replica, tenant and second.
type recorder struct {
	vendor http.Handler

	mu       sync.Mutex
	start    time.Time
	arrivals []arrival
}

func (r *recorder) begin(t time.Time) {
	r.mu.Lock()
	r.start = t
	r.mu.Unlock()
}

func (r *recorder) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	t := time.Now()
	sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
	r.vendor.ServeHTTP(sw, req)
	a := arrival{replica: -1, tenant: -1, ok: sw.code == http.StatusOK}
	if n, err := strconv.Atoi(req.Header.Get(headerReplica)); err == nil {
		a.replica = n
	}
	if n, err := strconv.Atoi(req.Header.Get(headerTenant)); err == nil {
		a.tenant = n
	}
	r.mu.Lock()
	a.at = t.Sub(r.start)
	r.arrivals = append(r.arrivals, a)
	r.mu.Unlock()
}

func (r *recorder) snapshot() []arrival {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]arrival(nil), r.arrivals...)
}

// statusWriter notes the status code a handler answered with.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	w.code = code
	w.ResponseWriter.WriteHeader(code)
}
