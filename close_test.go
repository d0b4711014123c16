package throttle

import (
	"context"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Close leaves no goroutine of the limiter running: the lane's, the
// abandoned bookings' giving back, a cleanup after a caller left, the
// subscription to the quota's news (its last limiter on the client), and
// Go's jobs. Each path below starts one.
func TestClose_LeavesNoGoroutineRunning(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		// Goroutines of the package that ran before: another test's
		// limiter, never closed, or still closing.
		before := map[string]bool{}
		for _, g := range goroutinesOf("github.com/throttlekit/throttle.") {
			before[goroutineID(g)] = true
		}
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 5, Window: 300 * time.Millisecond}, Options{Logger: quiet()})
		other := newLimiter(t, rdb, policies.SlidingLog{Limit: 5, Window: 300 * time.Millisecond}, Options{Mode: Queue, Logger: quiet()})
		ctx := context.Background()
		for range 5 {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			p.Release()
		}
		// Callers that leave while booked ahead: their bookings are
		// abandoned, and given back by a goroutine.
		for range 3 {
			c, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			_, _ = lim.Acquire(c)
			cancel()
		}
		lim.room.signal(math.MaxInt64) // units given back after every booking
		f := Go(ctx, other, func(context.Context) (int, error) { time.Sleep(20 * time.Millisecond); return 1, nil })
		for _, l := range []*Limiter{lim, other} {
			if err := l.Close(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := f.Wait(); err != nil {
			t.Error(err)
		}
		if n := pendingTimers(lim) + pendingTimers(other); n > 0 {
			t.Errorf("%d timers of the limiters still pending after Close", n)
		}
		// A goroutine's last act is to close the channel Close waits for;
		// it may not have returned yet when Close does (CI once saw the
		// news' goroutine runnable at its closing brace). One that is left
		// is still there 2 s later.
		var left []string
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			left = left[:0]
			for _, g := range goroutinesOf("github.com/throttlekit/throttle.") {
				if !before[goroutineID(g)] {
					left = append(left, g)
				}
			}
			if len(left) == 0 || time.Now().After(deadline) {
				break
			}
		}
		if len(left) > 0 {
			t.Errorf("%d goroutines of the limiter still run after Close:\n%s", len(left), strings.Join(left, "\n\n"))
		}
	})
}

// Close neither waits out the limiter's timers (the news of room given
// back, the spares' return) nor leaves them to fire after it: it drops
// those still pending, waits for a function a timer already started, and
// sets no timer once it began. A timer run at Close instead, or set after
// it, woke a sleeping call that, with Redis in trouble, set the next at
// once: a loop that never let Close return (the simulation's seeds from
// 237 on, in virtual time).
func TestClose_DropsItsTimersAndWaitsForThoseThatFired(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var (
			r   running
			mu  sync.Mutex
			ran []string
		)
		note := func(what string) {
			mu.Lock()
			defer mu.Unlock()
			ran = append(ran, what)
		}
		r.after(time.Hour, func() { note("pending") })
		r.after(time.Millisecond, func() { time.Sleep(time.Second); note("fired") })
		time.Sleep(2 * time.Millisecond) // the second has fired: its function runs for a second
		start := time.Now()
		if err := r.close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("Close took %v: it waited out a pending timer", d)
		}
		mu.Lock()
		got := slices.Clone(ran)
		mu.Unlock()
		if !slices.Equal(got, []string{"fired"}) {
			t.Errorf("Close returned when %q had run, want the fired timer's function alone", got)
		}
		r.after(0, func() { note("late") })
		if err := r.close(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Hour)
		mu.Lock()
		defer mu.Unlock()
		if !slices.Equal(ran, []string{"fired"}) {
			t.Errorf("after Close, ran %q, want nothing more", ran)
		}
	})
}

// pendingTimers returns how many timers l set that have not fired.
func pendingTimers(l *Limiter) int {
	l.work.mu.Lock()
	defer l.work.mu.Unlock()
	return len(l.work.timers)
}

// goroutinesOf returns the stacks of the goroutines running a function of
// pkg (the test's own aside).
// goroutineID returns the id in the header of a goroutine's stack, as
// runtime.Stack writes it ("goroutine 18 [running]:").
func goroutineID(stack string) string {
	id, _, _ := strings.Cut(strings.TrimPrefix(stack, "goroutine "), " ")
	return id
}

func goroutinesOf(pkg string) []string {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, pkg) && !strings.Contains(g, "testing.tRunner") && !strings.Contains(g, "goroutinesOf") {
			out = append(out, g)
		}
	}
	return out
}
