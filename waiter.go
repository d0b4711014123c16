package throttle

import (
	"context"
	"time"

	"github.com/throttlekit/throttle/lua"
)

// cancelTimeout bounds giving a booking back after the caller's context ended.
const cancelTimeout = time.Second

// wait is Block mode: book the earliest slot the call fits in, within the
// context's deadline and MaxWait, and sleep until it. One script call admits
// the call; a waiter never polls.
func (l *Limiter) wait(ctx context.Context, c call) (*Permit, error) {
	start := time.Now()
	maxWait := l.s.maxWait
	if deadline, ok := ctx.Deadline(); ok {
		maxWait = min(maxWait, time.Until(deadline))
	}
	r, err := l.acquire(ctx, c, max(maxWait, 0))
	if err != nil {
		return nil, err
	}
	if !r.admitted {
		return nil, l.limited(r.wait)
	}
	if r.wait <= 0 {
		return &Permit{l: l, call: c, waited: time.Since(start)}, nil
	}
	// The script counted the wait from its own clock; the reply took some of
	// it to arrive, so sleeping the whole wait from here never wakes early.
	wake := time.Now().Add(r.wait)
	if deadline, ok := ctx.Deadline(); ok && wake.After(deadline) {
		l.cancel(ctx, c, r)
		return nil, l.limited(r.wait)
	}
	t := time.NewTimer(r.wait)
	defer t.Stop()
	select {
	case <-t.C:
		return &Permit{l: l, call: c, waited: time.Since(start)}, nil
	case <-ctx.Done():
		l.cancel(ctx, c, r)
		return nil, ctx.Err()
	}
}

// cancel gives a booking back so that the next caller can have the slot. It
// runs even though ctx has ended; if Redis cannot be reached the booking
// stays, which wastes its slot but never overfills a window.
func (l *Limiter) cancel(ctx context.Context, c call, r result) {
	ctx, stop := context.WithTimeout(context.WithoutCancel(ctx), cancelTimeout)
	defer stop()
	_ = lua.Cancel.Run(ctx, l.rdb, r.keys, r.member, c.cost).Err()
}
