package main

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/throttlekit/throttle/examples/fakeapi"
)

// The fleet's /metrics endpoint is written by hand in the Prometheus text
// format, so that the examples need no more than the library does:
// client_golang comes with the observe/prometheus module, to users who want
// it. Where a metric means what one of observe/prometheus means, it has the
// same name and labels (quota, outcome), so that dashboards work on both;
// the fleet's own metrics start with fleet_.

// waitBounds are the upper bounds of the wait buckets, in seconds, as
// observe/prometheus.DefaultWaitBuckets.
var waitBounds = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// waitBucket returns the index of the bucket a wait falls in; waits past
// the last bound fall in len(waitBounds).
func waitBucket(d time.Duration) int {
	s := d.Seconds()
	i, _ := slices.BinarySearch(waitBounds, s)
	return i
}

// textFormat is the Content-Type of the Prometheus text format.
const textFormat = "text/plain; version=0.0.4; charset=utf-8"

// fleetMetrics holds what /metrics reports: every run of the invocation so
// far, the running one included.
type fleetMetrics struct {
	mu   sync.Mutex
	runs []*runMetrics
}

// runMetrics is one fleet run as /metrics reads it.
type runMetrics struct {
	gate     variant
	quota    string
	window   time.Duration
	vendor   *fakeapi.Vendor
	children []*child
}

func (m *fleetMetrics) add(r *runMetrics) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.runs = append(m.runs, r)
}

// serveMetrics serves m at http://addr/metrics until the returned stop is
// called. It fails at once when addr cannot be listened on.
func serveMetrics(addr string, m *fleetMetrics) (url string, stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, fmt.Errorf("-metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", m)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	host, port, _ := net.SplitHostPort(ln.Addr().String())
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "localhost" // listening on every address, :9099 says
	}
	return "http://" + net.JoinHostPort(host, port) + "/metrics", func() { _ = srv.Close() }, nil
}

// ServeHTTP writes the metrics in the Prometheus text format.
func (m *fleetMetrics) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", textFormat)
	_ = m.write(w)
}

// replicaSample is one replica's counts, with the labels of its series.
type replicaSample struct {
	labels []string
	t      totals
	wait   int64
}

// runSample is one run's counts, with the labels of its series.
type runSample struct {
	labels   []string
	st       fakeapi.Stats
	limit    int
	window   time.Duration
	inWindow int
	replicas []replicaSample
}

// write writes every metric, one family after another as the format
// requires.
func (m *fleetMetrics) write(out io.Writer) error {
	samples := m.readCounts()
	e := newExpo(out)
	writeReplicaFamilies(e, samples)
	writeVendorFamilies(e, samples)
	return e.flush()
}

// readCounts reads every count once, so that the families of one scrape agree.
func (m *fleetMetrics) readCounts() []runSample {
	m.mu.Lock()
	runs := slices.Clone(m.runs)
	m.mu.Unlock()
	var samples []runSample
	for _, r := range runs {
		rs := runSample{
			labels: []string{"quota", r.quota, "gate", r.gate.String()},
			st:     r.vendor.Stats(), limit: r.vendor.Limit(), window: r.window, inWindow: r.vendor.InWindow(),
		}
		for _, c := range r.children {
			rs.replicas = append(rs.replicas, replicaSample{
				labels: append(slices.Clone(rs.labels), "replica", strconv.Itoa(c.id)),
				t:      c.counts(),
				wait:   c.waiting.Load(),
			})
		}
		samples = append(samples, rs)
	}
	return samples
}

// writeReplicaFamilies writes the families of what each replica reported.
func writeReplicaFamilies(e *expo, samples []runSample) {
	e.family("throttle_calls_total", "counter",
		`Calls that asked the replica's gate for a slot, by outcome: admitted, or limited (refused, retried after RetryAfter).`)
	eachReplica(samples, func(r replicaSample) {
		e.sample("throttle_calls_total", float64(r.t.Admitted), with(r.labels, "outcome", "admitted")...)
		e.sample("throttle_calls_total", float64(r.t.Limited), with(r.labels, "outcome", "limited")...)
	})
	e.family("throttle_wait_seconds", "histogram", "How long admitted calls waited for their slot.")
	eachReplica(samples, func(r replicaSample) {
		e.histogram("throttle_wait_seconds", waitBounds, r.t.Waits, r.t.WaitSum, r.labels...)
	})
	e.perReplica(samples, "throttle_vendor_limited_total", "counter", "Calls the vendor answered 429, as the replica saw them.",
		func(r replicaSample) float64 { return float64(r.t.Rejected) })
	e.perReplica(samples, "fleet_calls_failed_total", "counter", "Calls lost to Redis or network errors.",
		func(r replicaSample) float64 { return float64(r.t.Failed) })
	e.perReplica(samples, "fleet_calls_waiting", "gauge", "Calls that want to go to the vendor and have not been admitted yet.",
		func(r replicaSample) float64 { return float64(r.wait) })
	e.perReplica(samples, "fleet_redis_scripts_total", "counter", "Redis scripts the replica ran (EVALSHA, EVAL): the limiter's cost in round trips.",
		func(r replicaSample) float64 { return float64(r.t.ScriptCalls) })
}

// writeVendorFamilies writes the families of what the vendor counted in
// each run.
func writeVendorFamilies(e *expo, samples []runSample) {
	e.family("fleet_vendor_requests_total", "counter", "Calls the vendor answered, by status code: 200 within its cap, 429 past it.")
	for _, rs := range samples {
		e.sample("fleet_vendor_requests_total", float64(rs.st.Accepted), with(rs.labels, "code", "200")...)
		e.sample("fleet_vendor_requests_total", float64(rs.st.OverCap), with(rs.labels, "code", "429")...)
	}
	e.perRun(samples, "fleet_vendor_limit", "The vendor's cap: calls per window.",
		func(rs runSample) float64 { return float64(rs.limit) })
	e.perRun(samples, "fleet_vendor_window_seconds", "The length of the vendor's sliding window.",
		func(rs runSample) float64 { return rs.window.Seconds() })
	e.perRun(samples, "fleet_vendor_window_calls", "Calls the vendor counts in its window ending now.",
		func(rs runSample) float64 { return float64(rs.inWindow) })
	e.perRun(samples, "fleet_vendor_cap_used_ratio", "Share of the vendor's cap used in its window ending now: window calls over the limit.",
		func(rs runSample) float64 { return ratio(rs.inWindow, rs.limit) })
	e.perRun(samples, "fleet_vendor_max_window_calls", "The most calls the vendor saw in any one window, 429s included; at most the limit when the fleet kept under the cap.",
		func(rs runSample) float64 { return float64(rs.st.MaxInWindow) })
}

// eachReplica calls f with every replica of every run, in order.
func eachReplica(samples []runSample, f func(replicaSample)) {
	for _, rs := range samples {
		for _, r := range rs.replicas {
			f(r)
		}
	}
}

// perReplica writes a family of one sample per replica.
func (e *expo) perReplica(samples []runSample, name, typ, help string, value func(replicaSample) float64) {
	e.family(name, typ, help)
	eachReplica(samples, func(r replicaSample) { e.sample(name, value(r), r.labels...) })
}

// perRun writes a gauge family of one sample per run.
func (e *expo) perRun(samples []runSample, name, help string, value func(runSample) float64) {
	e.family(name, "gauge", help)
	for _, rs := range samples {
		e.sample(name, value(rs), rs.labels...)
	}
}

func ratio(n, d int) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / float64(d)
}

// with returns labels with one more name and value, leaving labels as it is.
func with(labels []string, name, value string) []string {
	return append(slices.Clip(labels), name, value)
}

// expo writes the Prometheus text exposition format, version 0.0.4: each
// family a # HELP and a # TYPE line followed by its samples, one per line.
type expo struct {
	w   *bufio.Writer
	err error
}

func newExpo(w io.Writer) *expo { return &expo{w: bufio.NewWriter(w)} }

func (e *expo) printf(format string, args ...any) {
	if e.err == nil {
		_, e.err = fmt.Fprintf(e.w, format, args...)
	}
}

// family starts a metric family.
func (e *expo) family(name, typ, help string) {
	e.printf("# HELP %s %s\n# TYPE %s %s\n", name, escapeHelp(help), name, typ)
}

// sample writes one sample; labels are name, value pairs.
func (e *expo) sample(name string, v float64, labels ...string) {
	e.printf("%s%s %s\n", name, labelSet(labels), formatValue(v))
}

// histogram writes the series of one histogram: its cumulative buckets,
// the +Inf one included, its sum and its count. counts holds a count per
// bucket, not cumulative, with one more for the values past the last bound;
// a short or nil counts reads as zeros.
func (e *expo) histogram(name string, bounds []float64, counts []int64, sum float64, labels ...string) {
	var cum int64
	for i, b := range bounds {
		if i < len(counts) {
			cum += counts[i]
		}
		e.sample(name+"_bucket", float64(cum), with(labels, "le", formatValue(b))...)
	}
	if len(counts) > len(bounds) {
		cum += counts[len(bounds)]
	}
	e.sample(name+"_bucket", float64(cum), with(labels, "le", "+Inf")...)
	e.sample(name+"_sum", sum, labels...)
	e.sample(name+"_count", float64(cum), labels...)
}

func (e *expo) flush() error {
	if e.err != nil {
		return e.err
	}
	return e.w.Flush()
}

// labelSet renders name, value pairs as {name="value",...}.
func labelSet(labels []string) string {
	if len(labels) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteByte('{')
	for i := 0; i+1 < len(labels); i += 2 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(labels[i])
		b.WriteString(`="`)
		b.WriteString(labelEscaper.Replace(labels[i+1]))
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String()
}

var (
	labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
)

func escapeHelp(s string) string { return helpEscaper.Replace(s) }

// formatValue writes a float as the format spells it: +Inf, -Inf, NaN, or
// the shortest decimal that reads back the same.
func formatValue(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	case v == math.Trunc(v) && math.Abs(v) < 1e15:
		return strconv.FormatFloat(v, 'f', -1, 64) // counts in full, not as 1e+06
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}
