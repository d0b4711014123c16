package throttle

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/lua"
	"github.com/throttlekit/throttle/policies"
)

// Why acquire refused a call.
const (
	reasonNone = iota
	reasonTooFar
	reasonBusy // a concurrency rule is full
	reasonLate // every admission came too late to start in (decided here, not by the script)
)

// args builds the arguments every script takes (see internal/lua/lib.lua): the time,
// the call's id, its cost, three arguments of the script's own, and then
// each rule.
func (l *Limiter) args(id string, cost int, a, b, c int64) []any {
	return argsFor(l.s.clock, id, cost, a, b, c, l.rules)
}

func argsFor(clock func() time.Time, id string, cost int, a, b, c int64, rules []policies.Rule) []any {
	var now int64
	if clock != nil {
		now = clock().UnixMicro()
	}
	args := make([]any, 0, 6+5*len(rules))
	args = append(args, now, id, cost, a, b, c)
	for _, r := range rules {
		for _, v := range ruleArgs(r) {
			args = append(args, v)
		}
	}
	return args
}

// perCallFlag is added to the kind of a rule that counts each call once
// (see internal/lua/lib.lua).
const perCallFlag = 16

// ruleArgs encodes rule r as the script reads it: the kind and four
// parameters in microseconds or units (see internal/lua/lib.lua).
func ruleArgs(r policies.Rule) [5]int64 {
	us := func(d time.Duration) int64 { return d.Microseconds() }
	kind := int64(r.Kind)
	if r.PerCall {
		kind += perCallFlag
	}
	switch r.Kind {
	case policies.KindSlidingCounter:
		return [5]int64{kind, int64(r.Limit), us(r.Window), us(r.Bucket), us(r.Margin)}
	case policies.KindTokenBucket:
		return [5]int64{kind, int64(r.Limit), us(r.Every), 0, 0}
	case policies.KindConcurrency:
		return [5]int64{kind, int64(r.Limit), us(r.Lease), 0, 0}
	}
	return [5]int64{kind, int64(r.Limit), us(r.Window), 0, us(r.Margin)}
}

type result struct {
	admitted  bool
	reason    int
	wait      time.Duration
	remaining int
	now       time.Duration // Redis time since the Unix epoch
	done      time.Duration // Redis time the script ended
	pause     time.Duration // Redis time until which the scope is paused, or 0
	scope     scope
	member    string
	cost      int           // the units booked
	epoch     int64         // the quota's epoch when the call was decided
	margin    time.Duration // the smallest guarded margin in force, 0 for none
	stale     bool          // decided by a Redis clock that had just stepped forward
	local     bool          // decided without Redis (FailOpen, Local)
}

// slot is the Redis time of the call's booked slot.
func (r result) slot() time.Duration { return r.now + r.wait }

// startsAt is the Redis time from which the call can start: its slot, or
// the end of the script that admitted it, if later. The script's own time
// is not the caller's lateness: it stays under a millisecond on Redis at
// every policy's bounds.
func (r result) startsAt() time.Duration { return max(r.slot(), r.done) }

// cancel gives a booking back so that the next caller can have the slot. It
// runs even though ctx has ended; if Redis cannot be reached the booking
// stays, which wastes its slot but never overfills a window.
func (l *Limiter) cancel(ctx context.Context, c call, r result) {
	if r.local {
		if l.local != nil {
			l.local.forget(r.scope, r.member)
		}
		return
	}
	_ = l.run(context.WithoutCancel(ctx), lua.Cancel, r.scope, l.args(r.member, c.cost, r.slot().Microseconds(), r.epoch, 0)).Err()
}

// run runs a script with the limiter's Redis timeout. go-redis sends
// EVALSHA, and EVAL when Redis does not know the script yet: a fleet on a
// Redis that has the script sends only its SHA, however many replicas start
// at once.
func (l *Limiter) run(ctx context.Context, s *redis.Script, sc scope, args []any) *redis.Cmd {
	ctx, cancel := context.WithTimeout(ctx, l.s.redisTimeout)
	defer cancel()
	return s.Run(ctx, l.rdb, sc.keys, args...)
}

// unavailable wraps an error of Redis, or of the way to it.
func (l *Limiter) unavailable(err error) error {
	return &UnavailableError{Quota: l.name, Err: err}
}
