// Command inspect shows how full a throttle quota is, refreshing like top.
//
// Each refresh reads the quota with Limiter.Usage, one read-only script call
// that changes nothing in Redis, and shows a row per rule: its kind, limit
// and window, the units used in the window ending now, the units booked by
// waiting calls, the units a call could take now, how long until one more
// unit fits, and how full the rule is; above the table, whether the vendor
// paused the quota. When stdout is a terminal the screen is redrawn in
// place; otherwise each refresh is printed after the last.
//
// The policy must be given as the fleet configured it. A quota lives in one
// Redis key per rule, named by what the rule counts, not by its place:
// throttle:{NAME}:log<window µs> for a sliding log, counter<window>/<bucket
// width>, bucket<emission interval>, concurrency; calls: before it inside
// policies.PerCall; key:<id>:<hash of the key> for a per-key rule (see
// docs/PROTOCOL.md, 1.1). The script reads each key by its rule's kind,
// limit and window: another kind or window reads another rule's key, or
// none; another limit or margin reads the right key wrongly. For a per-key
// rule, -key names whose keys to read.
//
// Usage:
//
//	go run ./examples/inspect -redis redis://127.0.0.1:6379 -quota NAME -policy 'log:100/1s' [-key K] [-every 1s]
//	go run ./examples/inspect -redis redis://127.0.0.1:6379   (lists the quotas)
//	go run ./examples/inspect -demo
//
// The flags are:
//
//	-redis URL    the Redis holding the quota: redis://[:password@]host:port[/db], or host:port
//	-quota NAME   the quota's name, as given to throttle.New; without it (and
//	              without -policy and -key), the quotas the Redis holds are
//	              listed, found by their meta keys with SCAN
//	-policy P     the quota's policy, in the syntax below
//	-key K        the key whose per-key rules to read; required when the policy has a key: term
//	-prefix P     the key prefix, as given in throttle.Options.Prefix (throttle)
//	-every D      time between refreshes (1s)
//	-n N          refreshes before exiting; 0 until interrupted (0)
//	-demo         start an embedded Redis, run some traffic on a quota, and show it
//
// The policy syntax: terms joined by '+', each one of
//
//	log:LIMIT/WINDOW[,margin=D]                  policies.SlidingLog
//	counter:LIMIT/WINDOW[,buckets=N][,margin=D]  policies.SlidingCounter
//	bucket:RATE/PER[,burst=N]                    policies.TokenBucket
//	concurrency:MAX[,lease=D]                    policies.Concurrency
//
// prefixed with key: for a per-key limit. 'log:100/1s+key:log:10/1s' is
// policies.All(SlidingLog{100, time.Second}, PerKey{SlidingLog{10, time.Second}}).
package main

import (
	"bytes"
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

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// readTimeout bounds one refresh's read, so that a hung Redis shows as an
// error instead of a frozen screen.
const readTimeout = 2 * time.Second

// defaultPrefix is the key prefix a limiter uses when its Options.Prefix is
// empty.
const defaultPrefix = "throttle"

// config is what the flags ask for.
type config struct {
	Redis  string
	Quota  string
	Policy policies.Policy
	Rules  []policies.Rule
	Key    string
	HasKey bool
	Prefix string
	Every  time.Duration
	N      int
	Demo   bool
	List   bool // no -quota: list the quotas the Redis holds
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "inspect:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout, isTerminal(os.Stdout)); err != nil {
		fmt.Fprintln(os.Stderr, "inspect:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line into a config and checks it.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("inspect", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Redis, "redis", "", "the Redis holding the quota: redis://host:port or host:port")
	fs.StringVar(&cfg.Quota, "quota", "", "the quota's name, as given to throttle.New")
	policy := fs.String("policy", "", "the quota's policy, exactly as the fleet configured it (see below)")
	fs.StringVar(&cfg.Key, "key", "", "the key whose per-key rules to read")
	fs.StringVar(&cfg.Prefix, "prefix", defaultPrefix, "the key prefix, as given in throttle.Options.Prefix")
	fs.DurationVar(&cfg.Every, "every", time.Second, "time between refreshes")
	fs.IntVar(&cfg.N, "n", 0, "refreshes before exiting; 0 until interrupted")
	fs.BoolVar(&cfg.Demo, "demo", false, "start an embedded Redis, run some traffic on a quota, and show it")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: inspect -redis URL -quota NAME -policy P [-key K] [-every D] [-n N]\n       inspect -redis URL   (lists the quotas)\n       inspect -demo")
		fs.PrintDefaults()
		fmt.Fprintln(fs.Output(), "\n-policy takes "+policySyntax)
	}
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	fs.Visit(func(f *flag.Flag) { cfg.HasKey = cfg.HasKey || f.Name == "key" })
	if cfg.Demo {
		if cfg.Redis != "" {
			return cfg, errors.New("-demo runs its own Redis; leave -redis out")
		}
		if cfg.Quota == "" {
			cfg.Quota = demoQuota
		}
		if *policy == "" {
			*policy = demoPolicy
		}
	}
	switch {
	case cfg.Redis == "" && !cfg.Demo:
		return cfg, errors.New("-redis is required (or -demo)")
	case cfg.Quota == "" && *policy == "" && !cfg.HasKey:
		cfg.List = true
		return cfg, nil
	case cfg.Quota == "":
		return cfg, errors.New("-quota is required with -policy or -key (without them, inspect lists the quotas)")
	case cfg.Every <= 0:
		return cfg, fmt.Errorf("-every must be positive, got %v", cfg.Every)
	case cfg.N < 0:
		return cfg, fmt.Errorf("-n must not be negative, got %d", cfg.N)
	}
	var err error
	if cfg.Policy, err = parsePolicy(*policy); err != nil {
		return cfg, err
	}
	if cfg.Rules, err = policies.Rules(cfg.Policy); err != nil {
		return cfg, fmt.Errorf("-policy: %w", err)
	}
	perKey := false
	for _, r := range cfg.Rules {
		perKey = perKey || r.PerKey
	}
	switch {
	case perKey && !cfg.HasKey && cfg.Demo:
		cfg.Key, cfg.HasKey = demoKeys[0], true
	case perKey && !cfg.HasKey:
		return cfg, errors.New("-key is required: the policy has a key: term, whose keys differ for each key")
	case !perKey && cfg.HasKey:
		return cfg, errors.New("-key is given, but the policy has no key: term to read it with")
	}
	return cfg, nil
}

// run shows the quota every cfg.Every until ctx ends or cfg.N refreshes are
// done. It fails when the first read fails, as a wrong address or name
// would; later failures are shown and the display goes on.
func run(ctx context.Context, cfg config, stdout io.Writer, terminal bool) error {
	where := cfg.Redis
	if cfg.Demo {
		addr, stopDemo, err := startDemo(ctx, cfg)
		if err != nil {
			return err
		}
		defer stopDemo()
		cfg.Redis, where = addr, "embedded miniredis at "+addr+", with demo traffic"
	}
	rdb, err := newRedis(cfg.Redis)
	if err != nil {
		return err
	}
	defer rdb.Close()
	if cfg.List {
		return listQuotas(ctx, rdb, cfg.Prefix, stdout)
	}
	lim, err := throttle.New(rdb, cfg.Quota, cfg.Policy, throttle.Options{Prefix: cfg.Prefix})
	if err != nil {
		return err
	}
	var opts []throttle.CallOption
	if cfg.HasKey {
		opts = append(opts, throttle.Key(cfg.Key))
	}

	tick := time.NewTicker(cfg.Every)
	defer tick.Stop()
	var buf bytes.Buffer
	for i := 0; cfg.N == 0 || i < cfg.N; i++ {
		if i > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
		}
		f := frame{Quota: cfg.Quota, Prefix: cfg.Prefix, Redis: where, Key: cfg.Key, HasKey: cfg.HasKey, Rules: cfg.Rules}
		rctx, cancel := context.WithTimeout(ctx, readTimeout)
		f.Usage, f.Err = lim.Usage(rctx, opts...)
		cancel()
		f.At = time.Now()
		if i == 0 && f.Err != nil {
			return f.Err
		}
		// One write per refresh, so that the screen never shows half a frame.
		buf.Reset()
		switch {
		case terminal:
			buf.WriteString(clearScreen)
		case i > 0:
			buf.WriteString("\n")
		}
		render(&buf, f)
		if _, err := stdout.Write(buf.Bytes()); err != nil {
			return err
		}
	}
	return nil
}

// newRedis returns a client for a redis:// URL or a host:port.
func newRedis(spec string) (*redis.Client, error) {
	if strings.Contains(spec, "://") {
		opts, err := redis.ParseURL(spec)
		if err != nil {
			return nil, fmt.Errorf("-redis: %w", err)
		}
		return redis.NewClient(opts), nil
	}
	if !strings.Contains(spec, ":") {
		return nil, fmt.Errorf("-redis: %q is neither a redis:// URL nor host:port", spec)
	}
	return redis.NewClient(&redis.Options{Addr: spec}), nil
}

// isTerminal reports whether f is a terminal, where the screen can be
// redrawn in place.
func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
