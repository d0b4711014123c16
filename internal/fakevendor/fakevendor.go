// Package fakevendor is a strict fake third-party API for tests and demos of
// the rate limiter. It counts every arrival in an exact sliding window and
// answers 429 past its cap, so a test can tell whether a client really stayed
// under the vendor's limit rather than under an approximation of it.
package fakevendor

import (
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Header names used by the HTTP handler.
const (
	// HeaderCost is the optional request header carrying the cost of a
	// request in units (an integer >= 1; 1 when absent).
	HeaderCost = "X-Cost"
	// HeaderLimit is the response header carrying the current cap.
	HeaderLimit = "X-RateLimit-Limit"
	// HeaderRemaining is the response header carrying the units still
	// available in the window after this request was counted.
	HeaderRemaining = "X-RateLimit-Remaining"
	// HeaderRetryAfter is the standard header set on 429 responses when
	// Config.RetryAfter is true.
	HeaderRetryAfter = "Retry-After"
)

// Config describes a vendor's cap and behaviour.
type Config struct {
	// Limit is the number of units allowed in any window. Zero rejects
	// every arrival; negative values are invalid.
	Limit int
	// Window is the sliding window length. It must be positive.
	Window time.Duration
	// RetryAfter makes 429 responses carry a Retry-After header in whole
	// seconds, rounded up. It is the time until enough already-counted
	// arrivals leave the window for the rejected request to fit; for a
	// cost-1 request under an unchanged cap that is when the oldest arrival
	// leaves. The header is omitted when the request can never fit (its
	// cost exceeds Limit). With CountRejected it is a lower bound, since
	// later rejected arrivals also count.
	RetryAfter bool
	// Work is an optional simulated handling time spent after an accepted
	// HTTP request has been counted, so that concurrency and latency look
	// realistic. Rejected requests answer at once, like most real vendors.
	Work time.Duration
	// CountRejected makes over-cap arrivals enter the window too, as a
	// vendor that counts every request does; a client that keeps retrying
	// then stays locked out. The default counts only accepted arrivals, so
	// that OverCap measures how far the client exceeded the cap without the
	// rejections themselves causing further rejections.
	CountRejected bool
}

// Stats is a snapshot of what a Vendor has seen since it was created or
// last Reset. Counts named in units add up the cost of each arrival.
type Stats struct {
	// Requests is the number of arrivals, regardless of cost.
	Requests int
	// Arrivals is the number of units that arrived, accepted or not.
	Arrivals int
	// Accepted is the number of units within the cap.
	Accepted int
	// OverCapRequests is the number of arrivals answered 429.
	OverCapRequests int
	// OverCap is the number of units answered 429.
	OverCap int
	// MaxInWindow is the largest number of units that arrived in any
	// half-open window (t-Window, t], counting accepted and over-cap
	// arrivals alike whatever CountRejected says, since a strict vendor
	// would count them all. A client that respects the cap keeps it at or
	// below Limit.
	MaxInWindow int
	// First and Last are the recorded times of the first and last arrival;
	// both are zero when nothing has arrived.
	First, Last time.Time
	// PerSecond holds arrived units per second since First: element i
	// covers [First+i s, First+(i+1) s). It is meant for charts.
	PerSecond []int
}

// Utilization reports how much of the cap a run used:
//
//	Accepted / (limit * (Last-First) / window)
//
// that is, accepted units divided by the allowance of limit units per
// window over the span from the first to the last arrival. It returns 0
// when that span is not positive (no arrivals, a single arrival, or all
// arrivals at one instant) or when limit or window is not positive.
//
// The span leaves out the last window, and a span of length D can hold up
// to limit*(D/window+1) accepted units, so short bursty runs can score
// above 1; a long run held at the cap approaches 1.
func (s Stats) Utilization(limit int, window time.Duration) float64 {
	span := s.Last.Sub(s.First)
	if s.Requests < 2 || span <= 0 || limit <= 0 || window <= 0 {
		return 0
	}
	return float64(s.Accepted) * float64(window) / (float64(limit) * float64(span))
}

// Vendor is a fake rate-limited API. New serves it over an httptest.Server;
// NewInProcess gives the same logic without a server. All methods are safe
// for concurrent use.
//
// Arrivals are serialized by a mutex. The HTTP handler reads the clock at
// the very start of the request, before waiting for the mutex, so a request
// can reach the counter with a time slightly earlier than one already
// recorded; it is then recorded at that later time. This keeps the window
// ordered and the cap exact for every window, at the cost of the lock wait.
type Vendor struct {
	// URL is the base URL of the test server; it is empty for a vendor
	// made by NewInProcess.
	URL string

	srv       *httptest.Server
	closeOnce sync.Once

	// now is the clock; tests in this package replace it through
	// newVendor before any request can read it.
	now           func() time.Time
	window        time.Duration
	retryAfter    bool
	work          time.Duration
	countRejected bool

	mu      sync.Mutex
	limit   int
	counted ring // arrivals that count against the cap
	all     ring // every arrival, for MaxInWindow; unused with countRejected
	st      Stats
}

// New starts an httptest.Server serving a vendor with cfg. Close stops it.
// It panics if cfg is invalid (Window <= 0, Limit < 0 or Work < 0).
func New(cfg Config) *Vendor {
	return newVendor(cfg, time.Now, true)
}

// NewInProcess returns a vendor with cfg and no server, for use through
// Handler or Arrive. Its URL is empty and Close does nothing. It panics if
// cfg is invalid, like New.
func NewInProcess(cfg Config) *Vendor {
	return newVendor(cfg, time.Now, false)
}

func newVendor(cfg Config, now func() time.Time, serve bool) *Vendor {
	if cfg.Window <= 0 {
		panic("fakevendor: Window must be positive")
	}
	if cfg.Limit < 0 {
		panic("fakevendor: Limit must not be negative")
	}
	if cfg.Work < 0 {
		panic("fakevendor: Work must not be negative")
	}
	v := &Vendor{
		now:           now,
		window:        cfg.Window,
		retryAfter:    cfg.RetryAfter,
		work:          cfg.Work,
		countRejected: cfg.CountRejected,
		limit:         cfg.Limit,
	}
	if serve {
		v.srv = httptest.NewServer(v.Handler())
		v.URL = v.srv.URL
	}
	return v
}

// Close stops the server started by New. It is safe to call more than once.
func (v *Vendor) Close() {
	v.closeOnce.Do(func() {
		if v.srv != nil {
			v.srv.Close()
		}
	})
}

// Handler returns the vendor's HTTP handler. Every request, whatever its
// method or path, is one arrival costing the X-Cost header (default 1). It
// answers 200 "ok" within the cap and 429 past it, both with
// X-RateLimit-Limit and X-RateLimit-Remaining, and 429 with Retry-After when
// configured. An X-Cost that is not an integer >= 1 gets 400 and is not
// counted, since the vendor could not know what to charge.
func (v *Vendor) Handler() http.Handler {
	return http.HandlerFunc(v.serveHTTP)
}

func (v *Vendor) serveHTTP(w http.ResponseWriter, r *http.Request) {
	// Read the clock first so queueing inside the vendor does not shift
	// the arrival time.
	t := v.now()
	cost := 1
	if s := r.Header.Get(HeaderCost); s != "" {
		c, err := strconv.ParseInt(strings.TrimSpace(s), 10, 32)
		if err != nil || c < 1 {
			http.Error(w, "invalid "+HeaderCost, http.StatusBadRequest)
			return
		}
		cost = int(c)
	}
	d := v.arrive(t, cost)
	h := w.Header()
	h.Set(HeaderLimit, strconv.Itoa(d.limit))
	h.Set(HeaderRemaining, strconv.Itoa(d.remaining))
	if !d.ok {
		if v.retryAfter && d.retryAfter > 0 {
			secs := (d.retryAfter + time.Second - 1) / time.Second
			h.Set(HeaderRetryAfter, strconv.FormatInt(int64(secs), 10))
		}
		http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
		return
	}
	if v.work > 0 {
		timer := time.NewTimer(v.work)
		select {
		case <-timer.C:
		case <-r.Context().Done():
			timer.Stop()
			return
		}
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// Arrive records one arrival of cost 1 at the current time and reports
// whether it was within the cap.
func (v *Vendor) Arrive() bool {
	return v.ArriveN(1)
}

// ArriveN records one arrival costing n units at the current time and
// reports whether it was within the cap: it is over cap if the units
// already counted in (now-Window, now] plus n exceed the limit. It panics
// if n < 1.
func (v *Vendor) ArriveN(n int) bool {
	if n < 1 {
		panic("fakevendor: cost must be at least 1")
	}
	return v.arrive(v.now(), n).ok
}

// decision is the outcome of one arrival.
type decision struct {
	ok         bool
	limit      int
	remaining  int
	retryAfter time.Duration // 0 when the request can never fit
}

func (v *Vendor) arrive(t time.Time, n int) decision {
	v.mu.Lock()
	defer v.mu.Unlock()

	if v.st.Requests > 0 && t.Before(v.st.Last) {
		t = v.st.Last
	}
	v.counted.trim(t, v.window)
	in := v.counted.sum()
	// Written as a subtraction so a huge n cannot overflow.
	d := decision{ok: n <= v.limit-in, limit: v.limit}
	if !d.ok {
		// Find the oldest counted arrival whose departure frees enough.
		if k := v.counted.search(in + n - v.limit); k < v.counted.n {
			d.retryAfter = v.counted.at(k).t.Add(v.window).Sub(t)
		}
	}
	if d.ok || v.countRejected {
		v.counted.push(t, n)
	}
	d.remaining = max(0, v.limit-v.counted.sum())

	all := v.counted.sum()
	if !v.countRejected {
		v.all.trim(t, v.window)
		v.all.push(t, n)
		all = v.all.sum()
	}

	st := &v.st
	if st.Requests == 0 {
		st.First = t
	}
	st.Last = t
	st.Requests++
	st.Arrivals += n
	if d.ok {
		st.Accepted += n
	} else {
		st.OverCapRequests++
		st.OverCap += n
	}
	st.MaxInWindow = max(st.MaxInWindow, all)
	sec := int(t.Sub(st.First) / time.Second)
	if sec >= len(st.PerSecond) {
		st.PerSecond = append(st.PerSecond, make([]int, sec+1-len(st.PerSecond))...)
	}
	st.PerSecond[sec] += n
	return d
}

// SetLimit changes the cap from now on, as a vendor that lowers or raises
// its limit at run time. Arrivals already counted stay in the window. It
// panics if n < 0.
func (v *Vendor) SetLimit(n int) {
	if n < 0 {
		panic("fakevendor: limit must not be negative")
	}
	v.mu.Lock()
	v.limit = n
	v.mu.Unlock()
}

// Limit returns the current cap.
func (v *Vendor) Limit() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.limit
}

// InWindow returns the units that count against the cap in the window
// ending now.
func (v *Vendor) InWindow() int {
	t := v.now()
	v.mu.Lock()
	defer v.mu.Unlock()
	// Count without trimming: an arrival that read the clock before t may
	// still be on its way and must see the window as of its own time.
	return v.counted.sumSince(t, v.window)
}

// Stats returns a snapshot of what the vendor has seen.
func (v *Vendor) Stats() Stats {
	v.mu.Lock()
	defer v.mu.Unlock()
	s := v.st
	s.PerSecond = slices.Clone(v.st.PerSecond)
	return s
}

// Reset forgets all arrivals and statistics. The current limit is kept.
func (v *Vendor) Reset() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.counted = ring{}
	v.all = ring{}
	v.st = Stats{}
}

// Replay judges arrivals of cost 1 at the times given, in time order, as a
// vendor with cfg would have, and returns what it saw. A test whose
// vendor shares a loaded machine with its clients replays the times the
// calls left them: the vendor's own handler, scheduled late by the
// machine, would count arrivals later than any network would.
func Replay(cfg Config, at []time.Time) Stats {
	v := newVendor(cfg, time.Now, false)
	at = slices.Clone(at)
	slices.SortFunc(at, func(x, y time.Time) int { return x.Compare(y) })
	for _, t := range at {
		v.arrive(t, 1)
	}
	return v.Stats()
}
