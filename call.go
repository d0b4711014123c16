package throttle

import (
	"context"
	"errors"
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

// optionsKey is the context key of the options Track gives a context.
type optionsKey struct{}

// optionsFrom returns the options Track gave ctx, and whether
// there are any.
func optionsFrom(ctx context.Context) ([]CallOption, bool) {
	opts, ok := ctx.Value(optionsKey{}).([]CallOption)
	return opts, ok
}

// CostIn makes the call cost n units of the unit name, under the rules of
// a policies.Unit of that name; n must be between 0 and the smallest limit
// of those rules. A call of a quota that counts named units must give the
// cost of each; its Cost counts under the other rules.
func CostIn(name string, n int) CallOption {
	return func(c *call) {
		if c.named == nil {
			c.named = map[string]int{}
		}
		c.named[name] = n
	}
}

// Priority ranks the call among the quota's calls, fleet-wide. Each
// priority is a class of calls whose share of a full quota every replica
// holds for it: lower priorities book only what the higher ones leave,
// less the share those booked (or asked for and waited) in the last window
// and a half, so that a higher-priority call finds room when it comes.
// Every class keeps a tenth of each limit, so none starves. In Queue mode
// it also orders the local queue: higher values run first, calls of equal
// priority in arrival order. The default is 0; Options.ArrivalOrder serves
// the limiter's calls first come, first served instead (docs/PROTOCOL.md,
// 3.13).
func Priority(p int) CallOption { return func(c *call) { c.priority = p } }

type call struct {
	key      string
	hasKey   bool
	cost     int
	hasCost  bool           // Cost was given: Permit.Heard reads the vendor's tokens as the call's units
	named    map[string]int // its costs in named units (CostIn), nil for none
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
	// moved is the failure of the call's last move, which bounds how
	// long its next script call may wait for Redis (see moveFailed).
	moved *moveFailed
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
	case c.cost > l.cfg.maxCost:
		return c, fmt.Errorf("throttle: quota %q: Cost %d exceeds %s and could never run", l.name, c.cost, l.cfg.maxCostIs)
	case l.cfg.perKey && !c.hasKey:
		return c, fmt.Errorf("throttle: quota %q has a per-key limit: the call needs a Key", l.name)
	case c.hasKey && !l.cfg.perKey:
		return c, fmt.Errorf("throttle: quota %q: Key %q given, but no policy is a policies.PerKey: every key would share one quota", l.name, redactKey(c.key))
	case l.closed.Load():
		return c, quotaErr(l.name, ErrClosed, "limiter closed")
	}
	return c, l.checkNamed(c.named)
}

// checkNamed checks a call's costs in named units: each counted by the
// quota, within the smallest limit of the rules that count it, and one
// for each unit the quota counts.
func (l *Limiter) checkNamed(named map[string]int) error {
	for name, n := range named {
		most, ok := l.cfg.unitMax[name]
		switch {
		case !ok:
			return fmt.Errorf("throttle: quota %q: CostIn(%q, %d): no policy counts unit %q (its units: %s)", l.name, name, n, name, l.unitList())
		case n < 0:
			return fmt.Errorf("throttle: quota %q: CostIn(%q, %d): a cost must not be negative", l.name, name, n)
		case n > most:
			return fmt.Errorf("throttle: quota %q: CostIn(%q, %d) exceeds the limit %d of unit %q and could never run", l.name, name, n, most, name)
		}
	}
	for _, name := range l.cfg.units {
		if _, ok := named[name]; !ok {
			return fmt.Errorf("throttle: quota %q counts unit %q (policies.Unit): the call needs CostIn(%q, n): %w", l.name, name, name, errNoUnitCost)
		}
	}
	return nil
}

// errNoUnitCost is why a call that gives no cost in a unit its quota
// counts fails; Usage, which reads the quota, needs none.
var errNoUnitCost = errors.New("no cost given in a counted unit")

// unitList names the units the quota counts, for an error.
func (l *Limiter) unitList() string {
	if len(l.cfg.units) == 0 {
		return "none"
	}
	return strings.Join(l.cfg.units, ", ")
}

// redactKey shows the start of a key, which may be a secret (an API token).
func redactKey(k string) string {
	if len(k) <= 4 {
		return strings.Repeat("*", len(k))
	}
	return k[:4] + "…"
}
