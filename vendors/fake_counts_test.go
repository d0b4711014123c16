package vendors

import (
	"os"
	"sync"
	"testing"
	"time"
)

// counts are a vendor's fixed-window counts, by name (a resource, an
// endpoint, a token's): each counts units in windows of its own length,
// fixed in time from the fake's start, as GitHub, Stripe and OpenAI
// report theirs with a reset.
type counts struct {
	start time.Time
	mu    sync.Mutex
	c     map[string]*count
}

type count struct {
	limit  int
	window time.Duration
	k      int64 // the window counted
	n      int
	served []int    // units taken, per window of the run
	taken  []taking // units taken, by when, from the start
}

// taking is n units taken at, from the counts' start.
type taking struct {
	at time.Duration
	n  int
}

// newCounts starts the windows at a whole second, as the vendors' epoch
// resets fall.
func newCounts() *counts {
	return &counts{start: time.Now().Truncate(time.Second), c: map[string]*count{}}
}

// take takes n units of each named count if all of them have room, and
// reports which was full, or "".
func (c *counts) take(now time.Time, n map[string]int, limits map[string]limit) (full string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for name, units := range n {
		if k := c.at(now, name, limits[name]); k.n+units > k.limit {
			return name
		}
	}
	for name, units := range n {
		k := c.at(now, name, limits[name])
		k.n += units
		for int64(len(k.served)) <= k.k {
			k.served = append(k.served, 0)
		}
		k.served[k.k] += units
		k.taken = append(k.taken, taking{now.Sub(c.start), units})
	}
	return ""
}

// at returns the count of name as of now, its window rolled over.
func (c *counts) at(now time.Time, name string, l limit) *count {
	k := c.c[name]
	if k == nil {
		k = &count{limit: l.n, window: l.per}
		c.c[name] = k
	}
	if w := int64(now.Sub(c.start) / k.window); w != k.k {
		k.k, k.n = w, 0
	}
	return k
}

// state returns what is left of name and when its window resets.
func (c *counts) state(now time.Time, name string, l limit) (left int, reset time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.at(now, name, l)
	return k.limit - k.n, c.start.Add(time.Duration(k.k+1) * k.window)
}

// share returns the units served of name in its windows that start at
// skip or later (one window at least) and end by the run's end d, as a
// share of what the limit allows in them.
func (c *counts) share(name string, d, skip time.Duration) (float64, []int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.c[name]
	if k == nil {
		return 0, nil
	}
	windows := int(d / k.window)
	first := max(int((skip+k.window-1)/k.window), 1)
	served := append([]int(nil), k.served...)
	for len(served) < windows {
		served = append(served, 0)
	}
	sum := 0
	for _, n := range served[first:windows] {
		sum += n
	}
	return float64(sum) / float64(k.limit*(windows-first)), served
}

// meanShare returns the units served of name in a window, averaged over
// every window that starts at skip or later and ends by the run's end d,
// as a share of the limit. A fleet that sends a window's units in one
// burst, a window and its margin apart, fills each window from a burst on,
// and half of the fixed windows of a short run can hold one burst fewer
// than another run's: their share moved by a whole burst (8 or 9 of 9
// windows, 0.889 or 1.000, on one fleet). The windows from every moment
// count each burst by how long it lies in them, so that the figure is the
// fleet's rate, not the phase of its bursts.
func (c *counts) meanShare(name string, d, skip time.Duration) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.c[name]
	if k == nil {
		return 0
	}
	return windowsMean(k.taken, skip, d, k.window) / float64(k.limit)
}

// windowsMean returns the units of taken (at times from the run's start)
// in a window of the given length, averaged over every window that starts
// at from or later and ends by to; 0 when none fits.
func windowsMean(taken []taking, from, to, window time.Duration) float64 {
	// Each unit taken at t counts in the windows that start in (t-W, t]:
	// the length of that span within [from, to-W], over the span's length.
	last := to - window
	if last <= from {
		return 0
	}
	sum := 0.0
	for _, a := range taken {
		lo, hi := max(a.at-window, from), min(a.at, last)
		if hi > lo {
			sum += float64(a.n) * float64(hi-lo)
		}
	}
	return sum / float64(last-from)
}

// limit is n units per window of per.
type limit struct {
	n   int
	per time.Duration
}

// fleetRun is how long a vendor's fleet runs: long under THROTTLE_LONG=1,
// as the vendors' fleets are measured, and shorter by default, so that the
// module's tests stay quick.
func fleetRun(short, long time.Duration) time.Duration {
	if os.Getenv("THROTTLE_LONG") == "1" {
		return long
	}
	return short
}

// runEachWorker drives workers goroutines for each of replicas, each
// calling call with its replica's and its own index and its count of
// calls, until d has passed.
func runEachWorker(replicas, workers int, d time.Duration, call func(replica, worker, n int)) {
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := range replicas {
		for j := range workers {
			wg.Go(func() {
				for n := 0; time.Now().Before(deadline); n++ {
					call(i, j, n)
				}
			})
		}
	}
	wg.Wait()
}

// errorCounts tallies the errors a fleet's calls returned, by text, so
// that a figure below its bound says what the calls met.
type errorCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *errorCounts) add(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = map[string]int{}
	}
	e.n[err.Error()]++
}

// log writes each error's text and count.
func (e *errorCounts) log(t *testing.T) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for text, n := range e.n {
		t.Logf("%d× %s", n, text)
	}
}
