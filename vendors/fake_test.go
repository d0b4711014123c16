package vendors

import (
	"sync"
	"time"
)

// fixedWindow is a vendor's count: limit calls per window, the windows
// fixed in time, as GitHub and OpenAI count and report them.
type fixedWindow struct {
	limit  int
	window time.Duration
	start  time.Time

	mu       sync.Mutex
	k        int64
	n        int // calls counted in window k, from every consumer
	ours     int // calls of the fleet accepted
	refused  int // calls of the fleet refused
	inWindow []int
}

func newFixedWindow(limit int, window time.Duration) *fixedWindow {
	return &fixedWindow{limit: limit, window: window, start: time.Now()}
}

// take counts one call, the fleet's unless other, and reports whether it
// fits, what is left, and when the window resets.
func (v *fixedWindow) take(other bool) (ok bool, remaining int, reset time.Time) {
	now := time.Now()
	v.mu.Lock()
	defer v.mu.Unlock()
	k := int64(now.Sub(v.start) / v.window)
	if k != v.k {
		v.k, v.n = k, 0
	}
	ok = v.n < v.limit
	if ok {
		v.n++
	}
	if !other {
		if ok {
			v.ours++
			for int64(len(v.inWindow)) <= k {
				v.inWindow = append(v.inWindow, 0)
			}
			v.inWindow[k]++
		} else {
			v.refused++
		}
	}
	return ok, v.limit - v.n, v.start.Add(time.Duration(k+1) * v.window)
}

func (v *fixedWindow) results() (ours, refused int, perWindow []int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.ours, v.refused, append([]int(nil), v.inWindow...)
}

// otherConsumer spends share of the vendor's limit in each window, spread
// over it, until stop is closed: another service on the same API key.
func otherConsumer(v *fixedWindow, share float64, stop <-chan struct{}) {
	every := time.Duration(float64(v.window) / (share * float64(v.limit)))
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			v.take(true)
		}
	}
}

// runEach drives workers goroutines for each of replicas, each calling
// call with its replica's index until d has passed.
func runEach(replicas, workers int, d time.Duration, call func(replica int)) {
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := range replicas {
		for range workers {
			wg.Go(func() {
				for time.Now().Before(deadline) {
					call(i)
				}
			})
		}
	}
	wg.Wait()
}
