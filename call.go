package throttle

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// A CallOption describes one call: who it is for and what it costs.
type CallOption func(*call)

// Key names who the call is for: a tenant, a user, an API token. It selects
// the quota of every policies.PerKey limit; limits that are not per key ignore
// it. The key is hashed before it reaches Redis, so it may hold secrets and
// be of any length.
func Key(k string) CallOption { return func(c *call) { c.key, c.hasKey = k, true } }

// Cost makes the call count as n units (a batch of n messages, n tokens).
// The default is 1; n must be between 1 and the smallest Limit of the quota.
func Cost(n int) CallOption { return func(c *call) { c.cost, c.hasCost = n, true } }

// costKey is the context key of WithCost.
type costKey struct{}

// WithCost returns a context whose requests, sent through a Transport,
// cost n units, on every try an SDK sends; Transport.Cost is not called. A caller of an SDK who knows the call's
// estimate from the parameters it passes (an LLM's max_tokens and
// prompt) sets it once, where the Transport would read and parse the
// request's body again on each try. Combined with Track:
//
//	ctx, call := throttle.Track(throttle.WithCost(ctx, estimate))
func WithCost(ctx context.Context, n int) context.Context {
	return context.WithValue(ctx, costKey{}, n)
}

// CostFrom returns the cost WithCost put in ctx, and whether there is one.
func CostFrom(ctx context.Context) (int, bool) {
	n, ok := ctx.Value(costKey{}).(int)
	return n, ok
}

// Priority orders calls in the queue of a limiter in Queue mode: higher
// values run first, calls of equal priority in arrival order. The default is
// 0. Other modes ignore it.
func Priority(p int) CallOption { return func(c *call) { c.priority = p } }

type call struct {
	key      string
	hasKey   bool
	cost     int
	hasCost  bool // Cost was given: Permit.Heard reads the vendor's tokens as the call's units
	priority int
	// lead is how far ahead of now the call asks for its slot: a slot
	// whose reply came back too late to start in is booked again this much
	// later, so that the next reply arrives before it.
	lead time.Duration
	// queued is when the call entered the local queue (Queue mode), or
	// zero once it asked Redis (see failedWhileQueued).
	queued time.Time
	// moves says that the booking given back with the call is its own,
	// asked to move earlier (move.go): the script keeps its slot when
	// nothing earlier fits.
	moves bool
}

// callOf applies a call's options to the defaults.
func callOf(opts []CallOption) call {
	c := call{cost: 1}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	return c
}

// newCall reads and checks a call's options.
func (l *Limiter) newCall(opts []CallOption) (call, error) {
	c := callOf(opts)
	if err := l.made(); err != nil {
		return c, err
	}
	switch {
	case c.cost <= 0:
		return c, fmt.Errorf("throttle: quota %q: Cost must be > 0, got %d", l.name, c.cost)
	case c.cost > l.maxCost:
		return c, fmt.Errorf("throttle: quota %q: Cost %d exceeds %s and could never run", l.name, c.cost, l.maxCostIs)
	case l.perKey && !c.hasKey:
		return c, fmt.Errorf("throttle: quota %q has a per-key limit: the call needs a Key", l.name)
	case c.hasKey && !l.perKey:
		return c, fmt.Errorf("throttle: quota %q: Key %q given, but no policy is a policies.PerKey: every key would share one quota", l.name, redactKey(c.key))
	case l.closed.Load():
		return c, quotaErr(l.name, ErrClosed, "limiter closed")
	}
	return c, nil
}

// redactKey shows the start of a key, which may be a secret (an API token).
func redactKey(k string) string {
	if len(k) <= 4 {
		return strings.Repeat("*", len(k))
	}
	return k[:4] + "…"
}
