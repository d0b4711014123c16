package fakeapi

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// clock is a fake time source for a Vendor or an LLM.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newTestVendor(cfg Config) (*Vendor, *clock) {
	v, c := New(cfg), newClock()
	v.now = c.now
	return v, c
}

func get(t *testing.T, h http.Handler) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/anything", nil))
	return w
}

func TestVendor_CountsInAnExactSlidingWindow(t *testing.T) {
	v, c := newTestVendor(Config{Limit: 3, Window: time.Second})
	for i := range 3 {
		if !v.Arrive() {
			t.Fatalf("call %d refused under the cap", i+1)
		}
		c.advance(100 * time.Millisecond)
	}
	// At 0.3s the window (−0.7s, 0.3s] holds all three.
	if v.Arrive() {
		t.Fatal("a fourth call in the window was accepted")
	}
	c.advance(699 * time.Millisecond)
	if v.Arrive() {
		t.Fatal("a call 1ms before the first left the window was accepted")
	}
	c.advance(time.Millisecond)
	if !v.Arrive() {
		t.Fatal("a call as the first left the window was refused")
	}
	if got, want := v.Stats(), (Stats{Accepted: 4, OverCap: 2, MaxInWindow: 5}); got != want {
		t.Errorf("Stats() = %+v, want %+v", got, want)
	}
}

func TestVendor_AnswersWithTheHeaders(t *testing.T) {
	v, c := newTestVendor(Config{Limit: 2, Window: time.Second, RetryAfter: true})
	w := get(t, v)
	if w.Code != http.StatusOK || w.Body.String() != "ok\n" {
		t.Fatalf("first call: %d %q, want 200 ok", w.Code, w.Body.String())
	}
	if w.Header().Get(HeaderLimit) != "2" || w.Header().Get(HeaderRemaining) != "1" {
		t.Errorf("first call: limit %q, remaining %q; want 2 and 1", w.Header().Get(HeaderLimit), w.Header().Get(HeaderRemaining))
	}
	c.advance(100 * time.Millisecond)
	get(t, v)
	c.advance(100 * time.Millisecond)
	w = get(t, v)
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("third call: %d, want 429", w.Code)
	}
	// The first call leaves 0.8s later: rounded up to a whole second.
	if got := w.Header().Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After = %q, want 1", got)
	}
	if got := w.Header().Get(HeaderRemaining); got != "0" {
		t.Errorf("remaining = %q on a 429, want 0", got)
	}
}

func TestVendor_RetryAfterOnlyWhenAskedAndWhenACallCanFit(t *testing.T) {
	v, _ := newTestVendor(Config{Limit: 1, Window: time.Minute})
	get(t, v)
	if w := get(t, v); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "" {
		t.Errorf("without RetryAfter: %d, Retry-After %q; want 429 and none", w.Code, w.Header().Get("Retry-After"))
	}
	v, _ = newTestVendor(Config{Limit: 0, Window: time.Minute, RetryAfter: true})
	if w := get(t, v); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "" {
		t.Errorf("at a cap of 0: %d, Retry-After %q; want 429 and none", w.Code, w.Header().Get("Retry-After"))
	}
}

func TestVendor_SetLimitKeepsTheCallsInTheWindow(t *testing.T) {
	v, c := newTestVendor(Config{Limit: 4, Window: time.Second})
	for range 3 {
		v.Arrive()
	}
	v.SetLimit(2)
	if v.Limit() != 2 {
		t.Fatalf("Limit() = %d after SetLimit(2)", v.Limit())
	}
	if w := get(t, v); w.Code != http.StatusTooManyRequests || w.Header().Get(HeaderLimit) != "2" {
		t.Errorf("over the lowered cap: %d, limit %q; want 429 and 2", w.Code, w.Header().Get(HeaderLimit))
	}
	c.advance(time.Second)
	for i, want := range []bool{true, true, false} {
		if got := v.Arrive(); got != want {
			t.Errorf("a window later, call %d: accepted %v, want %v under the lowered cap of 2", i+1, got, want)
		}
	}
}

func TestVendor_InWindowCountsAcceptedCalls(t *testing.T) {
	v, c := newTestVendor(Config{Limit: 2, Window: time.Second})
	v.Arrive()
	c.advance(500 * time.Millisecond)
	v.Arrive()
	v.Arrive() // refused: not counted
	if got := v.InWindow(); got != 2 {
		t.Errorf("InWindow() = %d, want 2", got)
	}
	c.advance(500 * time.Millisecond)
	if got := v.InWindow(); got != 1 {
		t.Errorf("InWindow() = %d as the first call left, want 1", got)
	}
}

func TestVendor_CountsALateArrivalWithTheLastOne(t *testing.T) {
	v, c := newTestVendor(Config{Limit: 1, Window: time.Second})
	early := c.now()
	c.advance(time.Second)
	v.Arrive()
	// A call that read the clock a second ago reaches the counter now: it
	// is counted now, in the window of the call before it.
	if v.arrive(early).ok {
		t.Error("a late arrival was counted at its own time, outside the window")
	}
}

func TestVendor_WorkDelaysAcceptedCallsOnly(t *testing.T) {
	v := New(Config{Limit: 1, Window: time.Minute, Work: 50 * time.Millisecond})
	start := time.Now()
	get(t, v)
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Errorf("an accepted call took %v, want at least the Work of 50ms", d)
	}
	start = time.Now()
	get(t, v)
	if d := time.Since(start); d >= 50*time.Millisecond {
		t.Errorf("a refused call took %v, want an answer at once", d)
	}

	v = New(Config{Limit: 1, Window: time.Minute, Work: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := httptest.NewRecorder()
	v.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx))
	if w.Body.Len() != 0 {
		t.Errorf("a canceled call was answered %q", w.Body.String())
	}
}

func TestVendor_HoldsTheCapUnderConcurrentCalls(t *testing.T) {
	v := New(Config{Limit: 50, Window: time.Hour})
	srv := httptest.NewServer(v)
	defer srv.Close()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 20 {
				resp, err := http.Get(srv.URL)
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	if got, want := v.Stats(), (Stats{Accepted: 50, OverCap: 110, MaxInWindow: 160}); got != want {
		t.Errorf("Stats() = %+v, want %+v", got, want)
	}
}

func TestNew_PanicsOnABadConfig(t *testing.T) {
	for _, cfg := range []Config{{Limit: 1}, {Limit: -1, Window: time.Second}, {Limit: 1, Window: time.Second, Work: -1}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("New(%+v) did not panic", cfg)
				}
			}()
			New(cfg)
		}()
	}
}
