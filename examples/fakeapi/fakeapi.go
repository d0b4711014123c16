// Package fakeapi is the strict fake vendor the examples call: a rate-limited
// API that counts every call in an exact sliding window and answers 429 Too
// Many Requests past its cap. A real vendor's limits are looser or hidden;
// this one is exact, so that an example can show whether its fleet really
// stayed under the cap.
//
// Vendor counts calls and answers with the headers most vendors send:
// X-RateLimit-Limit, X-RateLimit-Remaining and, when asked, Retry-After. LLM
// is a chat-completions API that counts requests and tokens, with OpenAI's
// headers. Both are http.Handlers: serve them with httptest.NewServer, or
// any http.Server. A Vendor can also be called in process with Arrive.
//
// The package uses the standard library only. Copy it, with the example that
// needs it, into a program of your own.
package fakeapi

import (
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Headers a Vendor sets on every answer.
const (
	// HeaderLimit carries the current cap, in calls per window.
	HeaderLimit = "X-RateLimit-Limit"
	// HeaderRemaining carries the calls still allowed in the window ending
	// now, once this call is counted.
	HeaderRemaining = "X-RateLimit-Remaining"
)

// Config describes a Vendor.
type Config struct {
	// Limit is how many calls the vendor accepts in any window. Zero
	// refuses every call.
	Limit int
	// Window is the length of the sliding window. It must be positive.
	Window time.Duration
	// RetryAfter makes every 429 carry a Retry-After header: the whole
	// seconds, rounded up, until enough accepted calls have left the
	// window for one more to fit.
	RetryAfter bool
	// Work is how long the vendor takes to answer a call it accepted, so
	// that calls overlap as they do against a real API. A refused call is
	// answered at once.
	Work time.Duration
}

// Stats is what a Vendor has seen since New.
type Stats struct {
	// Accepted is the calls within the cap, answered 200.
	Accepted int
	// OverCap is the calls past the cap, answered 429.
	OverCap int
	// MaxInWindow is the most calls, accepted or refused, that arrived in
	// any one window. A fleet that kept under the cap keeps it at or below
	// Limit.
	MaxInWindow int
}

// Vendor is a fake rate-limited API that counts calls in an exact sliding
// window: a call is accepted when fewer than Limit calls were accepted in
// the window ending at its arrival, and refused with 429 otherwise. Refused
// calls do not count against the cap. A Vendor is safe for concurrent use.
type Vendor struct {
	window     time.Duration
	retryAfter bool
	work       time.Duration
	now        func() time.Time // the clock; tests in this package replace it

	mu       sync.Mutex
	limit    int
	accepted window // the calls that count against the cap
	all      window // every call, for MaxInWindow
	last     time.Time
	st       Stats
}

// New returns a Vendor configured by cfg. It panics when cfg.Window is not
// positive, or cfg.Limit or cfg.Work is negative.
func New(cfg Config) *Vendor {
	if cfg.Window <= 0 || cfg.Limit < 0 || cfg.Work < 0 {
		panic("fakeapi: Config needs a positive Window and no negative Limit or Work")
	}
	return &Vendor{
		window:     cfg.Window,
		retryAfter: cfg.RetryAfter,
		work:       cfg.Work,
		now:        time.Now,
		limit:      cfg.Limit,
		accepted:   window{length: cfg.Window},
		all:        window{length: cfg.Window},
	}
}

// ServeHTTP counts every request, whatever its method or path, as one call.
// It answers 200 "ok" within the cap and 429 past it, both with
// X-RateLimit-Limit and X-RateLimit-Remaining, and a 429 with Retry-After
// when Config.RetryAfter is set.
func (v *Vendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// The arrival's time is read before waiting for the lock, so that
	// calls queueing inside the vendor are counted when they came.
	d := v.arrive(v.now())
	h := w.Header()
	h.Set(HeaderLimit, strconv.Itoa(d.limit))
	h.Set(HeaderRemaining, strconv.Itoa(d.remaining))
	if !d.ok {
		if v.retryAfter && d.retryAfter > 0 {
			secs := (d.retryAfter + time.Second - 1) / time.Second
			h.Set("Retry-After", strconv.FormatInt(int64(secs), 10))
		}
		http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
		return
	}
	if v.work > 0 {
		t := time.NewTimer(v.work)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// Arrive counts one call now, as ServeHTTP does, and reports whether the
// vendor accepted it.
func (v *Vendor) Arrive() bool {
	return v.arrive(v.now()).ok
}

// decision is the vendor's answer to one call.
type decision struct {
	ok         bool
	limit      int
	remaining  int
	retryAfter time.Duration // until one more call fits; 0 if none ever does
}

func (v *Vendor) arrive(t time.Time) decision {
	v.mu.Lock()
	defer v.mu.Unlock()
	// A call that read the clock before the last one counted is counted
	// with it, so that the log stays in order.
	if t.Before(v.last) {
		t = v.last
	}
	v.last = t
	v.accepted.trim(t)
	v.all.trim(t)
	v.all.add(t, 1)
	v.st.MaxInWindow = max(v.st.MaxInWindow, v.all.sum)

	d := decision{ok: v.accepted.sum < v.limit, limit: v.limit}
	if d.ok {
		v.accepted.add(t, 1)
		v.st.Accepted++
	} else {
		v.st.OverCap++
		d.retryAfter = v.accepted.freeIn(t, v.accepted.sum+1-v.limit)
	}
	d.remaining = max(0, v.limit-v.accepted.sum)
	return d
}

// SetLimit changes the cap from now on, as a vendor that lowers or raises
// its limit at run time does. The calls already accepted stay in the window.
// It panics if n is negative.
func (v *Vendor) SetLimit(n int) {
	if n < 0 {
		panic("fakeapi: negative limit")
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.limit = n
}

// Limit returns the current cap.
func (v *Vendor) Limit() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.limit
}

// InWindow returns the accepted calls in the window ending now.
func (v *Vendor) InWindow() int {
	now := v.now()
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.accepted.count(now)
}

// Stats returns what the vendor has seen so far.
func (v *Vendor) Stats() Stats {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.st
}
