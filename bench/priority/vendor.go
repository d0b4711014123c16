package main

import (
	"slices"
	"sync"
	"time"
)

// The strict vendor's cap: vendorLimit calls in any sliding vendorWindow.
// Every quota of the program has the same Limit and Window.
const (
	vendorLimit  = 100
	vendorWindow = time.Second
)

// vendor is a strict vendor: it notes when each call started and whose it
// was, and afterwards counts the calls over its cap. It refuses nothing, so
// that a call over the cap does not change what the fleet does next.
type vendor struct {
	mu    sync.Mutex
	calls []vendorCall
}

// vendorCall is one call as the vendor saw it.
type vendorCall struct {
	at  time.Time
	who string // the class of call or the tenant
}

// note records who's call, started at at.
func (v *vendor) note(who string, at time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.calls = append(v.calls, vendorCall{at: at, who: who})
}

// overCap counts the calls that found vendorLimit others started in the
// vendorWindow before them: the calls a strict vendor refuses.
func (v *vendor) overCap() int {
	v.mu.Lock()
	at := make([]time.Time, len(v.calls))
	for i, c := range v.calls {
		at[i] = c.at
	}
	v.mu.Unlock()
	return overCap(at, vendorLimit, vendorWindow)
}

// overCap counts the times in at that have limit others in the window
// before them, that window (t-window, t] being half-open: a call a whole
// window after another no longer shares a window with it.
func overCap(at []time.Time, limit int, window time.Duration) int {
	at = slices.Clone(at)
	slices.SortFunc(at, time.Time.Compare)
	over, first := 0, 0
	for i, t := range at {
		for !at[first].After(t.Add(-window)) {
			first++
		}
		if i-first+1 > limit {
			over++
		}
	}
	return over
}

// started counts the calls started in [from, to) whose who is in whos, or
// every call there when whos is empty.
func (v *vendor) started(from, to time.Time, whos ...string) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := 0
	for _, c := range v.calls {
		if !c.at.Before(from) && c.at.Before(to) && (len(whos) == 0 || slices.Contains(whos, c.who)) {
			n++
		}
	}
	return n
}
