package throttle

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/delayproxy"
	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// fleetCase is one policy driven by a fleet against a strict vendor.
type fleetCase struct {
	name    string
	policy  policies.Policy
	vendor  int     // the vendor's cap per second
	minUtil float64 // of the vendor's cap, from the end of the first window on
	// window is the vendor's and the policy's window; 1s when zero.
	window time.Duration
	// maxInFlight, when set, bounds the calls at the vendor at once, and
	// each call takes a while there.
	maxInFlight int
	// maxScripts, when set, bounds the script calls per admitted call.
	maxScripts float64
	// workers is how many goroutines of each replica make calls; 20 when
	// zero.
	workers int
	// apart runs the vendor in a process of its own, as a real vendor's
	// clock is: on a machine this loaded, a server in the test's process
	// would count arrivals late, by its own scheduling.
	apart bool
}

// The utilization floors leave room for a loaded machine (-race on 2
// cores, other tests beside): the benchmarks in bench/ measure how much of
// the cap the fleet really uses; these catch a fleet that leaves much of it
// idle. A widened margin lowers each floor in proportion.
var fleetCases = []fleetCase{
	// Two-second windows, and a margin for the vendor standing in this very
	// process: on a loaded machine its server is itself late to count the
	// arrivals, which a vendor's own clock would not be (bench/conditions
	// runs the vendor in a process of its own, at the default margin).
	{name: "SlidingLog", policy: policies.SlidingLog{Limit: 200, Window: 2 * time.Second, Margin: 60 * time.Millisecond}, vendor: 200, minUtil: 0.9, window: 2 * time.Second},
	// A counter gives up one bucket of ten to stay under the cap; its
	// margin does not follow the fleet's spread, so the test gives it room
	// for a loaded machine's.
	{name: "SlidingCounter", policy: policies.SlidingCounter{Limit: 100, Window: time.Second, Margin: 100 * time.Millisecond}, vendor: 100, minUtil: 0.7},
	// Even pacing, 5% under the cap for the jitter between calls.
	{name: "TokenBucket", policy: policies.TokenBucket{Rate: 95, Per: time.Second}, vendor: 100, minUtil: 0.85},
	{name: "All", policy: policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.TokenBucket{Rate: 200, Per: time.Second},
	), vendor: 100, minUtil: 0.7},
	{name: "Concurrency", policy: policies.All(
		policies.Concurrency{Max: 5},
		policies.SlidingLog{Limit: 100, Window: time.Second},
	), vendor: 100, minUtil: 0.6, maxInFlight: 5},
}

// miniWorkers is how many goroutines of each replica make calls against
// miniredis, which runs every script in the test's own process: 60 workers
// of three replicas, their HTTP calls, the vendor and the scripts' Lua under
// -race on two cores start their calls up to 180 ms apart, past the
// margin's ceiling, and that measures the machine, not the fleet. Eight
// keep every policy's quota full, as redis-server's 20 do.
const miniWorkers = 8

// The promise, end to end: several replicas, each with its own Redis client
// and many goroutines, hammer one quota for several windows, and every
// admitted call reaches a strict vendor. The vendor sees no call over its
// cap, and the fleet keeps the cap in use.
func TestFleet_NeverOverCapAndUsesTheQuota(t *testing.T) {
	long(t)
	for _, fc := range fleetCases {
		t.Run(fc.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				fc := fc
				if !s.Real {
					fc.workers = miniWorkers
				}
				runFleet(t, fc, func(t *testing.T) redis.UniversalClient { return s.Client(t) })
			})
		})
	}
}

func TestFleet_NeverOverCapOnCluster(t *testing.T) {
	long(t)
	c := redistest.StartCluster(t)
	runFleet(t, fleetCases[0], func(t *testing.T) redis.UniversalClient { return c.Client(t) })
}

// Redis tens of milliseconds away delays every call by about the same
// time, which does no harm at the vendor: the fleet keeps under the cap and
// uses it, at about one script call per admitted call, whatever the round
// trip, with jitter on every packet.
func TestFleet_RedisFarAway(t *testing.T) {
	long(t)
	s := redistest.Real(t)
	for _, d := range []struct{ latency, jitter time.Duration }{
		{time.Millisecond, 500 * time.Microsecond},
		{10 * time.Millisecond, 3 * time.Millisecond},
		{25 * time.Millisecond, 5 * time.Millisecond},
		{50 * time.Millisecond, 5 * time.Millisecond},
	} {
		t.Run(fmt.Sprintf("%v±%v", d.latency, d.jitter), func(t *testing.T) {
			proxy := delayproxy.Start(t, s.Addr, delayproxy.WithLatency(d.latency), delayproxy.WithJitter(d.jitter))
			fc := fleetCase{
				name:       fmt.Sprintf("far-%v", d.latency),
				policy:     policies.SlidingLog{Limit: 100, Window: time.Second},
				vendor:     100,
				minUtil:    0.85,
				maxScripts: 1.5,
			}
			runFleet(t, fc, func(t *testing.T) redis.UniversalClient {
				rdb := redis.NewClient(&redis.Options{Addr: proxy.Addr(), ContextTimeoutEnabled: true, PoolSize: 20})
				t.Cleanup(func() { rdb.Close() })
				return rdb
			})
		})
	}
}

// On a machine whose every core is busy with other work, calls start late
// after their slots, and later than each other: the fleet measures the
// spread, widens its margin, and keeps under the cap.
func TestFleet_BusyMachine(t *testing.T) {
	long(t)
	s := redistest.Real(t)
	busyLoops(t, 2*runtime.NumCPU())
	// Two-second windows: the margin may grow to 200ms, room for the
	// spread of a machine this busy. The vendor runs in a process of its
	// own, as in bench/conditions, which runs the one-second case.
	fc := fleetCase{name: "busy", policy: policies.SlidingLog{Limit: 200, Window: 2 * time.Second}, vendor: 200, window: 2 * time.Second, minUtil: 0.5, apart: true}
	runFleet(t, fc, func(t *testing.T) redis.UniversalClient { return s.Client(t) })
}

// margin0 is the largest margin configured in a policy's windows.
func margin0(p policies.Policy) time.Duration {
	rules, _ := policies.Rules(p)
	var m time.Duration
	for _, r := range rules {
		m = max(m, r.Margin)
	}
	return m
}

// fleetVendor is the strict vendor of a fleet test, in this process or in
// one of its own.
type fleetVendor struct {
	url     string
	here    fakevendor.Config
	arrived *arrivalLog
}

// startVendorHere serves a vendor in this process, judged by when each
// call left its replica (sentHeader): on a machine the race run and the
// other tests keep busy, the vendor's handler here was itself scheduled
// 100 ms late now and then, and counted two calls of one window in the
// next, which no network between a fleet and its vendor does at the
// margin these tests set. The margin's work against a vendor's own clock
// is measured with the vendor apart (TestFleet_BusyMachine, and
// bench/conditions at the default margin).
func startVendorHere(t *testing.T, cfg fakevendor.Config) fleetVendor {
	v := fakevendor.NewInProcess(cfg)
	arrivals := &arrivalLog{sent: true}
	srv := httptest.NewServer(arrivals.record(v.Handler()))
	t.Cleanup(srv.Close)
	return fleetVendor{url: srv.URL, here: cfg, arrived: arrivals}
}

// vendorReport is what a vendor in its own process says at the end.
type vendorReport struct {
	Stats       fakevendor.Stats
	Utilization float64
	MaxInFlight int
}

// startVendorApart starts this test binary again as the vendor
// (TestHelperVendor), and reads its address from its first line.
func startVendorApart(t *testing.T, cfg fakevendor.Config) fleetVendor {
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperVendor$")
	cmd.Env = append(os.Environ(), "THROTTLE_VENDOR="+strconv.Itoa(cfg.Limit)+"/"+cfg.Window.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("the vendor process said nothing: %v", err)
	}
	return fleetVendor{url: strings.TrimSpace(line)}
}

// results returns what the vendor saw: its counts, the utilization of its
// cap, and the most calls it held at once.
func (v fleetVendor) results(t *testing.T, limit int, window time.Duration) (fakevendor.Stats, float64, int) {
	if v.arrived != nil {
		v.arrived.mu.Lock()
		inFlight := v.arrived.maxInFlight
		at := slices.Clone(v.arrived.at)
		v.arrived.mu.Unlock()
		return fakevendor.Replay(v.here, at), v.arrived.utilization(limit, window), inFlight
	}
	resp, err := http.Get(v.url + "/report")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r vendorReport
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	return r.Stats, r.Utilization, r.MaxInFlight
}

// TestHelperVendor serves a strict vendor, as a process of
// startVendorApart; it does nothing in a normal run.
func TestHelperVendor(t *testing.T) {
	spec, ok := os.LookupEnv("THROTTLE_VENDOR")
	if !ok {
		return
	}
	limitText, windowText, _ := strings.Cut(spec, "/")
	limit, _ := strconv.Atoi(limitText)
	window, _ := time.ParseDuration(windowText)
	v := fakevendor.NewInProcess(fakevendor.Config{Limit: limit, Window: window})
	var arrivals arrivalLog
	mux := http.NewServeMux()
	mux.Handle("/", arrivals.record(v.Handler()))
	mux.HandleFunc("/report", func(w http.ResponseWriter, _ *http.Request) {
		arrivals.mu.Lock()
		inFlight := arrivals.maxInFlight
		arrivals.mu.Unlock()
		_ = json.NewEncoder(w).Encode(vendorReport{Stats: v.Stats(), Utilization: arrivals.utilization(limit, window), MaxInFlight: inFlight})
	})
	srv := httptest.NewServer(mux)
	fmt.Println(srv.URL)
	select {} // until the test kills it
}

// busyLoops starts n processes that spin until the test ends.
func busyLoops(t *testing.T, n int) {
	for range n {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperBusyLoop$")
		cmd.Env = append(os.Environ(), "THROTTLE_BUSY_LOOP=1")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
	}
}

// TestHelperBusyLoop spins, as a process of busyLoops; it does nothing in a
// normal run.
func TestHelperBusyLoop(t *testing.T) {
	if os.Getenv("THROTTLE_BUSY_LOOP") != "1" {
		return
	}
	for x := 0; ; x++ {
		_ = x
	}
}

// runFleet runs fc's fleet of replicas against a strict vendor for three
// windows and a half, and checks what the vendor saw.
func runFleet(t *testing.T, fc fleetCase, newClient func(*testing.T) redis.UniversalClient) {
	r := &fleetRun{t: t, fc: fc, window: cmp.Or(fc.window, time.Second)}
	// Three windows and a half: the first one's burst, and two and a half
	// at the cap to measure.
	r.runFor = r.window * 7 / 2
	cfg := fakevendor.Config{Limit: fc.vendor, Window: r.window}
	if fc.maxInFlight > 0 {
		cfg.Work = 20 * time.Millisecond
	}
	if fc.apart {
		r.v = startVendorApart(t, cfg)
	} else {
		r.v = startVendorHere(t, cfg)
	}
	r.run(newClient)
	r.check()
}

// fleetReplicas is how many replicas a fleet test runs.
const fleetReplicas = 3

// fleetRun is one fleet test under way: its case, the vendor, and what the
// fleet's calls and Redis saw.
type fleetRun struct {
	t        *testing.T
	fc       fleetCase
	window   time.Duration
	runFor   time.Duration
	v        fleetVendor
	lims     []*Limiter
	admitted atomic.Int64
	refused  atomic.Int64
	scripts  atomic.Int64
	// The widest margin the fleet's calls were held to: at its ceiling, a
	// tenth of the window, the log paces its calls (see the utilization
	// bound in check).
	widest atomic.Int64
}

// observe keeps the widest margin of the fleet's script calls.
func (r *fleetRun) observe(e Event) {
	if e.Kind == EventRedis {
		keepWidest(&r.widest, int64(e.Margin))
	}
}

// keepWidest raises widest to m when m is wider.
func keepWidest(widest *atomic.Int64, m int64) {
	for {
		old := widest.Load()
		if m <= old || widest.CompareAndSwap(old, m) {
			return
		}
	}
}

// run starts the replicas' workers, each calling the vendor through Do
// until the run ends, and waits for them.
func (r *fleetRun) run(newClient func(*testing.T) redis.UniversalClient) {
	t := r.t
	workers := cmp.Or(r.fc.workers, 20)
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: fleetReplicas * workers}}
	defer httpc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), r.runFor)
	defer cancel()
	var wg sync.WaitGroup
	for range fleetReplicas {
		rdb := newClient(t)
		rdb.AddHook(countScripts{&r.scripts})
		lim, err := New(rdb, "fleet-"+r.fc.name, r.fc.policy, Options{Observer: r.observe})
		if err != nil {
			t.Fatal(err)
		}
		r.lims = append(r.lims, lim)
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					_, err := Do(ctx, lim, func(ctx context.Context) (int, error) {
						// An admitted call always completes, even as the run ends.
						return get(context.WithoutCancel(ctx), httpc, r.v.url)
					})
					switch {
					case err == nil:
						r.admitted.Add(1)
					case errors.Is(err, ErrLimited), errors.Is(err, context.DeadlineExceeded):
						// The run ends before this worker's next slot.
						r.refused.Add(1)
						return
					default:
						t.Errorf("Do: %v", err)
						return
					}
				}
			})
		}
	}
	wg.Wait()
}

// check reads what the vendor saw: no call over its cap, every admitted
// call accepted, and the cap used, in calls at once and in script calls
// per admitted call within the case's bounds.
func (r *fleetRun) check() {
	t, fc, window, limit := r.t, r.fc, r.window, r.fc.vendor
	st, util, maxInFlight := r.v.results(t, limit, window)
	if st.OverCap != 0 || st.MaxInWindow > limit {
		t.Errorf("vendor saw %d calls over its cap (at most %d in one window, cap %d)", st.OverCap, st.MaxInWindow, limit)
	}
	if int64(st.Accepted) != r.admitted.Load() {
		t.Errorf("vendor accepted %d calls, the fleet admitted %d", st.Accepted, r.admitted.Load())
	}
	// A busy machine widens the margin, and so gives up some of the cap on
	// purpose: the bound follows the margin in force, up to its ceiling.
	var margin time.Duration
	u, err := r.lims[0].Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, rule := range u.Rules {
		margin = max(margin, rule.Margin)
	}
	perCall := float64(r.scripts.Load()) / float64(max(r.admitted.Load(), 1))
	t.Logf("admitted %d, refused at the end %d, over cap %d, max in a window %d, utilization %.3f, spread %v, margin %v, %.2f script calls per admitted call",
		r.admitted.Load(), r.refused.Load(), st.OverCap, st.MaxInWindow, util, u.Spread, margin, perCall)
	want := fc.minUtil
	if floor := max(margin0(fc.policy), policies.DefaultMargin); margin > floor {
		want *= float64(window+floor) / float64(window+margin)
	}
	if paced := time.Duration(r.widest.Load()) >= window/10; paced {
		// A log whose margin reached its ceiling paces its calls: a
		// window's calls that came at once are spread over the next one,
		// which costs up to half a window of the cap, once, out of the
		// windows measured.
		want *= 1 - float64(window/2)/float64(r.runFor-window)
		t.Logf("margin %v at its ceiling: the calls were paced", time.Duration(r.widest.Load()))
	}
	if util < want {
		t.Errorf("utilization %.3f, want at least %.3f", util, want)
	}
	if fc.maxScripts > 0 && perCall > fc.maxScripts {
		t.Errorf("%.2f script calls per admitted call, want at most %.2f", perCall, fc.maxScripts)
	}
	if fc.maxInFlight > 0 && maxInFlight > fc.maxInFlight {
		t.Errorf("%d calls at the vendor at once, want at most %d", maxInFlight, fc.maxInFlight)
	}
}

// arrivalLog records when each request reaches the vendor, or, with sent,
// when it left its replica (sentHeader), and how many are at the vendor
// at once.
type arrivalLog struct {
	sent        bool
	mu          sync.Mutex
	at          []time.Time
	inFlight    int
	maxInFlight int
}

// sentHeader carries, in nanoseconds since 1970, when get sent a request.
const sentHeader = "X-Sent-At"

func (a *arrivalLog) record(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		if ns, err := strconv.ParseInt(r.Header.Get(sentHeader), 10, 64); a.sent && err == nil {
			now = time.Unix(0, ns)
		}
		a.mu.Lock()
		a.at = append(a.at, now)
		a.inFlight++
		a.maxInFlight = max(a.maxInFlight, a.inFlight)
		a.mu.Unlock()
		defer func() {
			a.mu.Lock()
			a.inFlight--
			a.mu.Unlock()
		}()
		h.ServeHTTP(w, r)
	})
}

// utilization is the average, over every moment from the end of the first
// window to the last arrival, of the vendor's window count against its cap:
// the share of the quota the fleet kept in use once it was running.
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
	return sum / n / float64(limit)
}

func get(ctx context.Context, c *http.Client, url string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set(sentHeader, strconv.FormatInt(time.Now().UnixNano(), 10))
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}
