// Package prometheus exports what throttle limiters do as Prometheus
// metrics.
//
// An Observer is a prometheus.Collector whose Observe method is a
// throttle.Options.Observer: register it once, and pass its Observe to
// every limiter. One Observer serves any number of limiters; their series
// are told apart by the quota label, the limiter's name. No label ever holds a call's Key, which may be a
// secret and whose values are unbounded.
//
//	obs := throttleprom.New()
//	prometheus.MustRegister(obs)
//	lim, err := throttle.New(rdb, "twilio-sms", policy, throttle.Options{Observer: obs.Observe})
//
// The package is named prometheus, like client_golang's; import it under
// another name, such as throttleprom. The metrics are listed in
// observe/README.md.
package prometheus

import (
	"errors"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/throttlekit/throttle"
)

// Default histogram buckets, in seconds.
var (
	// DefaultWaitBuckets span a call's wait for its slot: from an
	// immediate admission to the limiter's default MaxWait of a minute.
	DefaultWaitBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	// DefaultRoundTripBuckets span a Redis round trip: from a loopback
	// Redis to the default Redis timeout of a second.
	DefaultRoundTripBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}
	// DefaultCallsPerScriptBuckets count the calls one script call decides;
	// concurrent calls of a process share a script call.
	DefaultCallsPerScriptBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128}
)

// An Option configures an Observer in New.
type Option func(*config)

type config struct {
	waitBuckets      []float64
	roundTripBuckets []float64
	constLabels      prometheus.Labels
}

// WithWaitBuckets sets the buckets of throttle_wait_seconds.
func WithWaitBuckets(b []float64) Option { return func(c *config) { c.waitBuckets = b } }

// WithRoundTripBuckets sets the buckets of
// throttle_redis_round_trip_seconds.
func WithRoundTripBuckets(b []float64) Option { return func(c *config) { c.roundTripBuckets = b } }

// WithConstLabels adds labels with fixed values to every metric, such as
// the service's name when several share a registry.
func WithConstLabels(l prometheus.Labels) Option { return func(c *config) { c.constLabels = l } }

// Observer turns limiter events into Prometheus metrics. It is safe for
// concurrent use, and its Observe allocates nothing once a quota's series
// exist.
type Observer struct {
	calls            *prometheus.CounterVec
	units            *prometheus.CounterVec
	wait             *prometheus.HistogramVec
	fallbackAdmitted *prometheus.CounterVec
	roundTrip        *prometheus.HistogramVec
	redisErrors      *prometheus.CounterVec
	callsPerScript   *prometheus.HistogramVec
	fallbackActive   *prometheus.GaugeVec
	fallbackSwitches *prometheus.CounterVec
	dataLost         *prometheus.CounterVec
	vendorLimited    *prometheus.CounterVec
	pauses           *prometheus.CounterVec
	pauseSeconds     *prometheus.CounterVec
	queueDepth       *prometheus.GaugeVec
	margin           *prometheus.GaugeVec
	capsLearned      *prometheus.CounterVec
	bookedAgain      *prometheus.CounterVec
	learnedLimit     *prometheus.GaugeVec
	others           *prometheus.GaugeVec

	quotas sync.Map // quota name -> *quotaMetrics
}

// Outcomes of a call, the values of the outcome label.
const (
	OutcomeAdmitted    = "admitted"
	OutcomeLimited     = "limited"
	OutcomeQueueFull   = "queue_full"
	OutcomeUnavailable = "unavailable"
)

// quotaMetrics holds one quota's series, looked up once rather than on
// every event.
type quotaMetrics struct {
	name             string
	admitted         prometheus.Counter
	refused          [3]prometheus.Counter // limited, queue_full, unavailable
	units            prometheus.Counter
	wait             prometheus.Observer
	fallbackAdmitted prometheus.Counter
	roundTrip        prometheus.Observer
	redisErrors      prometheus.Counter
	callsPerScript   prometheus.Observer
	fallbackActive   prometheus.Gauge
	toFallback       prometheus.Counter
	toRedis          prometheus.Counter
	dataLost         prometheus.Counter
	vendorLimited    prometheus.Counter
	pauses           prometheus.Counter
	pauseSeconds     prometheus.Counter
	margin           prometheus.Gauge
	capsLearned      prometheus.Counter
	learnedLimit     prometheus.Gauge
	others           prometheus.Gauge

	// Created on first use: only a limiter in shadow mode has shadow
	// refusals, and only one in Queue mode has a queue. Others would export
	// series that are always 0.
	shadowOnce sync.Once
	shadow     [3]prometheus.Counter
	queueOnce  sync.Once
	queueDepth prometheus.Gauge
}

// Indexes of refused and shadow.
const (
	limited = iota
	queueFull
	unavailable
)

var refusals = [...]string{limited: OutcomeLimited, queueFull: OutcomeQueueFull, unavailable: OutcomeUnavailable}

// newConfig returns the configuration opts make of the defaults.
func newConfig(opts []Option) config {
	c := config{
		waitBuckets:      DefaultWaitBuckets,
		roundTripBuckets: DefaultRoundTripBuckets,
	}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	return c
}

// New returns an Observer. Register it with a prometheus.Registerer to
// export its metrics.
func New(opts ...Option) *Observer {
	c := newConfig(opts)
	quota := []string{"quota"}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: c.constLabels}, labels)
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: c.constLabels}, quota)
	}
	histogram := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets, ConstLabels: c.constLabels}, quota)
	}
	return &Observer{
		calls: counter("throttle_calls_total",
			"Calls that asked for a permit, by outcome. shadow=\"true\" marks refused calls that a limiter in shadow mode let through.",
			"quota", "outcome", "shadow"),
		units: counter("throttle_units_total",
			"Units (the sum of the calls' Cost) admitted.", "quota"),
		wait: histogram("throttle_wait_seconds",
			"How long admitted calls waited for their slot.", c.waitBuckets),
		fallbackAdmitted: counter("throttle_fallback_admitted_total",
			"Calls admitted without Redis, by the fallback that Options.OnRedisError chose.", "quota"),
		roundTrip: histogram("throttle_redis_round_trip_seconds",
			"Round trips of the scripts that decide calls, failed ones included.", c.roundTripBuckets),
		redisErrors: counter("throttle_redis_errors_total",
			"Script calls that failed: Redis errors, timeouts, unreachable Redis.", "quota"),
		callsPerScript: histogram("throttle_redis_calls_per_script",
			"Calls decided by one script call; concurrent calls of a process share one.", DefaultCallsPerScriptBuckets),
		fallbackActive: gauge("throttle_fallback_active",
			"1 while calls are decided without Redis, after Redis kept failing; 0 once it answers again."),
		fallbackSwitches: counter("throttle_fallback_switches_total",
			"Switches to the fallback (to=\"fallback\") and back to Redis (to=\"redis\").", "quota", "to"),
		dataLost: counter("throttle_data_lost_total",
			"Times Redis lost the quota's data (a restart, a failover, an eviction); every limit then counts as full for one window.", "quota"),
		vendorLimited: counter("throttle_vendor_limited_total",
			"Vendor answers of 429, or 503 with Retry-After, seen by a Transport.", "quota"),
		pauses: counter("throttle_pauses_total",
			"Pauses of the quota, or of one of its keys, at the vendor's request.", "quota"),
		pauseSeconds: counter("throttle_pause_seconds_total",
			"The pauses' requested lengths, added up.", "quota"),
		queueDepth: gauge("throttle_queue_depth",
			"Calls waiting in the local queue of a limiter in Queue mode, as of its latest event."),
		margin: gauge("throttle_margin_seconds",
			"The smallest margin in force of the quota's windows: the configured Margin, or wider while the fleet's calls start late after their slots."),
		capsLearned: counter("throttle_caps_learned_total",
			"Times a vendor's refusal lowered the quota's limit in force to a cap learned from it.", "quota"),
		bookedAgain: counter("throttle_booked_again_total",
			"Calls that gave their slot back and asked for another, which may come later, by reason: late, paused, lost, unheard, lowered, clock, redis, outdated (throttle.Event's Reason).", "quota", "reason"),
		learnedLimit: gauge("throttle_learned_limit",
			"The lowest limit in force of the quota's rules after the latest cap learned from the vendor; Limiter.Usage says when it rose back."),
		others: gauge("throttle_others_units",
			"The units per window the quota leaves other consumers of the vendor's key, as the vendor's counts measure them; 0 when no one else spends it."),
	}
}

// Describe sends the descriptors of every metric of the Observer.
func (o *Observer) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range o.collectors() {
		c.Describe(ch)
	}
}

// Collect sends the current value of every series.
func (o *Observer) Collect(ch chan<- prometheus.Metric) {
	for _, c := range o.collectors() {
		c.Collect(ch)
	}
}

func (o *Observer) collectors() []prometheus.Collector {
	return []prometheus.Collector{
		o.calls, o.units, o.wait, o.fallbackAdmitted, o.roundTrip, o.redisErrors, o.callsPerScript,
		o.fallbackActive, o.fallbackSwitches, o.dataLost, o.vendorLimited, o.pauses, o.pauseSeconds, o.queueDepth, o.margin,
		o.capsLearned, o.bookedAgain, o.learnedLimit, o.others,
	}
}

// Observe records one event: pass it as throttle.Options.Observer.
func (o *Observer) Observe(e throttle.Event) {
	m := o.quota(e.Quota)
	switch e.Kind {
	case throttle.EventAdmitted:
		m.admitted.Inc()
		m.units.Add(float64(e.Cost))
		m.wait.Observe(e.Wait.Seconds())
		if e.Local {
			m.fallbackAdmitted.Inc()
		}
	case throttle.EventLimited:
		if errors.Is(e.Err, throttle.ErrQueueFull) {
			o.refused(m, queueFull, e.Shadow).Inc()
		} else {
			o.refused(m, limited, e.Shadow).Inc()
		}
	case throttle.EventUnavailable:
		o.refused(m, unavailable, e.Shadow).Inc()
	case throttle.EventRedis:
		m.roundTrip.Observe(e.Duration.Seconds())
		if e.Calls > 0 {
			m.callsPerScript.Observe(float64(e.Calls))
		}
		if e.Err == nil {
			m.margin.Set(e.Margin.Seconds())
		}
		if e.Err != nil {
			m.redisErrors.Inc()
		}
	case throttle.EventFallback:
		m.fallbackActive.Set(1)
		m.toFallback.Inc()
	case throttle.EventRecovered:
		m.fallbackActive.Set(0)
		m.toRedis.Inc()
	case throttle.EventDataLost:
		m.dataLost.Inc()
	case throttle.EventVendorLimited:
		m.vendorLimited.Inc()
	case throttle.EventPaused:
		m.pauses.Inc()
		m.pauseSeconds.Add(e.Duration.Seconds())
	case throttle.EventCapLearned:
		m.capsLearned.Inc()
		m.learnedLimit.Set(float64(e.Limit))
	case throttle.EventOthers:
		m.others.Set(float64(e.Others))
	case throttle.EventBookedAgain:
		o.bookedAgain.WithLabelValues(m.name, e.Reason).Inc()
	}
	if e.Mode == throttle.Queue {
		m.queueOnce.Do(func() { m.queueDepth = o.queueDepth.WithLabelValues(m.name) })
		m.queueDepth.Set(float64(e.Queued))
	}
}

// refused returns the counter of a refusal, of a shadow one when shadow.
func (o *Observer) refused(m *quotaMetrics, i int, shadow bool) prometheus.Counter {
	if !shadow {
		return m.refused[i]
	}
	m.shadowOnce.Do(func() {
		for j, outcome := range refusals {
			m.shadow[j] = o.calls.WithLabelValues(m.name, outcome, "true")
		}
	})
	return m.shadow[i]
}

// quota returns the series of quota, creating them on its first event.
// Every counter of the quota is created at once, so that each reads 0
// rather than being absent until its first increment: rate() and
// increase() need the zero.
func (o *Observer) quota(name string) *quotaMetrics {
	if m, ok := o.quotas.Load(name); ok {
		return m.(*quotaMetrics)
	}
	m := &quotaMetrics{
		name:             name,
		admitted:         o.calls.WithLabelValues(name, OutcomeAdmitted, "false"),
		units:            o.units.WithLabelValues(name),
		wait:             o.wait.WithLabelValues(name),
		fallbackAdmitted: o.fallbackAdmitted.WithLabelValues(name),
		roundTrip:        o.roundTrip.WithLabelValues(name),
		redisErrors:      o.redisErrors.WithLabelValues(name),
		callsPerScript:   o.callsPerScript.WithLabelValues(name),
		fallbackActive:   o.fallbackActive.WithLabelValues(name),
		toFallback:       o.fallbackSwitches.WithLabelValues(name, "fallback"),
		toRedis:          o.fallbackSwitches.WithLabelValues(name, "redis"),
		dataLost:         o.dataLost.WithLabelValues(name),
		vendorLimited:    o.vendorLimited.WithLabelValues(name),
		pauses:           o.pauses.WithLabelValues(name),
		pauseSeconds:     o.pauseSeconds.WithLabelValues(name),
		margin:           o.margin.WithLabelValues(name),
		capsLearned:      o.capsLearned.WithLabelValues(name),
		learnedLimit:     o.learnedLimit.WithLabelValues(name),
		others:           o.others.WithLabelValues(name),
	}
	for i, outcome := range refusals {
		m.refused[i] = o.calls.WithLabelValues(name, outcome, "false")
	}
	actual, _ := o.quotas.LoadOrStore(name, m)
	return actual.(*quotaMetrics)
}
