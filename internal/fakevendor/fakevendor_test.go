package fakevendor

import (
	"context"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"
)

// fakeClock is a manual clock so that window boundaries are tested exactly.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// at returns a vendor without a server on a fake clock, and the clock's
// start time.
func at(t *testing.T, cfg Config) (*Vendor, *fakeClock, time.Time) {
	t.Helper()
	clk := newFakeClock()
	return newVendor(cfg, clk.Now, false), clk, clk.Now()
}

// arriveAt sets the clock to start+off and records an arrival of cost n.
func arriveAt(v *Vendor, clk *fakeClock, start time.Time, off time.Duration, n int) bool {
	clk.mu.Lock()
	clk.t = start.Add(off)
	clk.mu.Unlock()
	return v.ArriveN(n)
}

func TestExactlyLimitPerWindow(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 3, Window: 10 * time.Second})
	steps := []struct {
		off  time.Duration
		want bool
	}{
		{0, true},
		{1 * time.Second, true},
		{2 * time.Second, true},
		{5 * time.Second, false},
		// The first arrival is still inside (t-W, t] one nanosecond early.
		{10*time.Second - 1, false},
		// Exactly Window after the first arrival it has left the window.
		{10 * time.Second, true},
		// Window now holds 1s, 2s and 10s.
		{10 * time.Second, false},
		{11 * time.Second, true},
	}
	for i, s := range steps {
		if got := arriveAt(v, clk, t0, s.off, 1); got != s.want {
			t.Fatalf("step %d at +%v: got %v, want %v", i, s.off, got, s.want)
		}
	}
	st := v.Stats()
	if st.Requests != 8 || st.Arrivals != 8 || st.Accepted != 5 || st.OverCap != 3 || st.OverCapRequests != 3 {
		t.Fatalf("stats = %+v", st)
	}
}

func TestBurstAtOneInstant(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 5, Window: time.Second})
	for i := range 5 {
		if !v.Arrive() {
			t.Fatalf("arrival %d rejected", i)
		}
	}
	if v.Arrive() {
		t.Fatal("arrival past the cap accepted")
	}
	if got := v.InWindow(); got != 5 {
		t.Fatalf("InWindow = %d, want 5", got)
	}
}

func TestZeroLimitRejectsAll(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 0, Window: time.Second})
	if v.Arrive() {
		t.Fatal("accepted with Limit 0")
	}
}

func TestCountRejected(t *testing.T) {
	for _, tc := range []struct {
		countRejected bool
		want          []bool
	}{
		// Without counting, the rejection at 5s does not extend the lockout.
		{false, []bool{true, false, true, true}},
		// Counted, it keeps the window full past 10s.
		{true, []bool{true, false, false, true}},
	} {
		v, clk, t0 := at(t, Config{Limit: 1, Window: 10 * time.Second, CountRejected: tc.countRejected})
		offs := []time.Duration{0, 5 * time.Second, 10 * time.Second, 20 * time.Second}
		for i, off := range offs {
			if got := arriveAt(v, clk, t0, off, 1); got != tc.want[i] {
				t.Fatalf("CountRejected=%v at +%v: got %v, want %v", tc.countRejected, off, got, tc.want[i])
			}
		}
	}
}

func TestCosts(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 5, Window: time.Second})
	steps := []struct {
		n    int
		want bool
	}{
		{3, true},
		{3, false}, // 3+3 > 5
		{2, true},  // 3+2 == 5
		{1, false},
		{6, false},
	}
	for i, s := range steps {
		if got := v.ArriveN(s.n); got != s.want {
			t.Fatalf("step %d ArriveN(%d) = %v, want %v", i, s.n, got, s.want)
		}
	}
	st := v.Stats()
	want := Stats{Requests: 5, Arrivals: 15, Accepted: 5, OverCapRequests: 3, OverCap: 10, MaxInWindow: 15}
	if st.Requests != want.Requests || st.Arrivals != want.Arrivals || st.Accepted != want.Accepted ||
		st.OverCapRequests != want.OverCapRequests || st.OverCap != want.OverCap || st.MaxInWindow != want.MaxInWindow {
		t.Fatalf("stats = %+v, want counts of %+v", st, want)
	}
}

func TestArriveNPanicsOnBadCost(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 5, Window: time.Second})
	defer func() {
		if recover() == nil {
			t.Fatal("ArriveN(0) did not panic")
		}
	}()
	v.ArriveN(0)
}

func TestInvalidConfigPanics(t *testing.T) {
	for _, cfg := range []Config{
		{Limit: 1, Window: 0},
		{Limit: -1, Window: time.Second},
		{Limit: 1, Window: time.Second, Work: -1},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("config %+v did not panic", cfg)
				}
			}()
			NewInProcess(cfg)
		}()
	}
}

func TestSetLimit(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 5, Window: 10 * time.Second})
	for i := range 3 {
		if !arriveAt(v, clk, t0, time.Duration(i)*time.Second, 1) {
			t.Fatalf("arrival %d rejected", i)
		}
	}
	v.SetLimit(2)
	if v.Limit() != 2 {
		t.Fatalf("Limit() = %d, want 2", v.Limit())
	}
	// Three already counted, so a lowered cap of 2 rejects.
	if arriveAt(v, clk, t0, 3*time.Second, 1) {
		t.Fatal("accepted above a lowered cap")
	}
	// At 11s the arrivals at 0s and 1s have left; one remains.
	if !arriveAt(v, clk, t0, 11*time.Second, 1) {
		t.Fatal("rejected once back under the lowered cap")
	}
	if arriveAt(v, clk, t0, 11*time.Second, 1) {
		t.Fatal("accepted a third unit under cap 2")
	}
	v.SetLimit(10)
	if !arriveAt(v, clk, t0, 11*time.Second, 8) {
		t.Fatal("rejected within a raised cap")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("SetLimit(-1) did not panic")
		}
	}()
	v.SetLimit(-1)
}

func TestStatsAndReset(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 2, Window: time.Second})
	if st := v.Stats(); st.Requests != 0 || !st.First.IsZero() || !st.Last.IsZero() || st.PerSecond != nil {
		t.Fatalf("empty stats = %+v", st)
	}
	arriveAt(v, clk, t0, 0, 1)
	arriveAt(v, clk, t0, 500*time.Millisecond, 1)
	arriveAt(v, clk, t0, 900*time.Millisecond, 1) // over cap
	arriveAt(v, clk, t0, 2200*time.Millisecond, 2)
	st := v.Stats()
	if !st.First.Equal(t0) || !st.Last.Equal(t0.Add(2200*time.Millisecond)) {
		t.Fatalf("First/Last = %v/%v", st.First, st.Last)
	}
	wantPS := []int{3, 0, 2}
	if len(st.PerSecond) != len(wantPS) {
		t.Fatalf("PerSecond = %v, want %v", st.PerSecond, wantPS)
	}
	for i := range wantPS {
		if st.PerSecond[i] != wantPS[i] {
			t.Fatalf("PerSecond = %v, want %v", st.PerSecond, wantPS)
		}
	}
	if st.MaxInWindow != 3 || st.Accepted != 4 || st.OverCap != 1 {
		t.Fatalf("stats = %+v", st)
	}
	// The snapshot must not alias the vendor's slice.
	st.PerSecond[0] = 99
	if v.Stats().PerSecond[0] != 3 {
		t.Fatal("Stats shares PerSecond with the vendor")
	}

	v.SetLimit(7)
	v.Reset()
	if st := v.Stats(); st.Requests != 0 || st.Arrivals != 0 || st.MaxInWindow != 0 || len(st.PerSecond) != 0 || !st.First.IsZero() {
		t.Fatalf("stats after Reset = %+v", st)
	}
	if v.Limit() != 7 || v.InWindow() != 0 {
		t.Fatalf("after Reset: Limit %d InWindow %d", v.Limit(), v.InWindow())
	}
}

func TestMaxInWindowCountsRejected(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 1, Window: time.Second})
	arriveAt(v, clk, t0, 0, 1)
	arriveAt(v, clk, t0, 500*time.Millisecond, 1)
	arriveAt(v, clk, t0, 900*time.Millisecond, 1)
	// (0s, 1s] holds 0.5, 0.9 and 1.0; the arrival at 0 has left.
	if !arriveAt(v, clk, t0, time.Second, 1) {
		t.Fatal("arrival at Window rejected")
	}
	if got := v.Stats().MaxInWindow; got != 3 {
		t.Fatalf("MaxInWindow = %d, want 3", got)
	}
}

func TestClockGoingBackIsClamped(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 1, Window: 10 * time.Second})
	arriveAt(v, clk, t0, 5*time.Second, 1)
	// An earlier reading is recorded at the latest time seen.
	arriveAt(v, clk, t0, 3*time.Second, 1)
	if got := v.Stats().Last; !got.Equal(t0.Add(5 * time.Second)) {
		t.Fatalf("Last = %v, want clamped to +5s", got)
	}
	if arriveAt(v, clk, t0, 15*time.Second-1, 1) {
		t.Fatal("accepted before the first arrival left")
	}
	if !arriveAt(v, clk, t0, 15*time.Second, 1) {
		t.Fatal("rejected after the first arrival left")
	}
}

func TestUtilization(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	cases := []struct {
		name   string
		s      Stats
		limit  int
		window time.Duration
		want   float64
	}{
		{"empty", Stats{}, 10, time.Second, 0},
		{"one arrival", Stats{Requests: 1, Accepted: 5, First: t0, Last: t0}, 10, time.Second, 0},
		{"same instant", Stats{Requests: 3, Accepted: 3, First: t0, Last: t0}, 10, time.Second, 0},
		{"zero limit", Stats{Requests: 2, Accepted: 2, First: t0, Last: t0.Add(time.Second)}, 0, time.Second, 0},
		{"zero window", Stats{Requests: 2, Accepted: 2, First: t0, Last: t0.Add(time.Second)}, 1, 0, 0},
		// 10 per second over 4s at 5 per second is half the allowance.
		{"half", Stats{Requests: 10, Accepted: 10, First: t0, Last: t0.Add(4 * time.Second)}, 5, time.Second, 0.5},
		// A full burst at each end of one window counts twice the allowance.
		{"bursts", Stats{Requests: 20, Accepted: 20, First: t0, Last: t0.Add(time.Second)}, 10, time.Second, 2},
		{"window scale", Stats{Requests: 30, Accepted: 30, First: t0, Last: t0.Add(time.Minute)}, 10, 20 * time.Second, 1},
	}
	for _, c := range cases {
		if got := c.s.Utilization(c.limit, c.window); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%s: Utilization = %v, want %v", c.name, got, c.want)
		}
	}

	// And from a real run: one arrival per 100ms at cap 10/s for 10s.
	v, clk, start := at(t, Config{Limit: 10, Window: time.Second})
	for i := range 101 {
		if !arriveAt(v, clk, start, time.Duration(i)*100*time.Millisecond, 1) {
			t.Fatalf("arrival %d rejected", i)
		}
	}
	if got := v.Stats().Utilization(10, time.Second); math.Abs(got-1.01) > 1e-12 {
		t.Fatalf("run Utilization = %v, want 1.01", got)
	}
}

// get sends one request to the handler with an optional X-Cost.
func get(t *testing.T, h http.Handler, cost string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/anything", nil)
	if cost != "" {
		r.Header.Set(HeaderCost, cost)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// answer is what the handler must answer: its code, and the values of
// HeaderRemaining and HeaderRetryAfter.
type answer struct {
	code       int
	remaining  string
	retryAfter string
}

// checkAnswer checks the handler's answer w at step against wt, and that
// it states a limit of 2, unless it refused a bad request.
func checkAnswer(t *testing.T, step string, w *httptest.ResponseRecorder, wt answer) {
	t.Helper()
	if w.Code != wt.code {
		t.Fatalf("%s: code %d, want %d", step, w.Code, wt.code)
	}
	if wt.code == http.StatusBadRequest {
		return
	}
	if got := w.Header().Get(HeaderLimit); got != "2" {
		t.Fatalf("%s: %s = %q, want 2", step, HeaderLimit, got)
	}
	if got := w.Header().Get(HeaderRemaining); got != wt.remaining {
		t.Fatalf("%s: %s = %q, want %q", step, HeaderRemaining, got, wt.remaining)
	}
	if got := w.Header().Get(HeaderRetryAfter); got != wt.retryAfter {
		t.Fatalf("%s: %s = %q, want %q", step, HeaderRetryAfter, got, wt.retryAfter)
	}
}

func TestHandlerCodesAndHeaders(t *testing.T) {
	v, clk, t0 := at(t, Config{Limit: 2, Window: 10 * time.Second, RetryAfter: true})
	h := v.Handler()
	set := func(off time.Duration) {
		clk.mu.Lock()
		clk.t = t0.Add(off)
		clk.mu.Unlock()
	}
	set(0)
	w := get(t, h, "")
	checkAnswer(t, "first", w, answer{http.StatusOK, "1", ""})
	if w.Body.String() != "ok\n" {
		t.Fatalf("body = %q", w.Body.String())
	}
	set(1500 * time.Millisecond)
	checkAnswer(t, "second", get(t, h, "1"), answer{http.StatusOK, "0", ""})
	// The oldest arrival leaves at 10s: 7.7s rounds up to 8.
	set(2300 * time.Millisecond)
	checkAnswer(t, "over cap", get(t, h, ""), answer{http.StatusTooManyRequests, "0", "8"})
	// A cost of 2 needs both arrivals gone: 11.5s-2.3s rounds up to 10.
	checkAnswer(t, "over cap cost 2", get(t, h, "2"), answer{http.StatusTooManyRequests, "0", "10"})
	// More than the cap can never fit, so no Retry-After.
	checkAnswer(t, "over cap cost 3", get(t, h, "3"), answer{http.StatusTooManyRequests, "0", ""})
	// Whole seconds are not rounded further.
	set(4 * time.Second)
	checkAnswer(t, "exact seconds", get(t, h, ""), answer{http.StatusTooManyRequests, "0", "6"})

	before := v.Stats().Requests
	for _, bad := range []string{"0", "-1", "x", "1.5", "99999999999"} {
		checkAnswer(t, "bad cost "+bad, get(t, h, bad), answer{code: http.StatusBadRequest})
	}
	if got := v.Stats().Requests; got != before {
		t.Fatalf("bad X-Cost was counted: %d requests, want %d", got, before)
	}

	set(10 * time.Second)
	checkAnswer(t, "after window", get(t, h, " 1 "), answer{http.StatusOK, "0", ""})
}

func TestHandlerWithoutRetryAfter(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 1, Window: time.Second})
	get(t, v.Handler(), "")
	w := get(t, v.Handler(), "")
	if w.Code != http.StatusTooManyRequests || w.Header().Get(HeaderRetryAfter) != "" {
		t.Fatalf("code %d Retry-After %q", w.Code, w.Header().Get(HeaderRetryAfter))
	}
}

func TestHandlerWork(t *testing.T) {
	v, _, _ := at(t, Config{Limit: 5, Window: time.Second, Work: time.Millisecond})
	if w := get(t, v.Handler(), ""); w.Code != http.StatusOK || w.Body.String() != "ok\n" {
		t.Fatalf("code %d body %q", w.Code, w.Body.String())
	}

	// A client that gives up ends the work early; the arrival still counts.
	v, _, _ = at(t, Config{Limit: 5, Window: time.Second, Work: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil)
	w := httptest.NewRecorder()
	v.Handler().ServeHTTP(w, r)
	if w.Body.Len() != 0 || v.Stats().Accepted != 1 {
		t.Fatalf("body %q accepted %d", w.Body.String(), v.Stats().Accepted)
	}
}

func TestServer(t *testing.T) {
	clk := newFakeClock()
	v := newVendor(Config{Limit: 1, Window: time.Minute, RetryAfter: true}, clk.Now, true)
	defer v.Close()
	if v.URL == "" {
		t.Fatal("empty URL")
	}
	codes := []int{}
	for range 2 {
		resp, err := http.Post(v.URL+"/v1/thing", "text/plain", nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get(HeaderRetryAfter) != "60" {
			t.Fatalf("Retry-After = %q, want 60", resp.Header.Get(HeaderRetryAfter))
		}
	}
	if codes[0] != http.StatusOK || codes[1] != http.StatusTooManyRequests {
		t.Fatalf("codes = %v", codes)
	}
	v.Close()
	v.Close()
}

func TestNewInProcess(t *testing.T) {
	v := NewInProcess(Config{Limit: 1, Window: time.Hour})
	defer v.Close()
	if v.URL != "" {
		t.Fatalf("URL = %q", v.URL)
	}
	if !v.Arrive() || v.Arrive() {
		t.Fatal("want one accepted then one rejected")
	}
}

func TestConcurrentArrive(t *testing.T) {
	const limit, goroutines, each = 100, 50, 40
	v := NewInProcess(Config{Limit: limit, Window: time.Hour})
	var wg sync.WaitGroup
	var mu sync.Mutex
	accepted := 0
	for range goroutines {
		wg.Go(func() {
			n := 0
			for range each {
				if v.Arrive() {
					n++
				}
				if n%7 == 0 {
					_ = v.Stats()
					_ = v.InWindow()
				}
			}
			mu.Lock()
			accepted += n
			mu.Unlock()
		})
	}
	wg.Wait()
	st := v.Stats()
	if accepted != limit || st.Accepted != limit || st.Arrivals != goroutines*each ||
		st.OverCap != goroutines*each-limit || st.MaxInWindow != goroutines*each {
		t.Fatalf("accepted %d, stats %+v", accepted, st)
	}
}

func TestConcurrentHTTP(t *testing.T) {
	const limit, requests = 30, 120
	v := New(Config{Limit: limit, Window: time.Hour, RetryAfter: true})
	defer v.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	codes := make(chan int, requests)
	errs := make(chan error, requests)
	for i := range requests {
		wg.Go(func() {
			req, err := http.NewRequest(http.MethodGet, v.URL, nil)
			if err != nil {
				errs <- err
				return
			}
			req.Header.Set(HeaderCost, strconv.Itoa(1+i%2))
			resp, err := client.Do(req)
			if err != nil {
				errs <- err
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	wg.Wait()
	close(codes)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	n := 0
	for c := range codes {
		if c != http.StatusOK && c != http.StatusTooManyRequests {
			t.Fatalf("unexpected code %d", c)
		}
		n++
	}
	st := v.Stats()
	// Costs alternate 1 and 2, so the cap is either met exactly or missed
	// by one unit when only cost-2 requests were left to try.
	if n != requests || st.Requests != requests || st.Accepted > limit || st.Accepted < limit-1 {
		t.Fatalf("responses %d, stats %+v", n, st)
	}
	if st.Arrivals != requests/2*3 || st.Accepted+st.OverCap != st.Arrivals {
		t.Fatalf("stats %+v", st)
	}
}

// modelArrival is one arrival in the brute-force model.
type modelArrival struct {
	t       time.Time
	n       int
	counted bool
}

// arrivalModel is the brute-force model: every arrival of the last window.
type arrivalModel struct {
	hist   []modelArrival
	window time.Duration
}

// decide returns the units counted in the window at now (in) and all that
// arrived in it, whether n more fit under limit, and if not, how long
// until they would: the earliest departure after which they fit.
func (m *arrivalModel) decide(now time.Time, n, limit int) (in, all int, ok bool, retry time.Duration) {
	window := m.window
	// Arrivals outside the window can never matter again.
	for len(m.hist) > 0 && now.Sub(m.hist[0].t) >= window {
		m.hist = m.hist[1:]
	}
	var live []modelArrival
	for _, a := range m.hist {
		if now.Sub(a.t) < window {
			all += a.n
			if a.counted {
				in += a.n
				live = append(live, a)
			}
		}
	}
	ok = in+n <= limit
	if !ok {
		left := in
		for j, a := range live {
			left -= a.n
			if j+1 < len(live) && live[j+1].t.Equal(a.t) {
				continue
			}
			if left+n <= limit {
				retry = a.t.Add(window).Sub(now)
				break
			}
		}
	}
	return in, all, ok, retry
}

// TestAgainstModel compares the vendor with a brute-force scan of every
// arrival, over random times, costs and cap changes.
func TestAgainstModel(t *testing.T) {
	for _, countRejected := range []bool{false, true} {
		rng := rand.New(rand.NewPCG(1, 2))
		const window = 100 * time.Millisecond
		limit := 8
		v, clk, _ := at(t, Config{Limit: limit, Window: window, CountRejected: countRejected})
		model := arrivalModel{window: window}
		maxAll, rejected, retries := 0, 0, 0
		for i := range 5000 {
			// Mostly small steps, some repeats of one instant, some gaps.
			switch r := rng.IntN(10); {
			case r < 2:
			case r < 9:
				clk.Advance(time.Duration(rng.IntN(int(window / 5))))
			default:
				clk.Advance(time.Duration(rng.IntN(int(3 * window))))
			}
			if rng.IntN(200) == 0 {
				limit = rng.IntN(12)
				v.SetLimit(limit)
			}
			now := clk.Now()
			n := 1 + rng.IntN(3)

			in, all, ok, retry := model.decide(now, n, limit)
			if got := v.InWindow(); got != in {
				t.Fatalf("step %d: InWindow %d, model %d", i, got, in)
			}
			model.hist = append(model.hist, modelArrival{t: now, n: n, counted: ok || countRejected})
			maxAll = max(maxAll, all+n)

			if !ok {
				rejected++
			}
			if retry > 0 {
				retries++
			}
			d := v.arrive(now, n)
			if d.ok != ok || d.retryAfter != retry {
				t.Fatalf("step %d (countRejected=%v): got ok=%v retry=%v, model ok=%v retry=%v",
					i, countRejected, d.ok, d.retryAfter, ok, retry)
			}
			if got := v.Stats().MaxInWindow; got != maxAll {
				t.Fatalf("step %d: MaxInWindow %d, model %d", i, got, maxAll)
			}
		}
		// Guard against a run that never reaches the interesting paths.
		if rejected < 500 || retries < 500 || rejected == retries {
			t.Fatalf("countRejected=%v: weak run: %d rejected, %d with Retry-After", countRejected, rejected, retries)
		}
		t.Logf("countRejected=%v: %d rejected, %d with Retry-After, max in window %d", countRejected, rejected, retries, maxAll)
	}
}

func TestRingShrinks(t *testing.T) {
	var r ring
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 1000 {
		r.push(t0.Add(time.Duration(i)), 1)
	}
	big := len(r.buf)
	r.trim(t0.Add(time.Hour), time.Second)
	if r.n != 0 || r.sum() != 0 || len(r.buf) >= big {
		t.Fatalf("after trim: n %d sum %d buf %d (was %d)", r.n, r.sum(), len(r.buf), big)
	}
	// Repeated trims bring the buffer back to its minimum.
	for range 10 {
		r.trim(t0.Add(time.Hour), time.Second)
	}
	if len(r.buf) != minRing {
		t.Fatalf("buf %d, want %d", len(r.buf), minRing)
	}
}

// Replay judges the times given in order, whatever order they come in.
func TestReplay(t *testing.T) {
	start := time.Unix(1000, 0)
	at := func(ms ...int) []time.Time {
		var ts []time.Time
		for _, m := range ms {
			ts = append(ts, start.Add(time.Duration(m)*time.Millisecond))
		}
		return ts
	}
	cfg := Config{Limit: 2, Window: time.Second}
	// Three in one window, given out of order: the last in time is over.
	st := Replay(cfg, at(900, 0, 500))
	if st.Accepted != 2 || st.OverCap != 1 || st.MaxInWindow != 3 {
		t.Fatalf("three in a window of 2: %+v", st)
	}
	// Two a window apart each: none over.
	st = Replay(cfg, at(1500, 0, 1000, 500))
	if st.Accepted != 4 || st.OverCap != 0 || st.MaxInWindow != 2 {
		t.Fatalf("two in each window: %+v", st)
	}
}
