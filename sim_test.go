package throttle

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/throttlekit/throttle/internal/sim"
)

// The deterministic simulation: the real code (a go-redis client and a
// Limiter per replica, Do on every call) runs in a testing/synctest bubble
// against a simulated Redis and network (internal/sim) and a strict vendor,
// on schedules drawn from seeds (sim_schedule_test.go). The bubble's clock
// moves only when every goroutine waits, so a run of seconds takes the CPU
// time of its script calls. Each schedule is checked for the promise:
// safety (the vendor never sees more than the policy allows, under
// FailClosed and Local), liveness (calls return by their deadlines, a call
// that began while Redis was unreachable fails within RedisTimeout, every
// replica admits calls again soon after Redis answers), and, on schedules
// without faults, the use of the cap.
//
//	go test -run TestSim_Schedules -sim.n 2000 .          # a corpus of seeds 1..2000
//	go test -run TestSim_Schedules -sim.seed 1234 -v .    # replay one, and shrink it if it fails
//	go test -run TestSim_Schedules -sim.for 1h -timeout 2h .  # new seeds for an hour
//	go test -run TestSim_Schedules -sim.n 1000 -sim.for 9m .  # 1,000 seeds, or as many as 9 minutes run
var (
	simN    = flag.Int("sim.n", 12, "how many schedules TestSim_Schedules runs (seeds sim.from, sim.from+1, ...); 0 under -race")
	simFrom = flag.Uint64("sim.from", 1, "the first seed of TestSim_Schedules")
	simSeed = flag.Uint64("sim.seed", 0, "run only the schedule of this seed, and shrink it if it fails")
	simFor  = flag.Duration("sim.for", 0, "run schedules from sim.from on for this long instead of sim.n of them (at most sim.n, when it is given)")
	simDump = flag.String("sim.stacks", "", "write every goroutine's stack to this file when a call runs past its deadline")
)

// Under the race detector the default corpus is empty, and the
// regressions alone run (TestSim_Regressions, a dozen schedules of every
// kind): the detector makes each schedule about twenty times slower.
// Without it, the default is seeds 1 to 12, a smoke test within the
// README's test command's 90 s (30 took 16.5 s of CPU of its 2 cores);
// .ci/run runs the seeds of two judged ranges for five minutes.
func init() {
	if raceEnabled {
		*simN = 0
	}
}

// simRuns numbers the runs of this process, so that no two share the
// timing this package keeps per Redis address.
var simRuns atomic.Int64

// outcome is what a run saw: the vendor's arrivals and every call's end.
type outcome struct {
	arrivals []simArrival
	calls    []simCall
	inFlight int  // the most calls in flight at once at the vendor
	scripts  int  // EVALSHA and EVAL commands sent, NOSCRIPT fallbacks counted twice
	cut      bool // cut short at -sim.for's end (simCut), and not judged
	closes   []simClose
	// firstReply is, per replica, when its client's first script call
	// was answered (see outcome.asked).
	firstReply map[int]time.Duration

	refusals   []simRefusal // by a modelled vendor
	otherCalls int          // its other consumer's
	// otherSeen is when the vendor first counted a call of its other
	// consumer: before, no count showed the fleet that it was there.
	otherSeen time.Duration
}

type simArrival struct {
	at      time.Duration // since the run's start
	cost    int           // the call's cost, an estimate when the schedule settles
	key     string
	replica int
	local   bool // decided without Redis
	scout   bool // sent while its rule was blind, to learn the vendor's count (lua/lib.lua, Scouts)
	quota   int  // which of a shared rule's two quotas
	in      int  // its input units (the units kind; cost is its output's)
	actual  int  // what the vendor counts of it once it answered
	answer  time.Duration
}

// counted returns what the vendor counts of a at t: its estimate while the
// call is under way, what it really cost once answered.
func (a simArrival) counted(t time.Duration) int {
	if a.answer <= t {
		return a.actual
	}
	return a.cost
}

type simCall struct {
	replica    int
	began, end time.Duration
	fnEnd      time.Duration // when the vendor answered, if the call got that far
	err        error
	priority   int
	cost       int
	counted    int           // what the vendor counted of it: its cost, or what it settled at
	arrived    time.Duration // when it reached the vendor; 0 if it did not
}

// simClose is a replica's Close of its limiter: when it began and
// returned, and what it returned.
type simClose struct {
	replica    int
	began, end time.Duration
	err        error
}

// TestSim_Schedules runs the corpus of schedules and checks each.
func TestSim_Schedules(t *testing.T) {
	if *simSeed != 0 {
		checkSchedule(t, drawSchedule(*simSeed), true)
		return
	}
	if *simFor > 0 {
		// With -sim.n given too, at most that many: CI's runs stop at
		// their count, or at their time on a machine too busy for it.
		most := -1
		flag.Visit(func(f *flag.Flag) {
			if f.Name == "sim.n" {
				most = *simN
			}
		})
		began, until := time.Now(), time.Now().Add(*simFor)
		time.AfterFunc(*simFor, func() { simCut.Store(true) })
		var under atomic.Uint64
		defer time.AfterFunc(*simFor+simGrace, func() { simHung(under.Load()) }).Stop()
		n := 0
		for seed := *simFrom; time.Now().Before(until) && n != most; seed++ {
			under.Store(seed)
			if checkSchedule(t, drawSchedule(seed), true) {
				n++
			}
		}
		t.Logf("%d schedules (seeds %d to %d) in %v", n, *simFrom, *simFrom+uint64(n)-1, time.Since(began).Round(time.Second))
		return
	}
	t.Cleanup(func() {
		if n := simOpen.Load(); n > 0 {
			t.Logf("%d schedules broke what the README leaves open (run with -v to see them)", n)
		}
	})
	for seed := *simFrom; seed < *simFrom+uint64(*simN); seed++ {
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			t.Parallel()
			checkSchedule(t, drawSchedule(seed), true)
		})
	}
}

// simCut is set when -sim.for's time has passed: the run under way stops
// within 10 ms of its clock, and is not judged.
var simCut atomic.Bool

// simGrace is how long past -sim.for's end the run under way may take to
// stop and close before simHung reports it.
const simGrace = 30 * time.Second

// simHung reports a run that did not stop after -sim.for's end, and ends
// the process: its bubble's clock no longer moves (goroutines that never
// all wait, a loop in virtual time), so the cut never comes, and a CI
// step would wait for its timeout with no seed named.
func simHung(seed uint64) {
	buf := make([]byte, 1<<24)
	buf = buf[:runtime.Stack(buf, true)]
	fmt.Fprintf(os.Stderr, "seed %d did not stop %v after -sim.for's end: its clock no longer moves (a loop in virtual time?)\nreplay: go test -run TestSim_Schedules -sim.seed %d -v .\n\n%s", seed, simGrace, seed, buf)
	os.Exit(1)
}

// checkSchedule runs s and reports what it broke; with shrink, it also
// reports the smallest schedule that still breaks it, and how to replay
// it. It returns whether s was judged: false for a run cut short (simCut).
func checkSchedule(t *testing.T, s schedule, shrink bool) bool {
	t.Helper()
	broken, summary := violations(t, s)
	if len(broken) > 0 && broken[0] == cutMark {
		t.Logf("seed %d: cut short at -sim.for's end, not judged", s.Seed)
		return false
	}
	if len(broken) == 0 {
		return true
	}
	if broken[0] == openMark {
		simOpen.Add(1)
		t.Logf("seed %d: what the README leaves open: %s\n%s\n%s", s.Seed, broken[1], s.describe(), summary)
		return true
	}
	msg := fmt.Sprintf("seed %d: %s\n%s\n%s\nreplay: go test -run TestSim_Schedules -sim.seed %d -v .", s.Seed, broken[0], s.describe(), summary, s.Seed)
	if shrink {
		small, runs := minimal(s, func(c schedule) bool { b, _ := violations(t, c); return len(b) > 0 && b[0] != openMark })
		b, _ := violations(t, small)
		msg += fmt.Sprintf("\nshrunk in %d runs to: %s\n%s", runs, b, small.describe())
	}
	t.Error(msg)
	return true
}

// violations runs s in a bubble of its own and returns what it broke, and
// a summary of the run.
func violations(t *testing.T, s schedule) ([]string, string) {
	var o outcome
	synctest.Test(t, func(*testing.T) { o = run(s) })
	if o.cut {
		return []string{cutMark}, ""
	}
	if broken := check(s, o); len(broken) > 0 {
		return broken, o.summary()
	}
	if open := knownOpen(s, o); len(open) > 0 {
		return append([]string{openMark}, open...), o.summary()
	}
	return nil, o.summary()
}

// openMark heads what violations returns for a run that broke only what
// the README leaves open (knownOpen); simOpen counts such runs.
const openMark = "open:"

// cutMark is what violations returns for a run cut short (simCut).
const cutMark = "cut:"

var simOpen atomic.Int64

// summary counts a run's calls by outcome.
func (o outcome) summary() string {
	errs := map[string]int{}
	for _, c := range o.calls {
		switch {
		case c.err == nil:
			errs["ok"]++
		case errors.Is(c.err, ErrLimited):
			errs["limited"]++
		case errors.Is(c.err, ErrUnavailable):
			errs["unavailable"]++
		default:
			errs[c.err.Error()]++
		}
	}
	return fmt.Sprintf("%d calls %v, %d arrivals at the vendor", len(o.calls), errs, len(o.arrivals))
}

// run plays schedule s with the real code, inside the bubble.
func run(s schedule) outcome {
	id := simRuns.Add(1)
	rng := rand.New(rand.NewPCG(s.Seed, 1))
	var rngMu sync.Mutex
	jitter := func() time.Duration {
		if s.Jitter == 0 {
			return 0
		}
		rngMu.Lock()
		defer rngMu.Unlock()
		return time.Duration(rng.Int64N(int64(s.Jitter) + 1))
	}
	stalls := make([]atomic.Int64, s.Replicas)
	redisDB := sim.NewRedis(func(i int) time.Duration { return s.Latency[i] + jitter() + time.Duration(stalls[i].Load()) })
	start := time.Now()
	w := &world{s: s, start: start, jitter: jitter, stalls: stalls}
	ctx, stop := context.WithCancel(context.Background())
	other := w.startVendor(ctx)
	var wg sync.WaitGroup
	replicas := make([]*simReplica, s.Replicas)
	for i := range s.Replicas {
		rep := &simReplica{i: i, w: w}
		rep.ctx, rep.stop = context.WithCancel(ctx)
		rep.rdb = redis.NewClient(&redis.Options{
			Addr:   simAddr(id, i),
			Dialer: redisDB.Dialer(i), ContextTimeoutEnabled: true,
			// Redis Enterprise's maintenance notifications: go-redis holds
			// their lock across a connection's handshake, which would stop
			// the bubble's clock (a goroutine waiting on a lock is not
			// durably blocked), and miniredis has none to send.
			MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
		})
		rep.rdb.AddHook(scriptCounter{w, i})
		rep.lim.Store(rep.newLimiter(s.Policy, "sim"))
		if s.Policy.Kind == "shared" {
			rep.lim2 = rep.newLimiter(s.Policy, "sim-b")
		}
		replicas[i] = rep
		wg.Go(rep.run)
	}
	var events sync.WaitGroup
	playEvents(ctx, &events, s, redisDB, replicas, w, start)
	if *simFor > 0 {
		wg.Go(func() { cutAtEnd(ctx, stop) })
	}
	_ = sleep(ctx, s.Length-time.Since(start))
	stop()
	wg.Wait()
	events.Wait()
	other.Wait()
	for _, rep := range replicas {
		rep.close()
	}
	redisDB.Close()
	// The subscriptions' goroutines see that their limiters left at their
	// next read, a Redis timeout away at most.
	time.Sleep(2 * defaultRedisTimeout)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.o.cut = simCut.Load()
	return w.o
}

// cutAtEnd stops a run (stop) within 10 ms of its clock once -sim.for's
// end has passed (simCut), or returns when ctx ends: a few schedules cost
// minutes of CPU, and a run that began before the end must not hold CI's
// step past it.
func cutAtEnd(ctx context.Context, stop context.CancelFunc) {
	for !simCut.Load() {
		if sleep(ctx, 10*time.Millisecond) != nil {
			return
		}
	}
	stop()
}

// simAddr names replica i's server in run id: an address of its own, an
// IP so that nothing looks it up, for the timing kept per address.
func simAddr(id int64, i int) string {
	n := id<<8 | int64(i)
	return fmt.Sprintf("10.%d.%d.%d:6379", n>>16&255, n>>8&255, n&255)
}

// world is what the replicas of a run share: the vendor and the record.
type world struct {
	s      schedule
	start  time.Time
	jitter func() time.Duration
	stalls []atomic.Int64 // how much slower each replica's link to Redis is now
	vendor *simVendor     // nil for a strict count (check)
	mu     sync.Mutex
	o      outcome
	inside int
}

func (w *world) since() time.Duration { return time.Since(w.start) }

// arrive records call a reaching the vendor, and returns when it is done.
func (w *world) arrive(a simArrival, hold time.Duration) {
	w.mu.Lock()
	a.at = w.since()
	a.answer = a.at + hold
	w.o.arrivals = append(w.o.arrivals, a)
	w.inside++
	w.o.inFlight = max(w.o.inFlight, w.inside)
	w.mu.Unlock()
	time.Sleep(hold)
	w.mu.Lock()
	w.inside--
	w.mu.Unlock()
}

// simReplica is one process of the fleet.
type simReplica struct {
	i    int
	w    *world
	rdb  *redis.Client
	lim  atomic.Pointer[Limiter] // replaced by a deploy
	lim2 *Limiter                // the second quota of a shared rule
	ctx  context.Context
	stop context.CancelFunc
	// closing is made by the first close, and closed once it is done: a
	// second close waits on it, which the bubble counts as blocked, as it
	// does not a goroutine waiting on a lock (a sync.Once's): its clock
	// would stop, and the first close wait for ever for its timers.
	closing chan struct{}

	mu      sync.Mutex
	version context.CancelFunc // stops the workers of the version running
	workers *sync.WaitGroup    // and waits for them
	all     sync.WaitGroup     // the workers of every version
	done    bool               // run waits for all: no version starts
}

// newLimiter returns a limiter of the replica's quota name under policy p.
func (r *simReplica) newLimiter(p simPolicy, name string) *Limiter {
	s := r.w.s
	lim, err := New(r.rdb, name, p.policy(), Options{
		Mode: s.Mode, OnRedisError: s.OnError, ExpectedReplicas: s.Replicas, Logger: quiet(),
		ArrivalOrder: s.ArrivalOrder,
	})
	if err != nil {
		panic(fmt.Sprintf("seed %d: %v", s.Seed, err))
	}
	return lim
}

// halt stops the replica's version running, as a deploy does before it
// starts the new one: its calls still waiting for their slots give up,
// those under way finish. It reports whether the replica ran.
func (r *simReplica) halt() bool {
	r.mu.Lock()
	stop, workers := r.version, r.workers
	r.mu.Unlock()
	if stop == nil || r.ctx.Err() != nil {
		return false // not started yet, or gone
	}
	stop()
	workers.Wait()
	return true
}

// restart starts the replica again under policy p, after halt.
func (r *simReplica) restart(p simPolicy) {
	_ = r.lim.Swap(r.newLimiter(p, "sim")).Close(context.Background())
	r.start()
}

// start starts a version of the replica, its workers, unless the replica
// is done.
func (r *simReplica) start() {
	ctx, stop := context.WithCancel(r.ctx)
	workers := &sync.WaitGroup{}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		stop()
		return
	}
	r.version, r.workers = stop, workers
	if r.w.s.Interactive > 0 && r.i == r.w.s.Replicas-1 {
		workers.Add(1)
		r.all.Go(func() {
			defer workers.Done()
			calls := &sync.WaitGroup{}
			r.ask(ctx, calls)
			calls.Wait()
		})
		return
	}
	for k := range r.w.s.Workers {
		workers.Add(1)
		r.all.Go(func() {
			defer workers.Done()
			r.work(ctx, uint64(k))
		})
	}
}

// run starts the replica's workers at its join time, and waits for them.
func (r *simReplica) run() {
	s := r.w.s
	if !sleepUntil(r.ctx, s.Join[r.i]-r.w.since()) {
		return
	}
	r.start()
	<-r.ctx.Done()
	r.mu.Lock()
	r.done = true
	r.mu.Unlock()
	r.all.Wait()
}

// work calls through Do in a loop, as a worker that backs off on errors.
func (r *simReplica) work(version context.Context, k uint64) {
	s := r.w.s
	rng := rand.New(rand.NewPCG(s.Seed, uint64(r.i)<<32|k))
	for version.Err() == nil {
		err := r.call(version, rng, k, nil)
		r.backOff(version, rng, err)
	}
}

// call makes worker k's next call through Do, drawn from rng, with opts
// added to its plan's, and records it.
func (r *simReplica) call(version context.Context, rng *rand.Rand, k uint64, opts []CallOption) error {
	s := r.w.s
	p := s.plan(rng, k)
	p.a.replica = r.i
	p.opts = append(p.opts, opts...)
	ctx, cancel := version, context.CancelFunc(func() {})
	if s.Deadline > 0 {
		ctx, cancel = context.WithTimeout(version, s.Deadline)
	}
	c := simCall{replica: r.i, began: r.w.since(), priority: int(k) % s.classes(), cost: p.a.cost}
	if opts != nil {
		c.priority = interactive
	}
	// The vendor's time on a call: up to 5 ms, and 5 to 50 ms under a
	// concurrency limit, which bounds the calls by it alone.
	hold := time.Duration(rng.IntN(5)) * time.Millisecond
	if s.Policy.Kind == "concurrency" {
		hold = time.Duration(5+rng.IntN(46)) * time.Millisecond
	}
	if s.Hold > 0 {
		hold = s.Hold
	}
	lim := r.lim.Load()
	if p.a.quota == 1 {
		lim = r.lim2
	}
	unwatch := watchDeadline(s.Deadline)
	_, err := Do(ctx, lim, func(ctx context.Context) (struct{}, error) {
		if p.cancel {
			return struct{}{}, PermitFrom(ctx).Cancel(ctx)
		}
		time.Sleep(s.Vendor + r.w.jitter())
		c.arrived = r.w.since()
		p.a.local = PermitFrom(ctx).r.local
		p.a.scout = PermitFrom(ctx).r.room < 0
		if r.w.vendor != nil {
			if err := r.atVendor(ctx, p, hold); err != nil {
				return struct{}{}, err
			}
			c.fnEnd = r.w.since()
			c.counted = s.settle(ctx, p)
			return struct{}{}, nil
		}
		r.w.arrive(p.a, hold)
		c.fnEnd = r.w.since()
		c.counted = s.settle(ctx, p)
		return struct{}{}, nil
	}, p.opts...)
	unwatch()
	cancel()
	c.end, c.err = r.w.since(), err
	r.ended(c)
	return err
}

// interactive is the priority of the calls Schedule.Interactive starts.
const interactive = 10

// ask starts a call of priority interactive every s.Interactive, each in a
// goroutine of its own (an open loop: none waits for another), until
// version ends.
func (r *simReplica) ask(version context.Context, calls *sync.WaitGroup) {
	s := r.w.s
	for n := uint64(0); sleepUntil(version, s.Interactive); n++ {
		rng := rand.New(rand.NewPCG(s.Seed, uint64(r.i)<<32|1<<31|n))
		calls.Go(func() { _ = r.call(version, rng, 0, []CallOption{Priority(interactive)}) })
	}
}

// ended records call c, which must have ended as the API says a call ends.
func (r *simReplica) ended(c simCall) {
	err := c.err
	if err != nil && !errors.Is(err, ErrLimited) && !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrClosed) && !errors.Is(err, errVendorRefused) &&
		!errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrQueueFull) {
		panic(fmt.Sprintf("seed %d: a call failed with %v", r.w.s.Seed, err))
	}
	r.w.mu.Lock()
	r.w.o.calls = append(r.w.o.calls, c)
	r.w.mu.Unlock()
}

// backOff waits after a call that failed with err.
func (r *simReplica) backOff(version context.Context, rng *rand.Rand, err error) {
	var le *LimitedError
	switch {
	case err == nil:
	case errors.As(err, &le):
		if le.RetryAfter < 0 {
			panic(fmt.Sprintf("seed %d: a refusal says to retry %v from now: %v", r.w.s.Seed, le.RetryAfter, le))
		}
		// As a client that honours Retry-After does: the hint and up to
		// as much again at random, so that refused workers do not all
		// come back at once, within 10 ms and a window.
		wait := le.RetryAfter + time.Duration(rng.Int64N(int64(le.RetryAfter)+1))
		sleepUntil(version, min(max(wait, 10*time.Millisecond), max(r.w.s.Policy.Window, 100*time.Millisecond)))
	default:
		sleepUntil(version, 10*time.Millisecond)
	}
}

// drain closes the replica's limiters, as a process that shuts down does,
// records how Close went, and stops the replica.
func (r *simReplica) drain() {
	began := r.w.since()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := r.lim.Load().Close(ctx)
	if r.lim2 != nil {
		err = errors.Join(err, r.lim2.Close(ctx))
	}
	cancel()
	r.w.mu.Lock()
	r.w.o.closes = append(r.w.o.closes, simClose{replica: r.i, began: began, end: r.w.since(), err: err})
	r.w.mu.Unlock()
	r.close()
}

// close stops the replica and closes its limiters and client, once.
func (r *simReplica) close() {
	r.mu.Lock()
	closing, first := r.closing, r.closing == nil
	if first {
		closing = make(chan struct{})
		r.closing = closing
	}
	r.mu.Unlock()
	if !first {
		<-closing
		return
	}
	defer close(closing)
	r.stop()
	_ = r.lim.Load().Close(context.Background())
	if r.lim2 != nil {
		_ = r.lim2.Close(context.Background())
	}
	_ = r.rdb.Close()
}

// sleepUntil sleeps d unless ctx ends first, and reports whether it slept.
func sleepUntil(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	return sleep(ctx, d) == nil
}

// playEvents starts a goroutine per event of s, each at its time, until
// ctx ends.
func playEvents(ctx context.Context, wg *sync.WaitGroup, s schedule, r *sim.Redis, replicas []*simReplica, w *world, start time.Time) {
	for _, e := range s.Events {
		if e.Kind == "failover" {
			wg.Go(func() {
				if sleepUntil(ctx, e.At-e.For-time.Since(start)) {
					r.Snapshot()
				}
			})
		}
		wg.Go(func() {
			held := s.holdAcross(ctx, e, replicas[e.Replica], start)
			if !sleepUntil(ctx, e.At-time.Since(start)) {
				return
			}
			switch e.Kind {
			case "kill":
				r.Kill()
				sleepUntil(ctx, e.For)
				r.Restart()
				s.findLoss(ctx, replicas[e.Replica], held)
			case "flush":
				r.Flush()
				s.findLoss(ctx, replicas[e.Replica], held)
			case "scriptflush":
				r.FlushScripts()
			case "step":
				r.Step(e.For)
			case "freeze":
				r.Freeze()
				sleepUntil(ctx, e.For)
				r.Thaw()
			case "cut":
				r.Cut(e.Replica)
				sleepUntil(ctx, e.For)
				r.Mend(e.Replica)
			case "failover":
				_ = r.Failover()
			case "stall":
				// The replica's replies come e.For late, for three times
				// that: a starved process, a congested link.
				w.stalls[e.Replica].Store(int64(e.For))
				sleepUntil(ctx, 3*e.For)
				w.stalls[e.Replica].Store(0)
			case "leave":
				replicas[e.Replica].close()
			case "close":
				replicas[e.Replica].drain()
			case "deploy":
				deploy(s, replicas)
			}
		})
	}
}

// deploy stops the old version everywhere, then starts the new one, its
// rule of another kind over the same windows (see deployed), as the README
// says a deploy that changes a rule's kind must go.
func deploy(s schedule, replicas []*simReplica) {
	var halted []*simReplica
	for _, rep := range replicas {
		if rep.halt() {
			halted = append(halted, rep)
		}
	}
	// Each replica restarts by itself, as a deploy's processes do: one
	// after another, each waiting for its old limiter's Close (up to a
	// news ping), 200 replicas took 2 s to start (seed 561546).
	var restarts sync.WaitGroup
	for _, rep := range halted {
		restarts.Go(func() { rep.restart(s.deployed()) })
	}
	restarts.Wait()
}

// watchDeadline writes every goroutine's stack to the file -sim.stacks
// names when the call it is started for has not returned 100 ms past its
// deadline: where a late call waits. It returns the function that ends the
// watch.
func watchDeadline(deadline time.Duration) func() {
	if *simDump == "" || deadline == 0 {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		t := time.NewTimer(deadline + 100*time.Millisecond)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			buf := make([]byte, 1<<22)
			_ = os.WriteFile(*simDump, buf[:runtime.Stack(buf, true)], 0o644)
		}
	}()
	return func() { close(done) }
}

// go-redis logs every dial that fails: thousands in the simulation, where
// Redis is killed, and in the fault tests. Set before any test runs, since
// go-redis reads its logger unguarded.
func init() { redis.SetLogger(quietRedis{}) }

// quietRedis is go-redis's logger in this package's tests: silent.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// scriptCounter counts the script calls replica i's client sends into its
// world's outcome, and notes when the first was answered.
type scriptCounter struct {
	w *world
	i int
}

func (scriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		n := h.count([]redis.Cmder{cmd})
		err := next(ctx, cmd)
		h.answered(n)
		return err
	}
}

func (h scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := h.count(cmds)
		err := next(ctx, cmds)
		h.answered(n)
		return err
	}
}

// count adds the script calls among cmds to the outcome, and returns them.
func (h scriptCounter) count(cmds []redis.Cmder) int {
	n := 0
	for _, c := range cmds {
		if name := c.Name(); name == "evalsha" || name == "eval" {
			n++
		}
	}
	if n > 0 {
		h.w.mu.Lock()
		h.w.o.scripts += n
		h.w.mu.Unlock()
	}
	return n
}

// answered notes the replica's first script call answered, if n > 0.
func (h scriptCounter) answered(n int) {
	if n == 0 {
		return
	}
	h.w.mu.Lock()
	defer h.w.mu.Unlock()
	if h.w.o.firstReply == nil {
		h.w.o.firstReply = map[int]time.Duration{}
	}
	if _, ok := h.w.o.firstReply[h.i]; !ok {
		h.w.o.firstReply[h.i] = h.w.since()
	}
}
