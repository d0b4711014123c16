package throttle

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"strconv"
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

// scope is the set of Redis keys one call touches: the pause keys and the
// key of every rule, per-key rules resolved for the call's key.
type scope struct {
	id   string   // the hashed key, or "" for a call that touches shared rules only
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
	return scope{id: hashed, keys: keys}
}

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

func (l *Limiter) newMember() string {
	return l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
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

// notePause remembers, in local time, until when a scope is paused, so that
// a waiter of this process that wakes during a pause books again instead of
// calling a vendor that asked for quiet.
//
// Pauses that ended are swept now and then, so that the memory of a quota
// with many keys paused once does not only grow.
func (l *Limiter) notePause(sc scope, now, until time.Duration) {
	if until <= now {
		return
	}
	p := pauseEnd{local: time.Now().Add(until - now), until: until}
	if old, had := l.pauses.Load(sc.keys[1]); had && old.(pauseEnd).until >= until {
		// Each reply restates a pause it knows; the first news of it
		// stands, however long its trip took.
		return
	}
	if _, had := l.pauses.Swap(sc.keys[1], p); !had && l.pausesAdded.Add(1)%pauseSweep == 0 {
		t := time.Now()
		l.pauses.Range(func(k, v any) bool {
			if !v.(pauseEnd).local.After(t) {
				l.pauses.CompareAndDelete(k, v)
			}
			return true
		})
	}
}

// pauseEnd is the end of a pause, in local time and in Redis time.
type pauseEnd struct {
	local time.Time
	until time.Duration
}

// pauseSweep is how many pauses are noted between two sweeps of the ended
// ones.
const pauseSweep = 256

// noteEpoch remembers the quota's epoch. A new one means Redis lost the
// quota's data: calls sleeping towards slots booked before then book again,
// since the new data knows nothing of them.
func (l *Limiter) noteEpoch(epoch int64, lost bool) {
	if old := l.epoch.Swap(epoch); old != epoch && old != 0 {
		l.scripts.Store(0)
		l.s.logger.Warn("throttle: Redis lost the quota's data; every limit counts as full for one window",
			"quota", l.name, "old_epoch", old, "epoch", epoch, "detected_here", lost)
		l.emit(Event{Kind: EventDataLost})
	}
}

// noteScripts remembers the quota's count of scripts run in its epoch (a
// new one when newEpoch), so that a Redis whose count goes back (a replica
// that missed the latest writes) is found out by the script.
func (l *Limiter) noteScripts(newEpoch bool, n int64) {
	if newEpoch {
		l.scripts.Store(n)
		return
	}
	for {
		old := l.scripts.Load()
		if n <= old || l.scripts.CompareAndSwap(old, n) {
			return
		}
	}
}

// pausedPast reports whether a pause this process knows of, not over yet,
// ends after the Redis time slot: a call booked at slot before the pause
// was known must not go ahead. A pause that ends at the slot or before it
// is one the booking already kept.
func (l *Limiter) pausedPast(sc scope, slot time.Duration) bool {
	now := time.Now()
	for _, k := range sc.keys[:2] {
		if v, ok := l.pauses.Load(k); ok {
			p := v.(pauseEnd)
			if p.local.After(now) && p.until > slot {
				return true
			}
		}
	}
	return false
}
