package throttle

import (
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
)

// What the vendor sees is not when Redis admitted a call but when the call
// arrives. Between the two lie the trip of Redis's reply back to the caller,
// the caller's timer and scheduler, and the way to the vendor. A delay that
// every call shares does no harm: a Redis 50 ms away shifts every arrival by
// the same 50 ms and keeps the calls as far apart as their slots. What can
// put two calls closer together at the vendor than at Redis is the spread of
// that delay, and the window's Margin is there to absorb it.
//
// So a call's lateness is measured against the usual delay, not against
// zero: it is how much later than the fastest reply this process has seen
// the call starts after its slot. The clocks of this process and of Redis
// need not agree: a reply that left Redis at Redis time now and arrived at
// local time recvd gives recvd - now, the one-way delay plus the offset of
// the two clocks; the least such value over recent replies is the fastest
// delay plus the same offset, and the offset cancels out in the difference.
// Local times are read from the monotonic clock, so a step of this machine's
// wall clock changes nothing.

// timingPeriod is how long a reading counts towards the fastest reply and
// the spread: a reading is forgotten after one to two periods.
const timingPeriod = 10 * time.Second

// clockStep is the least change between the clocks of Redis and of this
// process that counts as a step rather than as the drift of two clocks.
const clockStep = time.Millisecond

// minStep is the least forward step of Redis's clock that counts as a loss
// of the quota's data, whatever the margin: two machines' clocks drift
// apart by about a millisecond in the periods a reading is kept.
const minStep = 5 * time.Millisecond

// lateBuckets is how many buckets of lateness a process reports: bucket 0
// holds latenesses under 1ms, bucket k those under 2^(k/2) ms, the last one
// all the rest (see note_timing in lua/lib.lua).
const lateBuckets = protocol.LateBuckets

// timing keeps what a limiter needs to tell how late its calls start: the
// fastest reply of recent periods; and the latenesses of its calls since it
// last reported them to the fleet.
type timing struct {
	mu     sync.Mutex
	origin time.Time // local times are durations since origin, on the monotonic clock
	clock  func() time.Time

	periodAt time.Duration // local time the current period began
	fast     [2]minimum    // least recvd - Redis now, this period and the last
	ahead    [2]minimum    // least Redis now - asked
	trip     [2]minimum    // least round trip, the script's own time left out
	readings int           // replies observed since the last reset
	before   minimum       // least round trip before the last reset (see unsure)
	resetAt  time.Duration // local time of the last reset
	steps    uint64        // forward steps of Redis's clock seen
	stepBy   time.Duration // the size of the last one
	stepAt   time.Duration // the Redis time, by the new clock, of the reply that showed it
	last     time.Duration // local time of the latest reply observed
}

// lates counts how late a limiter's calls started since it last reported
// them to the fleet, by bucket (see lateBuckets), without a lock: a call
// noted while a report is read counts in this report or the next.
type lates struct {
	n   [lateBuckets]atomic.Int64
	max atomic.Int64 // the latest of them, in nanoseconds
}

// minReadings is how many replies a process observes before it tells the
// fleet its usual delay: the first ones may include opening a connection.
const minReadings = 5

// timings shares one timing among the limiters of a process that talk to
// the same Redis server through plain clients: a limiter that makes a call a
// second learns the usual delay from all of them, not from its own few
// replies, which a busy moment may all have slowed.
var timings sync.Map // server address -> *timing

type minimum struct {
	v   time.Duration
	set bool
}

func (m *minimum) add(v time.Duration) {
	if !m.set || v < m.v {
		m.v, m.set = v, true
	}
}

func newTiming(clock func() time.Time) *timing {
	return &timing{origin: time.Now(), clock: clock}
}

// timingFor returns the timing of a limiter on rdb: the one shared by every
// limiter of the process on the same server when rdb is a plain client,
// else one of its own (a cluster's nodes, a failover's masters, each have a
// clock of their own).
func timingFor(rdb redis.UniversalClient, clock func() time.Time) *timing {
	c, ok := rdb.(*redis.Client)
	if !ok || clock != nil {
		return newTiming(clock)
	}
	// A FailoverClient is a Client whose Addr names no server: the master
	// it talks to changes.
	o := c.Options()
	if !strings.Contains(o.Addr, ":") && !strings.HasPrefix(o.Addr, "/") {
		return newTiming(nil)
	}
	k, _ := timings.LoadOrStore(o.Network+"/"+o.Addr, newTiming(nil))
	return k.(*timing)
}

// now returns the local time, on the monotonic clock.
func (k *timing) now() time.Duration { return time.Since(k.origin) }

// roll starts a new period when the current one is over. k.mu is held.
func (k *timing) roll(at time.Duration) {
	if at-k.periodAt < timingPeriod {
		return
	}
	k.periodAt = at
	for _, m := range []*[2]minimum{&k.fast, &k.ahead, &k.trip} {
		m[1], m[0] = m[0], minimum{}
	}
}

// observe records a reply that Redis sent at Redis time redisNow, for a
// request sent at local time asked and answered at local time recvd.
//
// The script ran from Redis time began to Redis time redisNow; that part of
// the round trip is Redis's work, not the way to it. It reports whether
// the reply showed the clocks moved back, and when the reply before it
// came (see hiddenStep).
func (k *timing) observe(began, redisNow, asked, recvd time.Duration) (back bool, prev time.Duration) {
	if k.clock != nil {
		return false, 0 // the time is given: lateness is read off that clock
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.roll(recvd)
	off, rtt := recvd-redisNow, recvd-asked
	k.readings++
	prev, k.last = k.last, max(k.last, recvd)
	// The reply's delay is between zero and the round trip, so the offset
	// of the clocks lies within [off - rtt, off]; each reading narrows it.
	// A reading that falls outside what the others allow means that the
	// clocks moved against each other (Redis's clock stepped, a failover to
	// a server whose clock differs): what was known no longer holds.
	fast, okF := least(k.fast)
	ahead, okA := least(k.ahead)
	if okF && off-rtt > fast+clockStep || okA && off < -ahead-clockStep {
		if okA && off < -ahead-clockStep {
			// Redis's clock is ahead of where it can be: it stepped forward,
			// and windows measured by it end early.
			k.stepped(-ahead-off, redisNow)
		} else {
			back = true
		}
		k.keepTrip(recvd)
		k.fast, k.ahead, k.trip = [2]minimum{}, [2]minimum{}, [2]minimum{}
		k.readings = 1
	}
	k.fast[0].add(off)
	k.ahead[0].add(redisNow - asked)
	k.trip[0].add(rtt - (redisNow - began))
	return back, prev
}

// hiddenStep counts a forward step that a step back hid. A reply that
// shows the clocks moved back, to a process with no reply since before,
// shows only the sum of what Redis's clock did meanwhile: an hour back,
// then a second forward, reads as a step back. Redis counted the step
// back as a loss (its epoch, lostAt by the new clock, newer than the
// limiter's last reply saw) after the reply before this one (at local
// time prev); so no more time can have passed since the loss than since
// that reply, and a clock further past the loss than that stepped forward
// after it, by the difference (seed 720739: 6 in a window of 5). A reply
// of the same epoch as the last (a failover to a server whose clock is
// behind) is not read so: its loss may be hours old.
func (k *timing) hiddenStep(redisNow, lostAt, prev, asked, recvd time.Duration) {
	by := redisNow - lostAt - (recvd - prev) - (recvd - asked)
	if lostAt <= 0 || by <= clockStep || isOff(offHiddenSteps) {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.stepped(by, redisNow)
}

// stepped counts a forward step of Redis's clock by by, shown by a reply
// at Redis time at (by the new clock); mu is held.
func (k *timing) stepped(by, at time.Duration) {
	k.steps++
	k.stepBy, k.stepAt = by, at
}

// keepTrip keeps the least round trip known before a reset at local time
// at: the way to Redis does not change when its clock steps, and unsure
// compares the readings after the reset with it. k.mu is held.
func (k *timing) keepTrip(at time.Duration) {
	before := k.before
	if at-k.resetAt >= 2*timingPeriod {
		before = minimum{}
	}
	if t, ok := least(k.trip); ok {
		before.add(t)
	}
	k.before, k.resetAt = before, at
}

// unsure returns how much later than the fastest reply's delay a call may
// start without lateness telling: after the clocks stepped, the readings
// begin anew, and if the first of them all came slow (a stalled link, a
// starved process), the fastest of them is that much slower than the way
// to Redis, and a call that wakes by it starts that much late unseen (seed
// 65003: a step back of Redis's clock, then replies half a second slow; once
// they were fast again, a call woke half a second after its slot, and 11
// calls reached the vendor in a window of 10). The way to Redis has not
// changed with its clock: the least round trip since the reset (the
// scripts' own time left out, as before it), beyond the least round trip
// before it, is what the readings may hide, until a reply as fast as before
// shows it, or the readings before the reset are two periods old (a
// failover to a server farther away, whose clock differs, is doubted that
// long: its calls book again, and fail as too late after 3 tries).
func (k *timing) unsure() time.Duration {
	if k.clock != nil || isOff(offDoubt) {
		return 0
	}
	at := k.now()
	k.mu.Lock()
	defer k.mu.Unlock()
	trip, ok := least(k.trip)
	if !k.before.set || !ok || at-k.resetAt >= 2*timingPeriod {
		return 0
	}
	return max(trip-k.before.v, 0)
}

// fastest returns the least recvd - Redis now of the last two periods.
// k.mu is held.
func (k *timing) fastest() (time.Duration, bool) { return least(k.fast) }

// least returns the lesser of a minimum of this period and the last.
func least(m [2]minimum) (time.Duration, bool) {
	a, b := m[0], m[1]
	switch {
	case a.set && b.set:
		return min(a.v, b.v), true
	case a.set:
		return a.v, true
	case b.set:
		return b.v, true
	}
	return 0, false
}

// lateness returns how late after the Redis time slot a call starting now
// starts, beyond the fastest reply's delay; false before any reading.
func (k *timing) lateness(slot time.Duration) (time.Duration, bool) {
	if k.clock != nil {
		return time.Duration(k.clock().UnixMicro())*time.Microsecond - slot, true
	}
	at := k.now()
	k.mu.Lock()
	defer k.mu.Unlock()
	fast, ok := k.fastest()
	if !ok {
		return 0, false
	}
	return at - slot - fast, true
}

// wakeIn returns how long from now until a call whose slot starts at Redis
// time at starts with no lateness: at that local time, a reply sent at the
// slot by the fastest way seen would just have arrived, so Redis's clock has
// passed the slot (by that way's delay, less the drift of the two clocks
// since that reply: under a millisecond in the two periods a reading is
// kept, and a step resets the readings; see observe): the lateness of a
// call starting now, negated. A call that sleeps its wait from when a slow
// reply arrived starts late by all the reply's delay beyond the fastest;
// waking by this clock starts it on time however late its reply came.
// False before any reading, or when the time is given.
func (k *timing) wakeIn(at time.Duration) (time.Duration, bool) {
	if k.clock != nil {
		return 0, false
	}
	late, ok := k.lateness(at)
	return -late, ok
}

// redisAt returns an estimate of Redis's clock at the local time at that is
// never behind it: a request sent at local time asked reached Redis no
// earlier than asked, so Redis's clock runs at most (Redis now - asked)
// ahead of ours, the least of which is closest.
func (k *timing) redisAt(at time.Time) (time.Duration, bool) {
	if k.clock != nil {
		return time.Duration(k.clock().UnixMicro())*time.Microsecond - time.Since(at), true
	}
	local := k.now() - time.Since(at)
	k.mu.Lock()
	defer k.mu.Unlock()
	ahead, ok := least(k.ahead)
	if !ok {
		return 0, false
	}
	return local + ahead, true
}

// note records how late a call started, for the fleet's spread.
func (c *lates) note(late time.Duration) {
	b := 0
	if late >= time.Millisecond {
		b = min(int(2*math.Log2(float64(late)/float64(time.Millisecond)))+1, lateBuckets-1)
	}
	c.n[b].Add(1)
	raise(&c.max, int64(late))
}

// latest returns the latest of the latenesses noted since the last report.
func (c *lates) latest() time.Duration { return time.Duration(c.max.Load()) }

// report returns the latenesses noted since the last report, as the script
// takes them: n calls in bucket k, for each bucket that holds some.
func (c *lates) report() []protocol.Late {
	var out []protocol.Late
	c.max.Store(0)
	for i := range c.n {
		if n := c.n[i].Swap(0); n > 0 {
			out = append(out, protocol.Late{Bucket: int64(i), N: n})
		}
	}
	return out
}

// step returns how many forward steps of Redis's clock this process has
// seen, the size of the last one, and the Redis time (by the new clock)
// of the reply that showed it.
func (k *timing) step() (seq uint64, by, at time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.steps, k.stepBy, k.stepAt
}

// delay returns this process's usual one-way delay from Redis, half its
// shortest round trip, or -1 while it has seen too few replies to tell.
// Latenesses are measured from this process's usual delay; the delays of
// the processes differ by as much again, which the fleet adds to the spread.
func (k *timing) delay() time.Duration {
	k.mu.Lock()
	defer k.mu.Unlock()
	if trip, ok := least(k.trip); ok && k.readings >= minReadings {
		return max(trip, 0) / 2
	}
	return -time.Microsecond
}
