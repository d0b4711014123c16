package fakevendor

import (
	"slices"
	"sort"
	"time"
)

// minRing is the smallest buffer kept once a ring has grown; below it,
// shrinking would only cause churn.
const minRing = 16

// entry is one arrival in a ring. cum is the running total of units pushed
// up to and including this entry, so any range of entries sums in O(1) and
// can be searched by units in O(log n).
type entry struct {
	t   time.Time
	cum int
}

// ring is a deque of arrivals in time order, trimmed from the front as
// they leave the window. Its buffer length is zero or a power of two.
type ring struct {
	buf    []entry
	head   int
	n      int
	pushed int // units ever pushed
	popped int // units ever trimmed; pushed-popped is the window's sum
}

func (r *ring) at(i int) *entry {
	return &r.buf[(r.head+i)&(len(r.buf)-1)]
}

// push appends an arrival; t must not be before the last one pushed.
func (r *ring) push(t time.Time, units int) {
	if r.n == len(r.buf) {
		r.resize(max(minRing, 2*len(r.buf)))
	}
	r.pushed += units
	r.buf[(r.head+r.n)&(len(r.buf)-1)] = entry{t: t, cum: r.pushed}
	r.n++
}

// trim drops arrivals outside (now-w, now]: an arrival at s leaves exactly
// at s+w.
func (r *ring) trim(now time.Time, w time.Duration) {
	for r.n > 0 {
		e := &r.buf[r.head]
		if now.Sub(e.t) < w {
			break
		}
		r.popped = e.cum
		*e = entry{}
		r.head = (r.head + 1) & (len(r.buf) - 1)
		r.n--
	}
	// Give memory back after a burst; halving at a quarter keeps the cost
	// amortized O(1).
	if len(r.buf) > minRing && r.n <= len(r.buf)/4 {
		r.resize(len(r.buf) / 2)
	}
}

func (r *ring) resize(size int) {
	nb := make([]entry, size)
	for i := range r.n {
		nb[i] = *r.at(i)
	}
	r.buf, r.head = nb, 0
}

// sum returns the units in the ring.
func (r *ring) sum() int {
	return r.pushed - r.popped
}

// search returns the index of the first entry whose departure, together
// with those before it, frees at least need units, or r.n if the ring does
// not hold that many.
func (r *ring) search(need int) int {
	return sort.Search(r.n, func(i int) bool {
		return r.at(i).cum-r.popped >= need
	})
}

// sumSince returns the units in (now-w, now] without modifying the ring.
func (r *ring) sumSince(now time.Time, w time.Duration) int {
	i := sort.Search(r.n, func(i int) bool {
		return now.Sub(r.at(i).t) < w
	})
	if i == 0 {
		return r.sum()
	}
	return r.pushed - r.at(i-1).cum
}

// FullestWindow returns the most of starts (times from a run's start, in
// any order) in a window of length w that starts at one of them, from lo
// up to the first one at or after hi: a test reads the first burst past
// hi as the last one it may count.
func FullestWindow(starts []time.Duration, lo, hi, w time.Duration) int {
	starts = slices.Sorted(slices.Values(starts))
	most := 0
	for i, at := range starts {
		if at < lo {
			continue
		}
		n := 0
		for _, b := range starts[i:] {
			if b >= at+w {
				break
			}
			n++
		}
		most = max(most, n)
		if at >= hi {
			break
		}
	}
	return most
}
