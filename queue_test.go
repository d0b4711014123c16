package throttle

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// hold starts a call that takes the queue's only dispatch place and keeps it
// until the returned cancel is called: its slot is 30 seconds away.
func hold(t *testing.T, lim *Limiter) (release func()) {
	t.Helper()
	if _, err := lim.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := Go(ctx, lim, func(context.Context) (int, error) { return 0, nil })
	waitFor(t, func() bool {
		lim.q.mu.Lock()
		defer lim.q.mu.Unlock()
		return len(lim.q.waiting) == 0 && lim.q.active == 1
	}, "the held call's dispatch")
	return func() {
		cancel()
		<-f.done
	}
}

func newQueueLimiter(t *testing.T, s *redistest.Server, opts ...Options) *Limiter {
	t.Helper()
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	o.Mode = Queue
	return newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: 30 * time.Second}, o)
}

func TestQueue_ServesByPriorityThenArrival(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: 30 * time.Millisecond, Margin: time.Nanosecond}, Options{Mode: Queue})
		ctx := context.Background()
		if _, err := lim.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var order []string
		run := func(name string) func(context.Context) (string, error) {
			return func(context.Context) (string, error) {
				mu.Lock()
				defer mu.Unlock()
				order = append(order, name)
				return name, nil
			}
		}
		// "first" takes the dispatch place at once; the rest queue behind it.
		futures := []*Future[string]{
			Go(ctx, lim, run("first"), Priority(0)),
			Go(ctx, lim, run("low-1"), Priority(0)),
			Go(ctx, lim, run("high"), Priority(9)),
			Go(ctx, lim, run("low-2"), Priority(0)),
			Go(ctx, lim, run("mid"), Priority(5)),
		}
		for _, f := range futures {
			if _, err := f.Wait(); err != nil {
				t.Fatal(err)
			}
		}
		want := []string{"first", "high", "mid", "low-1", "low-2"}
		if !slices.Equal(order, want) {
			t.Errorf("ran in order %v, want %v", order, want)
		}
	})
}

func TestQueue_FullQueueTurnsAwayPerOverflow(t *testing.T) {
	tests := []struct {
		overflow Overflow
		newPrio  int
		// which of a (prio 1, oldest), b (prio 0), c (the new call) are turned away
		wantAway string
	}{
		{RejectNew, 5, "c"},
		{ShedOldest, 0, "a"},
		{ShedLowest, 5, "b"},
		{ShedLowest, 0, "c"},
	}
	for _, tt := range tests {
		t.Run(string(tt.overflow)+"_turns_away_"+tt.wantAway, func(t *testing.T) {
			s := redistest.Mini(t)
			lim := newQueueLimiter(t, s, Options{MaxQueue: 2, Overflow: tt.overflow})
			release := hold(t, lim)
			defer release()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			noop := func(context.Context) (int, error) { return 0, nil }
			calls := map[string]*Future[int]{
				"a": Go(ctx, lim, noop, Priority(1)),
				"b": Go(ctx, lim, noop, Priority(0)),
			}
			calls["c"] = Go(ctx, lim, noop, Priority(tt.newPrio))
			away := calls[tt.wantAway]
			select {
			case <-away.done:
			case <-time.After(10 * time.Second):
				t.Fatalf("call %s was not turned away", tt.wantAway)
			}
			if _, err := away.Wait(); !errors.Is(err, ErrQueueFull) || strings.Count(err.Error(), "throttle") != 1 {
				t.Errorf("call %s: %v, want ErrQueueFull, saying throttle once", tt.wantAway, err)
			}
			if n := queued(lim); n != 2 {
				t.Errorf("%d calls queued, want 2", n)
			}
		})
	}
}

func TestQueue_QueuedCallsCostNoRedisCall(t *testing.T) {
	s := redistest.New(t)
	rdb := s.Client(t)
	var scripts atomic.Int64
	rdb.AddHook(countScripts{&scripts})
	lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: 30 * time.Second}, Options{Mode: Queue})
	ctx, cancel := context.WithCancel(context.Background())
	var futures []*Future[int]
	for range 1000 {
		futures = append(futures, Go(ctx, lim, func(context.Context) (int, error) { return 0, nil }))
	}
	// Ten calls fit now; ten more take the dispatch places and book slots
	// 30 seconds away; the other 980 wait in the local queue.
	// A call that starts late books again and keeps its place a while
	// longer, so the count settles at about, not exactly, 980.
	waitFor(t, func() bool {
		q := queued(lim)
		return q >= 980 && rdb.ZCard(ctx, lim.cfg.shared[2]).Val() == int64(1000-q)
	}, "the queue to settle")
	if n := scripts.Load(); n > 30 {
		t.Errorf("%d script calls for 1000 queued calls, want about 20", n)
	}
	t.Logf("%d script calls admitted 10 calls and booked 10 of 1000", scripts.Load())
	cancel()
	for _, f := range futures {
		<-f.done
	}
}

func TestQueue_CloseDrainsEveryCall(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 5, Window: 50 * time.Millisecond, Margin: time.Nanosecond}, Options{Mode: Queue})
		ctx := context.Background()
		var ran atomic.Int64
		var futures []*Future[int]
		for range 30 {
			futures = append(futures, Go(ctx, lim, func(context.Context) (int, error) { ran.Add(1); return 0, nil }))
		}
		if err := lim.Close(ctx); err != nil {
			t.Fatalf("Close: %v", err)
		}
		for _, f := range futures {
			if _, err := f.Wait(); err != nil {
				t.Errorf("queued call: %v", err)
			}
		}
		if ran.Load() != 30 {
			t.Errorf("%d of 30 queued calls ran", ran.Load())
		}
		if _, err := lim.Acquire(ctx); !errors.Is(err, ErrClosed) {
			t.Errorf("Acquire after Close: %v, want ErrClosed", err)
		}
		if f := Go(ctx, lim, func(context.Context) (int, error) { return 0, nil }); !errors.Is(waitErr(f), ErrClosed) {
			t.Errorf("Go after Close: %v, want ErrClosed", waitErr(f))
		}
	})
}

func TestQueue_CloseGivesUpWithAnErrorForEveryCall(t *testing.T) {
	s := redistest.Mini(t)
	lim := newQueueLimiter(t, s)
	release := hold(t, lim)
	defer release()
	var futures []*Future[int]
	for range 5 {
		futures = append(futures, Go(context.Background(), lim, func(context.Context) (int, error) { return 0, nil }))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := lim.Close(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close with a call 30 seconds away: %v, want the context's deadline", err)
	}
	for i, f := range futures {
		if err := waitErr(f); !errors.Is(err, ErrClosed) {
			t.Errorf("queued call %d: %v, want ErrClosed", i, err)
		}
	}
}

func TestQueue_ContextEndsWhileQueued(t *testing.T) {
	s := redistest.Mini(t)
	lim := newQueueLimiter(t, s)
	release := hold(t, lim)
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	f := Go(ctx, lim, func(context.Context) (int, error) { return 0, nil })
	waitFor(t, func() bool { return queued(lim) == 1 }, "the call to queue")
	cancel()
	if err := waitErr(f); !errors.Is(err, context.Canceled) {
		t.Errorf("queued call: %v, want context.Canceled", err)
	}
	if n := queued(lim); n != 0 {
		t.Errorf("%d calls still queued", n)
	}
}

func waitErr[T any](f *Future[T]) error {
	_, err := f.Wait()
	return err
}

// countScripts counts the scripts a client runs, NOSCRIPT fallbacks included.
type countScripts struct{ n *atomic.Int64 }

func (countScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (countScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// queued returns how many calls wait in l's local queue.
func queued(l *Limiter) int {
	if l.q == nil {
		return 0
	}
	return l.q.len()
}

// Close drains the work it admitted: it returns once every function that
// Do and Go run has returned, in Queue mode and in Block mode alike, not
// once each call has its slot.
func TestClose_WaitsForTheFunctionsDoAndGoRun(t *testing.T) {
	t.Parallel()
	for _, mode := range []Mode{Queue, Block} {
		t.Run(string(mode), func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 5, Window: time.Second}, Options{Mode: mode})
				ctx := context.Background()
				var running, finished atomic.Int64
				job := func(context.Context) (int, error) {
					running.Add(1)
					time.Sleep(100 * time.Millisecond)
					finished.Add(1)
					return 0, nil
				}
				futures := []*Future[int]{Go(ctx, lim, job), Go(ctx, lim, job)}
				go func() { _, _ = Do(ctx, lim, job) }()
				waitFor(t, func() bool { return running.Load() == 3 }, "the three jobs to start")
				if err := lim.Close(ctx); err != nil {
					t.Fatalf("Close: %v", err)
				}
				if n := finished.Load(); n != 3 {
					t.Errorf("Close returned with %d of 3 jobs finished, want all", n)
				}
				for _, f := range futures {
					if err := waitErr(f); err != nil {
						t.Error(err)
					}
				}
				if _, err := Do(ctx, lim, job); !errors.Is(err, ErrClosed) {
					t.Errorf("Do after Close: %v, want ErrClosed", err)
				}
			})
		})
	}
}
