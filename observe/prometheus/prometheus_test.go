package prometheus_test

import (
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/throttlekit/throttle"
	throttleprom "github.com/throttlekit/throttle/observe/prometheus"
)

// scrape serves reg as a Prometheus server would scrape it, and returns the
// text exposition and its parsed families.
func scrape(t *testing.T, reg *prometheus.Registry) (string, map[string]*dto.MetricFamily) {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.PanicOnError}))
	defer srv.Close()
	req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("Content-Type %q, want the text format", ct)
	}
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("the scrape does not parse as Prometheus text: %v\n%s", err, body)
	}
	return string(body), fams
}

// series finds the one series of family name whose labels are exactly
// labels ("k=v" pairs).
func series(t *testing.T, fams map[string]*dto.MetricFamily, name string, typ dto.MetricType, labels ...string) *dto.Metric {
	t.Helper()
	f, ok := fams[name]
	if !ok {
		t.Fatalf("no metric %s; have %v", name, slices.Sorted(maps.Keys(fams)))
	}
	if f.GetType() != typ {
		t.Fatalf("%s is a %v, want a %v", name, f.GetType(), typ)
	}
	want := strings.Join(labels, ",")
	var have []string
	for _, m := range f.GetMetric() {
		var got []string
		for _, l := range m.GetLabel() {
			got = append(got, l.GetName()+"="+l.GetValue())
		}
		if strings.Join(got, ",") == want {
			return m
		}
		have = append(have, "{"+strings.Join(got, ",")+"}")
	}
	t.Fatalf("no series %s{%s}; have %v", name, want, have)
	return nil
}

func counter(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	return series(t, fams, name, dto.MetricType_COUNTER, labels...).GetCounter().GetValue()
}

func gauge(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	return series(t, fams, name, dto.MetricType_GAUGE, labels...).GetGauge().GetValue()
}

func histogram(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) *dto.Histogram {
	t.Helper()
	return series(t, fams, name, dto.MetricType_HISTOGRAM, labels...).GetHistogram()
}

// absent fails the test when family name has a series whose labels contain
// every one of labels.
func absent(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) {
	t.Helper()
	for _, m := range fams[name].GetMetric() {
		var got []string
		for _, l := range m.GetLabel() {
			got = append(got, l.GetName()+"="+l.GetValue())
		}
		if containsAll(got, labels) {
			t.Errorf("unexpected series %s%v", name, got)
		}
	}
}

func containsAll(have, want []string) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }

func TestObserver_ExportsEveryEventKind(t *testing.T) {
	obs := throttleprom.New(throttleprom.WithConstLabels(prometheus.Labels{"service": "billing"}))
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(obs)
	observeEveryKind(obs)

	text, fams := scrape(t, reg)
	t.Logf("\n%s", text)
	sms := smsLabels
	for _, c := range callsOfEveryKind {
		got := counter(t, fams, "throttle_calls_total", "outcome="+c.outcome, "quota=sms", "service=billing", "shadow="+c.shadow)
		if got != c.want {
			t.Errorf("throttle_calls_total{outcome=%q,shadow=%q} = %v, want %v", c.outcome, c.shadow, got, c.want)
		}
	}
	for _, c := range countersOfEveryKind {
		if got := counter(t, fams, c.name, c.labels...); !near(got, c.want) {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if got := gauge(t, fams, "throttle_learned_limit", sms...); got != 40 {
		t.Errorf("throttle_learned_limit = %v, want 40, the latest", got)
	}
	if got := gauge(t, fams, "throttle_others_units", sms...); got != 24 {
		t.Errorf("throttle_others_units = %v, want 24, the latest", got)
	}
	if got := gauge(t, fams, "throttle_fallback_active", sms...); got != 1 {
		t.Errorf("throttle_fallback_active = %v after a second fallback, want 1", got)
	}
	if got := gauge(t, fams, "throttle_queue_depth", "quota=jobs", "service=billing"); got != 2 {
		t.Errorf("throttle_queue_depth{quota=jobs} = %v, want 2 (its latest event)", got)
	}
	absent(t, fams, "throttle_queue_depth", "quota=sms")
	absent(t, fams, "throttle_calls_total", "quota=jobs", "shadow=true")
	checkHistogramsOfEveryKind(t, fams, sms)
	lintExposition(t, text)
}

// observeEveryKind gives obs events of every kind, of quota sms, and two
// of a limiter in Queue mode, of quota jobs.
func observeEveryKind(obs *throttleprom.Observer) {
	ev := func(kind throttle.EventKind, e throttle.Event) {
		e.Kind, e.Quota = kind, "sms"
		obs.Observe(e)
	}
	ev(throttle.EventAdmitted, throttle.Event{Cost: 1})
	ev(throttle.EventAdmitted, throttle.Event{Cost: 2, Wait: 20 * time.Millisecond})
	ev(throttle.EventAdmitted, throttle.Event{Cost: 3, Wait: 2 * time.Second, Local: true})
	ev(throttle.EventLimited, throttle.Event{Cost: 1, Wait: time.Second})
	ev(throttle.EventLimited, throttle.Event{Cost: 1, Shadow: true})
	ev(throttle.EventLimited, throttle.Event{Err: throttle.ErrQueueFull})
	ev(throttle.EventUnavailable, throttle.Event{})
	ev(throttle.EventRedis, throttle.Event{Duration: time.Millisecond, Calls: 1})
	ev(throttle.EventRedis, throttle.Event{Duration: 3 * time.Millisecond, Calls: 5})
	ev(throttle.EventRedis, throttle.Event{Duration: time.Second, Calls: 2, Err: errors.New("i/o timeout")})
	ev(throttle.EventFallback, throttle.Event{})
	ev(throttle.EventRecovered, throttle.Event{})
	ev(throttle.EventFallback, throttle.Event{})
	ev(throttle.EventDataLost, throttle.Event{})
	ev(throttle.EventVendorLimited, throttle.Event{})
	ev(throttle.EventVendorLimited, throttle.Event{})
	ev(throttle.EventPaused, throttle.Event{Duration: 1500 * time.Millisecond})
	ev(throttle.EventPaused, throttle.Event{Duration: 500 * time.Millisecond})
	ev(throttle.EventCapLearned, throttle.Event{Limit: 50})
	ev(throttle.EventCapLearned, throttle.Event{Limit: 40})
	ev(throttle.EventOthers, throttle.Event{Others: 25})
	ev(throttle.EventOthers, throttle.Event{Others: 24})
	ev(throttle.EventBookedAgain, throttle.Event{Reason: "late"})
	ev(throttle.EventBookedAgain, throttle.Event{Reason: "lowered"})
	ev(throttle.EventBookedAgain, throttle.Event{Reason: "late"})
	// A limiter in Queue mode: the gauge follows its latest event.
	obs.Observe(throttle.Event{Kind: throttle.EventAdmitted, Quota: "jobs", Mode: throttle.Queue, Cost: 1, Queued: 4})
	obs.Observe(throttle.Event{Kind: throttle.EventLimited, Err: throttle.ErrQueueFull, Quota: "jobs", Mode: throttle.Queue, Queued: 2})
}

// callsOfEveryKind are the calls observeEveryKind reports, by outcome.
var callsOfEveryKind = []struct {
	outcome, shadow string
	want            float64
}{
	{"admitted", "false", 3},
	{"limited", "false", 1},
	{"limited", "true", 1},
	{"queue_full", "false", 1},
	{"queue_full", "true", 0},
	{"unavailable", "false", 1},
	{"unavailable", "true", 0},
}

// countersOfEveryKind are the other counters of quota sms after
// observeEveryKind.
var countersOfEveryKind = []struct {
	name   string
	labels []string
	want   float64
}{
	{"throttle_units_total", smsLabels, 6},
	{"throttle_fallback_admitted_total", smsLabels, 1},
	{"throttle_redis_errors_total", smsLabels, 1},
	{"throttle_fallback_switches_total", []string{"quota=sms", "service=billing", "to=fallback"}, 2},
	{"throttle_fallback_switches_total", []string{"quota=sms", "service=billing", "to=redis"}, 1},
	{"throttle_data_lost_total", smsLabels, 1},
	{"throttle_vendor_limited_total", smsLabels, 2},
	{"throttle_pauses_total", smsLabels, 2},
	{"throttle_pause_seconds_total", smsLabels, 2},
	{"throttle_caps_learned_total", smsLabels, 2},
	{"throttle_booked_again_total", []string{"quota=sms", "reason=late", "service=billing"}, 2},
	{"throttle_booked_again_total", []string{"quota=sms", "reason=lowered", "service=billing"}, 1},
}

// smsLabels are the labels of quota sms's series.
var smsLabels = []string{"quota=sms", "service=billing"}

// checkHistogramsOfEveryKind checks the waits and Redis's round trips that
// observeEveryKind reports.
func checkHistogramsOfEveryKind(t *testing.T, fams map[string]*dto.MetricFamily, sms []string) {
	t.Helper()
	wait := histogram(t, fams, "throttle_wait_seconds", sms...)
	if wait.GetSampleCount() != 3 || !near(wait.GetSampleSum(), 2.02) {
		t.Errorf("throttle_wait_seconds: count %d sum %v, want 3 and 2.02", wait.GetSampleCount(), wait.GetSampleSum())
	}
	wantBuckets := map[float64]uint64{0.001: 1, 0.025: 2, 1: 2, 2.5: 3, 60: 3}
	for _, b := range wait.GetBucket() {
		if want, ok := wantBuckets[b.GetUpperBound()]; ok && b.GetCumulativeCount() != want {
			t.Errorf("throttle_wait_seconds_bucket{le=%v} = %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), want)
		}
	}
	rt := histogram(t, fams, "throttle_redis_round_trip_seconds", sms...)
	if rt.GetSampleCount() != 3 || !near(rt.GetSampleSum(), 1.004) {
		t.Errorf("throttle_redis_round_trip_seconds: count %d sum %v, want 3 and 1.004", rt.GetSampleCount(), rt.GetSampleSum())
	}
	per := histogram(t, fams, "throttle_redis_calls_per_script", sms...)
	if per.GetSampleCount() != 3 || per.GetSampleSum() != 8 {
		t.Errorf("throttle_redis_calls_per_script: count %d sum %v, want 3 and 8", per.GetSampleCount(), per.GetSampleSum())
	}
}

// lintExposition fails the test on every problem promlint finds in text.
func lintExposition(t *testing.T, text string) {
	t.Helper()
	problems, err := promlint.New(strings.NewReader(text)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}

func TestObserver_CreatesAQuotasSeriesAtZeroOnItsFirstEvent(t *testing.T) {
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	obs.Observe(throttle.Event{Kind: throttle.EventRedis, Quota: "github", Duration: time.Millisecond, Calls: 1})

	_, fams := scrape(t, reg)
	for _, outcome := range []string{"admitted", "limited", "queue_full", "unavailable"} {
		if got := counter(t, fams, "throttle_calls_total", "outcome="+outcome, "quota=github", "shadow=false"); got != 0 {
			t.Errorf("throttle_calls_total{outcome=%q} = %v, want 0", outcome, got)
		}
	}
	if got := gauge(t, fams, "throttle_fallback_active", "quota=github"); got != 0 {
		t.Errorf("throttle_fallback_active = %v, want 0", got)
	}
	if got := counter(t, fams, "throttle_redis_errors_total", "quota=github"); got != 0 {
		t.Errorf("throttle_redis_errors_total = %v, want 0", got)
	}
}

func TestObserver_LabelsNothingButTheQuota(t *testing.T) {
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	// Event has no key; whatever an error says must not become a label.
	obs.Observe(throttle.Event{Kind: throttle.EventUnavailable, Quota: "q", Err: errors.New("dial tcp 10.0.0.1:6379: refused")})
	obs.Observe(throttle.Event{Kind: throttle.EventRedis, Quota: "q", Err: errors.New("secret-token-123")})

	text, fams := scrape(t, reg)
	if strings.Contains(text, "secret") || strings.Contains(text, "10.0.0.1") {
		t.Errorf("an error's text reached the exposition:\n%s", text)
	}
	allowed := []string{"quota", "outcome", "shadow", "to", "le"}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(allowed, l.GetName()) {
					t.Errorf("%s has label %q", name, l.GetName())
				}
			}
		}
	}
}

func TestObserver_CountsConcurrentEventsExactly(t *testing.T) {
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	const goroutines, each, quotas = 8, 500, 3
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				obs.Observe(throttle.Event{Kind: throttle.EventAdmitted, Quota: fmt.Sprint("q", (g+i)%quotas), Cost: 2})
			}
		})
	}
	wg.Wait()

	_, fams := scrape(t, reg)
	var calls, units float64
	for q := range quotas {
		calls += counter(t, fams, "throttle_calls_total", "outcome=admitted", fmt.Sprint("quota=q", q), "shadow=false")
		units += counter(t, fams, "throttle_units_total", fmt.Sprint("quota=q", q))
	}
	if calls != goroutines*each || units != 2*goroutines*each {
		t.Errorf("counted %v calls and %v units, want %d and %d", calls, units, goroutines*each, 2*goroutines*each)
	}
}

func TestObserver_IgnoresUnknownKinds(t *testing.T) {
	obs := throttleprom.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(obs)
	obs.Observe(throttle.Event{Kind: throttle.EventKind("from_a_later_version"), Quota: "q", Cost: 1})
	_, fams := scrape(t, reg)
	if got := counter(t, fams, "throttle_calls_total", "outcome=admitted", "quota=q", "shadow=false"); got != 0 {
		t.Errorf("an unknown kind counted as admitted: %v", got)
	}
}

// The metrics table of observe/README.md names every metric the Observer
// describes, and no other.
func TestREADME_NamesEveryMetric(t *testing.T) {
	doc, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(throttle_[a-z_]+)` \\|").FindAllStringSubmatch(string(doc), -1) {
		documented[m[1]] = true
	}
	ch := make(chan *prometheus.Desc, 100)
	throttleprom.New().Describe(ch)
	close(ch)
	described := map[string]bool{}
	for d := range ch {
		name := regexp.MustCompile(`fqName: "([a-z_]+)"`).FindStringSubmatch(d.String())[1]
		described[name] = true
		if !documented[name] {
			t.Errorf("observe/README.md's table does not name %s", name)
		}
	}
	for name := range documented {
		if !described[name] {
			t.Errorf("observe/README.md's table names %s, which the Observer does not describe", name)
		}
	}
}
