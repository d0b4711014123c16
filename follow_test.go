package throttle

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// quietVendor is a strict vendor that says nothing of its limit but
// Retry-After on a 429, and notes when it accepted and refused calls.
type quietVendor struct {
	v     *fakevendor.Vendor
	start time.Time
	mu    sync.Mutex
	ok    []time.Duration // since start
	no    []time.Duration
}

func (q *quietVendor) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	at := time.Since(q.start)
	accepted := q.v.Arrive()
	q.mu.Lock()
	if accepted {
		q.ok = append(q.ok, at)
	} else {
		q.no = append(q.no, at)
	}
	q.mu.Unlock()
	if !accepted {
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	}
}

// count returns the calls accepted and refused from one time to another.
func (q *quietVendor) count(from, to time.Duration) (ok, no int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, t := range q.ok {
		if t >= from && t < to {
			ok++
		}
	}
	for _, t := range q.no {
		if t >= from && t < to {
			no++
		}
	}
	return ok, no
}

// A vendor halves its cap without a word, and answers 429 with Retry-After
// and nothing else; Transport.AboutRate says its every 429 is about its
// rate. The fleet learns the new cap from its refusals: about one 429 per
// call in flight, then none, at the new cap; and when the vendor raises its
// cap again, the fleet finds it within a few windows.
func TestFollow_LearnsALoweredCapAndFindsItRaised(t *testing.T) {
	long(t)
	const (
		replicas = 3
		workers  = 20
		window   = 500 * time.Millisecond
		limit    = 100 // per window
		halveAt  = 3 * window
		// The cap learned holds 8 windows from the first refusal, which
		// comes after the halving: the vendor raises its cap again before
		// the fleet may probe above the halved one, or the probe would be
		// refused, as it should.
		raiseAt = halveAt + 8*window
		endAt   = 24 * window
	)
	s := redistest.Real(t)
	q := &quietVendor{v: fakevendor.NewInProcess(fakevendor.Config{Limit: limit, Window: window})}
	srv := httptest.NewServer(q)
	defer srv.Close()

	q.start = time.Now()
	f := startFollowers(t, s, srv.URL, policies.SlidingLog{Limit: limit, Window: window}, replicas, workers)
	time.AfterFunc(halveAt, func() { q.v.SetLimit(limit / 2) })
	time.AfterFunc(raiseAt, func() { q.v.SetLimit(limit) })
	time.Sleep(endAt)
	f.stop()

	_, refused := q.count(halveAt, raiseAt)
	settled := halveAt + 5*window
	_, refusedLate := q.count(settled, raiseAt)
	if refused > replicas*workers {
		t.Errorf("%d refusals after the vendor halved its cap, want at most one per worker in flight (%d)", refused, replicas*workers)
	}
	if refusedLate > 0 {
		t.Errorf("%d refusals in the last %v before the cap rose again, want none", refusedLate, raiseAt-settled)
	}
	// A sliding log runs at the cap per window and margin: the fleet's
	// calls go out in bursts one window and margin apart (a busy machine
	// widens the margin, up to a tenth of windows this short, on purpose),
	// so two such periods hold two bursts' worth whatever their phase,
	// where a second may hold one burst and part of another. The margin is
	// the widest the fleet's calls were held to: the one in force at the
	// end may be narrower than while the periods counted ran (beside CI's
	// race run: 92 calls in two periods of the end's margin).
	u, err := f.lims[0].Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	period := window + max(u.Rules[0].Margin, time.Duration(f.widest.Load()))
	okLate, _ := q.count(settled, settled+2*period)
	t.Logf("from the halving: %d refusals, %d after it settled; %d calls served in %v (two windows and margins) at a cap of %d; %d caps learned",
		refused, refusedLate, okLate, 2*period, limit/2, f.learned.Load())
	if want := 0.95 * float64(limit/2) * 2; float64(okLate) < want {
		t.Errorf("%d calls served in two windows and margins at the halved cap, want at least %.0f (95%% of the cap)", okLate, want)
	}
	// Raised again, the cap is found within a few windows of the learned
	// cap's hold; the floor catches a fleet that stays at the halved cap.
	found := endAt - 4*window
	okEnd, refusedEnd := q.count(found, endAt)
	t.Logf("cap raised again: %d calls served in the last %v, %d refused", okEnd, endAt-found, refusedEnd)
	if want := 0.7 * float64(limit) * float64(endAt-found) / float64(window); float64(okEnd) < want {
		t.Errorf("%d calls served in the last four windows with the cap back at %d, want at least %.0f", okEnd, limit, want)
	}
}

// callUntil starts workers goroutines for each client, each calling url
// until ctx ends.
func callUntil(ctx context.Context, clients []*http.Client, workers int, url string) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, c := range clients {
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					_, _ = get(ctx, c, url)
				}
			})
		}
	}
	return &wg
}

// followers are replicas whose workers call a vendor through Transports as
// fast as they can, until stop.
type followers struct {
	lims    []*Limiter
	learned atomic.Int64 // EventCapLearned, of every replica
	widest  atomic.Int64 // the widest margin a script call of any replica was held to
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// startFollowers starts replicas replicas of workers workers each, calling
// url through a Transport whose every 429 is about the rate.
func startFollowers(t *testing.T, s *redistest.Server, url string, policy policies.SlidingLog, replicas, workers int) *followers {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f := &followers{cancel: cancel}
	for range replicas {
		lim, err := New(s.Client(t), "follow", policy,
			Options{Observer: func(e Event) {
				switch e.Kind {
				case EventCapLearned:
					f.learned.Add(1)
				case EventRedis:
					keepWidest(&f.widest, int64(e.Margin))
				}
			}})
		if err != nil {
			t.Fatal(err)
		}
		f.lims = append(f.lims, lim)
		c := &http.Client{Transport: &Transport{Base: &http.Transport{MaxIdleConnsPerHost: workers}, Limiter: lim,
			AboutRate: func(*http.Response) bool { return true }}}
		for range workers {
			f.wg.Go(func() {
				for ctx.Err() == nil {
					_, _ = get(ctx, c, url)
				}
			})
		}
	}
	return f
}

// stop stops the workers and waits for them.
func (f *followers) stop() {
	f.cancel()
	f.wg.Wait()
}

// fixedWindowVendor counts calls in fixed windows, as GitHub and most
// vendors that send a reset time do, and answers in one vendor's shape of
// headers.
type fixedWindowVendor struct {
	limit     int
	window    time.Duration
	shape     func(h http.Header, limit, remaining int, reset time.Time)
	start     time.Time
	mu        sync.Mutex
	k         int64 // the window counted
	n         int   // calls accepted in it
	ok, no    int
	perWindow map[int64]int // calls accepted in each window
}

func (v *fixedWindowVendor) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	v.mu.Lock()
	k := int64(now.Sub(v.start) / v.window)
	if k != v.k {
		v.k, v.n = k, 0
	}
	accepted := v.n < v.limit
	if accepted {
		v.n++
		v.ok++
		if v.perWindow == nil {
			v.perWindow = map[int64]int{}
		}
		v.perWindow[k]++
	} else {
		v.no++
	}
	remaining := v.limit - v.n
	reset := v.start.Add(time.Duration(k+1) * v.window)
	v.mu.Unlock()
	v.shape(w.Header(), v.limit, remaining, reset)
	if !accepted {
		w.WriteHeader(http.StatusTooManyRequests)
	}
}

// The shapes of the vendors' headers, with the counts of one window.
var headerShapes = []struct {
	name  string
	shape func(h http.Header, limit, remaining int, reset time.Time)
}{
	{"GitHub", func(h http.Header, limit, remaining int, reset time.Time) {
		h.Set("x-ratelimit-limit", strconv.Itoa(limit))
		h.Set("x-ratelimit-remaining", strconv.Itoa(remaining))
		h.Set("x-ratelimit-reset", strconv.FormatInt(reset.Add(time.Second-1).Unix(), 10))
	}},
	{"OpenAI", func(h http.Header, limit, remaining int, reset time.Time) {
		h.Set("x-ratelimit-limit-requests", strconv.Itoa(limit))
		h.Set("x-ratelimit-remaining-requests", strconv.Itoa(remaining))
		h.Set("x-ratelimit-reset-requests", time.Until(reset).Round(time.Millisecond).String())
	}},
	{"Anthropic", func(h http.Header, limit, remaining int, reset time.Time) {
		h.Set("anthropic-ratelimit-requests-limit", strconv.Itoa(limit))
		h.Set("anthropic-ratelimit-requests-remaining", strconv.Itoa(remaining))
		h.Set("anthropic-ratelimit-requests-reset", reset.Add(time.Second-1).UTC().Truncate(time.Second).Format(time.RFC3339))
	}},
	{"Discord", func(h http.Header, limit, remaining int, reset time.Time) {
		h.Set("X-RateLimit-Limit", strconv.Itoa(limit))
		h.Set("X-RateLimit-Remaining", strconv.Itoa(remaining))
		h.Set("X-RateLimit-Reset-After", strconv.FormatFloat(time.Until(reset).Seconds(), 'f', 3, 64))
	}},
	{"IETF", func(h http.Header, limit, remaining int, reset time.Time) {
		h.Set("RateLimit-Policy", `"default";q=`+strconv.Itoa(limit)+`;w=`+strconv.Itoa(int(clampWindow/time.Second)))
		h.Set("RateLimit", `"default";r=`+strconv.Itoa(remaining)+`;t=`+strconv.Itoa(int((time.Until(reset)+time.Second-1)/time.Second)))
	}},
}

// clampWindow is the vendor's window in TestFollow_ClampConverges: headers
// that give resets in whole seconds cost up to a second of each window,
// waited on purpose (a second of an hour at GitHub).
const clampWindow = 3 * time.Second

// A fleet configured at twice the vendor's real cap converges to it from
// the vendor's answers, whatever the shape of its headers: most of the cap
// used, and a handful of 429s while it learns, none once it has.
func TestFollow_ClampConverges(t *testing.T) {
	long(t)
	const (
		replicas = 3
		workers  = 10
		window   = clampWindow
		limit    = 40 // the vendor's, per window
		windows  = 4
	)
	s := redistest.Real(t)
	for _, hs := range headerShapes {
		t.Run(hs.name, func(t *testing.T) {
			t.Parallel()
			v := &fixedWindowVendor{limit: limit, window: window, shape: hs.shape}
			srv := httptest.NewServer(v)
			defer srv.Close()
			ctx, cancel := context.WithCancel(context.Background())
			var clients []*http.Client
			for range replicas {
				lim, err := New(s.Client(t), "clamp-"+hs.name, policies.SlidingLog{Limit: 2 * limit, Window: window})
				if err != nil {
					t.Fatal(err)
				}
				clients = append(clients, &http.Client{Transport: &Transport{Base: &http.Transport{MaxIdleConnsPerHost: workers}, Limiter: lim}})
			}
			// The vendor's windows start with the fleet, on a whole second,
			// as epoch-second resets are.
			v.mu.Lock()
			v.start = time.Now().Truncate(time.Second)
			v.mu.Unlock()
			wg := callUntil(ctx, clients, workers, srv.URL)
			time.Sleep(time.Until(v.start.Add(2 * window)))
			v.mu.Lock()
			noEarly := v.no
			v.mu.Unlock()
			time.Sleep(time.Until(v.start.Add(windows * window)))
			cancel()
			wg.Wait()
			v.mu.Lock()
			defer v.mu.Unlock()
			served := 0
			for k := int64(1); k < windows; k++ {
				served += v.perWindow[k]
			}
			util := float64(served) / (float64(limit) * float64(windows-1))
			t.Logf("%s: %d accepted, %d refused, %d in the last %d windows; %.0f%% of the cap in the windows after the first; accepted per window %v",
				hs.name, v.ok, v.no, v.no-noEarly, windows-2, 100*util, v.perWindow)
			if util < 0.9 {
				t.Errorf("%.0f%% of the vendor's cap used, want at least 90%%", 100*util)
			}
			if v.no > replicas*workers || v.no > noEarly {
				t.Errorf("%d 429s, %d in the last %d windows; want at most one per worker in flight (%d), none in those",
					v.no, v.no-noEarly, windows-2, replicas*workers)
			}
		})
	}
}
