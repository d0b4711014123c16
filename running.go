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
	idle   chan struct{}          // closed once closed and no call runs
	timers map[*time.Timer]func() // set by after and not yet fired, each with its f
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

// after runs f in a goroutine once d has passed, as start does. Close
// does not wait out d: it stops the timers still pending and runs their
// f at once (they wake, or give back, what waits on them), and waits for
// every f. Once close began, after runs f at once.
func (r *running) after(d time.Duration, f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
	if r.closed {
		go r.run(f)
		return
	}
	if r.timers == nil {
		r.timers = make(map[*time.Timer]func())
	}
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		r.mu.Lock()
		delete(r.timers, t)
		r.mu.Unlock()
		r.run(f)
	})
	r.timers[t] = f
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

// close stops counting calls in, runs at once what the pending timers of
// after would run, and waits until the calls, goroutines and timers
// counted have left, or ctx ends.
func (r *running) close(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	for t, f := range r.timers {
		if t.Stop() {
			delete(r.timers, t)
			go r.run(f)
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
