package throttle

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
)

// maxDispatched bounds how many calls of one process seek or hold a slot in
// Redis at once in Queue mode: the rest wait in the local queue and cost
// nothing, so a queue of 10,000 calls is not 10,000 Redis calls.
const maxDispatched = 64

// queue is the local queue of a limiter in Queue mode. Its head calls are
// dispatched: they book their slots as in Block mode, at most free at once.
type queue struct {
	mu       sync.Mutex
	waiting  waitHeap
	max      int
	overflow Overflow
	free     int // dispatch places left
	active   int // calls dispatched and not done
	seq      uint64
	closed   bool
	drained  chan struct{} // closed when closed and nothing is queued or active
}

// waiter is one call in the queue.
type waiter struct {
	priority int
	seq      uint64
	index    int           // in the heap, -1 once out of it
	ready    chan struct{} // closed when the call is dispatched or turned away
	err      error         // why it was turned away; set before ready closes
}

func newQueue(size int, o Overflow, dispatch int) *queue {
	return &queue{max: size, overflow: o, free: max(dispatch, 1), drained: make(chan struct{})}
}

// enqueue puts a call in the queue, or turns it (or another) away when the
// queue is full.
func (q *queue) enqueue(priority int, quota string) (*waiter, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return nil, quotaErr(quota, ErrClosed, "limiter closed")
	}
	q.seq++
	w := &waiter{priority: priority, seq: q.seq, ready: make(chan struct{})}
	if len(q.waiting) >= q.max {
		victim := q.victim(w)
		if victim == w {
			return nil, quotaErr(quota, ErrQueueFull, fmt.Sprintf("queue full (%d waiting, Options.MaxQueue %d)", len(q.waiting), q.max))
		}
		heap.Remove(&q.waiting, victim.index)
		victim.err = quotaErr(quota, ErrQueueFull, fmt.Sprintf("queue full: turned away by a newer call (%v)", q.overflow))
		close(victim.ready)
	}
	heap.Push(&q.waiting, w)
	q.dispatch()
	return w, nil
}

// victim picks the call a full queue turns away to make room for w.
func (q *queue) victim(w *waiter) *waiter {
	switch q.overflow {
	case ShedOldest:
		oldest := q.waiting[0]
		for _, x := range q.waiting {
			if x.seq < oldest.seq {
				oldest = x
			}
		}
		return oldest
	case ShedLowest:
		lowest := w
		for _, x := range q.waiting {
			if x.priority < lowest.priority || x.priority == lowest.priority && x.seq > lowest.seq {
				lowest = x
			}
		}
		return lowest
	}
	return w
}

// dispatch lets the head calls go while there are places. q.mu is held.
func (q *queue) dispatch() {
	for q.free > 0 && len(q.waiting) > 0 {
		w := heap.Pop(&q.waiting).(*waiter)
		q.free--
		q.active++
		close(w.ready)
	}
}

// await waits until w is dispatched, turned away, or ctx ends. On success
// the caller owns a dispatch place and must call done.
func (q *queue) await(ctx context.Context, w *waiter) error {
	select {
	case <-w.ready:
		return w.err
	case <-ctx.Done():
	}
	q.mu.Lock()
	if w.index >= 0 {
		heap.Remove(&q.waiting, w.index)
		q.settled()
		q.mu.Unlock()
		return ctx.Err()
	}
	q.mu.Unlock()
	// Dispatched or turned away while the context ended.
	<-w.ready
	if w.err == nil {
		q.done()
	}
	return ctx.Err()
}

// done gives a dispatch place back once a dispatched call has its slot or
// gave up.
func (q *queue) done() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.free++
	q.active--
	q.dispatch()
	q.settled()
}

// settled closes drained once a closed queue is empty. q.mu is held.
func (q *queue) settled() {
	if q.closed && len(q.waiting) == 0 && q.active == 0 {
		select {
		case <-q.drained:
		default:
			close(q.drained)
		}
	}
}

// close stops the queue taking calls and waits for it to drain. If ctx ends
// first, the calls still queued are turned away with ErrClosed.
func (q *queue) close(ctx context.Context, quota string) error {
	q.mu.Lock()
	q.closed = true
	q.settled()
	q.mu.Unlock()
	select {
	case <-q.drained:
		return nil
	case <-ctx.Done():
	}
	q.mu.Lock()
	for len(q.waiting) > 0 {
		w := heap.Pop(&q.waiting).(*waiter)
		w.err = quotaErr(quota, ErrClosed, "limiter closed before the call's turn")
		close(w.ready)
	}
	q.settled()
	q.mu.Unlock()
	return ctx.Err()
}

func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiting)
}

// waitHeap orders waiters by priority, highest first, then by arrival.
type waitHeap []*waiter

func (h waitHeap) Len() int { return len(h) }
func (h waitHeap) Less(i, j int) bool {
	if h[i].priority != h[j].priority {
		return h[i].priority > h[j].priority
	}
	return h[i].seq < h[j].seq
}
func (h waitHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *waitHeap) Push(x any) {
	w := x.(*waiter)
	w.index = len(*h)
	*h = append(*h, w)
}
func (h *waitHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	w.index = -1
	*h = old[:len(old)-1]
	return w
}
