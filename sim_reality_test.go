package throttle

import (
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

// TestSim_AgainstTheConditionsFleets runs in the simulation the fault-free
// fleets that bench/conditions runs on a real redis-server (fleet-d0,
// fleet-d25, fleet-d50: 3 replicas × 20 workers, a sliding log of 100 per
// second, Redis 0, 25 and 50 ms away with a jitter of ±5 ms, the vendor
// answering after 10 ms, 10 s), and prints the two figures the program
// prints for them: the vendor's window count averaged over every
// millisecond, divided by the cap, and the script calls per admitted call.
// It checks that each uses at least 0.90 of the cap (the window's ceiling
// at the default margin is 1s/1.03s = 0.971) with no violation.
func TestSim_AgainstTheConditionsFleets(t *testing.T) {
	long(t)
	t.Log("| Redis away | utilization | scripts/admitted | admitted |")
	for _, away := range []time.Duration{0, 25 * time.Millisecond, 50 * time.Millisecond} {
		s := schedule{Seed: 1, Replicas: 3, Workers: 20, Policy: simPolicy{Kind: "log", Limit: 100, Window: time.Second},
			Mode: Block, OnError: FailClosed, MaxCost: 1, Join: make([]time.Duration, 3), Length: 10 * time.Second,
			Hold: 10 * time.Millisecond}
		for range s.Replicas {
			if away > 0 {
				s.Latency = append(s.Latency, away-5*time.Millisecond)
				s.Jitter = 10 * time.Millisecond
			} else {
				s.Latency = append(s.Latency, 0)
			}
		}
		var o outcome
		synctest.Test(t, func(*testing.T) { o = run(s) })
		if broken := check(s, o); len(broken) > 0 {
			t.Errorf("Redis %v away: %s", away, broken[0])
		}
		u := utilization(o, s.Policy.Limit, s.Policy.Window)
		per := float64(o.scripts) / float64(len(o.arrivals))
		t.Logf("| %v | %.3f | %.3f | %d |", away, u, per, len(o.arrivals))
		if u < 0.90 {
			t.Errorf("Redis %v away: utilization %.3f, want at least 0.90", away, u)
		}
	}
}

// utilization is bench/conditions' figure: the vendor's count over its
// window, averaged over every millisecond from the end of its first window
// to its last arrival, divided by the cap.
func utilization(o outcome, limit int, window time.Duration) float64 {
	as := slices.Clone(o.arrivals)
	slices.SortFunc(as, func(a, b simArrival) int { return int(a.at - b.at) })
	if len(as) == 0 {
		return 0
	}
	from, to := as[0].at+window, as[len(as)-1].at
	var sum, n float64
	lo, hi, in := 0, 0, 0
	for t := from; t <= to; t += time.Millisecond {
		for hi < len(as) && as[hi].at <= t {
			in += as[hi].cost
			hi++
		}
		for lo < hi && as[lo].at <= t-window {
			in -= as[lo].cost
			lo++
		}
		sum += float64(in)
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / n / float64(limit)
}
