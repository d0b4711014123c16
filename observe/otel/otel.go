// Package otel records what throttle limiters do as OpenTelemetry metrics.
//
// An Observer records into instruments of the Meter given to New; its
// Observe method is a throttle.Options.Observer for every limiter. One
// Observer serves any number of limiters, told apart by the throttle.quota
// attribute, the limiter's name. No attribute ever holds a call's Key,
// which may be a secret and whose values are unbounded.
//
//	obs, err := throttleotel.New(otel.Meter("github.com/throttlekit/throttle"))
//	lim, err := throttle.New(rdb, "twilio-sms", policy, throttle.Options{Observer: obs.Observe})
//
// Names, units and attributes follow the OpenTelemetry semantic conventions:
// dotted names, durations in seconds ("s") as histograms, counts with
// annotations such as "{call}". The metrics are listed in observe/README.md.
package otel

import (
	"context"
	"errors"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/throttlekit/throttle"
)

// Attribute keys.
const (
	// QuotaKey is the limiter's name.
	QuotaKey = attribute.Key("throttle.quota")
	// OutcomeKey is how a call fared: admitted, limited, queue_full or
	// unavailable.
	OutcomeKey = attribute.Key("throttle.outcome")
	// ShadowKey marks refused calls that a limiter in shadow mode let
	// through.
	ShadowKey = attribute.Key("throttle.shadow")
	// ToKey is where calls are decided after a switch: fallback or redis.
	ToKey = attribute.Key("throttle.to")
	// ReasonKey is why a call booked again (throttle.Event's Reason).
	ReasonKey = attribute.Key("throttle.reason")
)

// Histogram bucket boundaries.
var (
	// WaitBoundaries span a call's wait for its slot, in seconds: from an
	// immediate admission to the limiter's default MaxWait of a minute.
	WaitBoundaries = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	// RoundTripBoundaries span a Redis round trip, in seconds: from a
	// loopback Redis to the default Redis timeout of a second.
	RoundTripBoundaries = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}
	// CallsPerScriptBoundaries count the calls one script call decides.
	CallsPerScriptBoundaries = []float64{1, 2, 4, 8, 16, 32, 64, 128}
)

// Observer turns limiter events into OpenTelemetry measurements. It is safe
// for concurrent use, and its Observe allocates nothing once a quota's
// attributes exist.
type Observer struct {
	calls            metric.Int64Counter
	units            metric.Int64Counter
	wait             metric.Float64Histogram
	fallbackAdmitted metric.Int64Counter
	roundTrip        metric.Float64Histogram
	redisErrors      metric.Int64Counter
	callsPerScript   metric.Int64Histogram
	fallbackActive   metric.Int64Gauge
	fallbackSwitches metric.Int64Counter
	dataLost         metric.Int64Counter
	vendorLimited    metric.Int64Counter
	pauses           metric.Int64Counter
	pauseTime        metric.Float64Counter
	queueDepth       metric.Int64Gauge
	margin           metric.Float64Gauge
	capsLearned      metric.Int64Counter
	bookedAgain      metric.Int64Counter
	learnedLimit     metric.Int64Gauge
	others           metric.Int64Gauge

	mu     sync.Mutex // serializes the creation of a quota's attributes
	quotas sync.Map   // quota name -> *quotaAttrs
}

// quotaAttrs holds one quota's attribute sets, built once rather than on
// every event.
type quotaAttrs struct {
	quota      attrs
	calls      [4][2]attrs // [outcome][shadow]
	toFallback attrs
	toRedis    attrs
}

// attrs is one attribute set as the options of Add and Record, made once
// so that recording allocates no slice of options.
type attrs struct {
	add []metric.AddOption
	rec []metric.RecordOption
}

func newAttrs(kvs ...attribute.KeyValue) attrs {
	o := metric.WithAttributeSet(attribute.NewSet(kvs...))
	return attrs{add: []metric.AddOption{o}, rec: []metric.RecordOption{o}}
}

// Indexes of quotaAttrs.calls, and the values of OutcomeKey.
const (
	admitted = iota
	limited
	queueFull
	unavailable
)

var outcomes = [...]string{admitted: "admitted", limited: "limited", queueFull: "queue_full", unavailable: "unavailable"}

// New returns an Observer whose instruments meter creates. It fails only
// when meter refuses an instrument.
func New(meter metric.Meter) (*Observer, error) {
	if meter == nil {
		return nil, errors.New("throttle/observe/otel: New: meter is nil")
	}
	m := &maker{meter: meter}
	o := &Observer{}
	o.makeCallInstruments(m)
	o.makeRedisInstruments(m)
	o.makeQuotaInstruments(m)
	if err := errors.Join(m.errs...); err != nil {
		return nil, err
	}
	return o, nil
}

// makeCallInstruments makes the instruments of the calls a limiter decides.
func (o *Observer) makeCallInstruments(m *maker) {
	o.calls = m.counter("throttle.calls", "{call}",
		"Calls that asked for a permit, by outcome; throttle.shadow marks refused calls that a limiter in shadow mode let through.")
	o.units = m.counter("throttle.units", "{unit}", "Units (the sum of the calls' Cost) admitted.")
	o.wait = m.histogram("throttle.wait.duration", "How long admitted calls waited for their slot.", WaitBoundaries)
	o.fallbackAdmitted = m.counter("throttle.fallback.admitted", "{call}",
		"Calls admitted without Redis, by the fallback that Options.OnRedisError chose.")
}

// makeRedisInstruments makes the instruments of the scripts' round trips
// and of the fallback when Redis fails.
func (o *Observer) makeRedisInstruments(m *maker) {
	o.roundTrip = m.histogram("throttle.redis.round_trip.duration",
		"Round trips of the scripts that decide calls, failed ones included.", RoundTripBoundaries)
	o.redisErrors = m.counter("throttle.redis.errors", "{error}",
		"Script calls that failed: Redis errors, timeouts, unreachable Redis.")
	var err error
	o.callsPerScript, err = m.meter.Int64Histogram("throttle.redis.calls_per_script", metric.WithUnit("{call}"),
		metric.WithDescription("Calls decided by one script call; concurrent calls of a process share one."),
		metric.WithExplicitBucketBoundaries(CallsPerScriptBoundaries...))
	m.keep(err)
	o.fallbackActive = m.gauge("throttle.fallback.active", "1",
		"1 while calls are decided without Redis, after Redis kept failing; 0 once it answers again.")
	o.fallbackSwitches = m.counter("throttle.fallback.switches", "{switch}",
		"Switches to the fallback (throttle.to=fallback) and back to Redis (throttle.to=redis).")
	o.dataLost = m.counter("throttle.data_lost", "{event}",
		"Times Redis lost the quota's data; every limit then counts as full for one window.")
}

// makeQuotaInstruments makes the instruments of what the vendor said and of
// the quota's state: pauses, queue, margin, learned caps, others' share.
func (o *Observer) makeQuotaInstruments(m *maker) {
	o.vendorLimited = m.counter("throttle.vendor.limited", "{response}",
		"Vendor answers of 429, or 503 with Retry-After, seen by a Transport.")
	o.pauses = m.counter("throttle.pauses", "{pause}", "Pauses of the quota, or of one of its keys, at the vendor's request.")
	var err error
	o.pauseTime, err = m.meter.Float64Counter("throttle.pause.time", metric.WithUnit("s"),
		metric.WithDescription("The pauses' requested lengths, added up."))
	m.keep(err)
	o.queueDepth = m.gauge("throttle.queue.depth", "{call}",
		"Calls waiting in the local queue of a limiter in Queue mode, as of its latest event.")
	o.margin, err = m.meter.Float64Gauge("throttle.margin", metric.WithUnit("s"),
		metric.WithDescription("The smallest margin in force of the quota's windows: the configured Margin, or wider while the fleet's calls start late after their slots."))
	m.keep(err)
	o.capsLearned = m.counter("throttle.caps_learned", "{cap}",
		"Times a vendor's refusal lowered the quota's limit in force to a cap learned from it.")
	o.bookedAgain = m.counter("throttle.booked_again", "{call}",
		"Calls that gave their slot back and asked for another, which may come later, by reason (throttle.reason: late, paused, lost, unheard, lowered, clock, redis, outdated; throttle.Event's Reason).")
	o.learnedLimit = m.gauge("throttle.learned_limit", "{unit}",
		"The lowest limit in force of the quota's rules after the latest cap learned from the vendor; Limiter.Usage says when it rose back.")
	o.others = m.gauge("throttle.others", "{unit}",
		"The units per window the quota leaves other consumers of the vendor's key, as the vendor's counts measure them; 0 when no one else spends it.")
}

// maker creates instruments on one meter and keeps every refusal, so that
// New reports them all at once.
type maker struct {
	meter metric.Meter
	errs  []error
}

// keep notes an instrument's error for New.
func (m *maker) keep(err error) { m.errs = append(m.errs, err) }

// counter makes the most common instrument: a count of events.
func (m *maker) counter(name, unit, desc string) metric.Int64Counter {
	c, err := m.meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
	m.keep(err)
	return c
}

// histogram makes a histogram of durations, in seconds.
func (m *maker) histogram(name, desc string, bounds []float64) metric.Float64Histogram {
	h, err := m.meter.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc), metric.WithExplicitBucketBoundaries(bounds...))
	m.keep(err)
	return h
}

// gauge makes a gauge of a count or of a state (1 or 0).
func (m *maker) gauge(name, unit, desc string) metric.Int64Gauge {
	g, err := m.meter.Int64Gauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
	m.keep(err)
	return g
}

// Observe records one event: pass it as throttle.Options.Observer.
func (o *Observer) Observe(e throttle.Event) {
	// Event carries no context: the measurements are linked to no trace.
	ctx := context.Background()
	a := o.attrs(e.Quota)
	switch e.Kind {
	case throttle.EventAdmitted:
		o.calls.Add(ctx, 1, a.calls[admitted][0].add...)
		o.units.Add(ctx, int64(e.Cost), a.quota.add...)
		o.wait.Record(ctx, e.Wait.Seconds(), a.quota.rec...)
		if e.Local {
			o.fallbackAdmitted.Add(ctx, 1, a.quota.add...)
		}
	case throttle.EventLimited:
		outcome := limited
		if errors.Is(e.Err, throttle.ErrQueueFull) {
			outcome = queueFull
		}
		o.calls.Add(ctx, 1, a.calls[outcome][b2i(e.Shadow)].add...)
	case throttle.EventUnavailable:
		o.calls.Add(ctx, 1, a.calls[unavailable][b2i(e.Shadow)].add...)
	case throttle.EventRedis:
		o.roundTrip.Record(ctx, e.Duration.Seconds(), a.quota.rec...)
		if e.Calls > 0 {
			o.callsPerScript.Record(ctx, int64(e.Calls), a.quota.rec...)
		}
		if e.Err == nil {
			o.margin.Record(ctx, e.Margin.Seconds(), a.quota.rec...)
		}
		if e.Err != nil {
			o.redisErrors.Add(ctx, 1, a.quota.add...)
		}
	case throttle.EventFallback:
		o.fallbackActive.Record(ctx, 1, a.quota.rec...)
		o.fallbackSwitches.Add(ctx, 1, a.toFallback.add...)
	case throttle.EventRecovered:
		o.fallbackActive.Record(ctx, 0, a.quota.rec...)
		o.fallbackSwitches.Add(ctx, 1, a.toRedis.add...)
	case throttle.EventDataLost:
		o.dataLost.Add(ctx, 1, a.quota.add...)
	case throttle.EventVendorLimited:
		o.vendorLimited.Add(ctx, 1, a.quota.add...)
	case throttle.EventPaused:
		o.pauses.Add(ctx, 1, a.quota.add...)
		o.pauseTime.Add(ctx, e.Duration.Seconds(), a.quota.add...)
	case throttle.EventCapLearned:
		o.capsLearned.Add(ctx, 1, a.quota.add...)
		o.learnedLimit.Record(ctx, int64(e.Limit), a.quota.rec...)
	case throttle.EventOthers:
		o.others.Record(ctx, int64(e.Others), a.quota.rec...)
	case throttle.EventBookedAgain:
		o.bookedAgain.Add(ctx, 1, metric.WithAttributes(QuotaKey.String(e.Quota), ReasonKey.String(e.Reason)))
	}
	// Only a limiter in Queue mode has a queue; others would report a
	// gauge that is always 0.
	if e.Mode == throttle.Queue {
		o.queueDepth.Record(ctx, int64(e.Queued), a.quota.rec...)
	}
}

func (o *Observer) attrs(quota string) *quotaAttrs {
	if a, ok := o.quotas.Load(quota); ok {
		return a.(*quotaAttrs)
	}
	// Under the lock, no event of the quota is recorded before its zeros.
	o.mu.Lock()
	defer o.mu.Unlock()
	if a, ok := o.quotas.Load(quota); ok {
		return a.(*quotaAttrs)
	}
	q := QuotaKey.String(quota)
	a := &quotaAttrs{
		quota:      newAttrs(q),
		toFallback: newAttrs(q, ToKey.String("fallback")),
		toRedis:    newAttrs(q, ToKey.String("redis")),
	}
	for i, outcome := range outcomes {
		a.calls[i][0] = newAttrs(q, OutcomeKey.String(outcome), ShadowKey.Bool(false))
		a.calls[i][1] = newAttrs(q, OutcomeKey.String(outcome), ShadowKey.Bool(true))
	}
	o.start(a)
	o.quotas.Store(quota, a)
	return a
}

// start reports a new quota's counters at 0, so that each exists from its
// first event on rather than from its first increment: a rate needs the
// zero.
func (o *Observer) start(a *quotaAttrs) {
	ctx := context.Background()
	for i := range outcomes {
		o.calls.Add(ctx, 0, a.calls[i][0].add...)
	}
	for _, c := range []metric.Int64Counter{o.units, o.fallbackAdmitted, o.redisErrors, o.dataLost, o.vendorLimited, o.pauses} {
		c.Add(ctx, 0, a.quota.add...)
	}
	o.fallbackSwitches.Add(ctx, 0, a.toFallback.add...)
	o.fallbackSwitches.Add(ctx, 0, a.toRedis.add...)
	o.pauseTime.Add(ctx, 0, a.quota.add...)
	o.fallbackActive.Record(ctx, 0, a.quota.rec...)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
