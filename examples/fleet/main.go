// Command fleet shows a fleet of replicas sharing one vendor rate cap through
// throttle and one Redis: no 429s, and the cap fully used.
//
// It starts a strict fake vendor, which counts every call in an exact sliding
// window and answers 429 past its cap, and an embedded Redis unless -redis
// names one. It then runs -procs replicas as separate processes of this same
// program. Each replica calls the vendor over HTTP from -workers goroutines,
// and a throttle.Limiter shared through Redis admits every call first.
//
// While the fleet runs, a line on stderr shows the rate the vendor accepts
// against the cap, the calls waiting for a slot and the 429s so far. At the
// end a table per replica and for the fleet shows the calls admitted, the
// vendor's 429s, the share of the cap used, the wait for a slot and the Redis
// script calls per admitted call; an SVG chart shows the calls the vendor
// accepted each second against the cap.
//
// With -compare the same fleet runs twice more the way fleets often do it
// today, with no shared state: each replica with its own token bucket, once
// set to limit/procs and once to the whole limit. The three runs are printed
// side by side.
//
// The load is uneven on purpose, as real traffic is: the fleet asks for
// -demand times the cap, and replica 0 gets the -skew share of it.
//
// Usage:
//
//	go run ./examples/fleet [flags]
//
// The flags are:
//
//	-procs N         replica processes (3)
//	-workers M       goroutines calling the vendor in each replica (20)
//	-limit L         vendor cap: calls per window (50)
//	-window W        vendor window (1s)
//	-margin D        window margin of the shared quota; 0 means policies.DefaultMargin
//	-duration D      how long the fleet runs (12s; 6s per run with -compare)
//	-mode M          block or failfast: what a call does when the quota is full (block)
//	-tenants N       give each call one of N tenant keys under a per-tenant limit (0: none)
//	-tenant-limit T  calls per window for each tenant (0: 2*limit/tenants)
//	-demand F        calls the fleet asks for, as a multiple of the cap; 0 for as many as admitted (1.2)
//	-skew S          share of the demand on replica 0, the rest spread evenly (0.7)
//	-redis URL       Redis to use instead of the embedded one: redis://host:port, or host:port,host:port for a cluster
//	-cluster         treat -redis as a Redis Cluster even with a single address
//	-chart PATH      SVG chart to write; empty for none (fleet.svg)
//	-compare         also run the fleet with a local limiter per replica and compare
//	-metrics ADDR    serve Prometheus metrics at http://ADDR/metrics while the fleet runs, as :9099 (none)
//
// With -metrics, the parent serves what the replicas report and what the
// vendor counts, in the Prometheus text format: the calls admitted and
// limited per replica, their waits, the vendor's 429s, the calls waiting,
// the Redis scripts run, and the share of the cap in use. The metrics are
// listed in observe/README.md. Give -duration time enough for a few scrapes.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"

	"github.com/throttlekit/throttle"
)

// Defaults of the flags.
const (
	defaultDuration        = 12 * time.Second
	defaultCompareDuration = 6 * time.Second
)

// config is what the flags ask for.
type config struct {
	Procs       int
	Workers     int
	Limit       int
	Window      time.Duration
	Margin      time.Duration
	Duration    time.Duration
	Mode        throttle.Mode
	Tenants     int
	TenantLimit int
	Demand      float64
	Skew        float64
	Redis       string
	Cluster     bool
	Chart       string
	Compare     bool
	Metrics     string

	// exe is the program the replicas run; os.Executable() when empty.
	// Tests set it to the test binary, which dispatches in TestMain.
	exe string
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == replicaFlag {
		os.Exit(replicaMain(os.Args[2:]))
	}
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleet:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	_, err = run(ctx, cfg, os.Stdout, os.Stderr)
	switch {
	case ctx.Err() != nil:
		fmt.Fprintln(os.Stderr, "fleet: interrupted")
		os.Exit(130)
	case err != nil:
		fmt.Fprintln(os.Stderr, "fleet:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line into a config and checks it.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	cfg := config{}
	fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.Procs, "procs", 3, "replica processes")
	fs.IntVar(&cfg.Workers, "workers", 20, "goroutines calling the vendor in each replica")
	fs.IntVar(&cfg.Limit, "limit", 50, "vendor cap: calls per window")
	fs.DurationVar(&cfg.Window, "window", time.Second, "vendor window")
	fs.DurationVar(&cfg.Margin, "margin", 0, "window margin of the shared quota; 0 means policies.DefaultMargin")
	fs.DurationVar(&cfg.Duration, "duration", defaultDuration, "how long the fleet runs; 6s per run with -compare unless set")
	mode := fs.String("mode", "block", "what a call does when the quota is full: block or failfast")
	fs.IntVar(&cfg.Tenants, "tenants", 0, "give each call one of N tenant keys under a per-tenant limit; 0 for none")
	fs.IntVar(&cfg.TenantLimit, "tenant-limit", 0, "calls per window for each tenant; 0 means 2*limit/tenants")
	fs.Float64Var(&cfg.Demand, "demand", 1.2, "calls the fleet asks for, as a multiple of the cap; 0 for as many as admitted")
	fs.Float64Var(&cfg.Skew, "skew", 0.7, "share of the demand on replica 0, the rest spread evenly")
	fs.StringVar(&cfg.Redis, "redis", "", "Redis to use instead of the embedded one: redis://host:port, or host:port,host:port for a cluster")
	fs.BoolVar(&cfg.Cluster, "cluster", false, "treat -redis as a Redis Cluster even with a single address")
	fs.StringVar(&cfg.Chart, "chart", "fleet.svg", "SVG chart to write; empty for none")
	fs.BoolVar(&cfg.Compare, "compare", false, "also run the fleet with a local limiter per replica and compare")
	fs.StringVar(&cfg.Metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics while the fleet runs, as :9099; empty for none")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	m, err := parseMode(*mode)
	if err != nil {
		return cfg, err
	}
	cfg.Mode = m
	durationSet := false
	fs.Visit(func(f *flag.Flag) { durationSet = durationSet || f.Name == "duration" })
	if cfg.Compare && !durationSet {
		cfg.Duration = defaultCompareDuration
	}
	if cfg.Tenants > 0 && cfg.TenantLimit == 0 {
		cfg.TenantLimit = max(1, (2*cfg.Limit+cfg.Tenants-1)/cfg.Tenants)
	}
	return cfg, cfg.validate()
}

func (c config) validate() error {
	switch {
	case c.Procs < 1:
		return fmt.Errorf("-procs must be at least 1, got %d", c.Procs)
	case c.Workers < 1:
		return fmt.Errorf("-workers must be at least 1, got %d", c.Workers)
	case c.Limit < 1:
		return fmt.Errorf("-limit must be at least 1, got %d", c.Limit)
	case c.Window < time.Millisecond:
		return fmt.Errorf("-window must be at least 1ms, got %v", c.Window)
	case c.Margin < 0:
		return fmt.Errorf("-margin must not be negative, got %v", c.Margin)
	case c.Duration <= 0:
		return fmt.Errorf("-duration must be positive, got %v", c.Duration)
	case c.Tenants < 0:
		return fmt.Errorf("-tenants must not be negative, got %d", c.Tenants)
	case c.Tenants > 0 && c.TenantLimit < 1:
		return fmt.Errorf("-tenant-limit must be at least 1, got %d", c.TenantLimit)
	case c.Demand < 0:
		return fmt.Errorf("-demand must not be negative, got %v", c.Demand)
	case c.Skew < 0 || c.Skew > 1:
		return fmt.Errorf("-skew must be between 0 and 1, got %v", c.Skew)
	}
	return nil
}

func parseMode(s string) (throttle.Mode, error) {
	switch strings.ToLower(s) {
	case "block":
		return throttle.Block, nil
	case "failfast":
		return throttle.FailFast, nil
	}
	return "", fmt.Errorf("-mode must be block or failfast, got %q", s)
}

func modeFlag(m throttle.Mode) string { return strings.ToLower(string(m)) }

// replicaRate is the calls per second replica i asks for: Demand times the
// cap in all, Skew of it on replica 0. Zero means as many as admitted.
func (c config) replicaRate(i int) float64 {
	if c.Demand == 0 {
		return 0
	}
	total := c.Demand * float64(c.Limit) / c.Window.Seconds()
	switch {
	case c.Procs == 1:
		return total
	case i == 0:
		return total * c.Skew
	}
	return total * (1 - c.Skew) / float64(c.Procs-1)
}

// Report is everything one invocation measured.
type Report struct {
	// Runs holds the shared run first, then with -compare the split and
	// naive ones.
	Runs []Result
	// Chart is the path of the SVG written, or "" when none was.
	Chart string
}

// run starts the vendor and the Redis, runs the fleet once (three times with
// Compare), and prints the tables to stdout and the progress to stderr.
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) (Report, error) {
	var rep Report
	if err := cfg.validate(); err != nil {
		return rep, err
	}
	exe, err := cfg.executable()
	if err != nil {
		return rep, err
	}
	spec, where, stopRedis, err := cfg.startRedis()
	if err != nil {
		return rep, err
	}
	defer stopRedis()
	if err := pingRedis(ctx, spec, cfg.Cluster); err != nil {
		return rep, err
	}

	env := fleetEnv{exe: exe, redis: spec, cluster: cfg.Cluster}
	if cfg.Metrics != "" {
		env.metrics = &fleetMetrics{}
		url, stop, err := serveMetrics(cfg.Metrics, env.metrics)
		if err != nil {
			return rep, err
		}
		defer stop()
		fmt.Fprintf(stderr, "metrics: %s\n", url)
	}

	printHeader(stdout, cfg, where)
	rep.Runs, err = runVariants(ctx, cfg, env, stdout, stderr)
	if err != nil {
		return rep, err
	}
	if cfg.Chart != "" {
		if err := writeChart(cfg.Chart, rep.Runs); err != nil {
			return rep, err
		}
		rep.Chart = cfg.Chart
		fmt.Fprintf(stdout, "chart: %s\n", cfg.Chart)
	}
	return rep, ctx.Err()
}

// executable is the program the replicas run: this one, unless a test
// named its own binary.
func (c config) executable() (string, error) {
	if c.exe != "" {
		return c.exe, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find this program to start the replicas: %w", err)
	}
	return exe, nil
}

// startRedis returns the Redis the replicas share, as -redis names it, or
// an embedded one; where says which for the header, and stop ends it.
func (c config) startRedis() (spec, where string, stop func(), err error) {
	if c.Redis != "" {
		where = c.Redis
		if c.Cluster || strings.Contains(c.Redis, ",") {
			where += " (cluster)"
		}
		return c.Redis, where, func() {}, nil
	}
	mr, err := miniredis.Run()
	if err != nil {
		return "", "", nil, fmt.Errorf("start embedded Redis: %w", err)
	}
	return mr.Addr(), "embedded miniredis at " + mr.Addr(), mr.Close, nil
}

// runVariants runs the fleet once (three times with Compare), printing each
// table as it ends and the runs side by side after, and returns the runs.
// A run that fails ends them, the runs before it returned with the error.
func runVariants(ctx context.Context, cfg config, env fleetEnv, stdout, stderr io.Writer) ([]Result, error) {
	variants := []variant{shared}
	if cfg.Compare {
		variants = append(variants, split, naive)
	}
	var runs []Result
	for _, v := range variants {
		res, err := runFleet(ctx, cfg, v, env, stderr)
		if err != nil {
			return runs, fmt.Errorf("%s run: %w", v, err)
		}
		runs = append(runs, res)
		printResult(stdout, res)
		if ctx.Err() != nil {
			break
		}
	}
	if len(runs) > 1 {
		printComparison(stdout, runs)
	}
	return runs, nil
}
