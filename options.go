package throttle

import (
	"cmp"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// Mode says what a call does when the quota is full. The empty Mode, unset,
// is Block.
type Mode string

const (
	// Block books the earliest slot in which the call fits and waits for it,
	// within the context's deadline and the limiter's MaxWait. Waiters of a
	// class (a Priority, or a key under a limit every key shares) are
	// served in arrival order across the fleet; a full quota holds each
	// class above them its share. It is the default.
	Block Mode = "Block"
	// FailFast runs the call only if it fits now, and otherwise returns an
	// error matching ErrLimited at once. It waits only for Redis: a reply
	// read too late to start in asks again for the moment that much ahead
	// (milliseconds; see Limiter.Allow).
	FailFast Mode = "FailFast"
	// Queue puts the call in a bounded local queue, served by Priority and
	// then in arrival order; the calls at the head book their slots as in
	// Block. A full queue answers ErrQueueFull at once (see Options.Overflow).
	// Close drains the queue.
	Queue Mode = "Queue"
)

// Defaults of a Limiter (see Options).
const (
	defaultMaxWait      = time.Minute
	defaultPrefix       = "throttle"
	defaultMaxQueue     = 10_000
	defaultRedisTimeout = time.Second
	// maxNameLen is the longest quota name or Prefix New accepts, in bytes.
	maxNameLen = 128
)

// Options tune a Limiter in New. The zero value of every field picks its
// default, so Options{} is a limiter in Block mode that fails closed. New
// takes one Options value, or none: two are an error, since nothing
// could say which of their fields should win.
type Options struct {
	// Mode is what a call does when the quota is full. The default is Block.
	Mode Mode
	// MaxWait bounds how long a call may wait for its slot in Block and
	// Queue mode: a call whose slot lies further away fails at once with
	// ErrLimited instead of sleeping; the context's deadline, when earlier,
	// bounds the wait too. When 0, a call waits for any slot before its
	// context's deadline, and a minute at most when its context has none.
	MaxWait time.Duration
	// MaxQueue bounds the local queue of a limiter in Queue mode. The
	// default is 10,000 calls.
	MaxQueue int
	// Overflow says which call a full queue turns away. The default is
	// RejectNew.
	Overflow Overflow

	// OnRedisError is what a call does when Redis cannot decide it. The
	// default is FailClosed. Whatever the choice, a breaker stops sending
	// calls to a Redis that keeps failing (three failures in a row, over
	// 50ms at least), probes it every 100 to 250ms, jittered, and returns
	// to it by itself once it answers; each switch is logged. A Redis that
	// answers with an error reply (a user without a right the scripts
	// need, a key of another type) is no outage: such a call fails with
	// ErrUnavailable whatever OnRedisError says.
	OnRedisError OnRedisError
	// ExpectedReplicas is how many processes share the quota, for the Local
	// fallback: each then admits Limit/n per window, so that the fleet
	// stays under the cap even when every replica has lost Redis, once a
	// window has passed since it took over (see Local). Local needs it.
	ExpectedReplicas int
	// RedisTimeout bounds how long a decision waits for Redis, apart from
	// the caller's context, so that a hung Redis cannot hang every outbound
	// call: past it the call fails with ErrUnavailable. It runs from when
	// the call asks, its wait behind the script call of other calls of the
	// process included, unless Redis answers that one (a slow Redis is not
	// a failing one). The default is one second.
	//
	// go-redis stops reading a reply at a context's deadline only when its
	// Options.ContextTimeoutEnabled is set; otherwise its ReadTimeout (3s by
	// default) bounds the call that is talking to Redis, while the calls
	// queued behind it still give up at this timeout. Set
	// ContextTimeoutEnabled on the client you pass to New.
	RedisTimeout time.Duration
	// Prefix starts every Redis key the limiter writes, so that several
	// applications can share one Redis. The default is "throttle".
	Prefix string

	// Observer is told what the limiter, and the transports built on it,
	// do (see Event): the calls admitted and refused and how long they
	// waited, each round trip to Redis, the vendor's pushback, the switches
	// to and from a fallback. It feeds metrics; the Prometheus and
	// OpenTelemetry adapters live in their own modules (observe/prometheus,
	// observe/otel), and their Observe methods are Observers. It is called
	// on the path of every call: it must be quick, must not block, and must
	// be safe for concurrent use. The default is none, and none of this
	// work is done.
	Observer func(Event)
	// Logger is where the limiter reports what it changes by itself: Redis
	// losing a quota's data, switching to and from a fallback. The default
	// is slog.Default().
	Logger *slog.Logger
	// Shadow puts the limiter in shadow mode: it decides and reports every
	// call (to its Observer, see Event.Shadow) as FailFast would, without
	// waiting, and lets every call through at once, refused or not. Roll a limiter out in front of
	// a live vendor this way, and watch what it would have done. It changes
	// nothing the vendor or a live quota of the same name sees: it keeps
	// its calls, pauses and learned caps under Prefix + ":shadow" (Usage,
	// Quotas and the dashboard read them there), and a Transport sends each
	// request once.
	Shadow bool
	// WithoutLearning keeps the configured limits whatever the vendor says:
	// its refusals pause the fleet, but never teach the quota a lower cap
	// (see Permit.Heard). Its remaining counts are still heeded.
	WithoutLearning bool
	// ArrivalOrder serves the quota first come, first served across the
	// fleet: the limiter's calls book the earliest free slot, and hold no
	// share for a class of calls (see Priority). By default a full quota
	// keeps, in every replica, the share that higher priorities and, under
	// a rule every key shares, lighter keys booked in the last window and
	// a half, so that their calls find room when they come; a fleet whose
	// calls are all of priority 0 and of no key behaves the same either way.
	ArrivalOrder bool
	// Clock makes the limiter pass the time from Clock() to the script
	// instead of letting the script read Redis TIME. Use it only for hosted
	// services that refuse TIME in scripts, and only when every replica's
	// clock is synchronised: a replica whose clock runs ahead admits calls
	// early by that much. Tests use it to drive time.
	Clock func() time.Time
}

type settings struct {
	observer     func(Event)
	shadow       bool
	onRedisError OnRedisError
	replicas     int
	logger       *slog.Logger
	redisTimeout time.Duration
	mode         Mode
	maxWait      time.Duration
	clock        func() time.Time
	prefix       string
	maxQueue     int
	overflow     Overflow
	noLearning   bool
	arrival      bool
	maxWaitSet   bool
}

// newSettings applies opts to the defaults and checks the result, naming
// the first bad option.
func newSettings(name string, opts []Options) (settings, error) {
	var o Options
	switch len(opts) {
	case 0:
	case 1:
		o = opts[0]
	default:
		return settings{}, fmt.Errorf("throttle: quota %q: New takes one Options value, got %d: set every field in one", name, len(opts))
	}
	s := settings{
		observer: o.Observer, shadow: o.Shadow, onRedisError: o.OnRedisError, replicas: o.ExpectedReplicas,
		logger: o.Logger, redisTimeout: o.RedisTimeout, mode: o.Mode, maxWait: o.MaxWait, clock: o.Clock,
		prefix: o.Prefix, maxQueue: o.MaxQueue, overflow: o.Overflow, noLearning: o.WithoutLearning,
		arrival: o.ArrivalOrder, maxWaitSet: o.MaxWait > 0,
	}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	if s.maxWait == 0 {
		s.maxWait = defaultMaxWait
	}
	if s.prefix == "" {
		s.prefix = defaultPrefix
	}
	if s.maxQueue == 0 {
		s.maxQueue = defaultMaxQueue
	}
	if s.redisTimeout == 0 {
		s.redisTimeout = defaultRedisTimeout
	}
	s.mode = cmp.Or(s.mode, Block)
	s.onRedisError = cmp.Or(s.onRedisError, FailClosed)
	s.overflow = cmp.Or(s.overflow, RejectNew)
	var err error
	switch {
	case s.mode != Block && s.mode != FailFast && s.mode != Queue:
		err = fmt.Errorf("throttle: quota %q: Options.Mode: unknown mode %q (Block, FailFast or Queue)", name, s.mode)
	case s.maxWait < 0:
		err = fmt.Errorf("throttle: quota %q: Options.MaxWait must not be negative, got %v", name, s.maxWait)
	case s.onRedisError != FailClosed && s.onRedisError != FailOpen && s.onRedisError != Local:
		err = fmt.Errorf("throttle: quota %q: Options.OnRedisError: unknown policy %q (FailClosed, FailOpen or Local)", name, s.onRedisError)
	case s.replicas < 0:
		err = fmt.Errorf("throttle: quota %q: Options.ExpectedReplicas must not be negative, got %d", name, s.replicas)
	case s.onRedisError == Local && s.replicas == 0:
		err = fmt.Errorf("throttle: quota %q: Options.OnRedisError Local needs Options.ExpectedReplicas, to divide the quota among the replicas", name)
	case s.redisTimeout < 0:
		err = fmt.Errorf("throttle: quota %q: Options.RedisTimeout must not be negative, got %v", name, s.redisTimeout)
	case s.maxQueue < 0:
		err = fmt.Errorf("throttle: quota %q: Options.MaxQueue must not be negative, got %d", name, s.maxQueue)
	case s.overflow != RejectNew && s.overflow != ShedOldest && s.overflow != ShedLowest:
		err = fmt.Errorf("throttle: quota %q: Options.Overflow: unknown overflow %q (RejectNew, ShedOldest or ShedLowest)", name, s.overflow)
	default:
		err = validName("Options.Prefix", s.prefix)
	}
	return s, err
}

// keyPrefix starts every key the limiter writes: Prefix, and in shadow
// mode a keyspace of its own, of which a live quota sees nothing.
func (s settings) keyPrefix() string {
	if s.shadow {
		return s.prefix + ":shadow"
	}
	return s.prefix
}

// validName rejects names that would break the hash tag or bloat every key.
func validName(field, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("throttle: %s must not be empty", field)
	case len(v) > maxNameLen:
		return fmt.Errorf("throttle: %s must be at most %d bytes, got %d", field, maxNameLen, len(v))
	case strings.ContainsAny(v, "{}"):
		return fmt.Errorf("throttle: %s must not contain '{' or '}' (they would break the Redis Cluster hash tag), got %q", field, v)
	}
	return nil
}

// OnRedisError says what a call does when Redis cannot decide it: Redis is
// down, slow past the Redis timeout, or answers an error.
type OnRedisError string

const (
	// FailClosed does not make the call: it gets an error matching
	// ErrUnavailable. The vendor is never called over the cap. The default.
	FailClosed OnRedisError = "FailClosed"
	// FailOpen makes the call as if Redis had admitted it. The fleet keeps
	// working, and may go over the vendor's cap while Redis is away.
	FailOpen OnRedisError = "FailOpen"
	// Local decides the call in this process, under the quota's limits
	// divided by the number of replicas (see Options.ExpectedReplicas): the fleet
	// stays under the cap, at the price of the quota a shared Redis would
	// have spread better.
	//
	// It admits nothing until a window (a TokenBucket's burst span, a
	// Concurrency lease) and the time the fleet takes to notice the failure
	// (RedisTimeout and 200ms) have passed since it took over: the calls
	// Redis admitted before it failed may fill that window, and no replica
	// sees them. With a window of a second, calls go again 1.2s into an
	// outage; with a window of an hour, only an hour and 1.2s into it, and
	// Local is FailClosed for every shorter outage. Choose it for quotas
	// whose windows are short beside the outages it should ride out.
	Local OnRedisError = "Local"
)

// Overflow says which call a full queue turns away, as Bottleneck's
// strategies do.
type Overflow string

const (
	// RejectNew turns the new call away with ErrQueueFull. The default.
	RejectNew Overflow = "RejectNew"
	// ShedOldest lets the new call in and turns away the call that has
	// waited longest, which gets ErrQueueFull: fresh work is worth more.
	ShedOldest Overflow = "ShedOldest"
	// ShedLowest lets the new call in if its Priority is higher than that of
	// some waiting call, and turns away the newest of the lowest-priority
	// calls; otherwise the new call is turned away.
	ShedLowest Overflow = "ShedLowest"
)
