// Command fleetsim simulates a fleet of small replicas sharing one throttle
// quota, so that what a fleet does at 10,000 replicas can be predicted from
// the Redis costs measured on this machine; and checks the simulation
// against the conditions program's measured runs of 1,000 replicas.
//
//	cd bench && go run ./fleetsim            # the simulated figures, 100 to 10,000 replicas
//	cd bench && go run ./fleetsim -measure   # and the accuracy: run ../conditions, compare
//
// # The model
//
// A discrete-event simulation, in microseconds, of the conditions program's
// replicas scenarios: processes of limiters (each with its own Redis client)
// of workers, each worker calling throttle.Do in a loop in Block mode on
// one quota, policies.SlidingLog{Limit: 1000, Window: 1s} with the default
// 30ms margin, until the run's end (10s). What it models, and how:
//
//   - Redis runs the acquire script of lua/ as the simulation's
//     quota does (script.go): the exact log with its entries and bookings,
//     the search for the earliest slot with its budget of 512 entries and
//     the log's hint, pacing at Window/Limit once twice the spread reaches
//     the margin's ceiling, give-backs, the fleet's spread (the 99th
//     percentile of the latenesses the limiters report, by 2s period, the
//     warm-up's period forgotten), the margins it gives and their holds,
//     and the warm-up of a new quota with its pacing of the lone calls of
//     many limiters (the log's latest 8 entries, 8 other limiters). The
//     search after a paced time reads at most 32 entries, pacing moves a
//     call at most twice, and the hint follows acquire.lua's rules (a search
//     from past the hint's room leaves it; a slot already past that is
//     given back lowers it only if it leaves room).
//     Pauses, losses, learned caps, the Local fallback and costs other than
//     1 are left out: the scenarios meet none of them.
//   - Redis is single-threaded, and its event loop works in turns: it runs
//     the scripts of every request that has arrived, one after the other in
//     arrival order, and writes their replies only at the end of the turn.
//     So when 1,000 replicas ask at once, the first of them hears back when
//     the last script has run (the "time in Redis" column).
//   - A script takes ScriptFixed + ScriptPerCall per call it decides +
//     ScriptPerEntry per log entry its searches read (the budget they
//     spend). The split is that of the TIME probes in docs/BENCH-NOTES.md ("Where
//     those 140 µs go": 64 µs for what every script does, 9 µs to write a
//     call's entry, 57 µs to search about 210 entries), scaled by 1.3
//     (-redis-scale): of the factors tried (1.0 to 1.9), the one that brings
//     replicas-1000's utilization and script calls per admitted call closest
//     to the calibration run. Redis's mean time per script then comes out at
//     about 130 µs, where the conditions program measured 176-286 µs for
//     replicas-1000: once the fleet runs steadily, the model's searches
//     read about 10 entries (the log's hint holds), fewer than Redis spends
//     time on. A scale of 1.8 matches Redis's time, and costs the simulated
//     replicas-1000 4-5% of utilization: docs/BENCH-NOTES.md ("10,000
//     replicas by simulation") shows both.
//   - The client side runs on the machine's 2 cores, less the one Redis
//     holds while it runs scripts: a first-come-first-served queue of CPU
//     work, served at the rate of the cores left (a fluid approximation: one
//     task may go faster than one core could). A script call costs the
//     client ClientScript (half to send it, half to read the reply), a call
//     to the vendor ClientSend from fn's start to its arrival at the vendor
//     (the client's request and the vendor's server reading it) and
//     ClientReturn for the answer to reach the worker, a wake from sleep
//     ClientWake. Each cost varies uniformly by ±Jitter. The network adds
//     NetOneWay each way.
//   - A limiter's first call subscribes it to the quota's news on a
//     connection of its own before it asks (news.go's listen): ClientConnect
//     of the client's CPU, and RedisConnect in one of Redis's turns.
//   - A worker is waiter.go's wait: it asks (calls of one limiter that ask
//     while a script call of it is on its way wait for the next one, up to
//     32, as batch.go batches them), and on the reply checks how late the
//     call would start after its slot beyond the fastest reply its process
//     has seen (timing.go), against half the margin the script gave. A call
//     too late is given back in its next script call and booked again (a
//     late reply asks that much later, as lead), at most 3 times, then fails
//     with a cancel script and the worker pauses 10ms. A booked call sleeps
//     until its slot by its process's fastest reply, no longer than the
//     whole wait from its reply's arrival, looking at that reply again half
//     the way (100ms at most) before, as waiter.go's sleepToSlot does, and is
//     checked again when it wakes. A call on time runs fn: the vendor answers
//     10ms after the arrival, and the worker calls Do again. A call whose
//     slot lies past the run's end is refused and its worker stops.
//   - Every worker asks at the run's start, in an order drawn from the seed.
//     Redis's clock starts at a phase of the timing period drawn from it too.
//
// The figures are those of the conditions program, computed the same way:
// utilization (the vendor's window count averaged every millisecond from
// the end of its first window to its last arrival, over the cap), script
// calls per admitted call (cancels included), wait p50/p99 from asking Do
// to fn's start, late-start failures. Each simulated figure is the mean of
// -seeds runs (seeds 1, 2, ...).
//
// # Calibrated constants
//
// Defaults holds them, each with where its value came from. The run they
// were calibrated on (2026-11-24, 2 cores, Redis 7.0.15, the first of the
// measured runs in docs/BENCH-NOTES.md): replicas-1000 0.875 of the cap, 1.251
// script calls per admitted call, wait 1055/2239 ms, script round trip
// 0.4/171/176 ms (p50/p99/max), fn start to vendor 0.1/18.5/53.9 ms, 176 µs
// per EVALSHA in Redis.
//
// The flags are:
//
//	-replicas N,N,...  the simulated fleets: N limiters of one worker in one
//	                   process, as replicas-1000 (100,300,1000,3000,10000)
//	-limit N           the quota's Limit per second for them (1000)
//	-duration D        how long the workers run (10s)
//	-seeds N           runs per simulated figure (5)
//	-measure           also run the conditions program's replicas scenarios
//	                   (about 40 s) and print measured against simulated
//	-runs N            with -measure, run the conditions program N times and
//	                   compare with the mean of the runs (1)
//	-measured F,F,...  compare with the mean of saved outputs of the
//	                   conditions program (or of this program with -measure)
//	                   instead of running it
//	-timeline          print each simulated fleet's calls per quarter second
//	-redis-scale F     the factor on the TIME probes' split of a script's
//	                   work in Redis (1.3)
//	-cores N           the cores the replicas share with Redis (2); a large
//	                   number stands for replicas on machines of their own
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"time"
)

// redisScale is the factor on the TIME probes' split of a script's work
// that fits the calibration run (see the package comment).
const redisScale = 1.3

// Defaults returns the calibrated costs, in microseconds.
func Defaults() Costs { return costs(redisScale) }

// costs returns the calibrated costs with the script's work scaled by scale.
func costs(scale float64) Costs {
	return Costs{
		// Loopback on this machine: PING's round trip is 20-130 µs over the
		// days of docs/BENCH-NOTES.md, half of it each way.
		NetOneWay: 30,
		// The TIME probes of docs/BENCH-NOTES.md, scaled.
		ScriptFixed:    64 * scale,
		ScriptPerCall:  9 * scale,
		ScriptPerEntry: 57.0 / 210 * scale,
		Cores:          2,
		// The script round trip's median, 0.4 ms on the calibration run, less
		// Redis's time and the network's.
		ClientScript: 150,
		// The way from fn's start to the vendor: its median was 0.1 ms on
		// the calibration run; the burst of 1,000 calls at the start took up
		// to 54 ms to reach the vendor, on the cores Redis leaves.
		ClientSend:   75,
		ClientReturn: 25,
		ClientWake:   10,
		// Guesses: a TCP connection on loopback, go-redis's HELLO and the
		// SUBSCRIBE of a limiter's first call. The simulated utilization
		// moves by less than 1% between none and twice these.
		ClientConnect: 100,
		RedisConnect:  20,
		// The conditions program's vendor and workers.
		VendorWork:   10_000,
		FailurePause: 10_000,
		// A guess: enough that no two workers run in lockstep.
		Jitter: 0.5,
	}
}

// measuredScenarios are the conditions program's scenarios the simulation
// is checked against.
var measuredScenarios = []Fleet{
	{Name: "replicas-1000", Processes: 1, Limiters: 1000, Workers: 1},
	{Name: "replicas-10x100", Processes: 10, Limiters: 100, Workers: 1},
	{Name: "replicas-100x10", Processes: 1, Limiters: 100, Workers: 10},
}

type options struct {
	replicas []int
	limit    int
	duration time.Duration
	seeds    int
	measure  bool
	runs     int
	measured []string
	timeline bool
	scale    float64
	cores    float64
}

func main() {
	opts, err := parseFlags(os.Args[1:])
	if err == flag.ErrHelp {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleetsim:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, opts, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "fleetsim:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (options, error) {
	var opts options
	fs := flag.NewFlagSet("fleetsim", flag.ContinueOnError)
	replicas := fs.String("replicas", "100,300,1000,3000,10000", "the simulated fleets: N limiters of one worker each, comma-separated")
	fs.IntVar(&opts.limit, "limit", 1000, "the quota's Limit per second for the simulated fleets")
	fs.DurationVar(&opts.duration, "duration", 10*time.Second, "how long the workers run")
	fs.IntVar(&opts.seeds, "seeds", 5, "simulated runs per figure")
	fs.BoolVar(&opts.measure, "measure", false, "also run the conditions program's replicas scenarios and compare")
	fs.IntVar(&opts.runs, "runs", 1, "with -measure, how many times to run the conditions program")
	measured := fs.String("measured", "", "compare with these saved outputs of the conditions program, comma-separated, instead of running it")
	fs.BoolVar(&opts.timeline, "timeline", false, "print each simulated fleet's calls per quarter second")
	fs.Float64Var(&opts.scale, "redis-scale", redisScale, "the factor on the TIME probes' split of a script's work in Redis")
	fs.Float64Var(&opts.cores, "cores", 2, "the cores the replicas share with Redis; a large number stands for replicas on machines of their own")
	if err := fs.Parse(args); err != nil {
		return opts, err
	}
	for name := range strings.SplitSeq(*measured, ",") {
		if name = strings.TrimSpace(name); name != "" {
			opts.measured = append(opts.measured, name)
		}
	}
	for s := range strings.SplitSeq(*replicas, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return opts, fmt.Errorf("-replicas: %q is not a number of replicas", s)
		}
		opts.replicas = append(opts.replicas, n)
	}
	switch {
	case opts.limit < 1:
		return opts, fmt.Errorf("-limit must be at least 1, got %d", opts.limit)
	case opts.runs < 1:
		return opts, fmt.Errorf("-runs must be at least 1, got %d", opts.runs)
	case opts.seeds < 1:
		return opts, fmt.Errorf("-seeds must be at least 1, got %d", opts.seeds)
	case opts.cores < 2:
		return opts, fmt.Errorf("-cores must be at least 2 (Redis holds one), got %v", opts.cores)
	case opts.scale <= 0:
		return opts, fmt.Errorf("-redis-scale must be positive, got %v", opts.scale)
	case opts.duration < 2*time.Second:
		return opts, fmt.Errorf("-duration must be at least 2s, got %v", opts.duration)
	}
	return opts, nil
}

// fleet returns f with the conditions program's quota and run length.
func (o options) fleet(f Fleet, limit int) Fleet {
	f.Limit, f.Window, f.Margin, f.Duration = limit, 1_000_000, 30_000, o.duration.Microseconds()
	return f
}

// run prints the accuracy of the simulation against the conditions
// program's runs, when there are any, then the simulated fleets.
func run(ctx context.Context, opts options, out, progress io.Writer) error {
	began := time.Now()
	costs := costs(opts.scale)
	costs.Cores = opts.cores
	fmt.Fprintf(out, "fleetsim: SlidingLog{Limit: %d, Window: 1s}, default margin, Block mode, %v per run, each simulated figure the mean of %d seeds; Redis's work per script scaled by %g; %g cores\n\n",
		opts.limit, opts.duration, opts.seeds, opts.scale, opts.cores)

	runs, err := measuredRuns(ctx, opts, out, progress)
	if err != nil {
		return err
	}
	checked := checkAgainst(runs, opts, costs)
	if len(checked) > 0 {
		fmt.Fprintf(out, "Accuracy: measured (m, the mean of %d runs of the conditions program; the runs' range in brackets) against simulated (s), and the simulation's difference\n\n", len(runs))
		writeAccuracy(out, checked)
		fmt.Fprintln(out)
	}

	var series []summary
	for _, n := range opts.replicas {
		f := opts.fleet(Fleet{Name: fmt.Sprintf("%d", n), Processes: 1, Limiters: n, Workers: 1}, opts.limit)
		series = append(series, simulate(f, costs, opts.seeds))
	}
	fmt.Fprintln(out, "Simulated fleets: N replicas of one worker in one process, as replicas-1000")
	fmt.Fprintln(out)
	writeSeries(out, series)
	fmt.Fprintln(out)
	writeChart(out, series, checked)
	if opts.timeline {
		fmt.Fprintln(out)
		writeTimelines(out, series)
	}
	fmt.Fprintf(out, "\ntook %.0fs\n", time.Since(began).Seconds())
	return nil
}

// measuredRuns returns the conditions program's rows, by scenario, of each
// run: read from the saved outputs -measured names, or run now with
// -measure; none without either.
func measuredRuns(ctx context.Context, opts options, out, progress io.Writer) ([]map[string]*Measured, error) {
	var runs []map[string]*Measured
	switch {
	case len(opts.measured) > 0:
		for _, name := range opts.measured {
			b, err := os.ReadFile(name)
			if err != nil {
				return nil, err
			}
			rows, err := parseConditions(string(b))
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			runs = append(runs, rows...)
		}
	case opts.measure:
		var names []string
		for _, f := range measuredScenarios {
			names = append(names, f.Name)
		}
		for i := range opts.runs {
			fmt.Fprintf(out, "The conditions program's run %d of %d:\n\n", i+1, opts.runs)
			text, err := measure(ctx, benchDir(), names, opts.duration.String(), out, progress)
			if err != nil {
				return nil, err
			}
			fmt.Fprintln(out)
			rows, err := parseConditions(text)
			if err != nil {
				return nil, err
			}
			runs = append(runs, rows...)
		}
	}
	return runs, nil
}

// checkAgainst simulates each measured scenario that the runs hold, and
// pairs it with the mean of the runs.
func checkAgainst(runs []map[string]*Measured, opts options, costs Costs) []check {
	var checked []check
	for _, f := range measuredScenarios {
		var ms []Measured
		for _, rows := range runs {
			if m, ok := rows[f.Name]; ok {
				ms = append(ms, *m)
			}
		}
		if len(ms) > 0 {
			checked = append(checked, check{m: mean(ms), runs: ms, sim: simulate(opts.fleet(f, 1000), costs, opts.seeds)})
		}
	}
	return checked
}
