package throttle

import (
	"context"
	"sync"
)

// running counts the calls that Do and Go run, so that Close can wait for
// them: a limiter that drains lets the work it admitted finish.
type running struct {
	mu     sync.Mutex
	n      int
	closed bool
	idle   chan struct{} // closed once closed and no call runs
}

// enter counts a call in, and reports false once Close began.
func (r *running) enter() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.n++
	return true
}

// leave counts a call out.
func (r *running) leave() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n--
	r.settle()
}

// settle closes idle once no call runs after Close began. r.mu is held.
func (r *running) settle() {
	if r.closed && r.n == 0 && r.idle != nil {
		close(r.idle)
		r.idle = nil
	}
}

// close stops counting calls in, and waits until the calls counted have
// left, or ctx ends.
func (r *running) close(ctx context.Context) error {
	r.mu.Lock()
	if r.n == 0 {
		r.closed = true
		r.mu.Unlock()
		return nil
	}
	if !r.closed {
		r.closed, r.idle = true, make(chan struct{})
	}
	idle := r.idle
	r.mu.Unlock()
	if idle == nil {
		return nil
	}
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
