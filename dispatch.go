package throttle

import (
	"context"
	"time"
)

// dispatch decides call c as the limiter's mode says, reports the outcome
// to the Observer, and in shadow mode lets the call through whatever the
// decision. Every entry point (Acquire, Do, Go, the Transport) goes through
// it. w, when not nil, is the call's place in the queue, taken already: Go
// queues a call before it returns.
func (l *Limiter) dispatch(ctx context.Context, c call, w *waiter) (*Permit, error) {
	if w == nil {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	if l.s.shadow {
		return l.shadow(ctx, c)
	}
	var (
		p   *Permit
		err error
	)
	switch l.s.mode {
	case FailFast:
		var r result
		if r, err = l.now(ctx, c); err == nil {
			if r.admitted {
				p = l.permit(c, r, 0)
			} else {
				err = l.refused(r, "FailFast mode")
			}
		}
	case Queue:
		if w == nil {
			w, err = l.q.enqueue(c.priority, l.name)
		}
		if err == nil {
			p, err = l.fromQueue(ctx, c, w)
		}
	default:
		p, err = l.wait(ctx, c)
	}
	l.emitOutcome(c, p, err, false)
	return p, err
}

// shadow decides a call as FailFast would, records it when it fits, reports
// the decision, and lets the call through either way.
func (l *Limiter) shadow(ctx context.Context, c call) (*Permit, error) {
	r, err := l.now(ctx, c)
	if err == nil && r.admitted {
		p := l.permit(c, r, 0)
		l.emitOutcome(c, p, nil, false)
		return p, nil
	}
	if err == nil {
		err = l.refused(r, "shadow mode")
	} else if ctx.Err() != nil {
		return nil, err
	}
	l.emitOutcome(c, nil, err, true)
	// Nothing was recorded: the permit holds nothing to give back.
	return l.permit(c, result{local: true}, 0), nil
}

// fromQueue waits for a queued call's turn, then books its slot as Block does.
func (l *Limiter) fromQueue(ctx context.Context, c call, w *waiter) (*Permit, error) {
	c.queued = time.Now()
	if err := l.q.await(ctx, w); err != nil {
		return nil, err
	}
	defer l.q.done()
	return l.wait(ctx, c)
}
