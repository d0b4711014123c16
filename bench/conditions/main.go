// Command conditions measures whether throttle keeps its promise under the
// conditions users really run it in: Redis tens of milliseconds away, a
// machine whose cores are all busy, and a thousand limiters on one Redis.
// It prints one row per scenario.
//
// Every scenario runs a fleet against a strict fake vendor (the parent's
// internal/fakevendor, served over HTTP on loopback), which counts every
// arrival in an exact sliding window and answers 429 past its cap. The fleet
// is made of replica processes, this very program started again with a
// hidden -replica flag. Each replica makes its limiters (each with its own
// go-redis client, ContextTimeoutEnabled, and a hook counting the script
// calls it sends), opens their connection pools, and on the parent's word
// starts its workers. A worker loops, until the run ends, on
//
//	throttle.Do(ctx, lim, fn)
//
// in Block mode, where fn makes one HTTP GET to the vendor (on a context that
// the run's end does not cancel: an admitted call completes), which answers
// an accepted call after 10ms. The quota is a
// policies.SlidingLog with the vendor's Limit and Window and the default
// Margin (-margin sets another). Redis is a throwaway redis-server the program starts on a free
// 127.0.0.1 port (never 6379), with no persistence, emptied before each
// scenario and killed at the end.
//
// The scenarios:
//
//	fleet-dN         3 replicas × 20 workers, Limit 100 per 1s, Redis reached
//	                 through internal/delayproxy at a one-way latency of N ms
//	                 (N = 0, 1, 10, 25, 50), with a jitter of ±5ms (±0.5ms at
//	                 1ms, none at 0); each replica's client has PoolSize 20
//	busy             fleet-d25 with 2 busy-looping processes per core beside it
//	replicas-1000    one replica process with 1,000 limiters of one quota, each
//	                 with its own client (PoolSize 2) and one worker, Limit
//	                 1000 per 1s, Redis direct
//	replicas-100x10  the same with 100 limiters of 10 workers each
//	dials            3 replicas × 20 workers, Limit 100 per 1s, Redis direct, the
//	                 calls sent through a throttle.Transport (not Do) whose base
//	                 http.Transport opens a connection for every call (no
//	                 keep-alives), taking from 0 to 80ms at random (TLS
//	                 handshakes with a distant vendor): each call arrives at
//	                 the vendor up to 80ms after the limiter let it go, which
//	                 the limiter does not measure
//
// The columns of the main table:
//
//	admitted                 calls the limiter let through (fn ran)
//	429s                     units the vendor answered 429
//	max/cap                  the most calls the vendor saw in one of its windows, and its cap
//	utilization              the vendor's window count, averaged over every millisecond
//	                         from the end of its first window to its last arrival,
//	                         divided by the cap
//	scripts/admitted         EVALSHA and EVAL commands sent by every client (NOSCRIPT
//	                         fallbacks count twice; SCRIPT LOAD and the final Usage
//	                         read are not counted), per admitted call
//	wait p50 / p99           time from asking Do to fn's start, over the admitted calls
//	errors (late starts)     calls that failed before the end for any reason but Redis;
//	                         in brackets, those refused with ErrLimited because every
//	                         slot came too late to start in
//	unavailable (timed out)  calls that failed with ErrUnavailable before the end; in
//	                         brackets, those that took the limiters' RedisTimeout (1s)
//	                         or more: Redis answered too late (the rest were refused
//	                         at once, mostly by the open breaker)
//	spread / margin          Usage.Spread and the widest RuleUsage.Margin at the end
//
// A call that fails because the run ends is not an error: ErrLimited whose
// slot lies past the end, or the end's context error (even when wrapped in
// ErrUnavailable because it struck during a round trip). A worker whose call
// failed otherwise pauses 10ms and goes on.
//
// A second table shows where the time went: the script calls' round trips
// (through an Options.Observer), the time from fn's start to the arrival at
// the vendor, the most calls started (rather than arrived) in one vendor
// window, Redis's own mean time per EVALSHA and CPU time (INFO commandstats
// and cpu), the calls that failed at the end by how, and the machine's load
// average. Notes below give the first error of each kind and the distinct
// lines the replicas logged (the library logs through log/slog's default,
// to stderr).
//
// Usage:
//
//	cd bench && go run ./conditions [flags]
//
// The flags are:
//
//	-only NAMES    run only these scenarios, comma-separated (all)
//	-duration D    how long each scenario's workers run (10s)
//	-timeline D    also print, for each scenario, every D of its run: the
//	               calls that reached the vendor in it, the vendor's window
//	               count at its end, and the quota's spread and widest margin
//	               in force as a Usage read then saw them (0: none)
//
// All of them take about a minute and a half. The program needs
// redis-server on PATH.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/throttlekit/throttle/bench/internal/redisserver"
)

// options is what the flags ask for.
type options struct {
	only     []string
	duration time.Duration
	timeline time.Duration
	margin   time.Duration // the SlidingLog's Margin; 0: the default

	// exe is the program the replicas run; os.Executable() when empty.
	exe string
}

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case replicaFlag:
			os.Exit(replicaMain(os.Args[2:]))
		case spinFlag:
			spin()
		}
	}
	opts, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "conditions:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := run(ctx, opts, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "conditions:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var opts options
	fs := flag.NewFlagSet("conditions", flag.ContinueOnError)
	fs.SetOutput(stderr)
	only := fs.String("only", "", "run only these scenarios, comma-separated: "+strings.Join(scenarioNames(), ", "))
	fs.DurationVar(&opts.duration, "duration", 10*time.Second, "how long each scenario's workers run")
	fs.DurationVar(&opts.timeline, "timeline", 0, "print each scenario's arrivals, window count, spread and margin every `D` (0: none)")
	fs.DurationVar(&opts.margin, "margin", 0, "the quota's SlidingLog `Margin` (0: policies.DefaultMargin, 30ms)")
	if err := fs.Parse(args); err != nil {
		return opts, err
	}
	if fs.NArg() > 0 {
		return opts, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if opts.duration <= 0 {
		return opts, fmt.Errorf("-duration must be positive, got %v", opts.duration)
	}
	if opts.margin < 0 || opts.margin >= window {
		return opts, fmt.Errorf("-margin must lie in [0, %v), got %v", window, opts.margin)
	}
	if opts.timeline < 0 {
		return opts, fmt.Errorf("-timeline must not be negative, got %v", opts.timeline)
	}
	for name := range strings.SplitSeq(*only, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		if !slices.Contains(scenarioNames(), name) {
			return opts, fmt.Errorf("-only: no scenario %q; there are %s", name, strings.Join(scenarioNames(), ", "))
		}
		opts.only = append(opts.only, name)
	}
	return opts, nil
}

// run starts Redis, runs the chosen scenarios one after the other, and
// prints the table to stdout and the progress to stderr.
func run(ctx context.Context, opts options, stdout, stderr io.Writer) ([]result, error) {
	began := time.Now()
	exe := opts.exe
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("find this program to start the replicas: %w", err)
		}
	}
	srv, err := redisserver.Start("throttle-conditions-")
	if err != nil {
		return nil, err
	}
	defer srv.Stop()

	var results []result
	for _, sc := range scenarios() {
		if len(opts.only) > 0 && !slices.Contains(opts.only, sc.name) {
			continue
		}
		fmt.Fprintf(stderr, "%-16s running for %v ...", sc.name, opts.duration)
		t := time.Now()
		res, err := runScenario(ctx, env{exe: exe, redis: srv.Addr, timeline: opts.timeline, margin: opts.margin}, sc, opts.duration)
		if err != nil {
			fmt.Fprintln(stderr)
			return results, fmt.Errorf("%s: %w", sc.name, err)
		}
		fmt.Fprintf(stderr, " done in %.1fs\n", time.Since(t).Seconds())
		results = append(results, res)
	}

	margin := "default Margin"
	if opts.margin > 0 {
		margin = "Margin " + opts.margin.String()
	}
	fmt.Fprintf(stdout, "%d CPUs, %s %s/%s, redis-server %s; %v per scenario; quota policies.SlidingLog at the vendor's cap, %s, Block mode\n\n",
		runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH, srv.Version, opts.duration, margin)
	writeTable(stdout, results)
	fmt.Fprintln(stdout)
	writeDetails(stdout, results)
	writeNotes(stdout, results)
	if opts.timeline > 0 {
		writeTimelines(stdout, results, opts.timeline)
	}
	fmt.Fprintf(stdout, "\ntook %.0fs\n", time.Since(began).Seconds())
	return results, nil
}
