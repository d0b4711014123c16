package throttle

import (
	"context"
	"sync"
	"time"
)

// running counts the calls that Do and Go run, and the goroutines and
// timers the limiter starts, so that Close can wait for them: a limiter
// that drains lets the work it admitted finish, and leaves nothing running.
type running struct {
	mu     sync.Mutex
	n      int
	closed bool
	idle   chan struct{}        // closed once closed and no call runs
	timers map[*time.Timer]bool // set by after and not yet fired
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

// start runs f in a goroutine that close waits for; after close began
// too, since such work (a booking given back) must still be done.
func (r *running) start(f func()) {
	r.mu.Lock()
	r.n++
	r.mu.Unlock()
	go r.run(f)
}

// after runs f in a goroutine once d has passed, as start does, unless
// close begins first. Close does not wait out d: it drops the timers still
// pending, and after sets none once it began, since what they do is
// either done by Close itself (the spares given back) or not needed once
// the calls end (the news that wakes a sleeping call early). It waits for
// an f a timer already started.
func (r *running) after(d time.Duration, f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	if r.timers == nil {
		r.timers = make(map[*time.Timer]bool)
	}
	r.n++
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		r.mu.Lock()
		delete(r.timers, t)
		r.mu.Unlock()
		r.run(f)
	})
	r.timers[t] = true
}

// run runs f, counted in by start or after.
func (r *running) run(f func()) {
	defer r.leave()
	f()
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

// close stops counting calls in, drops the pending timers of after, and
// waits until the calls, goroutines and timers counted have left, or ctx
// ends.
func (r *running) close(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	for t := range r.timers {
		if t.Stop() {
			delete(r.timers, t)
			r.n--
		}
	}
	if r.n == 0 {
		r.mu.Unlock()
		return nil
	}
	if r.idle == nil {
		r.idle = make(chan struct{})
	}
	idle := r.idle
	r.mu.Unlock()
	return wait(ctx, idle)
}

// wait waits until done closes, or ctx ends.
func wait(ctx context.Context, done <-chan struct{}) error {
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
