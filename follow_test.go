package throttle

import (
	"context"
	"net/http"
	"net/http/httptest"
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
// and nothing else. The fleet learns the new cap from its refusals: about
// one 429 per call in flight, then none, at the new cap; and when the
// vendor raises its cap again, the fleet finds it within a few windows.
func TestFollow_LearnsALoweredCapAndFindsItRaised(t *testing.T) {
	const (
		replicas = 3
		workers  = 20
		window   = 500 * time.Millisecond
		limit    = 100 // per window
		halveAt  = 3 * window
		raiseAt  = 12 * window // the cap learned holds 8 windows
		endAt    = 21 * window
	)
	s := redistest.Real(t)
	q := &quietVendor{v: fakevendor.NewInProcess(fakevendor.Config{Limit: limit, Window: window})}
	srv := httptest.NewServer(q)
	defer srv.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var learned atomic.Int64
	for range replicas {
		lim, err := New(s.Client(t), "follow", policies.SlidingLog{Limit: limit, Window: window},
			WithObserver(ObserverFunc(func(e Event) {
				if e.Kind == EventCapLearned {
					learned.Add(1)
				}
			})))
		if err != nil {
			t.Fatal(err)
		}
		c := &http.Client{Transport: NewTransport(&http.Transport{MaxIdleConnsPerHost: workers}, lim)}
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					_, _ = get(ctx, c, srv.URL)
				}
			})
		}
	}
	q.start = time.Now()
	time.AfterFunc(halveAt, func() { q.v.SetLimit(limit / 2) })
	time.AfterFunc(raiseAt, func() { q.v.SetLimit(limit) })
	time.Sleep(endAt)
	cancel()
	wg.Wait()

	_, refused := q.count(halveAt, raiseAt)
	settled := halveAt + 6*window
	okLate, refusedLate := q.count(settled, raiseAt)
	t.Logf("from the halving: %d refusals, %d after it settled; %d calls served in the last %v at a cap of %d; %d caps learned",
		refused, refusedLate, okLate, raiseAt-settled, limit/2, learned.Load())
	if refused > replicas*workers {
		t.Errorf("%d refusals after the vendor halved its cap, want at most one per worker in flight (%d)", refused, replicas*workers)
	}
	if refusedLate > 0 {
		t.Errorf("%d refusals in the last %v before the cap rose again, want none", refusedLate, raiseAt-settled)
	}
	if want := 0.9 * float64(limit/2) * float64(raiseAt-settled) / float64(window); float64(okLate) < want {
		t.Errorf("%d calls served at the halved cap, want at least %.0f (90%%)", okLate, want)
	}
	// Raised again, the cap is found within a few windows of the learned
	// cap's hold.
	found := endAt - 2*window
	okEnd, refusedEnd := q.count(found, endAt)
	t.Logf("cap raised again: %d calls served in the last %v, %d refused", okEnd, endAt-found, refusedEnd)
	if want := 0.9 * float64(limit) * float64(endAt-found) / float64(window); float64(okEnd) < want {
		t.Errorf("%d calls served in the last two windows with the cap back at %d, want at least %.0f", okEnd, limit, want)
	}
}
