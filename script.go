package throttle

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/lua"
	"github.com/throttlekit/throttle/policies"
)

// Why acquire refused a call.
const (
	reasonNone = iota
	reasonTooFar
	reasonBusy // a concurrency rule is full
)

// scope is the set of Redis keys one call touches: the pause keys and the
// key of every rule, per-key rules resolved for the call's key.
type scope struct {
	keys []string // pause of the quota, pause of the key (or the quota's again), rules
}

// scopeFor resolves the keys of every rule for key k. The key is hashed so
// that tokens and tenant names never reach Redis in the clear, and every
// key of the quota carries the hash tag {name}, so one script can touch them
// all on Redis Cluster.
func (l *Limiter) scopeFor(c call) scope {
	if !l.perKey {
		return scope{keys: l.shared}
	}
	sum := sha256.Sum256([]byte(c.key))
	hashed := base64.RawURLEncoding.EncodeToString(sum[:16])
	keys := make([]string, len(l.shared))
	copy(keys, l.shared)
	if !l.hasShared {
		keys[1] = l.base + "pause:" + hashed
	}
	for i, r := range l.rules {
		if r.PerKey {
			keys[2+i] += ":" + hashed
		}
	}
	return scope{keys: keys}
}

// args builds the arguments every script takes (see lua/lib.lua): the time,
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
	args := make([]any, 0, 6+4*len(rules))
	args = append(args, now, id, cost, a, b, c)
	for _, r := range rules {
		for _, v := range r.Args() {
			args = append(args, v)
		}
	}
	return args
}

func (l *Limiter) newMember() string {
	return l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
}

type result struct {
	admitted  bool
	reason    int
	wait      time.Duration
	remaining int
	now       time.Duration // Redis time since the Unix epoch
	pause     time.Duration // Redis time until which the scope is paused, or 0
	scope     scope
	member    string
}

// slot is the Redis time of the call's booked slot.
func (r result) slot() time.Duration { return r.now + r.wait }

// acquire runs the acquire script once: it admits the call, books it within
// maxWait, or refuses it.
func (l *Limiter) acquire(ctx context.Context, c call, maxWait time.Duration) (result, error) {
	sc := l.scopeFor(c)
	member := l.newMember()
	v, err := l.run(ctx, lua.Acquire, sc, l.args(member, c.cost, maxWait.Microseconds(), 0, 0)).Int64Slice()
	if err != nil {
		return result{}, l.redisErr(err)
	}
	if len(v) != 6 {
		return result{}, fmt.Errorf("throttle: quota %q: unexpected script reply %v", l.name, v)
	}
	r := result{
		admitted:  v[0] == 1,
		wait:      time.Duration(v[1]) * time.Microsecond,
		remaining: int(v[2]),
		now:       time.Duration(v[3]) * time.Microsecond,
		reason:    int(v[4]),
		pause:     time.Duration(v[5]) * time.Microsecond,
		scope:     sc,
		member:    member,
	}
	l.notePause(sc, r.now, r.pause)
	return r, nil
}

// cancel gives a booking back so that the next caller can have the slot. It
// runs even though ctx has ended; if Redis cannot be reached the booking
// stays, which wastes its slot but never overfills a window.
func (l *Limiter) cancel(ctx context.Context, c call, r result) {
	ctx, stop := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer stop()
	_ = l.run(ctx, lua.Cancel, r.scope, l.args(r.member, c.cost, r.slot().Microseconds(), 0, 0)).Err()
}

func (l *Limiter) run(ctx context.Context, s *redis.Script, sc scope, args []any) *redis.Cmd {
	return s.Run(ctx, l.rdb, sc.keys, args...)
}

func (l *Limiter) redisErr(err error) error {
	return fmt.Errorf("throttle: quota %q: %w", l.name, err)
}

// notePause remembers, in local time, until when a scope is paused, so that
// a waiter of this process that wakes during a pause books again instead of
// calling a vendor that asked for quiet.
func (l *Limiter) notePause(sc scope, now, until time.Duration) {
	if until <= now {
		return
	}
	end := time.Now().Add(until - now)
	l.pauses.Store(sc.keys[1], end)
}

// pausedFor reports how long the scope stays paused, as this process knows.
func (l *Limiter) pausedFor(sc scope) time.Duration {
	v, ok := l.pauses.Load(sc.keys[1])
	if !ok {
		return 0
	}
	d := time.Until(v.(time.Time))
	if d <= 0 {
		l.pauses.CompareAndDelete(sc.keys[1], v)
		return 0
	}
	return d
}
