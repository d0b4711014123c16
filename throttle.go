package throttle

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/lua"
	"github.com/throttlekit/throttle/policies"
)

// Mode says what a call does when the quota is full.
type Mode int

const (
	// Block books the earliest slot in which the call fits and waits for it,
	// within the context's deadline and the limiter's MaxWait. Waiters are
	// served in arrival order across the fleet. It is the default.
	Block Mode = iota
	// FailFast runs the call only if it fits now, and otherwise returns an
	// error matching ErrLimited at once.
	FailFast
)

// String returns the mode's name.
func (m Mode) String() string {
	switch m {
	case Block:
		return "Block"
	case FailFast:
		return "FailFast"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// Defaults of a Limiter.
const (
	// DefaultMaxWait bounds how long a call waits in Block mode when its
	// context has no earlier deadline.
	DefaultMaxWait = time.Minute
	// DefaultPrefix starts every Redis key a Limiter writes.
	DefaultPrefix = "throttle"
	// MaxNameLen is the longest quota name New accepts, in bytes.
	MaxNameLen = 128
)

// ErrLimited is matched, through errors.Is, by every error that refuses a
// call because the quota is full. The error is a *LimitedError, which says
// when to retry.
var ErrLimited = errors.New("throttle: rate limited")

// LimitedError is returned when a call does not fit the quota now (FailFast),
// or could not get a slot within its context deadline or MaxWait (Block).
type LimitedError struct {
	// Quota is the limiter's name.
	Quota string
	// RetryAfter is how long until the call would fit, as Redis saw it.
	RetryAfter time.Duration
}

// Error describes the refusal.
func (e *LimitedError) Error() string {
	return fmt.Sprintf("throttle: quota %q: rate limited, retry after %v", e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrLimited.
func (e *LimitedError) Is(target error) bool { return target == ErrLimited }

// An Option configures a Limiter in New.
type Option func(*settings)

type settings struct {
	mode    Mode
	maxWait time.Duration
	clock   func() time.Time
	prefix  string
}

// WithMode sets what a call does when the quota is full. The default is Block.
func WithMode(m Mode) Option { return func(s *settings) { s.mode = m } }

// WithMaxWait bounds how long a call may wait for its slot in Block mode. A
// call whose slot lies further away fails at once with ErrLimited instead of
// sleeping. The default is DefaultMaxWait; the context's deadline, when
// earlier, bounds the wait too.
func WithMaxWait(d time.Duration) Option { return func(s *settings) { s.maxWait = d } }

// WithClock makes the limiter pass the time from now() to the script instead
// of letting the script read Redis TIME. Use it only for hosted services that
// refuse TIME in scripts, and only when every replica's clock is synchronised:
// a replica whose clock runs ahead admits calls early by that much. Tests use
// it to drive time.
func WithClock(now func() time.Time) Option { return func(s *settings) { s.clock = now } }

// WithPrefix sets the start of every Redis key the limiter writes, so that
// several applications can share one Redis. The default is DefaultPrefix.
func WithPrefix(p string) Option { return func(s *settings) { s.prefix = p } }

// A CallOption describes one call: who it is for and what it costs.
type CallOption func(*call)

// Key names who the call is for: a tenant, a user, an API token. It selects
// the quota of every policies.PerKey limit; limits that are not per key ignore
// it. The key is hashed before it reaches Redis, so it may hold secrets and
// be of any length.
func Key(k string) CallOption { return func(c *call) { c.key, c.hasKey = k, true } }

// Cost makes the call count as n units (a batch of n messages, n tokens).
// The default is 1; n must be between 1 and the smallest Limit of the quota.
func Cost(n int) CallOption { return func(c *call) { c.cost = n } }

type call struct {
	key    string
	hasKey bool
	cost   int
}

// Limiter enforces one quota, shared by every process that uses the same
// Redis and the same name.
//
// The quota is a sliding window: at most Limit calls in any window of length
// Window, wherever the window starts, as most vendors count. One Lua script in
// Redis decides every call with Redis's own clock, so the fleet needs no
// synchronised clocks and never sees two different answers.
//
// Acquire and Do take a call through the limiter in the chosen Mode: Block
// (the default) books the earliest free slot and sleeps until it, which serves
// waiting calls in arrival order across the fleet at one Redis round trip per
// call; FailFast refuses a call that does not fit now with ErrLimited. Allow
// asks the same question without ever waiting. Most callers should use Do, or
// a Transport for HTTP.
//
// A Limiter is safe for concurrent use.
type Limiter struct {
	rdb     redis.UniversalClient
	name    string
	rules   []policies.Rule
	keys    []string // Redis key of each shared rule; the prefix for per-key ones
	perKey  bool
	maxCost int
	s       settings
	id      string
	seq     atomic.Uint64
}

// New returns a Limiter for the quota called name on rdb (a Client,
// ClusterClient or FailoverClient), enforcing policy. It validates every
// argument and returns an error naming the first bad one. It does not contact
// Redis.
func New(rdb redis.UniversalClient, name string, policy policies.Policy, opts ...Option) (*Limiter, error) {
	if rdb == nil {
		return nil, errors.New("throttle: New: redis client is nil")
	}
	if err := validName("name", name); err != nil {
		return nil, err
	}
	rules, err := policies.Rules(policy)
	if err != nil {
		return nil, fmt.Errorf("throttle: quota %q: %w", name, err)
	}
	s := settings{mode: Block, maxWait: DefaultMaxWait, prefix: DefaultPrefix}
	for _, o := range opts {
		if o != nil {
			o(&s)
		}
	}
	switch {
	case s.mode != Block && s.mode != FailFast:
		return nil, fmt.Errorf("throttle: quota %q: WithMode: unknown mode %v", name, s.mode)
	case s.maxWait < 0:
		return nil, fmt.Errorf("throttle: quota %q: WithMaxWait must not be negative, got %v", name, s.maxWait)
	}
	if err := validName("WithPrefix", s.prefix); err != nil {
		return nil, err
	}
	l := &Limiter{rdb: rdb, name: name, rules: rules, s: s, id: newID()}
	l.maxCost = rules[0].Limit
	for i, r := range rules {
		l.keys = append(l.keys, s.prefix+":{"+name+"}:"+strconv.Itoa(i))
		l.perKey = l.perKey || r.PerKey
		l.maxCost = min(l.maxCost, r.Limit)
	}
	return l, nil
}

// validName rejects names that would break the hash tag or bloat every key.
func validName(field, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("throttle: %s must not be empty", field)
	case len(v) > MaxNameLen:
		return fmt.Errorf("throttle: %s must be at most %d bytes, got %d", field, MaxNameLen, len(v))
	case strings.ContainsAny(v, "{}"):
		return fmt.Errorf("throttle: %s must not contain '{' or '}' (they would break the Redis Cluster hash tag), got %q", field, v)
	}
	return nil
}

// newID returns a random prefix that makes this process's entries unique in
// every log, whatever the other processes do and whenever they do it.
func newID() string {
	var b [9]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// Name returns the quota's name.
func (l *Limiter) Name() string { return l.name }

// Mode returns the limiter's mode.
func (l *Limiter) Mode() Mode { return l.s.mode }

// Decision is the answer of Allow.
type Decision struct {
	// OK reports whether the call was admitted, and counted, now.
	OK bool
	// RetryAfter is how long until the call would fit, when it was not admitted.
	RetryAfter time.Duration
	// Remaining is how many units are still free now under the tightest limit.
	Remaining int
}

// Allow admits the call now if it fits, and counts it; it never waits and
// never books a slot. Limits are reported in the Decision, not as an error;
// the error is for bad options and Redis failures.
func (l *Limiter) Allow(ctx context.Context, opts ...CallOption) (Decision, error) {
	c, err := l.newCall(opts)
	if err != nil {
		return Decision{}, err
	}
	r, err := l.acquire(ctx, c, 0)
	if err != nil {
		return Decision{}, err
	}
	d := Decision{OK: r.admitted, Remaining: r.remaining}
	if !r.admitted {
		d.RetryAfter = r.wait
	}
	return d, nil
}

// Acquire takes a call through the limiter in its Mode. It returns a Permit
// once the call may run; the caller runs the call and then calls Release.
// In Block mode it waits for its slot, and fails at once with ErrLimited when
// the slot lies beyond the context's deadline or MaxWait, as
// golang.org/x/time/rate's Wait does. If the context ends while it waits, it
// gives its slot back and returns the context's error.
func (l *Limiter) Acquire(ctx context.Context, opts ...CallOption) (*Permit, error) {
	c, err := l.newCall(opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if l.s.mode == FailFast {
		r, err := l.acquire(ctx, c, 0)
		if err != nil {
			return nil, err
		}
		if !r.admitted {
			return nil, l.limited(r.wait)
		}
		return &Permit{l: l, call: c}, nil
	}
	return l.wait(ctx, c)
}

// Do acquires a permit from l, runs fn, and releases the permit. It returns
// fn's result, or the error that kept fn from running.
func Do[T any](ctx context.Context, l *Limiter, fn func(context.Context) (T, error), opts ...CallOption) (T, error) {
	p, err := l.Acquire(ctx, opts...)
	if err != nil {
		var zero T
		return zero, err
	}
	defer p.Release()
	return fn(ctx)
}

// Permit is the right to make one call. Release it when the call is done.
type Permit struct {
	l        *Limiter
	call     call
	waited   time.Duration
	released atomic.Bool
}

// Waited returns how long Acquire waited for the call's slot.
func (p *Permit) Waited() time.Duration { return p.waited }

// Release ends the call. A sliding window counts the call for its whole
// window whatever happens, so for it Release only marks the permit used;
// calling it more than once is harmless.
func (p *Permit) Release() { p.released.Store(true) }

func (l *Limiter) newCall(opts []CallOption) (call, error) {
	c := call{cost: 1}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	switch {
	case c.cost <= 0:
		return c, fmt.Errorf("throttle: quota %q: Cost must be > 0, got %d", l.name, c.cost)
	case c.cost > l.maxCost:
		return c, fmt.Errorf("throttle: quota %q: Cost %d exceeds the quota's smallest Limit %d and could never run", l.name, c.cost, l.maxCost)
	case l.perKey && !c.hasKey:
		return c, fmt.Errorf("throttle: quota %q has a per-key limit: the call needs a Key", l.name)
	}
	return c, nil
}

// redisKeys returns the sorted set of every rule for the call's key.
func (l *Limiter) redisKeys(c call) []string {
	if !l.perKey {
		return l.keys
	}
	sum := sha256.Sum256([]byte(c.key))
	hashed := base64.RawURLEncoding.EncodeToString(sum[:16])
	keys := make([]string, len(l.keys))
	for i, r := range l.rules {
		keys[i] = l.keys[i]
		if r.PerKey {
			keys[i] += ":" + hashed
		}
	}
	return keys
}

type result struct {
	admitted  bool
	wait      time.Duration
	remaining int
	now       time.Duration // Redis time since the Unix epoch
	keys      []string
	member    string
}

// acquire runs the script once: it admits the call, books it within maxWait,
// or refuses it.
func (l *Limiter) acquire(ctx context.Context, c call, maxWait time.Duration) (result, error) {
	keys := l.redisKeys(c)
	member := l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
	var now int64
	if l.s.clock != nil {
		now = l.s.clock().UnixMicro()
	}
	args := make([]any, 0, 4+2*len(l.rules))
	args = append(args, now, member, c.cost, maxWait.Microseconds())
	for _, r := range l.rules {
		args = append(args, r.Limit, r.Window.Microseconds())
	}
	v, err := lua.Acquire.Run(ctx, l.rdb, keys, args...).Int64Slice()
	if err != nil {
		return result{}, fmt.Errorf("throttle: quota %q: %w", l.name, err)
	}
	if len(v) != 4 {
		return result{}, fmt.Errorf("throttle: quota %q: unexpected script reply %v", l.name, v)
	}
	return result{
		admitted:  v[0] == 1,
		wait:      time.Duration(v[1]) * time.Microsecond,
		remaining: int(v[2]),
		now:       time.Duration(v[3]) * time.Microsecond,
		keys:      keys,
		member:    member,
	}, nil
}

func (l *Limiter) limited(retryAfter time.Duration) error {
	return &LimitedError{Quota: l.name, RetryAfter: retryAfter}
}
