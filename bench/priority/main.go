// Command priority measures whom a full quota serves first: whether an
// urgent call gets ahead of a fleet's batch work, and whether a tenant that
// calls a lot crowds out the tenants that call a little. It prints one table
// per scenario, with a row for each version of the library it measures.
//
// Every scenario runs three replicas, each a *throttle.Limiter of the same
// quota on a go-redis client of its own, against one throwaway redis-server
// that the program starts on a free 127.0.0.1 port. The calls go to a strict
// vendor in this process, which notes when each call started; at the end it
// counts the calls over its cap, 100 calls in any sliding second. Each call
// runs as
//
//	throttle.Do(ctx, lim, fn, opts...)
//
// where fn notes the call at the vendor. Its wait is the time from asking
// Do to fn's start. The run's end stops new calls; every call asked before
// it is seen through (within callTimeout), so no call fails because the run
// ends.
//
// The scenarios:
//
//	priority   SlidingLog{Limit: 100, Window: 1s}. Replicas 1 and 2 run 30
//	           batch workers each, in a closed loop, with Priority(0);
//	           replica 3 asks for one interactive call with Priority(10)
//	           every 100ms, each in a goroutine of its own. Once with every
//	           limiter in Block mode, once in Queue mode.
//	fairness   All(SlidingLog{Limit: 100, Window: 1s}, PerKey{Policy:
//	           SlidingLog{Limit: 100, Window: 1s}}), Block mode. The heavy
//	           tenant, Key("tenant-0"), runs 40 workers in a closed loop on
//	           replica 1; nine light tenants, tenant-1 to tenant-9, each ask
//	           for 5 calls a second (a ticker, a goroutine per call), the odd
//	           ones on replica 2, the even ones on replica 3.
//
// The versions (-versions): FCFS is first come, first served across the
// fleet (Options.ArrivalOrder): a Block call books the earliest free slot,
// and Priority orders only the local queue of a limiter in Queue mode, so
// it cannot put replica 3's calls ahead of the other replicas' calls.
// shares is the default: a full quota holds, in every replica, the share
// that higher priorities and lighter keys booked (or asked for and waited)
// in the last window and a half, so that their calls find room when they
// come (docs/PROTOCOL.md, 3.13). Each version is a row of each table, in
// the same run.
//
// The figures: waits are nearest-rank percentiles; "over the cap" counts
// the calls that found 100 others started in the second before them; "use
// of the cap" is the calls started from the run's first second to its end
// over 100 per second of that time. A saturated fleet takes its 100 calls
// at the start of each window, and a window with the default Margin is
// 1.03s, so that figure counts whole bursts and moves with -d: 14 bursts
// from 1s to 15s, 1.000, where the long run takes 100 per 1.03s, 0.971.
// The heavy tenant's share of what the light tenants left is counted over
// the same span, in the same bursts.
//
// Usage:
//
//	cd bench && go run ./priority [-d 15s] [-versions FCFS]
//
// It takes about three times -d. The program needs redis-server on PATH.
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
	duration time.Duration
	versions []version
}

// main runs the program; it stops early on an interrupt.
func main() {
	opts, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "priority:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := run(ctx, opts, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "priority:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line.
func parseFlags(args []string, stderr io.Writer) (options, error) {
	var opts options
	fs := flag.NewFlagSet("priority", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.DurationVar(&opts.duration, "d", 15*time.Second, "how long each run asks for calls")
	names := fs.String("versions", strings.Join(versionNames(), ","), "the versions to measure, comma-separated")
	if err := fs.Parse(args); err != nil {
		return opts, err
	}
	if fs.NArg() > 0 {
		return opts, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if opts.duration < 2*time.Second {
		return opts, fmt.Errorf("-d must be at least 2s (the first second is left out of the use of the cap), got %v", opts.duration)
	}
	for name := range strings.SplitSeq(*names, ",") {
		if name = strings.TrimSpace(name); name == "" {
			continue
		}
		i := slices.IndexFunc(versions, func(v version) bool { return v.name == name })
		if i < 0 {
			return opts, fmt.Errorf("-versions: no version %q; there are %s", name, strings.Join(versionNames(), ", "))
		}
		opts.versions = append(opts.versions, versions[i])
	}
	if len(opts.versions) == 0 {
		return opts, errors.New("-versions names no version")
	}
	return opts, nil
}

// results is what one run of the program measured.
type results struct {
	priority []priorityResult
	fairness []fairnessResult
}

// run starts Redis, runs every scenario for every version, and prints the
// tables to stdout and the progress to stderr.
func run(ctx context.Context, opts options, stdout, stderr io.Writer) (results, error) {
	began := time.Now()
	srv, err := redisserver.Start("throttle-priority-")
	if err != nil {
		return results{}, err
	}
	defer srv.Stop()

	var res results
	for _, v := range opts.versions {
		for _, mode := range priorityModes {
			fmt.Fprintf(stderr, "priority %s %s: running for %v ...", v.name, mode, opts.duration)
			r, err := runPriority(ctx, srv.Addr, v, mode, opts.duration)
			if err != nil {
				fmt.Fprintln(stderr)
				return res, fmt.Errorf("priority, %s, %s: %w", v.name, mode, err)
			}
			fmt.Fprintln(stderr, " done")
			res.priority = append(res.priority, r)
		}
		fmt.Fprintf(stderr, "fairness %s: running for %v ...", v.name, opts.duration)
		r, err := runFairness(ctx, srv.Addr, v, opts.duration)
		if err != nil {
			fmt.Fprintln(stderr)
			return res, fmt.Errorf("fairness, %s: %w", v.name, err)
		}
		fmt.Fprintln(stderr, " done")
		res.fairness = append(res.fairness, r)
	}

	fmt.Fprintf(stdout, "%d CPUs, %s %s/%s, redis-server %s; %v a run; a strict vendor at %d calls per %v\n\n",
		runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH, srv.Version, opts.duration, vendorLimit, vendorWindow)
	writeVersions(stdout, opts.versions)
	writePriority(stdout, res.priority)
	writeFairness(stdout, res.fairness)
	writeErrors(stdout, res)
	fmt.Fprintf(stdout, "\ntook %.0fs\n", time.Since(began).Seconds())
	return res, nil
}
