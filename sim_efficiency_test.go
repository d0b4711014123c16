package throttle

import (
	"fmt"
	"slices"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// efficiency checks the use of the cap on a schedule whose demand
// saturates it: from two windows after the last replica joined, or after
// the last fault ended and recovered allowed for it, to a window before
// the end, the vendor's count, averaged over every millisecond, must be at
// least efficiencyFloor of what its counting allows: the window's ceiling
// at the margin, Window / (Window + margin). It looks at a sliding log or
// counter quota of calls that wait for their slots (Block or Queue, no
// deadline) and at a vendor without a cap of its own, other consumers or
// locks; a schedule whose workers cannot ask for one and a half times the
// cap, given their round trips, does not saturate it.
func efficiency(s schedule, o outcome) []string {
	from, to, ok := s.steady()
	if !ok {
		return nil
	}
	u := usedBetween(o, s.Policy.Limit, s.Policy.Window, from, to)
	ceiling := s.ceiling()
	if want := efficiencyFloor(s) * ceiling; u < want {
		return []string{fmt.Sprintf("efficiency: the fleet used %.3f of the cap from %v to %v, want at least %.3f (%.2f of the ceiling %.3f)", u, from, to, want, efficiencyFloor(s), ceiling)}
	}
	return nil
}

// ceiling is the most of the cap a saturated fleet can use: a window's
// worth in each window and its margin (the default, widened by the
// spread of two calls' round trips, each way jittered), less a counter's
// bucket.
func (s schedule) ceiling() float64 {
	c := float64(s.Policy.Window) / float64(s.Policy.Window+policies.DefaultMargin+4*s.Jitter)
	if s.Policy.Kind == "counter" {
		c *= 1 - 1/float64(policies.DefaultBuckets)
	}
	return c
}

// efficiencyFloor is the share of the ceiling a schedule must use. Costs
// settled after the call are a known shortfall (the fleet runs at 0.5 to
// 0.8 of the cap when estimates are settled, docs/TESTING.md), checked
// only against half the ceiling until the feedback that moves the calls
// booked at their estimates closes it.
func efficiencyFloor(s schedule) float64 {
	if s.Settle != "" {
		return 0.5
	}
	return 0.9
}

// steady returns the span of a run over which efficiency reads it, and
// whether it reads it at all.
func (s schedule) steady() (from, to time.Duration, ok bool) {
	if !s.saturates() {
		return 0, 0, false
	}
	from = slices.Max(s.Join) + 2*s.Policy.Window
	for _, e := range s.Events {
		from = max(from, e.end()+s.recovery())
	}
	to = s.Length - s.Policy.Window
	return from, to, to-from >= 3*s.Policy.Window
}

// saturates reports whether s is a schedule efficiency reads: a log or
// counter quota whose calls wait for their slots (Block or Queue, a
// deadline of 2 s or none), enough of them to ask for one and a half times
// the cap given their round trips, every replica calling to the end, no
// call given back (a known shortfall, docs/TESTING.md), and a vendor that
// holds no cap of its own, other consumer or lock.
func (s schedule) saturates() bool {
	if (s.Policy.Kind != "log" && s.Policy.Kind != "counter") || s.Mode == FailFast || s.Deadline != 0 && s.Deadline < 2*time.Second {
		return false
	}
	if m := s.Model; m != nil && (m.Lower > 0 || m.Other > 0 || m.Lock > 0) || s.Cancel || s.has("leave") || s.has("close") {
		return false
	}
	return s.demand() >= 1.5*float64(s.Policy.Limit)
}

// demand returns the units per window the workers could ask for at most,
// each a call at a time, a round trip to Redis and the vendor's time apart.
func (s schedule) demand() float64 {
	sum := 0.0
	for i := range s.Replicas {
		trip := 2*(s.Latency[i]+s.Jitter) + 2*s.Vendor + 6*time.Millisecond
		sum += float64(s.Workers) * float64(s.Policy.Window) / float64(trip) * float64(1+s.MaxCost) / 2
	}
	return sum
}

// usedBetween is the vendor's count over its window, as it counts it,
// averaged over every millisecond from from to to, divided by limit.
func usedBetween(o outcome, limit int, window, from, to time.Duration) float64 {
	as := slices.Clone(o.arrivals)
	slices.SortFunc(as, func(a, b simArrival) int { return int(a.at - b.at) })
	var sum, n float64
	lo, hi := 0, 0
	for t := from; t <= to; t += time.Millisecond {
		for hi < len(as) && as[hi].at <= t {
			hi++
		}
		for lo < hi && as[lo].at <= t-window {
			lo++
		}
		for _, a := range as[lo:hi] {
			sum += float64(a.counted(t))
		}
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / n / float64(limit)
}
