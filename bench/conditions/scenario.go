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
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/bench/internal/redisserver"
	"github.com/throttlekit/throttle/internal/delayproxy"
	"github.com/throttlekit/throttle/internal/fakevendor"
)

const (
	// window is the vendor's window, and the quota's.
	window = time.Second
	// vendorWork is how long the vendor takes to answer an accepted call,
	// so that calls overlap as they do against a real API.
	vendorWork = 10 * time.Millisecond
	// readyTimeout bounds the start of the replicas.
	readyTimeout = 60 * time.Second
	// reportTimeout bounds the wait for the replicas' reports past the end
	// of the run; they are then killed.
	reportTimeout = 30 * time.Second
	// stderrKeep is how much of a replica's stderr is kept.
	stderrKeep = 64 << 10
)

// scenario is one row of the table.
type scenario struct {
	name     string
	procs    int // replica processes
	limiters int // limiters per process, each with its own client
	workers  int // workers per limiter
	pool     int // PoolSize of each client
	limit    int // the vendor's cap per window, and the quota's Limit
	proxy    bool
	latency  time.Duration // one-way, through the proxy
	jitter   time.Duration
	spinners int           // busy-looping processes beside the fleet
	dial     time.Duration // calls through a throttle.Transport whose dials take this long (see replicaConfig.Dial)
}

func scenarios() []scenario {
	fleet := func(name string, latency, jitter time.Duration) scenario {
		return scenario{name: name, procs: 3, limiters: 1, workers: 20, pool: 20, limit: 100, proxy: true, latency: latency, jitter: jitter}
	}
	busy := fleet("busy", 25*time.Millisecond, 5*time.Millisecond)
	busy.spinners = 2 * runtime.NumCPU()
	return []scenario{
		fleet("fleet-d0", 0, 0),
		fleet("fleet-d1", time.Millisecond, 500*time.Microsecond),
		fleet("fleet-d10", 10*time.Millisecond, 5*time.Millisecond),
		fleet("fleet-d25", 25*time.Millisecond, 5*time.Millisecond),
		fleet("fleet-d50", 50*time.Millisecond, 5*time.Millisecond),
		busy,
		{name: "replicas-1000", procs: 1, limiters: 1000, workers: 1, pool: 2, limit: 1000},
		{name: "replicas-10x100", procs: 10, limiters: 100, workers: 1, pool: 2, limit: 1000},
		{name: "replicas-100x10", procs: 1, limiters: 100, workers: 10, pool: 2, limit: 1000},
		{name: "dials", procs: 3, limiters: 1, workers: 20, pool: 20, limit: 100, dial: 80 * time.Millisecond},
	}
}

func scenarioNames() []string {
	var names []string
	for _, sc := range scenarios() {
		names = append(names, sc.name)
	}
	return names
}

// env is what every scenario of one invocation shares.
type env struct {
	exe      string
	redis    string        // host:port of the redis-server
	timeline time.Duration // sample the run this often; 0: never
	margin   time.Duration // the SlidingLog's Margin; 0: the default
}

// runScenario runs one scenario against a fresh vendor and an emptied Redis
// and returns its row.
func runScenario(ctx context.Context, e env, sc scenario, duration time.Duration) (result, error) {
	admin := redis.NewClient(&redis.Options{Addr: e.redis})
	defer admin.Close()
	cpuBefore, err := resetRedis(ctx, admin)
	if err != nil {
		return result{}, err
	}
	r := &scenarioRun{env: e, sc: sc, admin: admin, quota: "conditions-" + sc.name + "-" + randomHex(4)}
	stopVendor, err := r.serveVendor()
	if err != nil {
		return result{}, err
	}
	defer stopVendor()
	redisAddr, closeProxy, err := r.redisAddr()
	if err != nil {
		return result{}, err
	}
	defer closeProxy()

	defer r.killAll()
	if err := r.start(redisAddr); err != nil {
		return result{}, err
	}
	if err := r.awaitReady(ctx); err != nil {
		return result{}, err
	}
	began := time.Now()
	end := began.Add(duration)
	if err := r.tellGo(end); err != nil {
		return result{}, err
	}
	samples := r.sampleUsage(ctx, began, end)
	reps, stderr, err := r.collect(ctx, end)
	if err != nil {
		return result{}, err
	}
	// Every admitted call has completed: the replicas reported after it.
	res, err := r.measure(ctx, reps, cpuBefore)
	if err != nil {
		return result{}, err
	}
	res.Stderr = distinctLines(stderr)
	if e.timeline > 0 {
		res.Timeline = r.arrivals.timeline(began, end, e.timeline, window, samples())
	}
	return res, nil
}

// scenarioRun is one scenario under way: its vendor, its quota and the
// processes it started.
type scenarioRun struct {
	env      env
	sc       scenario
	admin    *redis.Client
	quota    string
	vendor   *fakevendor.Vendor
	arrivals arrivalLog
	url      string   // where the replicas call the vendor
	procs    []*child // every process started, spinners included
	replicas []*child
}

// resetRedis empties Redis and its command statistics, and returns the CPU
// time Redis has used so far.
func resetRedis(ctx context.Context, admin *redis.Client) (time.Duration, error) {
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return 0, fmt.Errorf("FLUSHALL: %w", err)
	}
	if err := admin.ConfigResetStat(ctx).Err(); err != nil {
		return 0, fmt.Errorf("CONFIG RESETSTAT: %w", err)
	}
	return redisCPU(ctx, admin)
}

// serveVendor serves a fresh vendor at the scenario's cap on a free local
// port, noting every arrival, until the returned stop.
func (r *scenarioRun) serveVendor() (stop func(), err error) {
	r.vendor = fakevendor.NewInProcess(fakevendor.Config{Limit: r.sc.limit, Window: window, Work: vendorWork})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("vendor: %w", err)
	}
	srv := &http.Server{Handler: r.arrivals.record(r.vendor.Handler()), ReadHeaderTimeout: callTimeout}
	go func() { _ = srv.Serve(ln) }()
	r.url = "http://" + ln.Addr().String() + "/call"
	return func() { _ = srv.Close() }, nil
}

// redisAddr is where the replicas reach Redis: directly, or through a proxy
// that delays each way when the scenario asks for one.
func (r *scenarioRun) redisAddr() (addr string, closeProxy func(), err error) {
	if !r.sc.proxy {
		return r.env.redis, func() {}, nil
	}
	p, err := delayproxy.New(r.env.redis, delayproxy.WithLatency(r.sc.latency), delayproxy.WithJitter(r.sc.jitter))
	if err != nil {
		return "", nil, err
	}
	return p.Addr(), func() { p.Close() }, nil
}

// start starts the scenario's spinners, then its replicas on redisAddr.
func (r *scenarioRun) start(redisAddr string) error {
	for range r.sc.spinners {
		c, err := startChild(r.env.exe, "spinner", []string{spinFlag})
		if err != nil {
			return err
		}
		r.procs = append(r.procs, c)
	}
	sc := r.sc
	for i := range sc.procs {
		rc := replicaConfig{
			ID: i, Redis: redisAddr, Vendor: r.url, Quota: r.quota,
			Limit: sc.limit, Window: window, Limiters: sc.limiters, Workers: sc.workers, Pool: sc.pool, Margin: r.env.margin,
			Dial: sc.dial,
		}
		c, err := startChild(r.env.exe, fmt.Sprintf("replica %d", i), rc.args())
		if err != nil {
			return err
		}
		r.procs = append(r.procs, c)
		r.replicas = append(r.replicas, c)
	}
	return nil
}

// killAll ends every process the run started that is still running.
func (r *scenarioRun) killAll() {
	for _, c := range r.procs {
		c.kill()
	}
}

// awaitReady waits until every replica has made its limiters and opened
// its pools.
func (r *scenarioRun) awaitReady(ctx context.Context) error {
	readyBy := time.Now().Add(readyTimeout)
	for _, c := range r.replicas {
		if _, err := c.await(ctx, readyBy, func(m message) bool { return m.Ready }); err != nil {
			return err
		}
	}
	return nil
}

// tellGo starts every replica's workers, to run until end.
func (r *scenarioRun) tellGo(end time.Time) error {
	for _, c := range r.replicas {
		if _, err := fmt.Fprintf(c.stdin, "go %d\n", end.UnixNano()); err != nil {
			return fmt.Errorf("%s: %w", c.name, err)
		}
	}
	return nil
}

// sampleUsage reads the quota's usage every env.timeline until end, when a
// timeline is asked for. The returned func waits for the samples.
func (r *scenarioRun) sampleUsage(ctx context.Context, began, end time.Time) func() []sample {
	if r.env.timeline <= 0 {
		return func() []sample { return nil }
	}
	var samples []sample
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		samples = sampleUsage(ctx, r.admin, r.quota, r.sc.limit, window, r.env.margin, began, end, r.env.timeline)
	}()
	return func() []sample {
		<-sampled
		return samples
	}
}

// collect waits for every replica's report, then for its exit, and returns
// the reports and what the replicas wrote on stderr.
func (r *scenarioRun) collect(ctx context.Context, end time.Time) ([]report, string, error) {
	var reps []report
	for _, c := range r.replicas {
		m, err := c.await(ctx, end.Add(reportTimeout), func(m message) bool { return m.Report != nil })
		if err != nil {
			return nil, "", err
		}
		reps = append(reps, *m.Report)
	}
	var stderr strings.Builder
	for _, c := range r.replicas {
		if err := c.finish(); err != nil {
			return nil, "", err
		}
		stderr.WriteString(c.stderr.String())
	}
	return reps, stderr.String(), nil
}

// measure adds up the reports, the vendor's counts and Redis's costs.
func (r *scenarioRun) measure(ctx context.Context, reps []report, cpuBefore time.Duration) (result, error) {
	st := r.vendor.Stats()
	res := summarize(r.sc, reps)
	res.OverCap, res.MaxInWindow = st.OverCap, st.MaxInWindow
	res.Utilization = r.arrivals.utilization(r.sc.limit, window)
	res.WayToVendor = newSpread(r.arrivals.waysToVendor())
	res.MaxStartedInWindow = r.arrivals.maxStartedInWindow(window)
	res.Load = loadAverage()
	var err error
	if res.ScriptMicros, err = scriptMicros(ctx, r.admin); err != nil {
		return result{}, err
	}
	cpuAfter, err := redisCPU(ctx, r.admin)
	if err != nil {
		return result{}, err
	}
	res.RedisCPU = cpuAfter - cpuBefore
	return res, nil
}

// summarize adds up the replicas' reports.
func summarize(sc scenario, reps []report) result {
	res := result{Name: sc.name, Cap: sc.limit}
	var waits, trips []time.Duration
	for _, r := range reps {
		res.Admitted += r.Admitted
		res.EndOfRun += r.EndLimited + r.EndContext + r.EndUnavailable
		res.EndLimited += r.EndLimited
		res.EndContext += r.EndContext
		res.EndUnavailable += r.EndUnavailable
		res.Unavailable += r.Unavailable
		res.TimedOut += r.TimedOut
		res.Errors += r.Errors
		res.Late += r.Late
		if res.FirstError == "" {
			res.FirstError = r.FirstError
		}
		if res.FirstUnavailable == "" {
			res.FirstUnavailable = r.FirstUnavailable
		}
		if res.UsageError == "" {
			res.UsageError = r.UsageError
		}
		res.ScriptCalls += r.ScriptCalls
		for _, w := range r.WaitsMicros {
			waits = append(waits, time.Duration(w)*time.Microsecond)
		}
		for _, d := range r.RoundTripsMicros {
			trips = append(trips, time.Duration(d)*time.Microsecond)
		}
		res.Spread = max(res.Spread, time.Duration(r.SpreadMicros)*time.Microsecond)
		res.Margin = max(res.Margin, time.Duration(r.MarginMicros)*time.Microsecond)
	}
	slices.Sort(waits)
	res.WaitP50, res.WaitP99 = durations.Percentile(waits, 0.50), durations.Percentile(waits, 0.99)
	slices.Sort(trips)
	res.RoundTrip = newSpread(trips)
	return res
}

// logTime is the date and time the standard logger puts before a line.
var logTime = regexp.MustCompile(`^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d `)

// distinctLines returns the distinct lines of s, their log times left out,
// in the order they first appear, each with the times it appears.
func distinctLines(s string) []counted {
	var out []counted
	index := map[string]int{}
	for line := range strings.Lines(s) {
		line = logTime.ReplaceAllString(strings.TrimSpace(line), "")
		if line == "" {
			continue
		}
		if i, ok := index[line]; ok {
			out[i].n++
			continue
		}
		index[line] = len(out)
		out = append(out, counted{line, 1})
	}
	return out
}

// loadAverage returns the machine's load average over the last minute, as
// Linux reports it, or "" elsewhere.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// scriptMicros returns Redis's own mean time per EVALSHA since the last
// CONFIG RESETSTAT, in microseconds, from INFO commandstats.
func scriptMicros(ctx context.Context, admin *redis.Client) (float64, error) {
	info, err := admin.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO commandstats: %w", err)
	}
	for f := range strings.SplitSeq(redisserver.InfoField(info, "cmdstat_evalsha"), ",") {
		if v, ok := strings.CutPrefix(f, "usec_per_call="); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, nil
}

// redisCPU returns the CPU time Redis has used, from INFO cpu.
func redisCPU(ctx context.Context, admin *redis.Client) (time.Duration, error) {
	info, err := admin.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO cpu: %w", err)
	}
	var total float64
	for _, field := range []string{"used_cpu_sys", "used_cpu_user"} {
		v, err := strconv.ParseFloat(redisserver.InfoField(info, field), 64)
		if err != nil {
			return 0, fmt.Errorf("INFO cpu: %s: %w", field, err)
		}
		total += v
	}
	return time.Duration(total * float64(time.Second)), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}

// arrivalLog records when each request reaches the vendor, and how long
// after fn started it.
type arrivalLog struct {
	mu      sync.Mutex
	at      []time.Time
	started []time.Time     // when fn started each call that said so
	ways    []time.Duration // from fn's start to the arrival
}

func (a *arrivalLog) record(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		started, err := strconv.ParseInt(r.Header.Get(headerStarted), 10, 64)
		a.mu.Lock()
		a.at = append(a.at, now)
		if err == nil {
			a.started = append(a.started, time.Unix(0, started))
			a.ways = append(a.ways, now.Sub(time.Unix(0, started)))
		}
		a.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

// maxStartedInWindow is the most calls that fn started in any window: what
// the vendor would have counted at most had every call reached it at once.
func (a *arrivalLog) maxStartedInWindow(window time.Duration) int {
	a.mu.Lock()
	started := slices.Clone(a.started)
	a.mu.Unlock()
	return maxInWindow(started, window)
}

// maxInWindow returns the most times in any half-open window (t-window, t].
func maxInWindow(at []time.Time, window time.Duration) int {
	slices.SortFunc(at, func(x, y time.Time) int { return x.Compare(y) })
	most, lo := 0, 0
	for hi, t := range at {
		for !at[lo].After(t.Add(-window)) {
			lo++
		}
		most = max(most, hi-lo+1)
	}
	return most
}

// waysToVendor returns the times from fn's start to the arrival, sorted.
func (a *arrivalLog) waysToVendor() []time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	ways := slices.Clone(a.ways)
	slices.Sort(ways)
	return ways
}

// utilization is the average, over every millisecond from the end of the
// first window to the last arrival, of the vendor's window count against its
// cap: the share of the quota the fleet kept in use once it was running.
// (The definition of arrivalLog.utilization in the root package's
// fleet_test.go.)
func (a *arrivalLog) utilization(limit int, window time.Duration) float64 {
	a.mu.Lock()
	at := slices.Clone(a.at)
	a.mu.Unlock()
	slices.SortFunc(at, func(x, y time.Time) int { return x.Compare(y) })
	if len(at) < 2 {
		return 0
	}
	var sum, n float64
	lo, hi := 0, 0
	for t := at[0].Add(window); !t.After(at[len(at)-1]); t = t.Add(time.Millisecond) {
		for hi < len(at) && !at[hi].After(t) {
			hi++
		}
		for lo < hi && !at[lo].After(t.Add(-window)) {
			lo++
		}
		sum += float64(hi - lo)
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / n / float64(limit)
}

// child is a process this program started: a replica, or a spinner.
type child struct {
	name   string // "replica 2", "spinner"
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *tailBuffer
	msgs   chan message  // the replica's messages, in order
	exited chan struct{} // closed when its stdout ends
	// Set before exited is closed.
	readErr error
	waited  bool
}

func startChild(exe, name string, args []string) (*child, error) {
	c := &child{name: name, stderr: &tailBuffer{max: stderrKeep}, msgs: make(chan message, 4), exited: make(chan struct{})}
	c.cmd = exec.Command(exe, args...)
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
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go c.read(stdout)
	return c, nil
}

// read passes the child's messages on until its stdout ends.
func (c *child) read(stdout io.Reader) {
	defer close(c.exited)
	dec := json.NewDecoder(stdout)
	for {
		var m message
		if err := dec.Decode(&m); err != nil {
			if !errors.Is(err, io.EOF) {
				c.readErr = err
			}
			_, _ = io.Copy(io.Discard, stdout)
			return
		}
		c.msgs <- m
	}
}

// await returns the first message that want accepts, skipping others.
func (c *child) await(ctx context.Context, by time.Time, want func(message) bool) (message, error) {
	timeout := time.NewTimer(time.Until(by))
	defer timeout.Stop()
	for {
		select {
		case m := <-c.msgs:
			if want(m) {
				return m, nil
			}
		case <-c.exited:
			select {
			case m := <-c.msgs:
				if want(m) {
					return m, nil
				}
			default:
			}
			if c.readErr != nil {
				return message{}, c.failure("bad message: " + c.readErr.Error())
			}
			return message{}, c.failure("exited early")
		case <-timeout.C:
			return message{}, c.failure("no answer in time")
		case <-ctx.Done():
			return message{}, ctx.Err()
		}
	}
}

// finish lets a replica that has reported exit, and waits for it.
func (c *child) finish() error {
	c.stdin.Close()
	select {
	case <-c.exited:
	case <-time.After(reportTimeout):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	err := c.cmd.Wait()
	c.waited = true
	if err != nil {
		return c.failure(err.Error())
	}
	return nil
}

// kill ends a child that is still running.
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
	msg := c.name + ": " + what
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
	cut bool // the start was dropped
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = bytes.Clone(b.buf[over:])
		b.cut = true
	}
	return len(p), nil
}

// String returns the whole lines kept.
func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := string(b.buf)
	if b.cut {
		if _, rest, ok := strings.Cut(s, "\n"); ok {
			return rest
		}
	}
	return s
}
