package throttle

import (
	"strings"
	"testing"
	"time"
)

// The safety checker judges a window around a rebuild of the rule from a
// vendor that counts fixed windows as the vendor counts (docs/FAILURES.md:
// the rule rebuilt from the vendor's count counts as the vendor does), and
// every other window, and every window of a run without a rebuild, by the
// rule's sliding window: five calls before the flush and five after fit in
// the vendor's two windows of five, a sixth after does not, and without the
// flush the sixth call is over the rule.
func TestSimCheck_ARebuiltRuleIsJudgedAsTheVendorCounts(t *testing.T) {
	const ms = time.Millisecond
	run := func(after int, flush bool) []string {
		s := schedule{Policy: simPolicy{Kind: "counter", Limit: 5, Window: 200 * ms}, OnError: FailClosed, Mode: Block,
			Model: &vendorModel{Counts: "fixed", Report: "response"}, Length: 3 * time.Second}
		if flush {
			s.Events = []event{{At: 600 * ms, Kind: "flush"}}
		}
		var o outcome
		for i := range 5 { // the vendor's window [400 ms, 600 ms)
			o.arrivals = append(o.arrivals, simArrival{at: (500 + 10*time.Duration(i)) * ms, cost: 1, actual: 1, answer: time.Hour})
		}
		for i := range after { // the vendor's window [600 ms, 800 ms)
			o.arrivals = append(o.arrivals, simArrival{at: (610 + 10*time.Duration(i)) * ms, cost: 1, actual: 1, answer: time.Hour})
		}
		return safety(s, o)
	}
	if v := run(5, true); len(v) != 0 {
		t.Errorf("5 and 5 in the vendor's windows, around a flush: %v, want no violation", v)
	}
	if v := run(6, true); len(v) != 1 || !strings.Contains(v[0], "as the vendor counts") {
		t.Errorf("5 and 6 in the vendor's windows, around a flush: %v, want the second window over", v)
	}
	if v := run(5, false); len(v) != 1 || !strings.Contains(v[0], "the rule: 6 in the window") {
		t.Errorf("5 and 5 in a window of the rule, no rebuild: %v, want the rule's window over at the sixth", v)
	}
}
