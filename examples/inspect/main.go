// Command inspect shows how full a throttle quota is, refreshing like top.
//
// Each refresh reads the quota with Limiter.Usage, one read-only script call
// that changes nothing in Redis, and shows a row per rule: its kind, limit
// and window, the units used in the window ending now, the units booked by
// waiting calls, the units a call could take now, how long until one more
// unit fits, and how full the rule is; above the table, whether the quota
// is paused and why (the vendor, a loss of its data, a new policy, a step
// of Redis's clock), and since when its data runs. When stdout is a
// terminal the screen is redrawn in place; otherwise each refresh is
// printed after the last.
//
// No policy needs typing: every quota stores its own description with its
// meta key (throttle.Open reads it), so -quota NAME is enough; with only
// -redis, inspect lists the quotas the Redis holds and shows the first.
// -policy reads a quota whose fleet runs a version that does not describe
// it, and must then be given exactly as the fleet configured it. A quota
// lives in one Redis key per rule, named by what the rule counts, not by
// its place: throttle:{NAME}:log<window µs> for a sliding log,
// counter<window>/<bucket width>, bucket<emission interval>, concurrency;
// calls: before it inside policies.PerCall, <unit>: inside policies.Unit;
// key:<id>:<hash of the key> for a per-key rule; throttle:{GROUP}/NAME: for
// a quota with policies.Shared rules, whose shared keys are
// throttle:{GROUP}//<id> (see docs/PROTOCOL.md, 1.1). A per-key rule is read
// for one key, named by -key; without it, its row shows no figures.
//
// Usage:
//
//	go run ./examples/inspect -redis redis://127.0.0.1:6379                (lists the quotas, shows the first)
//	go run ./examples/inspect -redis redis://127.0.0.1:6379 -quota NAME [-key K] [-every 1s]
//	go run ./examples/inspect -redis redis://127.0.0.1:6379 -quota NAME -policy 'log:100/1s'
//	go run ./examples/inspect -demo
//
// The flags are:
//
//	-redis URL    the Redis holding the quota: redis://[:password@]host:port[/db], or host:port
//	-quota NAME   the quota's name, as given to throttle.New; without it, the
//	              quotas the Redis holds are listed, found by their meta keys
//	              with SCAN, and the first is shown
//	-policy P     the quota's policy, in the syntax below, for a quota that
//	              holds no description of its own
//	-key K        the key whose per-key rules to read
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
	Group  string          // the quota's policies.Shared group, found when listed
	Policy policies.Policy // the policy typed with -policy, or the demo's
	Typed  bool            // -policy was given: read the quota under it, not its own description
	Key    string
	HasKey bool
	Prefix string
	Every  time.Duration
	N      int
	Demo   bool
	List   bool // no -quota: list the quotas the Redis holds, and show the first
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
	fs.StringVar(&cfg.Quota, "quota", "", "the quota's name, as given to throttle.New; without it, the quotas are listed and the first shown")
	policy := fs.String("policy", "", "the quota's policy, for a quota that holds no description of its own (see below)")
	fs.StringVar(&cfg.Key, "key", "", "the key whose per-key rules to read")
	fs.StringVar(&cfg.Prefix, "prefix", defaultPrefix, "the key prefix, as given in throttle.Options.Prefix")
	fs.DurationVar(&cfg.Every, "every", time.Second, "time between refreshes")
	fs.IntVar(&cfg.N, "n", 0, "refreshes before exiting; 0 until interrupted")
	fs.BoolVar(&cfg.Demo, "demo", false, "start an embedded Redis, run some traffic on a quota, and show it")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: inspect -redis URL [-quota NAME] [-key K] [-every D] [-n N]\n       inspect -redis URL -quota NAME -policy P\n       inspect -demo")
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
	cfg.Typed = *policy != ""
	if err := checkFlags(&cfg); err != nil {
		return cfg, err
	}
	if cfg.Demo && !cfg.Typed {
		*policy = demoPolicy
	}
	if *policy == "" {
		return cfg, nil
	}
	var err error
	if cfg.Policy, err = parsePolicy(*policy); err != nil {
		return cfg, err
	}
	rules, err := policies.Rules(cfg.Policy)
	if err != nil {
		return cfg, fmt.Errorf("-policy: %w", err)
	}
	if cfg.Demo && !cfg.HasKey && perKey(rules) {
		cfg.Key, cfg.HasKey = demoKeys[0], true
	}
	if cfg.Typed && cfg.HasKey && !perKey(rules) {
		return cfg, errors.New("-key is given, but the policy has no key: term to read it with")
	}
	return cfg, nil
}

// checkFlags checks the flags that do not need the policy.
func checkFlags(cfg *config) error {
	if cfg.Demo {
		if cfg.Redis != "" {
			return errors.New("-demo runs its own Redis; leave -redis out")
		}
		if cfg.Quota == "" {
			cfg.Quota = demoQuota
		}
	}
	switch {
	case cfg.Redis == "" && !cfg.Demo:
		return errors.New("-redis is required (or -demo)")
	case cfg.Quota == "" && (cfg.Typed || cfg.HasKey):
		return errors.New("-quota is required with -policy or -key (without them, inspect lists the quotas)")
	case cfg.Every <= 0:
		return fmt.Errorf("-every must be positive, got %v", cfg.Every)
	case cfg.N < 0:
		return fmt.Errorf("-n must not be negative, got %d", cfg.N)
	}
	cfg.List = cfg.Quota == ""
	return nil
}

// perKey reports whether some rule applies to each key separately.
func perKey(rules []policies.Rule) bool {
	for _, r := range rules {
		if r.PerKey {
			return true
		}
	}
	return false
}

// run shows the quota every cfg.Every until ctx ends or cfg.N refreshes are
// done; with cfg.List, it lists the quotas first and shows the first one.
// It fails when the first read fails, as a wrong address or name would;
// later failures are shown and the display goes on.
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
		names, err := listQuotas(ctx, rdb, cfg.Prefix, stdout)
		if err != nil || len(names) == 0 {
			return err
		}
		cfg.Quota, cfg.Group = names[0].Name, names[0].Group
		fmt.Fprintf(stdout, "\nshowing %q (-quota NAME shows another)\n\n", cfg.Quota)
	}
	lim, err := openQuota(ctx, rdb, &cfg)
	if err != nil {
		return err
	}
	return show(ctx, cfg, lim, where, stdout, terminal)
}

// openQuota returns a limiter that reads the quota: under the policy typed,
// or under the one the quota describes, found in its group when it has one.
func openQuota(ctx context.Context, rdb *redis.Client, cfg *config) (*throttle.Limiter, error) {
	if cfg.Typed {
		return throttle.New(rdb, cfg.Quota, cfg.Policy, throttle.Options{Prefix: cfg.Prefix})
	}
	q := throttle.QuotaName{Name: cfg.Quota, Group: cfg.Group}
	lim, err := throttle.Open(ctx, rdb, q, throttle.Options{Prefix: cfg.Prefix})
	if errors.Is(err, throttle.ErrNotDescribed) && q.Group == "" {
		// Perhaps a quota of a policies.Shared group, whose keys carry
		// the group's name: only a listing finds it.
		names, lerr := throttle.Quotas(ctx, rdb, cfg.Prefix)
		if lerr != nil {
			return nil, lerr
		}
		for _, n := range names {
			if n.Name == q.Name && n.Group != "" {
				cfg.Group = n.Group
				lim, err = throttle.Open(ctx, rdb, n, throttle.Options{Prefix: cfg.Prefix})
				break
			}
		}
	}
	if errors.Is(err, throttle.ErrNotDescribed) {
		return nil, fmt.Errorf("%w\n(a quota that has not called since its data began, or whose fleet does not describe it: give -policy)", err)
	}
	if err == nil && cfg.HasKey && !perKey(lim.Rules()) {
		return nil, fmt.Errorf("-key is given, but quota %q has no per-key rule to read it with", cfg.Quota)
	}
	return lim, err
}

// show refreshes the display of lim's quota until ctx ends or cfg.N
// refreshes are done.
func show(ctx context.Context, cfg config, lim *throttle.Limiter, where string, stdout io.Writer, terminal bool) error {
	// Without -key, a quota with per-key rules is read for a key of no
	// one's, whose figures are not shown (see render).
	var opts []throttle.CallOption
	if perKey(lim.Rules()) {
		opts = []throttle.CallOption{throttle.Key("\x00no key")}
	}
	if cfg.HasKey {
		opts = []throttle.CallOption{throttle.Key(cfg.Key)}
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
		f := frame{Quota: cfg.Quota, Group: cfg.Group, Prefix: cfg.Prefix, Redis: where, Key: cfg.Key, HasKey: cfg.HasKey, Rules: lim.Rules()}
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
