package throttle

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sync/atomic"
	"time"
)

type permitKey struct{}

// withPermit returns a copy of ctx that carries p, for PermitFrom: Do and
// Go give their fn such a context, and Transport sends each request with
// one. Use it in a wrapper of your own that takes calls through Acquire.
// When ctx carries a permit of Track, that permit stands for p from now on.
func withPermit(ctx context.Context, p *Permit) context.Context {
	if t := PermitFrom(ctx); t != nil && t.tracking && p != nil && !p.tracking {
		t.sent.Store(p)
	}
	return context.WithValue(ctx, permitKey{}, p)
}

// Track returns a copy of ctx, and a permit that stands for the call made
// with it: the permit a Transport sends a request of that context with (of
// the last request, when the request is sent again), or that Do or Go runs
// fn with. Code that calls a vendor through an SDK settles the call from
// the SDK's typed result so, without the raw response.
//
// opts apply to every request sent with the context through a Transport,
// on every try the SDK makes, on top of the Transport's Key, Cost and
// Priority: each given here wins. A caller who knows a call's estimate from
// the parameters it gives the SDK (an LLM's max_tokens and prompt) sets it
// once here. Do, Go, Acquire and Allow take their options as arguments.
//
//	ctx, call := throttle.Track(ctx, throttle.CostIn("output_tokens", int(params.MaxTokens)))
//	msg, err := client.Messages.New(ctx, params) // over a throttle.Transport
//	if err == nil {
//		err = call.Settle(ctx, throttle.CostIn("output_tokens", int(msg.Usage.OutputTokens)))
//	}
//
// Before a call is made, the permit's methods that tell the quota
// something (Settle, Cancel, Extend, Heard) fail with an error that says
// so, and the others do nothing. Track one call at a time with each
// context it returns: of calls made at once, it stands for the last to
// leave.
func Track(ctx context.Context, opts ...CallOption) (context.Context, *Permit) {
	if len(opts) > 0 {
		ctx = context.WithValue(ctx, optionsKey{}, slices.Clone(opts))
	}
	p := &Permit{tracking: true}
	return context.WithValue(ctx, permitKey{}, p), p
}

// errNotSent is what a permit of Track answers before its call is made.
var errNotSent = errors.New("no call was made with the context of this permit (Track) yet")

// acting returns the permit that method acts on (see target), or an error
// naming method when there is none.
func (p *Permit) acting(method string) (*Permit, error) {
	if t := p.target(); t != nil && t.l != nil {
		return t, nil
	}
	if p != nil && p.tracking {
		return nil, fmt.Errorf("throttle: %s: %w", method, errNotSent)
	}
	return nil, fmt.Errorf("throttle: %s: the permit is nil", method)
}

// target returns the permit p's methods act on: p, or, for a permit of
// Track, the permit of the call made with its context (nil before one).
func (p *Permit) target() *Permit {
	if p == nil || !p.tracking {
		return p
	}
	return p.sent.Load()
}

// PermitFrom returns the permit of the call that Do or Go runs with ctx, or
// that a Transport sends a request with, or that Track stands for; nil
// for any other context.
//
//	reply, err := throttle.Do(ctx, lim, func(ctx context.Context) (*Reply, error) {
//		reply, err := llm.Complete(ctx, prompt)
//		if err == nil {
//			err = throttle.PermitFrom(ctx).Settle(ctx, throttle.Cost(reply.Usage.TotalTokens))
//		}
//		return reply, err
//	}, throttle.Cost(estimate))
func PermitFrom(ctx context.Context) *Permit {
	p, _ := ctx.Value(permitKey{}).(*Permit)
	return p
}

// Permit is the right to make one call. Release it when the call is done.
type Permit struct {
	l        *Limiter
	call     call
	r        result
	held     int // concurrency units taken, whatever Settle does to the cost
	waited   time.Duration
	released atomic.Bool
	// How late after its slot the call started, as the last Start (or
	// Acquire) before Release saw it, which Release notes; noLate when not
	// known.
	late atomic.Int64
	// A permit of Track stands for sent, the permit of the last call made
	// with its context (see withPermit).
	tracking bool
	sent     atomic.Pointer[Permit]
}

// noLate is a Permit's late when how late its call started is not known.
const noLate = math.MinInt64

func (l *Limiter) permit(c call, r result, waited time.Duration) *Permit {
	p := &Permit{l: l, call: c, r: r, held: c.cost, waited: waited}
	p.late.Store(noLate)
	return p
}

// cost returns the units the call counts for: its Cost, or what Settle set.
func (p *Permit) cost() int {
	if p = p.target(); p == nil {
		return 0
	}
	return p.call.cost
}

// remaining returns how many units the quota had free now under its
// tightest limit right after it admitted the call, as Decision.Remaining
// says, or -1 when unknown (a call admitted without Redis).
func (p *Permit) remaining() int {
	if p = p.target(); p == nil || p.r.local || !p.r.admitted {
		return -1
	}
	return p.r.remaining
}

// Release ends the call. It frees the call's slots under a
// policies.Concurrency; a sliding window or a token bucket counts the call
// whatever happens, so for them Release marks the permit used. Release
// also notes how late after its slot the call started (see Start), for the
// spread the fleet's margin follows. Calling it more than once is
// harmless.
func (p *Permit) Release() {
	if p = p.target(); p == nil || p.l == nil || p.released.Swap(true) {
		return
	}
	if late := p.late.Load(); late != noLate {
		p.l.lates.note(time.Duration(late))
	}
	if !p.l.cfg.hasConc {
		return
	}
	if p.r.local {
		// The call ran: its units still count in every window; only its
		// concurrency slots free.
		if p.l.failover.local != nil {
			p.l.failover.local.release(p.r.scope, p.r.member)
		}
		p.l.signalFreed()
		return
	}
	p.releaseInRedis()
}

// releaseInRedis frees the permit's concurrency slots in Redis. If Redis
// cannot be reached, the slots free themselves when the lease ends.
func (p *Permit) releaseInRedis() {
	ctx, stop := context.WithTimeout(context.Background(), cleanupTimeout)
	defer stop()
	_ = p.l.run(ctx, scripts.release, p.r.scope, p.l.releaseArgs(p.r.member, p.held, 0)).Err()
	p.l.signalFreed()
}

// releaseWithin releases the permit as Release does, but waits for Redis no
// longer than ctx allows: Do returns by its caller's deadline even when
// Redis stops answering while the call runs, and the release goes on
// without it.
func (p *Permit) releaseWithin(ctx context.Context) {
	if p == nil || p.l == nil || !p.l.cfg.hasConc || p.r.local {
		p.Release()
		return
	}
	p.l.within(ctx, p.Release)
}

// Cancel gives the call back when it was not made after all (the request
// never left, the job was dropped before it ran): its units, and its call
// under policies.PerCall limits, no longer count, and its concurrency slots
// are free. A call that reached the vendor must not be cancelled, since the
// vendor counted it; use Settle for what it cost. Cancel releases the
// permit; calling it again, or after Release, does nothing more.
func (p *Permit) Cancel(ctx context.Context) error {
	p, err := p.acting("Cancel")
	if err != nil {
		return err
	}
	if p.released.Swap(true) {
		return nil
	}
	defer p.l.signalFreed()
	if p.r.local {
		if p.l.failover.local != nil {
			p.l.failover.local.forget(p.r.scope, p.r.member)
		}
		return nil
	}
	if err := p.l.runBooking(ctx, scripts.cancel, p.r, p.l.cancelArgs(p.r, p.l.costArg(p.call.cost, p.call.named))).Err(); err != nil {
		return p.l.unavailable(err)
	}
	if p.l.cfg.hasConc && p.held != p.call.cost {
		// Settle changed the cost: the slots held are still the first.
		_ = p.l.run(ctx, scripts.release, p.r.scope, p.l.releaseArgs(p.r.member, p.held, 0)).Err()
	}
	return nil
}

// Extend renews the lease of the call's concurrency slots for a call that
// runs longer than policies.Concurrency.Lease: the slots stay taken for
// lease from now. It does nothing for a quota without a Concurrency policy.
func (p *Permit) Extend(ctx context.Context, lease time.Duration) error {
	p, err := p.acting("Extend")
	if err != nil {
		return err
	}
	if !p.l.cfg.hasConc {
		return nil
	}
	if lease < time.Millisecond {
		return fmt.Errorf("throttle: quota %q: Extend: lease must be at least 1ms, got %v", p.l.name, lease)
	}
	if p.released.Load() {
		return fmt.Errorf("throttle: quota %q: Extend: permit already released", p.l.name)
	}
	if p.r.local {
		return nil // a slot held without Redis lasts until Release
	}
	held, err := p.l.run(ctx, scripts.release, p.r.scope, p.l.releaseArgs(p.r.member, p.held, lease)).Int64()
	if err != nil {
		return p.l.unavailable(err)
	}
	if held == 0 {
		return fmt.Errorf("throttle: quota %q: Extend: the lease had already run out", p.l.name)
	}
	return nil
}

// Settle replaces the costs the call was admitted with by what the vendor
// actually counted, for costs known only afterwards (LLM tokens, GraphQL
// points), given as the call's own were: Cost for its units, CostIn for
// those of a named unit (policies.Unit). A cost actual leaves out keeps
// what it was. The difference is refunded or charged in the same windows,
// at the call's slot, so that the shared count matches the vendor's, in
// one script call. A charge may take a window past its limit, since the
// vendor counted those units already: later calls then wait for them.
// Settle can be called again; each call replaces the costs before it. A
// cost must not be negative; one above the smallest limit of its unit
// counts as that limit, since a window holds no more. A Permit's methods
// are for the goroutine that holds it; Release and Start may be called
// from anywhere.
//
//	err = call.Settle(ctx, throttle.Cost(int(completion.Usage.TotalTokens)))
//	err = call.Settle(ctx, throttle.CostIn("input_tokens", in), throttle.CostIn("output_tokens", out))
func (p *Permit) Settle(ctx context.Context, actual ...CallOption) error {
	given := callOf(actual)
	if given.hasKey || given.priority != 0 {
		return fmt.Errorf("throttle: Settle takes Cost and CostIn only: a Key or a Priority stays the call's")
	}
	costs := maps.Clone(given.named)
	if given.hasCost {
		if costs == nil {
			costs = map[string]int{}
		}
		costs[""] = given.cost
	}
	return p.settle(ctx, costs)
}

// settle settles the costs in actual: "" the call's units, any other name
// its units of that unit.
func (p *Permit) settle(ctx context.Context, actual map[string]int) error {
	p, err := p.acting("Settle")
	if err != nil {
		return err
	}
	to := p.call
	to.named = maps.Clone(p.call.named)
	for name, n := range actual {
		most, ok := p.l.cfg.unitMax[name]
		switch {
		case name == "":
			most, ok = p.l.cfg.maxCost, true
		case !ok:
			return fmt.Errorf("throttle: quota %q: Settle: no policy counts unit %q (its units: %s)", p.l.name, name, p.l.unitList())
		}
		if n < 0 {
			return fmt.Errorf("throttle: quota %q: Settle: actual cost must not be negative, got %d for unit %q", p.l.name, n, name)
		}
		if name == "" {
			to.cost = min(n, most)
		} else {
			to.named[name] = min(n, most)
		}
	}
	if p.r.local || to.cost == p.call.cost && maps.Equal(to.named, p.call.named) {
		// A call decided without Redis has nothing in Redis to settle.
		return nil
	}
	args := p.l.settleArgs(p.r, p.l.costArg(p.call.cost, p.call.named), p.l.costArg(to.cost, to.named))
	if err := p.l.runBooking(ctx, scripts.settle, p.r, args).Err(); err != nil {
		return p.l.unavailable(err)
	}
	p.call.cost, p.call.named = to.cost, to.named
	return nil
}
