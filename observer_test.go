package throttle

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// recorder is an Observer that keeps every event.
type recorder struct {
	mu     sync.Mutex
	events []Event
}

func (r *recorder) Observe(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recorder) count(k EventKind, shadow bool) (n, units int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if e.Kind == k && e.Shadow == shadow {
			n++
			units += e.Cost
		}
	}
	return n, units
}

func TestObserver_SeesExactlyTheCallsMade(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		var rec recorder
		clock := newClock()
		rdb := s.Client(t)
		scripts := new(atomic.Int64)
		rdb.AddHook(countRuns{scripts})
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Second},
			Options{Mode: FailFast, Observer: rec.Observe, Clock: clock.Now})
		ctx := context.Background()
		admitted, limited := 0, 0
		for i := range 12 {
			_, err := Do(ctx, lim, func(context.Context) (int, error) { return 0, nil }, Cost(1+i%2))
			switch {
			case err == nil:
				admitted++
			case errors.Is(err, ErrLimited):
				limited++
			default:
				t.Fatal(err)
			}
		}
		if n, units := rec.count(EventAdmitted, false); n != admitted || units != 10 {
			t.Errorf("observer saw %d admitted calls of %d units; %d were admitted, of 10 units", n, units, admitted)
		}
		if n, _ := rec.count(EventLimited, false); n != limited {
			t.Errorf("observer saw %d limited calls; %d were limited", n, limited)
		}
		// One per script run (a call that takes a spare admission runs
		// none).
		if n, _ := rec.count(EventRedis, false); int64(n) != scripts.Load() || n < 12-maxSpares {
			t.Errorf("observer saw %d Redis round trips for 12 sequential calls; %d script calls ran", n, scripts.Load())
		}
		for _, e := range rec.events {
			if e.Quota != lim.Name() {
				t.Fatalf("event %+v has quota %q", e, e.Quota)
			}
		}
	})
}

func TestObserver_ShadowModeLetsEveryCallThrough(t *testing.T) {
	s := redistest.Mini(t)
	var rec recorder
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 3, Window: time.Hour}, Options{Shadow: true, Observer: rec.Observe})
	ran := 0
	for range 10 {
		if _, err := Do(context.Background(), lim, func(context.Context) (int, error) { ran++; return 0, nil }); err != nil {
			t.Fatalf("shadow mode refused a call: %v", err)
		}
	}
	if ran != 10 {
		t.Errorf("%d of 10 calls ran in shadow mode", ran)
	}
	if n, _ := rec.count(EventAdmitted, false); n != 3 {
		t.Errorf("%d calls within the quota reported, want 3", n)
	}
	if n, _ := rec.count(EventLimited, true); n != 7 {
		t.Errorf("%d calls reported as limited in shadow, want 7", n)
	}
}

// Every entry point goes through one dispatcher: in every mode, Do, Go,
// Acquire and the Transport report their calls to the Observer alike, and
// in shadow mode let every call through.
func TestObserver_EveryEntryPointReportsAndHonoursShadowMode(t *testing.T) {
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	entries := []struct {
		name string
		call func(*Limiter) error
	}{
		{"Do", func(l *Limiter) error {
			_, err := Do(context.Background(), l, func(context.Context) (int, error) { return 0, nil })
			return err
		}},
		{"Go", func(l *Limiter) error {
			_, err := Go(context.Background(), l, func(context.Context) (int, error) { return 0, nil }).Wait()
			return err
		}},
		{"Acquire", func(l *Limiter) error {
			p, err := l.Acquire(context.Background())
			if err == nil {
				p.Release()
			}
			return err
		}},
		{"Transport", func(l *Limiter) error {
			req := mustRequest(t, context.Background(), http.MethodGet, srv.URL, nil)
			resp, err := (&Transport{Limiter: l}).RoundTrip(req)
			if err == nil {
				resp.Body.Close()
			}
			return err
		}},
	}
	s := redistest.Mini(t)
	for _, mode := range []Mode{Block, FailFast, Queue} {
		for _, e := range entries {
			t.Run(string(mode)+"/"+e.name, func(t *testing.T) {
				checkReportsAndHonoursShadowMode(t, s, mode, e.call)
			})
		}
	}
}

// checkReportsAndHonoursShadowMode makes 3 calls through call under a
// limit of 2 in mode, and 3 in shadow mode under a limit of 1: the
// observer sees each call's outcome, and shadow mode lets every call by.
func checkReportsAndHonoursShadowMode(t *testing.T, s *redistest.Server, mode Mode, call func(*Limiter) error) {
	t.Helper()
	var rec recorder
	// A margin of a second: at the default 30 ms, a reply late on a busy
	// machine refused a Block call of a millisecond's MaxWait as too late.
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 2, Window: time.Hour, Margin: time.Second}, Options{Mode: mode, MaxWait: time.Millisecond, Observer: rec.Observe})
	admitted := 0
	for range 3 {
		if call(lim) == nil {
			admitted++
		}
	}
	if admitted != 2 {
		t.Errorf("%d of 3 calls admitted under a limit of 2", admitted)
	}
	if n, _ := rec.count(EventAdmitted, false); n != 2 {
		t.Errorf("observer saw %d admitted calls, want 2", n)
	}
	if n, _ := rec.count(EventLimited, false); n != 1 {
		t.Errorf("observer saw %d limited calls, want 1", n)
	}

	var shadowRec recorder
	shadow, err := New(s.Client(t), lim.Name()+"-shadow", policies.SlidingLog{Limit: 1, Window: time.Hour, Margin: time.Second}, Options{Mode: mode, Shadow: true, Observer: shadowRec.Observe})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := call(shadow); err != nil {
			t.Fatalf("call %d in shadow mode: %v", i, err)
		}
	}
	if n, _ := shadowRec.count(EventAdmitted, false); n != 1 {
		t.Errorf("shadow: observer saw %d admitted calls, want 1", n)
	}
	if n, _ := shadowRec.count(EventLimited, true); n != 2 {
		t.Errorf("shadow: observer saw %d calls limited in shadow, want 2", n)
	}
}

func TestObserver_SeesFailuresAndTheFallback(t *testing.T) {
	t.Parallel()
	var rec recorder
	lim := newLimiter(t, deadRedis(t), perSecond, Options{Observer: rec.Observe, OnRedisError: FailClosed})
	for range 5 {
		if _, err := lim.Acquire(context.Background()); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("Acquire on a dead Redis: %v", err)
		}
	}
	if n, _ := rec.count(EventUnavailable, false); n != 5 {
		t.Errorf("%d unavailable calls reported, want 5", n)
	}
	if n, _ := rec.count(EventFallback, false); n != 1 {
		t.Errorf("%d switches to the fallback reported, want 1", n)
	}
}

// With no Observer a limiter does no observing work at all; with one, the
// work is one interface call per event. Compare:
//
//	go test -run '^$' -bench Observer -benchmem
func BenchmarkObserver(b *testing.B) {
	for _, tc := range []struct {
		name string
		opts []Options
	}{
		{"none", nil},
		{"noop", []Options{{Observer: func(Event) {}}}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			lim, err := New(deadRedis(b), "bench", perSecond, tc.opts...)
			if err != nil {
				b.Fatal(err)
			}
			c := call{cost: 1}
			p := &Permit{l: lim, call: c}
			b.ReportAllocs()
			for b.Loop() {
				lim.emitOutcome(c, p, nil, false)
				lim.emit(Event{Kind: EventRedis, Duration: time.Millisecond, Calls: 1})
			}
		})
	}
}

// countRuns counts the scripts a client runs: one EVALSHA each, whether or
// not a NOSCRIPT reply makes it send EVAL after it.
type countRuns struct{ n *atomic.Int64 }

func (countRuns) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countRuns) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "evalsha" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (countRuns) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
