package otel_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/throttlekit/throttle"
	throttleotel "github.com/throttlekit/throttle/observe/otel"
	"github.com/throttlekit/throttle/policies"
)

// newObserver returns an Observer on a MeterProvider read by hand.
func newObserver(t *testing.T) (*throttleotel.Observer, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	obs, err := throttleotel.New(provider.Meter("github.com/throttlekit/throttle"))
	if err != nil {
		t.Fatal(err)
	}
	return obs, reader
}

// metrics collects what the reader holds, by instrument name.
func metrics(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// attrs renders a set as "k=v,k=v", sorted by key.
func attrs(s attribute.Set) string {
	var kv []string
	for _, a := range s.ToSlice() {
		kv = append(kv, string(a.Key)+"="+a.Value.String())
	}
	sort.Strings(kv)
	return strings.Join(kv, ",")
}

func get(t *testing.T, ms map[string]metricdata.Metrics, name, unit string) metricdata.Metrics {
	t.Helper()
	m, ok := ms[name]
	if !ok {
		var names []string
		for n := range ms {
			names = append(names, n)
		}
		slices.Sort(names)
		t.Fatalf("no instrument %s; have %v", name, names)
	}
	if m.Unit != unit {
		t.Errorf("%s has unit %q, want %q", name, m.Unit, unit)
	}
	if m.Description == "" {
		t.Errorf("%s has no description", name)
	}
	return m
}

// sum returns the value of the data point of a monotonic sum with exactly
// the attributes want.
func sum[N int64 | float64](t *testing.T, ms map[string]metricdata.Metrics, name, unit, want string) N {
	t.Helper()
	s, ok := get(t, ms, name, unit).Data.(metricdata.Sum[N])
	if !ok {
		t.Fatalf("%s is a %T, want a Sum[%T]", name, ms[name].Data, *new(N))
	}
	if !s.IsMonotonic || s.Temporality != metricdata.CumulativeTemporality {
		t.Errorf("%s: monotonic %v, temporality %v; want a cumulative counter", name, s.IsMonotonic, s.Temporality)
	}
	var have []string
	for _, dp := range s.DataPoints {
		if attrs(dp.Attributes) == want {
			return dp.Value
		}
		have = append(have, "{"+attrs(dp.Attributes)+"}")
	}
	t.Fatalf("%s has no point {%s}; have %v", name, want, have)
	return 0
}

func gauge(t *testing.T, ms map[string]metricdata.Metrics, name, unit, want string) int64 {
	t.Helper()
	g, ok := get(t, ms, name, unit).Data.(metricdata.Gauge[int64])
	if !ok {
		t.Fatalf("%s is a %T, want a Gauge[int64]", name, ms[name].Data)
	}
	for _, dp := range g.DataPoints {
		if attrs(dp.Attributes) == want {
			return dp.Value
		}
	}
	t.Fatalf("%s has no point {%s}", name, want)
	return 0
}

func histogram[N int64 | float64](t *testing.T, ms map[string]metricdata.Metrics, name, unit, want string) metricdata.HistogramDataPoint[N] {
	t.Helper()
	h, ok := get(t, ms, name, unit).Data.(metricdata.Histogram[N])
	if !ok {
		t.Fatalf("%s is a %T, want a Histogram[%T]", name, ms[name].Data, *new(N))
	}
	for _, dp := range h.DataPoints {
		if attrs(dp.Attributes) == want {
			return dp
		}
	}
	t.Fatalf("%s has no point {%s}", name, want)
	return metricdata.HistogramDataPoint[N]{}
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }

func TestObserver_RecordsEveryEventKind(t *testing.T) {
	obs, reader := newObserver(t)
	observeEveryKind(obs)

	ms := metrics(t, reader)
	for _, c := range callsOfEveryKind {
		attrs := fmt.Sprintf("throttle.outcome=%s,throttle.quota=sms,throttle.shadow=%v", c.outcome, c.shadow)
		if got := sum[int64](t, ms, "throttle.calls", "{call}", attrs); got != c.want {
			t.Errorf("throttle.calls{%s, shadow=%v} = %d, want %d", c.outcome, c.shadow, got, c.want)
		}
	}
	for _, c := range countersOfEveryKind {
		if got := sum[int64](t, ms, c.name, c.unit, c.attrs); got != c.want {
			t.Errorf("%s{%s} = %d, want %d", c.name, c.attrs, got, c.want)
		}
	}
	if got := sum[float64](t, ms, "throttle.pause.time", "s", sms); !near(got, 2) {
		t.Errorf("throttle.pause.time = %v, want 2", got)
	}
	if got := gauge(t, ms, "throttle.learned_limit", "{unit}", sms); got != 40 {
		t.Errorf("throttle.learned_limit = %d, want 40, the latest", got)
	}
	if got := gauge(t, ms, "throttle.others", "{unit}", sms); got != 24 {
		t.Errorf("throttle.others = %d, want 24, the latest", got)
	}
	if got := gauge(t, ms, "throttle.fallback.active", "1", sms); got != 1 {
		t.Errorf("throttle.fallback.active = %d after a second fallback, want 1", got)
	}
	if got := gauge(t, ms, "throttle.queue.depth", "{call}", "throttle.quota=jobs"); got != 2 {
		t.Errorf("throttle.queue.depth{jobs} = %d, want 2 (its latest event)", got)
	}
	for _, dp := range ms["throttle.queue.depth"].Data.(metricdata.Gauge[int64]).DataPoints {
		if attrs(dp.Attributes) != "throttle.quota=jobs" {
			t.Errorf("throttle.queue.depth has a point for {%s}, which is not in Queue mode", attrs(dp.Attributes))
		}
	}
	checkHistogramsOfEveryKind(t, ms)
}

// observeEveryKind gives obs events of every kind, of quota sms, and two
// of a limiter in Queue mode, of quota jobs.
func observeEveryKind(obs *throttleotel.Observer) {
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
	obs.Observe(throttle.Event{Kind: throttle.EventAdmitted, Quota: "jobs", Mode: throttle.Queue, Cost: 1, Queued: 4})
	obs.Observe(throttle.Event{Kind: throttle.EventLimited, Err: throttle.ErrQueueFull, Quota: "jobs", Mode: throttle.Queue, Queued: 2})
}

// callsOfEveryKind are the calls observeEveryKind reports, by outcome.
var callsOfEveryKind = []struct {
	outcome string
	shadow  bool
	want    int64
}{
	{"admitted", false, 3},
	{"limited", false, 1},
	{"limited", true, 1},
	{"queue_full", false, 1},
	{"unavailable", false, 1},
}

// sms is the attribute of quota sms's points.
const sms = "throttle.quota=sms"

// countersOfEveryKind are the other counters of quota sms after
// observeEveryKind.
var countersOfEveryKind = []struct {
	name, unit, attrs string
	want              int64
}{
	{"throttle.units", "{unit}", sms, 6},
	{"throttle.fallback.admitted", "{call}", sms, 1},
	{"throttle.redis.errors", "{error}", sms, 1},
	{"throttle.fallback.switches", "{switch}", sms + ",throttle.to=fallback", 2},
	{"throttle.fallback.switches", "{switch}", sms + ",throttle.to=redis", 1},
	{"throttle.data_lost", "{event}", sms, 1},
	{"throttle.vendor.limited", "{response}", sms, 2},
	{"throttle.pauses", "{pause}", sms, 2},
	{"throttle.caps_learned", "{cap}", sms, 2},
	{"throttle.booked_again", "{call}", sms + ",throttle.reason=late", 2},
	{"throttle.booked_again", "{call}", sms + ",throttle.reason=lowered", 1},
}

// checkHistogramsOfEveryKind checks the waits and Redis's round trips that
// observeEveryKind reports.
func checkHistogramsOfEveryKind(t *testing.T, ms map[string]metricdata.Metrics) {
	t.Helper()
	wait := histogram[float64](t, ms, "throttle.wait.duration", "s", sms)
	if wait.Count != 3 || !near(wait.Sum, 2.02) {
		t.Errorf("throttle.wait.duration: count %d sum %v, want 3 and 2.02", wait.Count, wait.Sum)
	}
	if !slices.Equal(wait.Bounds, throttleotel.WaitBoundaries) {
		t.Errorf("throttle.wait.duration bounds %v, want %v", wait.Bounds, throttleotel.WaitBoundaries)
	}
	rt := histogram[float64](t, ms, "throttle.redis.round_trip.duration", "s", sms)
	if rt.Count != 3 || !near(rt.Sum, 1.004) {
		t.Errorf("throttle.redis.round_trip.duration: count %d sum %v, want 3 and 1.004", rt.Count, rt.Sum)
	}
	per := histogram[int64](t, ms, "throttle.redis.calls_per_script", "{call}", sms)
	if per.Count != 3 || per.Sum != 8 {
		t.Errorf("throttle.redis.calls_per_script: count %d sum %d, want 3 and 8", per.Count, per.Sum)
	}
}

func TestObserver_StartsAQuotasCountersAtZero(t *testing.T) {
	obs, reader := newObserver(t)
	obs.Observe(throttle.Event{Kind: throttle.EventRedis, Quota: "github", Duration: time.Millisecond, Calls: 1})
	ms := metrics(t, reader)
	for _, outcome := range []string{"admitted", "limited", "queue_full", "unavailable"} {
		want := "throttle.outcome=" + outcome + ",throttle.quota=github,throttle.shadow=false"
		if got := sum[int64](t, ms, "throttle.calls", "{call}", want); got != 0 {
			t.Errorf("throttle.calls{%s} = %d, want 0", want, got)
		}
	}
	if got := gauge(t, ms, "throttle.fallback.active", "1", "throttle.quota=github"); got != 0 {
		t.Errorf("throttle.fallback.active = %d, want 0", got)
	}
}

func TestObserver_CountsConcurrentEventsExactly(t *testing.T) {
	obs, reader := newObserver(t)
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
	ms := metrics(t, reader)
	var calls, units int64
	for q := range quotas {
		calls += sum[int64](t, ms, "throttle.calls", "{call}", fmt.Sprintf("throttle.outcome=admitted,throttle.quota=q%d,throttle.shadow=false", q))
		units += sum[int64](t, ms, "throttle.units", "{unit}", fmt.Sprintf("throttle.quota=q%d", q))
	}
	if calls != goroutines*each || units != 2*goroutines*each {
		t.Errorf("counted %d calls and %d units, want %d and %d", calls, units, goroutines*each, 2*goroutines*each)
	}
}

func TestNew_RejectsANilMeter(t *testing.T) {
	if _, err := throttleotel.New(nil); err == nil {
		t.Error("New(nil) returned no error")
	}
}

func TestLimiter_CountsMatchTheCallsMade(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	obs, reader := newObserver(t)
	// What the limiter told of its script calls, to hold the recorded
	// figures to: a call whose reply came too late to start in asks again
	// (beside CI's race run, 7 script calls for 6 calls).
	var mu sync.Mutex
	var scripts, decided int64
	observe := func(e throttle.Event) {
		obs.Observe(e)
		if e.Kind == throttle.EventRedis {
			mu.Lock()
			scripts, decided = scripts+1, decided+int64(e.Calls)
			mu.Unlock()
		}
	}
	lim, err := throttle.New(rdb, "vendor", policies.SlidingLog{Limit: 5, Window: time.Minute},
		throttle.Options{Mode: throttle.FailFast, Observer: observe})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var admitted, limited, units int64
	for i := range 6 {
		cost := 1
		if i == 0 {
			cost = 2
		}
		p, err := lim.Acquire(ctx, throttle.Cost(cost))
		switch {
		case err == nil:
			admitted++
			units += int64(cost)
			p.Release()
		case errors.Is(err, throttle.ErrLimited):
			limited++
		default:
			t.Fatal(err)
		}
	}
	if admitted != 4 || limited != 2 {
		t.Fatalf("admitted %d, limited %d; want 4 and 2", admitted, limited)
	}

	ms := metrics(t, reader)
	if got := sum[int64](t, ms, "throttle.calls", "{call}", "throttle.outcome=admitted,throttle.quota=vendor,throttle.shadow=false"); got != admitted {
		t.Errorf("admitted calls: recorded %d, made %d", got, admitted)
	}
	if got := sum[int64](t, ms, "throttle.calls", "{call}", "throttle.outcome=limited,throttle.quota=vendor,throttle.shadow=false"); got != limited {
		t.Errorf("limited calls: recorded %d, made %d", got, limited)
	}
	if got := sum[int64](t, ms, "throttle.units", "{unit}", "throttle.quota=vendor"); got != units {
		t.Errorf("units: recorded %d, admitted %d", got, units)
	}
	if got := histogram[float64](t, ms, "throttle.wait.duration", "s", "throttle.quota=vendor").Count; got != uint64(admitted) {
		t.Errorf("waits recorded: %d, want %d", got, admitted)
	}
	mu.Lock()
	defer mu.Unlock()
	if scripts < 6 || decided != scripts {
		t.Errorf("the limiter told of %d script calls deciding %d calls, want 6 at least, one call each", scripts, decided)
	}
	per := histogram[int64](t, ms, "throttle.redis.calls_per_script", "{call}", "throttle.quota=vendor")
	if per.Count != uint64(scripts) || per.Sum != decided {
		t.Errorf("calls per script: %d script calls deciding %d calls, want %d and %d", per.Count, per.Sum, scripts, decided)
	}
}
