package throttle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// vendorServer is an httptest server in front of a handler that records
// every arrival at the vendor and every connection opened to it.
type vendorServer struct {
	*httptest.Server
	mu       sync.Mutex
	arrivals []arrival
	opened   atomic.Int64
	closed   atomic.Int64
}

type arrival struct {
	at         time.Time
	status     int
	replica    string // the X-Replica header the test's clients set
	body       string
	query      url.Values
	retryAfter int // the Retry-After of the answer, in seconds
}

func newVendorServer(t *testing.T, h http.Handler) *vendorServer {
	t.Helper()
	v := &vendorServer{}
	v.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := arrival{at: time.Now(), replica: r.Header.Get("X-Replica"), query: r.URL.Query()}
		body, _ := io.ReadAll(r.Body)
		a.body = string(body)
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		h.ServeHTTP(rec, r)
		a.status = rec.status
		a.retryAfter, _ = strconv.Atoi(w.Header().Get("Retry-After"))
		v.mu.Lock()
		v.arrivals = append(v.arrivals, a)
		v.mu.Unlock()
	}))
	v.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			v.opened.Add(1)
		case http.StateClosed, http.StateHijacked:
			v.closed.Add(1)
		}
	}
	v.Start()
	t.Cleanup(v.Close)
	return v
}

func (v *vendorServer) log() []arrival {
	v.mu.Lock()
	defer v.mu.Unlock()
	a := slices.Clone(v.arrivals)
	slices.SortFunc(a, func(x, y arrival) int { return x.at.Compare(y.at) })
	return a
}

func (v *vendorServer) count() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.arrivals)
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

// answer returns a handler that answers every request with status, headers
// given as name, value pairs, and body.
func answer(status int, body string, header ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Add(header[i], header[i+1])
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

// refuseFirst answers the first n requests with a 429 carrying the given
// headers, and the rest with 200 "ok".
func refuseFirst(n int, header ...string) http.HandlerFunc {
	var seen atomic.Int64
	return func(w http.ResponseWriter, r *http.Request) {
		if seen.Add(1) <= int64(n) {
			answer(http.StatusTooManyRequests, "slow down", header...)(w, r)
			return
		}
		answer(http.StatusOK, "ok")(w, r)
	}
}

// replicaLimiter is one replica's limiter for quota: its own Redis client on
// s, as a separate process would have.
func replicaLimiter(t *testing.T, s *redistest.Server, quota string, p policies.Policy, opts ...Options) *Limiter {
	t.Helper()
	rdb := s.Client(t)
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, quota, p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// replicaClient is an http.Client for one replica: its own connections, and
// a header that tells the vendor which replica sent each request.
func replicaClient(t *testing.T, name string, lim *Limiter) *http.Client {
	t.Helper()
	base := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(base.CloseIdleConnections)
	tagged := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		r.Header.Set("X-Replica", name)
		return base.RoundTrip(r)
	})
	return &http.Client{Transport: &Transport{Base: tagged, Limiter: lim}}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// bodyRecorder is a request body that records how often it was closed.
type bodyRecorder struct {
	r      io.Reader
	closed atomic.Int64
}

func newBodyRecorder(s string) *bodyRecorder { return &bodyRecorder{r: strings.NewReader(s)} }

func (b *bodyRecorder) Read(p []byte) (int, error) { return b.r.Read(p) }
func (b *bodyRecorder) Close() error               { b.closed.Add(1); return nil }

// eventually polls cond for up to 10 seconds, for state that another
// goroutine reaches at an unknown moment; it is never a timing assertion.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the response body: %v", err)
	}
	return string(b)
}

func mustRequest(t *testing.T, ctx context.Context, method, url string, body io.Reader) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// Several replicas, each with its own Redis client, limiter and
// connections, send as fast as they can through their Transports to a
// strict vendor: not one request arrives over the vendor's cap.
func TestTransport_FleetNeverOverCap(t *testing.T) {
	long(t)
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		const (
			limit    = 20
			window   = 500 * time.Millisecond
			replicas = 3
			workers  = 4
			runFor   = 1400 * time.Millisecond
		)
		vendor := fakevendor.NewInProcess(fakevendor.Config{Limit: limit, Window: window})
		srv := newVendorServer(t, vendor.Handler())
		ctx, cancel := context.WithTimeout(context.Background(), runFor)
		defer cancel()
		var wg sync.WaitGroup
		for i := range replicas {
			lim := replicaLimiter(t, s, "fleet-http", policies.SlidingLog{Limit: limit, Window: window})
			client := replicaClient(t, strconv.Itoa(i), lim)
			for range workers {
				wg.Go(func() {
					for ctx.Err() == nil {
						resp, err := client.Do(mustRequest(t, ctx, http.MethodGet, srv.URL, nil))
						if err != nil {
							if !errors.Is(err, ErrLimited) && !errors.Is(err, context.DeadlineExceeded) {
								t.Errorf("GET: %v", err)
							}
							return
						}
						readAll(t, resp)
					}
				})
			}
		}
		wg.Wait()
		st := vendor.Stats()
		t.Logf("vendor: %d requests, %d over cap, at most %d in a window of %v (cap %d)",
			st.Requests, st.OverCapRequests, st.MaxInWindow, window, limit)
		if st.OverCap != 0 || st.MaxInWindow > limit {
			t.Errorf("vendor saw %d requests over its cap, %d in one window, cap %d", st.OverCap, st.MaxInWindow, limit)
		}
		// Windows start at 0, W+margin and 2(W+margin): at least two full ones.
		if min := 2 * limit; st.Accepted < min {
			t.Errorf("vendor accepted %d requests in %v, want at least %d: the fleet left the quota unused", st.Accepted, runFor, min)
		}
	})
}

// The vendor halves its cap while the fleet runs at the old one. The first
// 429 pauses every replica until the vendor's Retry-After: no replica calls
// during the pause. The fleet then resumes, and no retry storm follows.
//
// The bound on 429s: a request reaches the vendor only with a permit, and a
// worker that gets a 429 has paused the quota in Redis before it asks for
// its next one; so within one pause, each worker gets at most one 429, from
// a request admitted before the pause landed. That is replicas × workers per
// pause, with no growth from one pause to the next. (The shared count,
// lowered from X-RateLimit-Remaining, cannot prevent them: the requests in
// flight when it is lowered are not in the vendor's count yet.)
func TestTransport_FleetPausesWhenTheVendorLowersItsCap(t *testing.T) {
	long(t)
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		const (
			limit    = 20
			lowered  = 10
			window   = time.Second
			replicas = 3
			workers  = 2
			perPause = replicas * workers
			lowerAt  = 1200 * time.Millisecond
			runFor   = 3700 * time.Millisecond
			// Each pause lasts at least the vendor's Retry-After of 1s.
			maxPauses = int((runFor - lowerAt + time.Second - 1) / time.Second)
		)
		r := &capLowered{t: t, perPause: perPause}
		r.run(s, policies.SlidingLog{Limit: limit, Window: window}, replicas, workers, lowered, lowerAt, runFor)
		log := r.srv.log()
		t.Logf("cap %d per %v, lowered to %d at %v; arrivals per 100ms:%s", limit, window, lowered,
			r.loweredAt.Sub(r.start).Round(time.Millisecond), timeline(r.start, log, 100*time.Millisecond))

		pauses := pausesIn(log)
		if len(pauses) == 0 {
			// The shared count, lowered from X-RateLimit-Remaining, slowed
			// the fleet down before the vendor had to refuse a call.
			t.Log("the vendor never answered 429")
			return
		}
		total := 0
		for i, p := range pauses {
			total += p.refused
			r.checkPause(i, p, log)
		}
		t.Logf("429s: %d in %d pauses (at most %d per pause)", total, len(pauses), perPause)
		if len(pauses) > maxPauses {
			t.Errorf("%d pauses in %v, want at most %d", len(pauses), runFor-lowerAt, maxPauses)
		}
		r.checkResumed(log, pauses[0], runFor)
	})
}

// capLowered is a run of TestTransport_FleetPausesWhenTheVendorLowersItsCap:
// the vendor, when the run began and when the vendor lowered its cap, and
// the most 429s a pause may bring.
type capLowered struct {
	t                *testing.T
	perPause         int
	srv              *vendorServer
	start, loweredAt time.Time
}

// run calls the vendor from workers goroutines of each of replicas
// replicas until runFor ends, with the vendor's cap lowered to lowered at
// lowerAt.
func (r *capLowered) run(s *redistest.Server, policy policies.SlidingLog, replicas, workers, lowered int, lowerAt, runFor time.Duration) {
	t := r.t
	vendor := fakevendor.NewInProcess(fakevendor.Config{Limit: policy.Limit, Window: policy.Window, RetryAfter: true})
	r.srv = newVendorServer(t, vendor.Handler())
	r.start = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), runFor)
	defer cancel()
	var wg sync.WaitGroup
	for i := range replicas {
		lim := replicaLimiter(t, s, "lowered", policy)
		client := replicaClient(t, strconv.Itoa(i), lim)
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					resp, err := client.Do(mustRequest(t, ctx, http.MethodGet, r.srv.URL, nil))
					if err != nil {
						if !errors.Is(err, ErrLimited) && !errors.Is(err, context.DeadlineExceeded) {
							t.Errorf("GET: %v", err)
						}
						return
					}
					readAll(t, resp)
				}
			})
		}
	}
	time.Sleep(lowerAt)
	vendor.SetLimit(lowered)
	r.loweredAt = time.Now()
	wg.Wait()
}

// checkPause checks pause i: after the cap was lowered, at most one 429
// per worker, and no more calls during it than the workers had booked.
func (r *capLowered) checkPause(i int, p pause, log []arrival) {
	t, start, perPause := r.t, r.start, r.perPause
	t.Helper()
	t.Logf("pause %d: first 429 at %v, Retry-After %v, %d 429s, next arrival %v later",
		i+1, p.at.Sub(start).Round(time.Millisecond), p.retryAfter, p.refused, p.next.Round(time.Millisecond))
	if p.at.Before(r.loweredAt) {
		t.Errorf("429 at %v, before the cap was lowered", p.at.Sub(start))
	}
	if p.refused > perPause {
		t.Errorf("pause %d: %d 429s, want at most %d (one per worker)", i+1, p.refused, perPause)
	}
	// Requests already on their way when the first 429 came back may
	// arrive just after it; then nothing until the vendor's time but
	// the calls another replica had booked before the pause reached
	// Redis: a sleeping call checks only the pauses its own process
	// has seen, so each worker may still wake and call once.
	quietFrom, quietTo := p.at.Add(100*time.Millisecond), p.at.Add(p.retryAfter-20*time.Millisecond)
	var inside []string
	for _, a := range log {
		if a.at.After(quietFrom) && a.at.Before(quietTo) {
			inside = append(inside, fmt.Sprintf("replica %s at %v", a.replica, a.at.Sub(start).Round(time.Millisecond)))
		}
	}
	if len(inside) > 0 {
		t.Logf("pause %d: booked before it, called during it: %s", i+1, strings.Join(inside, ", "))
	}
	if len(inside) > perPause {
		t.Errorf("pause %d (%v..%v): %d calls, want at most %d (one booked call per worker): %s",
			i+1, quietFrom.Sub(start), quietTo.Sub(start), len(inside), perPause, strings.Join(inside, ", "))
	}
}

// checkResumed checks that the vendor accepted calls after the first
// pause, unless it ended with the run.
func (r *capLowered) checkResumed(log []arrival, first pause, runFor time.Duration) {
	r.t.Helper()
	var resumed int
	for _, a := range log {
		if a.at.After(first.at.Add(first.retryAfter)) && a.status == http.StatusOK {
			resumed++
		}
	}
	// A fleet whose first pause ends with the run has no time left to
	// resume in.
	if ends := first.at.Add(first.retryAfter); resumed == 0 && ends.Before(r.start.Add(runFor-300*time.Millisecond)) {
		r.t.Error("the vendor accepted nothing after the first pause: the fleet did not resume")
	}
}

// pause is a run of 429s and the quiet that follows it.
type pause struct {
	at         time.Time     // the first 429
	retryAfter time.Duration // its Retry-After
	refused    int           // 429s in the group
	next       time.Duration // from the first 429 to the next accepted arrival
}

// pausesIn groups the 429s of a log by the pause they caused: a 429 after
// the end of the pause of the group before, as its first 429 and
// Retry-After give it, starts a new group.
func pausesIn(log []arrival) []pause {
	var ps []pause
	for i, a := range log {
		if a.status != http.StatusTooManyRequests {
			continue
		}
		if len(ps) == 0 || a.at.After(ps[len(ps)-1].at.Add(ps[len(ps)-1].retryAfter)) {
			ps = append(ps, pause{at: a.at, retryAfter: time.Duration(a.retryAfter) * time.Second})
		}
		p := &ps[len(ps)-1]
		p.refused++
		p.next = 0
		for _, b := range log[i+1:] {
			if b.status != http.StatusTooManyRequests {
				p.next = b.at.Sub(p.at)
				break
			}
		}
	}
	return ps
}

// timeline renders arrivals per step, with 429s in brackets and the replicas
// that sent them.
func timeline(start time.Time, log []arrival, step time.Duration) string {
	var b strings.Builder
	if len(log) == 0 {
		return "no arrivals"
	}
	end := log[len(log)-1].at
	for t0 := start; !t0.After(end); t0 = t0.Add(step) {
		n, refused := 0, 0
		replicas := map[string]bool{}
		for _, a := range log {
			if !a.at.Before(t0) && a.at.Before(t0.Add(step)) {
				n++
				replicas[a.replica] = true
				if a.status == http.StatusTooManyRequests {
					refused++
				}
			}
		}
		names := make([]string, 0, len(replicas))
		for r := range replicas {
			names = append(names, r)
		}
		slices.Sort(names)
		fmt.Fprintf(&b, "\n%5dms %3d arrivals", t0.Sub(start).Milliseconds(), n)
		if refused > 0 {
			fmt.Fprintf(&b, " [%d 429]", refused)
		}
		if n > 0 {
			fmt.Fprintf(&b, " from %s", strings.Join(names, ","))
		}
	}
	return b.String()
}

// A refused POST with an Idempotency-Key, whose body GetBody can produce
// again, is retried, through the limiter, and the vendor sees the same body
// on every attempt.
func TestTransport_RetryReplaysTheBody(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		srv := newVendorServer(t, refuseFirst(2, "Retry-After", "0"))
		lim := replicaLimiter(t, s, "replay", policies.SlidingLog{Limit: 3, Window: time.Minute})
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		const body = `{"to":"+15550100","text":"hello"}`
		req := mustRequest(t, context.Background(), http.MethodPost, srv.URL, strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "sms-1")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, resp); resp.StatusCode != http.StatusOK || got != "ok" {
			t.Fatalf("got %d %q, want 200 \"ok\"", resp.StatusCode, got)
		}
		log := srv.log()
		if len(log) != 3 {
			t.Fatalf("vendor saw %d attempts, want 3", len(log))
		}
		for i, a := range log {
			if a.body != body {
				t.Errorf("attempt %d carried %q, want %q", i+1, a.body, body)
			}
		}
		// Each attempt was a call to the vendor, and went through the limiter.
		if d, err := lim.Allow(context.Background()); err != nil || d.OK {
			t.Errorf("after 3 attempts the quota of 3 admits another call (%+v, %v): retries skipped the limiter", d, err)
		}
	})
}

// Only a request that can be sent again is retried; any other refusal comes
// back as the vendor sent it.
func TestTransport_RetriesOnlyWhatCanBeSentAgain(t *testing.T) {
	s := redistest.Mini(t)
	tests := []struct {
		name     string
		request  func(url string) *http.Request
		attempts int
	}{
		{"GET", func(url string) *http.Request { return mustRequest(t, context.Background(), http.MethodGet, url, nil) }, 2},
		{"PUT with GetBody", func(url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPut, url, strings.NewReader("x"))
		}, 2},
		{"POST with GetBody", func(url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPost, url, strings.NewReader("x"))
		}, 1},
		{"POST with GetBody and an Idempotency-Key", func(url string) *http.Request {
			r := mustRequest(t, context.Background(), http.MethodPost, url, strings.NewReader("x"))
			r.Header.Set("Idempotency-Key", "k-1")
			return r
		}, 2},
		{"POST without GetBody", func(url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPost, url, newBodyRecorder("x"))
		}, 1},
		{"PUT without GetBody", func(url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPut, url, newBodyRecorder("x"))
		}, 1},
		{"POST without a body", func(url string) *http.Request {
			return mustRequest(t, context.Background(), http.MethodPost, url, nil)
		}, 1},
		{"POST without a body, with an Idempotency-Key", func(url string) *http.Request {
			r := mustRequest(t, context.Background(), http.MethodPost, url, nil)
			r.Header.Set("Idempotency-Key", "k-1")
			return r
		}, 2},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newVendorServer(t, refuseFirst(1, "Retry-After", "0", "X-Vendor", "v"))
			lim := replicaLimiter(t, s, "only-"+strconv.Itoa(i), policies.SlidingLog{Limit: 10, Window: time.Minute})
			resp, err := (&Transport{Limiter: lim}).RoundTrip(tt.request(srv.URL))
			if err != nil {
				t.Fatal(err)
			}
			got := readAll(t, resp)
			if n := srv.count(); n != tt.attempts {
				t.Errorf("vendor saw %d attempts, want %d", n, tt.attempts)
			}
			if tt.attempts == 1 {
				// The refusal, untouched: status, headers and body.
				if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("X-Vendor") != "v" ||
					resp.Header.Get("Retry-After") != "0" || got != "slow down" {
					t.Errorf("got %d %v %q, want the vendor's 429 as sent", resp.StatusCode, resp.Header, got)
				}
			} else if resp.StatusCode != http.StatusOK {
				t.Errorf("got %d after a retry, want 200", resp.StatusCode)
			}
		})
	}
}

// The caller's request is left as it was, on the first attempt and on
// retries alike.
func TestTransport_DoesNotModifyTheRequest(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, refuseFirst(2, "Retry-After", "0"))
	lim := replicaLimiter(t, s, "untouched", policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Minute}})
	tr := &Transport{Limiter: lim, Key: func(r *http.Request) string { return r.Header.Get("X-Tenant") }}
	req := mustRequest(t, context.Background(), http.MethodPost, srv.URL+"/v1/messages?x=1", strings.NewReader("hello"))
	req.Header.Set("Idempotency-Key", "m-1")
	req.Header.Set("X-Tenant", "t-1")
	req.Header.Set("Authorization", "Bearer secret")
	type snapshot struct {
		Method, URL, Host string
		Header            http.Header
		ContentLength     int64
		Body              io.ReadCloser
		GetBody           bool
		Ctx               context.Context
		Close             bool
	}
	snap := func() snapshot {
		return snapshot{req.Method, req.URL.String(), req.Host, req.Header.Clone(), req.ContentLength, req.Body, req.GetBody != nil, req.Context(), req.Close}
	}
	before := snap()
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if after := snap(); !reflect.DeepEqual(before, after) {
		t.Errorf("the request changed:\nbefore %+v\nafter  %+v", before, after)
	}
	if n := srv.count(); n != 3 {
		t.Errorf("vendor saw %d attempts, want 3", n)
	}
}

// Whatever happens to a request, its body is closed, and the caller gets a
// response or an error, never both.
func TestTransport_ClosesTheBodyOnEveryPath(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ok := newVendorServer(t, answer(http.StatusOK, "ok"))
		refusing := newVendorServer(t, answer(http.StatusTooManyRequests, "no", "Retry-After", "0"))
		gone := httptest.NewServer(http.NotFoundHandler())
		gone.Close()
		full := replicaLimiter(t, s, "full", policies.SlidingLog{Limit: 1, Window: time.Minute}, Options{Mode: FailFast})
		if _, err := full.Allow(context.Background()); err != nil {
			t.Fatal(err)
		}
		open := func(name string) *Limiter {
			return replicaLimiter(t, s, name, policies.SlidingLog{Limit: 100, Window: time.Minute})
		}
		perKey := replicaLimiter(t, s, "per-key", policies.PerKey{Policy: policies.SlidingLog{Limit: 1, Window: time.Minute}})
		down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
		t.Cleanup(func() { _ = down.Close() })
		broken, err := New(down, "broken", policies.SlidingLog{Limit: 1, Window: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		tests := []struct {
			name    string
			tr      *Transport
			method  string
			url     string
			ctx     context.Context
			wantErr bool
		}{
			{"sent", &Transport{Limiter: open("sent")}, http.MethodPost, ok.URL, context.Background(), false},
			{"refused by the limiter", &Transport{Limiter: full}, http.MethodPost, ok.URL, context.Background(), true},
			{"limiter error: no key", &Transport{Limiter: perKey}, http.MethodPost, ok.URL, context.Background(), true},
			{"Redis down", &Transport{Limiter: broken}, http.MethodPost, ok.URL, context.Background(), true},
			{"context cancelled", &Transport{Limiter: open("cancelled")}, http.MethodPost, ok.URL, cancelled, true},
			{"vendor unreachable", &Transport{Limiter: open("unreachable")}, http.MethodPost, gone.URL, context.Background(), true},
			{"refused by the vendor, not retried", &Transport{Limiter: open("refused")}, http.MethodPost, refusing.URL, context.Background(), false},
			{"refused by the vendor, retries spent", &Transport{Limiter: open("spent"), MaxRetries: 1}, http.MethodPut, refusing.URL, context.Background(), false},
			{"no limit", &Transport{Routes: []Route{{Pattern: "/elsewhere/", Limiter: open("elsewhere")}}}, http.MethodPost, ok.URL, context.Background(), false},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				checkClosesTheBody(t, tt.tr, mustRequest(t, tt.ctx, tt.method, tt.url, newBodyRecorder("payload")), tt.wantErr)
			})
		}
	})
}

// checkClosesTheBody sends req, whose body is a bodyRecorder, through tr:
// the caller gets a response or an error (when wantErr), never both, and
// the body is closed. A PUT can be sent again, through its GetBody.
func checkClosesTheBody(t *testing.T, tr *Transport, req *http.Request, wantErr bool) {
	t.Helper()
	body := req.Body.(*bodyRecorder)
	if req.Method == http.MethodPut {
		req.GetBody = func() (io.ReadCloser, error) { return newBodyRecorder("payload"), nil }
	}
	resp, err := tr.RoundTrip(req)
	if (resp == nil) == (err == nil) {
		t.Fatalf("got response %v and error %v, want exactly one", resp, err)
	}
	if (err != nil) != wantErr {
		t.Errorf("error %v, want an error: %v", err, wantErr)
	}
	if resp != nil {
		readAll(t, resp)
	}
	// http.Transport may close the body from its own goroutine
	// after RoundTrip returns.
	eventually(t, "the request body to be closed", func() bool { return body.closed.Load() > 0 })
}

// In FailFast mode a full quota fails the request at once, and the error,
// wrapped by http.Client in a *url.Error, matches ErrLimited and carries
// RetryAfter.
func TestTransport_FailFastErrorIsErrLimited(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		srv := newVendorServer(t, answer(http.StatusOK, "ok"))
		lim := replicaLimiter(t, s, "fail-fast", policies.SlidingLog{Limit: 1, Window: time.Minute}, Options{Mode: FailFast})
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		start := time.Now()
		resp, err = client.Get(srv.URL)
		if err == nil {
			readAll(t, resp)
			t.Fatal("second request sent, want ErrLimited")
		}
		var ue *url.Error
		var le *LimitedError
		switch {
		case !errors.As(err, &ue):
			t.Errorf("error %T %v, want a *url.Error", err, err)
		case !errors.Is(err, ErrLimited):
			t.Errorf("error %v does not match ErrLimited", err)
		case !errors.As(err, &le):
			t.Errorf("error %v holds no *LimitedError", err)
		case le.RetryAfter < 59*time.Second || le.RetryAfter > time.Minute+warmMargin(time.Minute):
			t.Errorf("RetryAfter %v, want about a minute", le.RetryAfter)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("refusal took %v, want at once", d)
		}
		if n := srv.count(); n != 1 {
			t.Errorf("vendor saw %d requests, want 1", n)
		}
	})
}

// A request waiting for its slot gives up when its context is cancelled,
// with the context's error, and gives its slot back.
func TestTransport_ContextCancelledWhileWaitingForASlot(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		srv := newVendorServer(t, answer(http.StatusOK, "ok"))
		lim := replicaLimiter(t, s, "cancel", policies.SlidingLog{Limit: 1, Window: 10 * time.Second})
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)

		ctx, cancel := context.WithCancel(context.Background())
		body := newBodyRecorder("waiting")
		done := make(chan error, 1)
		go func() {
			resp, err := client.Do(mustRequest(t, ctx, http.MethodPost, srv.URL, body))
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
		// Wait until the request has booked its slot in Redis.
		eventually(t, "the request to book a slot", func() bool { return entries(lim) == 2 })
		cancel()
		select {
		case err = <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("the request did not return after its context was cancelled")
		}
		if !errors.Is(err, context.Canceled) {
			t.Errorf("error %v, want context.Canceled", err)
		}
		if body.closed.Load() == 0 {
			t.Error("the body of the cancelled request was not closed")
		}
		if n := srv.count(); n != 1 {
			t.Errorf("vendor saw %d requests, want 1", n)
		}
		eventually(t, "the booking to be given back", func() bool { return entries(lim) == 1 })
	})
}

// A refusal pauses the whole fleet for as long as the vendor asked, rounded
// up, whichever header said it: another replica, on its own Redis client,
// finds the quota paused.
func TestTransport_PausesTheFleet(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		epoch := func(d time.Duration) string { return strconv.FormatInt(time.Now().Add(d).Unix(), 10) }
		date := func(d time.Duration) string { return time.Now().Add(d).UTC().Format(http.TimeFormat) }
		tests := []pauseCase{
			{"429 Retry-After seconds", 429, []string{"Retry-After", "3"}, 2900 * time.Millisecond, 3 * time.Second, 429},
			{"429 Retry-After fraction, rounded up", 429, []string{"Retry-After", "2.0000001"}, 2 * time.Second, 2001 * time.Millisecond, 429},
			{"429 Retry-After date", 429, []string{"Retry-After", date(5 * time.Second)}, 3900 * time.Millisecond, 5 * time.Second, 429},
			{"429 X-RateLimit-Reset epoch", 429, []string{"X-RateLimit-Remaining", "0", "X-RateLimit-Reset", epoch(8 * time.Second)}, 6900 * time.Millisecond, 8 * time.Second, 429},
			{"429 X-RateLimit-Reset delta", 429, []string{"X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "4"}, 3900 * time.Millisecond, 4 * time.Second, 429},
			// Without its RateLimit-Policy: a limit of 100 stated, with
			// nothing left after the fleet's one call, measures others
			// that spent 99, and the share holds the fleet for a window
			// (TestOthers_ACountThatTeachesMeasuresThemToo).
			{"429 IETF RateLimit", 429, []string{"RateLimit", `"default";r=0;t=6`}, 5900 * time.Millisecond, 6 * time.Second, 429},
			{"429 without a hint: the default pause", 429, nil, 1900 * time.Millisecond, 2500 * time.Millisecond, 429},
			{"429 Retry-After beyond maxPause", 429, []string{"Retry-After", "999999999"}, maxPause - time.Second, maxPause, 429},
			{"503 Retry-After", 503, []string{"Retry-After", "2"}, 1900 * time.Millisecond, 2 * time.Second, 503},
			{"403 from GitHub, nothing left", 403, []string{"X-RateLimit-Remaining", "0", "X-RateLimit-Reset", epoch(9 * time.Second)}, 7900 * time.Millisecond, 9 * time.Second, 403},
			{"200 saying nothing is left until the reset", 200, []string{"RateLimit", `"default";r=0;t=7`}, 6900 * time.Millisecond, 7 * time.Second, 200},
			{"503 without Retry-After: no pause", 503, nil, 0, 0, 503},
			{"200 with Retry-After: no pause", 200, []string{"Retry-After", "30"}, 0, 0, 200},
		}
		made := time.Now() // when the dates and epochs above were written
		for i, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				// A date or an epoch lies nearer by the time the cases
				// before took (beside CI's race run, seconds).
				tt.atLeast -= time.Since(made)
				checkOtherReplicaPaused(t, s, "pause-"+strconv.Itoa(i), tt)
			})
		}
	})
}

// pauseCase is an answer of TestTransport_PausesTheFleet's vendor, and the
// pause it must set.
type pauseCase struct {
	name       string
	status     int
	header     []string
	atLeast    time.Duration // the pause the other replica must see, less the time the test takes
	atMost     time.Duration
	wantStatus int
}

// checkOtherReplicaPaused sends a request through a Transport to a vendor
// that answers as tt says, and asks another replica of quota for a call:
// it must be refused for the pause tt sets, or admitted when tt sets none.
func checkOtherReplicaPaused(t *testing.T, s *redistest.Server, quota string, tt pauseCase) {
	t.Helper()
	srv := newVendorServer(t, answer(tt.status, "body", tt.header...))
	lim := replicaLimiter(t, s, quota, policies.SlidingLog{Limit: 100, Window: time.Minute})
	other := replicaLimiter(t, s, quota, policies.SlidingLog{Limit: 100, Window: time.Minute})
	tr := &Transport{Limiter: lim, MaxRetries: -1, DefaultPause: 2 * time.Second}
	start := time.Now()
	resp, err := tr.RoundTrip(mustRequest(t, context.Background(), http.MethodGet, srv.URL, nil))
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, resp); resp.StatusCode != tt.wantStatus {
		t.Errorf("status %d, want %d", resp.StatusCode, tt.wantStatus)
	}
	d, err := other.Allow(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	if tt.atMost == 0 {
		if !d.OK {
			t.Errorf("the other replica was refused (retry after %v), want no pause", d.RetryAfter)
		}
		return
	}
	if d.OK {
		t.Fatal("the other replica was admitted, want the quota paused")
	}
	if d.RetryAfter < tt.atLeast-elapsed || d.RetryAfter > tt.atMost {
		t.Errorf("the other replica must wait %v, want between %v and %v", d.RetryAfter, tt.atLeast-elapsed, tt.atMost)
	}
}

// A Retry-After far in the future does not hang the request: the pause is
// capped at maxPause, and a retry that could only run after the budget is
// not waited for.
func TestTransport_HugeRetryAfterReturnsAtOnce(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusTooManyRequests, "come back in 31 years", "Retry-After", "999999999"))
	lim := replicaLimiter(t, s, "huge", policies.SlidingLog{Limit: 10, Window: time.Second})
	client := &http.Client{Transport: &Transport{Limiter: lim}}
	start := time.Now()
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != http.StatusTooManyRequests || body != "come back in 31 years" {
		t.Errorf("got %d %q, want the vendor's 429", resp.StatusCode, body)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %v, want the refusal at once", d)
	}
	if n := srv.count(); n != 1 {
		t.Errorf("vendor saw %d requests, want 1", n)
	}
}

// An answer that says fewer calls are left than the shared count believes
// lowers the count for every replica; one that says more changes nothing.
func TestTransport_LowersTheSharedCount(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, tt := range []struct {
			remaining string
			wantFree  int // calls the other replica can still make
		}{
			{"2", leftAfter(10, 1, 2)}, // the others spent 7: left to them, and a unit more
			{"50", 9},
		} {
			t.Run("vendor says "+tt.remaining, func(t *testing.T) {
				quota := "remaining-" + tt.remaining
				srv := newVendorServer(t, answer(http.StatusOK, "ok", "X-RateLimit-Remaining", tt.remaining))
				lim := replicaLimiter(t, s, quota, policies.SlidingLog{Limit: 10, Window: time.Minute})
				other := replicaLimiter(t, s, quota, policies.SlidingLog{Limit: 10, Window: time.Minute})
				resp, err := (&Transport{Limiter: lim}).RoundTrip(mustRequest(t, context.Background(), http.MethodGet, srv.URL, nil))
				if err != nil {
					t.Fatal(err)
				}
				readAll(t, resp)
				if free := allowed(t, other, 20); free != tt.wantFree {
					t.Errorf("the other replica could make %d calls, want %d", free, tt.wantFree)
				}
			})
		}
	})
}

// Requests go through the limiter of the first route they match: GitHub's
// search API at 30 a minute beside the core API at 5000 an hour.
func TestTransport_Routes(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	host := strings.TrimPrefix(srv.URL, "http://")
	core := replicaLimiter(t, s, "core", policies.SlidingLog{Limit: 5000, Window: time.Hour}, Options{Mode: FailFast})
	search := replicaLimiter(t, s, "search", policies.SlidingLog{Limit: 2, Window: time.Minute}, Options{Mode: FailFast})
	client := &http.Client{Transport: &Transport{
		Limiter: core,
		Routes: []Route{
			{Pattern: host + "/search/", Limiter: search},
			{Pattern: "/health", Limiter: nil},
		},
	}}
	get := func(path string) error {
		resp, err := client.Get(srv.URL + path)
		if err == nil {
			readAll(t, resp)
		}
		return err
	}
	for i := range 3 {
		err := get("/search/issues?q=bug")
		if wantLimited := i == 2; errors.Is(err, ErrLimited) != wantLimited || (err != nil && !wantLimited) {
			t.Errorf("search %d: %v, want limited: %v", i+1, err, wantLimited)
		}
	}
	for i := range 5 {
		if err := get("/repos/a/b"); err != nil {
			t.Errorf("core %d: %v", i+1, err)
		}
		if err := get("/health"); err != nil {
			t.Errorf("health %d: %v", i+1, err)
		}
	}
	d, err := core.Allow(context.Background(), Cost(4995))
	if err != nil || !d.OK {
		t.Errorf("core quota: %+v %v, want 5 used of 5000 (search and health not counted)", d, err)
	}
}

func TestRoute_PatternMatches(t *testing.T) {
	tests := []struct {
		pattern, url string
		want         bool
	}{
		{"api.github.com/search/", "https://api.github.com/search/issues", true},
		{"api.github.com/search/", "https://API.GitHub.com/search/", true},
		{"api.github.com/search/", "https://api.github.com/search", false},
		{"api.github.com/search/", "https://api.github.com/repos/a/b", false},
		{"api.github.com/search/", "https://uploads.github.com/search/x", false},
		{"api.github.com/", "https://api.github.com", true},
		{"api.github.com/", "https://api.github.com:443/x", true},
		{"api.github.com:8443/", "https://api.github.com/x", false},
		{"api.github.com:8443/", "https://api.github.com:8443/x", true},
		{"/search/", "https://any.example/search/code", true},
		{"/health", "https://any.example/health", true},
		{"/health", "https://any.example/healthz", false},
		{"/", "https://any.example/anything", true},
		{"/", "https://any.example", true},
		// An endpoint in a vendor's notation: a method, wildcards.
		{"GET /repos/{owner}/{repo}/issues", "https://api.github.com/repos/o/r/issues", true},
		{"GET /repos/{owner}/{repo}/issues", "HEAD https://api.github.com/repos/o/r/issues", true},
		{"GET /repos/{owner}/{repo}/issues", "POST https://api.github.com/repos/o/r/issues", false},
		{"POST /repos/{owner}/{repo}/issues", "POST https://api.github.com/repos/o/r/issues", true},
		{"GET /repos/{owner}/{repo}/issues", "https://api.github.com/repos/o/r/pulls", false},
		{"GET /repos/{owner}/{repo}/issues", "https://api.github.com/repos/o/r/issues/12", false},
		{"GET /repos/{owner}/{repo}/issues", "https://api.github.com/repos/o//issues", false},
		{"GET /repos/{owner}/{repo}/issues", "https://api.github.com/repos/o/issues", false},
		{"GET api.github.com/v1/payment_intents/{id}", "https://api.github.com/v1/payment_intents/pi_1", true},
		{"GET api.github.com/v1/payment_intents/{id}", "https://uploads.github.com/v1/payment_intents/pi_1", false},
		{"/files/{path...}", "https://any.example/files/a/b/c", true},
		{"/files/{path...}", "https://any.example/files", false},
		{"/files/{$}", "https://any.example/files/", true},
		{"/files/{$}", "https://any.example/files/a", false},
	}
	for _, tt := range tests {
		tr := (&Transport{Routes: []Route{{Pattern: tt.pattern, Limiter: &Limiter{}}}}).compile()
		if tr.err != nil {
			t.Fatalf("Route{Pattern: %q}: %v", tt.pattern, tr.err)
		}
		method, url, ok := strings.Cut(tt.url, " ")
		if !ok {
			method, url = http.MethodGet, tt.url
		}
		req := mustRequest(t, context.Background(), method, url, nil)
		if got := tr.routeFor(req).lim != nil; got != tt.want {
			t.Errorf("Route{Pattern: %q} matches %s: %v, want %v", tt.pattern, tt.url, got, tt.want)
		}
	}
}

// A bad field panics nowhere: every request through the transport fails
// with an error naming the field and the value, and its body is closed. The
// other fields of each transport are valid, and valid alone.
func TestTransport_BadFieldsFailEveryRequest(t *testing.T) {
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	set := func(*http.Request, string) {}
	match := func(*http.Request) bool { return false }
	lim := replicaLimiter(t, redistest.Mini(t), "bad-fields", policies.SlidingLog{Limit: 100, Window: time.Minute})
	valid := func() *Transport {
		return &Transport{Limiter: lim, MaxRetries: 1, Routes: []Route{{Pattern: "/elsewhere/"}, {Match: match}}}
	}
	tests := []struct {
		name string
		bad  func(*Transport)
		want string
	}{
		{"route without a path", func(tr *Transport) { tr.Routes = append(tr.Routes, Route{Pattern: "api.github.com"}) },
			`throttle: Transport.Routes[2]: pattern "api.github.com" needs a path starting with /`},
		{"route with a method in lower case", func(tr *Transport) { tr.Routes = append(tr.Routes, Route{Pattern: "get /x"}) },
			`throttle: Transport.Routes[2]: pattern "get /x": "get" is not a method`},
		{"route with a wildcard inside a segment", func(tr *Transport) { tr.Routes = append(tr.Routes, Route{Pattern: "/v1/pi_{id}"}) },
			`throttle: Transport.Routes[2]: pattern "/v1/pi_{id}": a wildcard must be a whole segment, got "pi_{id}"`},
		{"route with {rest...} before the end", func(tr *Transport) { tr.Routes = append(tr.Routes, Route{Pattern: "/files/{p...}/x"}) },
			`throttle: Transport.Routes[2]: pattern "/files/{p...}/x": "{p...}" must be the last segment`},
		{"route with neither Pattern nor Match", func(tr *Transport) { tr.Routes = append([]Route{{}}, tr.Routes...) },
			`throttle: Transport.Routes[0]: pattern "" needs a path starting with /`},
		{"route with Pattern and Match", func(tr *Transport) { tr.Routes[1].Pattern = "/search/" },
			`throttle: Transport.Routes[1]: set Pattern "/search/" or Match, not both`},
		{"negative retry time", func(tr *Transport) { tr.MaxRetryTime = -time.Second },
			"throttle: Transport.MaxRetryTime: must not be negative, got -1s"},
		{"negative pause", func(tr *Transport) { tr.DefaultPause = -time.Second },
			"throttle: Transport.DefaultPause: must not be negative, got -1s"},
		{"an empty key", func(tr *Transport) { tr.Keys, tr.SetKey = []string{"a", ""}, set },
			"throttle: Transport.Keys: key 1 is empty"},
		{"Keys without SetKey", func(tr *Transport) { tr.Keys = []string{"a"} },
			"throttle: Transport.Keys: needs SetKey"},
		{"SetKey without Keys", func(tr *Transport) { tr.SetKey = set },
			"throttle: Transport.Keys: empty, while SetKey is set"},
		{"no limiter at all", func(tr *Transport) { tr.Limiter = nil },
			"throttle: Transport.Limiter: is nil and no Route has a Limiter, so no request would be limited"},
	}
	// Without the bad field, the same transport sends the request.
	resp, _, err := postThrough(t, valid(), srv.URL)
	if err != nil {
		t.Fatalf("a transport of valid fields: %v", err)
	}
	readAll(t, resp)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := valid()
			tt.bad(tr)
			for range 2 {
				resp, body, err := postThrough(t, tr, srv.URL)
				if resp != nil {
					resp.Body.Close()
					t.Fatalf("a response from a transport with a bad field")
				}
				if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
					t.Errorf("err %v, want one saying %q", err, tt.want)
				}
				if body.closed.Load() != 1 {
					t.Errorf("the request's body was closed %d times, want once", body.closed.Load())
				}
			}
		})
	}
}

// postThrough posts a body to url through tr, and returns the body beside
// what RoundTrip returned.
func postThrough(t *testing.T, tr *Transport, url string) (*http.Response, *bodyRecorder, error) {
	t.Helper()
	body := newBodyRecorder("x")
	req := mustRequest(t, context.Background(), http.MethodPost, url, body)
	resp, err := tr.RoundTrip(req)
	return resp, body, err
}

// The zero value of a Transport's fields picks their defaults, and a
// negative MaxRetries never retries.
func TestTransport_ZeroFieldsPickTheDefaults(t *testing.T) {
	lim := newLimiter(t, deadRedis(t), policies.SlidingLog{Limit: 10, Window: time.Second})
	tr := (&Transport{Limiter: lim}).compile()
	if tr.err != nil {
		t.Fatal(tr.err)
	}
	if tr.base != http.DefaultTransport || tr.maxRetries != defaultMaxRetries || tr.maxRetryTime != defaultMaxRetryTime || tr.pause != defaultPause || tr.pool != nil {
		t.Errorf("a zero Transport: base %v, retries %d, retry time %v, pause %v, pool %v; want http.DefaultTransport, %d, %v, %v, none",
			tr.base, tr.maxRetries, tr.maxRetryTime, tr.pause, tr.pool, defaultMaxRetries, defaultMaxRetryTime, defaultPause)
	}
	tr = (&Transport{Limiter: lim, MaxRetries: -1}).compile()
	if tr.err != nil || tr.maxRetries != 0 {
		t.Errorf("MaxRetries -1: %d retries, error %v; want none, no error", tr.maxRetries, tr.err)
	}
	tr = (&Transport{Limiter: lim, MaxRetries: 5, MaxRetryTime: time.Second, DefaultPause: time.Millisecond}).compile()
	if tr.err != nil || tr.maxRetries != 5 || tr.maxRetryTime != time.Second || tr.pause != time.Millisecond {
		t.Errorf("set fields: %d retries, retry time %v, pause %v, error %v; want them kept", tr.maxRetries, tr.maxRetryTime, tr.pause, tr.err)
	}
}

// Under a policies.Concurrency a request holds its slot until the caller
// closes the response body.
func TestTransport_ConcurrencySlotHeldUntilTheBodyIsClosed(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		srv := newVendorServer(t, answer(http.StatusOK, "a long answer"))
		lim := replicaLimiter(t, s, "concurrency", policies.Concurrency{Max: 1}, Options{Mode: FailFast})
		client := &http.Client{Transport: &Transport{Limiter: lim}}
		first, err := client.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Get(srv.URL); !errors.Is(err, ErrLimited) {
			t.Errorf("second request while the first body is open: %v, want ErrLimited", err)
		}
		readAll(t, first) // reads and closes
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatalf("request after the first body was closed: %v", err)
		}
		readAll(t, resp)
	})
}

// Key, Cost and Priority come from the request.
func TestTransport_KeyAndCostFromTheRequest(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	lim := replicaLimiter(t, s, "tenants", policies.PerKey{Policy: policies.SlidingLog{Limit: 3, Window: time.Minute}}, Options{Mode: FailFast})
	client := &http.Client{Transport: &Transport{
		Limiter: lim,
		Key:     func(r *http.Request) string { return r.Header.Get("X-Tenant") },
		Cost:    func(r *http.Request) int { n, _ := strconv.Atoi(r.URL.Query().Get("batch")); return max(n, 1) },
	}}
	send := func(tenant string, batch int) error {
		req := mustRequest(t, context.Background(), http.MethodGet, srv.URL+"/send?batch="+strconv.Itoa(batch), nil)
		req.Header.Set("X-Tenant", tenant)
		resp, err := client.Do(req)
		if err == nil {
			readAll(t, resp)
		}
		return err
	}
	if err := send("a", 3); err != nil {
		t.Fatalf("tenant a, batch of 3: %v", err)
	}
	if err := send("a", 1); !errors.Is(err, ErrLimited) {
		t.Errorf("tenant a, over its quota: %v, want ErrLimited", err)
	}
	if err := send("b", 2); err != nil {
		t.Errorf("tenant b: %v", err)
	}
	if err := send("", 1); err == nil || !strings.Contains(err.Error(), "needs a Key") {
		t.Errorf("no tenant: %v, want an error asking for a Key", err)
	}
}

// In Queue mode requests wait in the limiter's queue, higher priority first.
func TestTransport_QueueServesHigherPriorityFirst(t *testing.T) {
	t.Parallel()
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	// The window is long enough for the low and the high request to queue
	// before the booked one starts, on a machine that stalls the test for
	// a second.
	lim := replicaLimiter(t, s, "queue", policies.SlidingLog{Limit: 1, Window: 2 * time.Second, Margin: time.Nanosecond}, Options{Mode: Queue})
	client := &http.Client{Transport: &Transport{
		Limiter:  lim,
		Priority: func(r *http.Request) int { n, _ := strconv.Atoi(r.URL.Query().Get("p")); return n },
	}}
	var wg sync.WaitGroup
	send := func(name string, priority int) {
		wg.Go(func() {
			resp, err := client.Get(srv.URL + "/?p=" + strconv.Itoa(priority) + "&name=" + name)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			readAll(t, resp)
		})
	}
	send("first", 0)
	eventually(t, "the first request to arrive", func() bool { return srv.count() == 1 })
	send("booked", 0) // takes the next slot and sleeps towards it
	eventually(t, "the second request to book its slot", func() bool { return entries(lim) == 2 })
	send("low", 0)
	eventually(t, "the low request to queue", func() bool { return queued(lim) == 1 })
	send("high", 5)
	eventually(t, "the high request to queue", func() bool { return queued(lim) == 2 })
	wg.Wait()
	var order []string
	for _, a := range srv.log() {
		order = append(order, a.query.Get("name"))
	}
	if want := []string{"first", "booked", "high", "low"}; !slices.Equal(order, want) {
		t.Errorf("the vendor saw %v, want %v", order, want)
	}
}

// No goroutine and no connection outlives the requests: after a mix of
// successes, retries, refusals and cancellations, closing the client's idle
// connections closes every connection the vendor saw, and once the limiter
// is closed the goroutine count comes back.
func TestTransport_LeaksNoGoroutinesOrConnections(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		before := transportGoroutines()
		srv := newVendorServer(t, refuseFirst(3, "Retry-After", "0"))
		lim := replicaLimiter(t, s, "leaks", policies.All(
			policies.SlidingLog{Limit: 20, Window: 500 * time.Millisecond},
			policies.Concurrency{Max: 4},
		))
		base := &http.Transport{}
		client := &http.Client{Transport: &Transport{Base: base, Limiter: lim}}
		var wg sync.WaitGroup
		for i := range 30 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(50+i*20)*time.Millisecond)
				defer cancel()
				resp, err := client.Do(mustRequest(t, ctx, http.MethodPost, srv.URL, strings.NewReader("x")))
				if err != nil {
					return // a deadline or ErrLimited: what this test is about is what is left behind
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			})
		}
		wg.Wait()
		client.CloseIdleConnections()
		// The limiter's subscription to its quota's news ends with it.
		if err := lim.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		eventually(t, "every connection to the vendor to close", func() bool {
			return srv.opened.Load() == srv.closed.Load()
		})
		if srv.opened.Load() == 0 {
			t.Fatal("no connection was opened")
		}
		srv.Close()
		var now int
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if now = transportGoroutines(); now <= before {
				break
			}
		}
		if now > before {
			buf := make([]byte, 1<<20)
			t.Errorf("%d goroutines of net/http or throttle before, %d after:\n%s", before, now, buf[:runtime.Stack(buf, true)])
		}
		t.Logf("%d connections opened and closed; %d goroutines before, %d after", srv.opened.Load(), before, now)
	})
}

// entries returns the calls admitted or booked in the log of a quota whose
// only policy is a SlidingLog.
func entries(lim *Limiter) int64 {
	return lim.rdb.ZCard(context.Background(), lim.cfg.shared[len(lim.cfg.shared)-1]).Val()
}

// transportGoroutines counts the goroutines running net/http or this
// package's code, other than the test's own.
func transportGoroutines() int {
	buf := make([]byte, 4<<20)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "testing.tRunner") {
			continue
		}
		if strings.Contains(g, "net/http.") || strings.Contains(g, "github.com/throttlekit/throttle.") {
			n++
		}
	}
	return n
}
