package throttle

import (
	"math"
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
	run := func(after int, flush bool) []string { return rebuiltRun("fixed", after, flush) }
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

// A vendor that counts a bucket, 5 units draining in 200 ms, rebuilds the
// rule from its bucket's level: five calls 10 ms apart before the flush,
// 4 units in the bucket at 540 ms, 2.25 at 610 ms; three calls after it
// fill it to 4.75 and a fourth to 5.5. Judged by the rule's window, the
// three are over (8 in 200 ms); by the vendor's bucket, the fourth is.
func TestSimCheck_ARuleRebuiltFromABucketIsJudgedAsTheBucket(t *testing.T) {
	run := func(after int, flush bool) []string { return rebuiltRun("bucket", after, flush) }
	if v := run(3, true); len(v) != 0 {
		t.Errorf("5 and 3 calls around a flush, in the vendor's bucket: %v, want no violation", v)
	}
	if v := run(4, true); len(v) != 1 || !strings.Contains(v[0], "its bucket at 5.50") {
		t.Errorf("5 and 4 calls around a flush, in the vendor's bucket: %v, want the bucket over at 5.50", v)
	}
	if v := run(3, false); len(v) != 1 || !strings.Contains(v[0], "the rule: 6 in the window") {
		t.Errorf("5 and 3 calls, no rebuild: %v, want the rule's window over at the sixth", v)
	}
}

// rebuiltRun judges five calls 10 ms apart from 500 ms, then after calls
// 10 ms apart from 610 ms, against a counter of 5 in 200 ms at a vendor
// that counts as counts says and states its counts; with flush, Redis's
// data is lost at 600 ms.
func rebuiltRun(counts string, after int, flush bool) []string {
	const ms = time.Millisecond
	s := schedule{Policy: simPolicy{Kind: "counter", Limit: 5, Window: 200 * ms}, OnError: FailClosed, Mode: Block,
		Model: &vendorModel{Counts: counts, Report: "response"}, Length: 3 * time.Second}
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

// A scout goes beyond what its blind rule knows (the vendor refuses it if
// at its cap): a window of the rule holds its units beside the limit, and
// no second scout's.
func TestSimCheck_OneScoutAWindowGoesBeyondTheRule(t *testing.T) {
	const ms = time.Millisecond
	run := func(scouts int) []string {
		s := schedule{Policy: simPolicy{Kind: "log", Limit: 5, Window: 200 * ms}, OnError: FailClosed, Mode: Block, Length: time.Second}
		var o outcome
		for i := range 5 + scouts {
			o.arrivals = append(o.arrivals, simArrival{at: (500 + 10*time.Duration(i)) * ms, cost: 1, actual: 1, answer: time.Hour, scout: i >= 5})
		}
		return safety(s, o)
	}
	if v := run(1); len(v) != 0 {
		t.Errorf("5 calls and a scout in a window of 5: %v, want no violation", v)
	}
	if v := run(2); len(v) != 1 || !strings.Contains(v[0], "7 in the window") {
		t.Errorf("5 calls and two scouts in a window of 5: %v, want the window over", v)
	}
}

// A rate refusal that asks for a short pause, while the fleet keeps a
// lock's second asked just before, is judged by the longer pause: the
// fleet comes back after the second, and only a fleet that stays away
// past it breaks the promise (seed 2922).
func TestSimCheck_APauseAskedBeforeIsWaitedOut(t *testing.T) {
	const ms = time.Millisecond
	run := func(back time.Duration) []string {
		s := schedule{Policy: simPolicy{Kind: "log", Limit: 50, Window: 100 * ms}, OnError: FailClosed, Mode: Block, Length: 3 * time.Second,
			Latency: []time.Duration{7 * ms}, Vendor: ms, Model: &vendorModel{Counts: "sliding", At: "arrival", Lock: 20}}
		o := outcome{refusals: []simRefusal{
			{at: 214 * ms, rate: true, pause: 13 * ms}, // recorded first, asked second
			{at: 166 * ms, pause: 1250 * ms},
		}}
		o.arrivals = append(o.arrivals, simArrival{at: back, cost: 1, actual: 1})
		return vendorChecks(s, o)
	}
	if v := run(1400 * ms); len(v) != 0 {
		t.Errorf("back 1.4 s in, after the lock's 1.25 s: %v, want no violation", v)
	}
	if v := run(2600 * ms); len(v) != 1 || !strings.Contains(v[0], "no more after a refusal at 214ms") {
		t.Errorf("back 2.6 s in, past the lock's pause and its allowance: %v, want the pause not ended", v)
	}
}

// A fleet short of the cap fails efficiency, unless its calls fall in
// classes that hold room for each other: that known shortfall is reported
// as open (knownOpen), not failed.
func TestSimCheck_ClassesShortOfTheCapAreReportedNotFailed(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 1, Workers: 8, Policy: simPolicy{Kind: "log", Limit: 10, Window: 100 * ms}, OnError: FailClosed, Mode: Block,
		Latency: []time.Duration{0}, Join: []time.Duration{0}, Length: 1500 * ms, Classes: 1}
	var o outcome
	for at := 0 * ms; at < s.Length; at += 20 * ms { // 5 a window: half the cap
		o.arrivals = append(o.arrivals, simArrival{at: at, cost: 1, actual: 1})
	}
	if v := check(s, o); len(v) != 1 || !strings.HasPrefix(v[0], "efficiency:") {
		t.Errorf("one class at half the cap: %v, want efficiency short", v)
	}
	s.Classes = 2
	if v := check(s, o); len(v) != 0 {
		t.Errorf("two classes at half the cap: %v, want nothing failed", v)
	}
	if v := knownOpen(s, o); len(v) != 1 || !strings.HasPrefix(v[0], "efficiency:") {
		t.Errorf("two classes at half the cap: %v, want efficiency reported open", v)
	}
}

// The other consumer on the fleet's key is judged from two windows after
// the vendor first counted one of its calls: before, no count told the
// fleet of it. One never counted is not judged at all (seed 520993: each
// of its calls came while the fleet's bursts held the window full, the
// last one as the run ended).
func TestSimCheck_AnOtherConsumerIsJudgedOnceTheVendorCountedIt(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Policy: simPolicy{Kind: "counter", Limit: 5, Window: 500 * ms}, OnError: FailClosed, Mode: Block, Length: 3 * time.Second,
		Latency: []time.Duration{0}, Join: []time.Duration{0}, Model: &vendorModel{Counts: "sliding", At: "arrival", Report: "response", Other: 1}}
	o := outcome{otherCalls: 6}
	for at := 500 * ms; at <= s.Length; at += 500 * ms {
		o.refusals = append(o.refusals, simRefusal{at: at, rate: true, other: true})
	}
	if v := othersRefused(s, o); len(v) != 0 {
		t.Errorf("never counted: %v, want not judged", v)
	}
	o.otherSeen = 400 * ms
	if v := othersRefused(s, o); len(v) != 1 || !strings.Contains(v[0], "4 of its 6 calls refused") {
		t.Errorf("first counted at 400 ms: %v, want the 4 refusals from 1.4 s on judged", v)
	}
}

// A worker that settles its cost does so before its next call: a round
// trip to Redis more per call, which the demand that efficiency asks of a
// schedule counts (seed 521540: Redis 25 ms away, windows of 100 ms, 8
// workers of costs up to 10 could ask for 0.87 of the cap, where 1.7 was
// counted, and the check asked of them what they could not ask for).
func TestSimCheck_ASettleIsARoundTripOfTheWorkersDemand(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 2, Workers: 4, Policy: simPolicy{Kind: "log", Limit: 50, Window: 100 * ms}, OnError: FailClosed, Mode: Block,
		Latency: []time.Duration{27 * ms, 25 * ms}, Join: []time.Duration{0, 0}, Length: 1500 * ms, MaxCost: 10, Classes: 1}
	if !s.saturates() {
		t.Fatalf("demand %.1f a window without settles, want it to saturate a cap of 50", s.demand())
	}
	s.Settle = "lower"
	if s.saturates() {
		t.Errorf("demand %.1f a window with a settle after each call, want it short of 1.5 times a cap of 50", s.demand())
	}
}

// Efficiency does not read the time the fleet kept quiet as the vendor
// asked: a refusal's pause, and a window after it while the vendor's
// window fills again. The rest of the span is still read (seed 486584's
// halved limit is found after a short pause), when two windows of it are
// left (seed 544494: pauses of a second in a run of 1.5 s).
func TestSimCheck_EfficiencyDoesNotReadAPauseTheVendorAsked(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 1, Workers: 8, Policy: simPolicy{Kind: "log", Limit: 10, Window: 100 * ms}, OnError: FailClosed, Mode: Block,
		Latency: []time.Duration{0}, Join: []time.Duration{0}, Length: 2000 * ms, Classes: 1,
		Model: &vendorModel{Counts: "sliding", At: "arrival"}}
	// The cap used whole but from 700 ms to 1.4 s, where the fleet was
	// quiet: under half the cap over the steady span.
	full := func(quiet func(time.Duration) bool) outcome {
		var o outcome
		for at := 0 * ms; at < s.Length; at += 10 * ms {
			if !quiet(at) {
				o.arrivals = append(o.arrivals, simArrival{at: at, cost: 1, actual: 1})
			}
		}
		return o
	}
	o := full(func(at time.Duration) bool { return at >= 700*ms && at < 1400*ms })
	if v := efficiency(s, o); len(v) != 1 || !strings.HasPrefix(v[0], "efficiency:") {
		t.Errorf("quiet for 700 ms with no refusal: %v, want efficiency short", v)
	}
	o.refusals = []simRefusal{{at: 700 * ms, rate: true, pause: 600 * ms}}
	if v := efficiency(s, o); len(v) != 0 {
		t.Errorf("quiet for the 600 ms a refusal asked and a window: %v, want no violation", v)
	}
	o.refusals[0].pause = 100 * ms
	if v := efficiency(s, o); len(v) != 1 || !strings.HasPrefix(v[0], "efficiency:") {
		t.Errorf("quiet for 700 ms after a refusal that asked 100 ms: %v, want efficiency short", v)
	}
	// A pause of 1.25 s from 300 ms in a run of 1.8 s leaves 150 ms of
	// the span to read: not judged, however quiet.
	s.Length = 1800 * ms
	o = full(func(at time.Duration) bool { return at >= 300*ms })
	o.refusals = []simRefusal{{at: 300 * ms, rate: true, pause: 1250 * ms}}
	if v := efficiency(s, o); len(v) != 0 {
		t.Errorf("a pause of 1.25 s from 300 ms in a run of 1.8 s: %v, want not judged", v)
	}
}

// Under Spread, a part's calls may cost up to its limit: the ceiling
// counts the half of a call's cost a part holds unused on average, and
// nothing for calls of one unit (seed 544800).
func TestSimCheck_ASpreadPartsCeilingCountsItsCallsCosts(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Policy: simPolicy{Kind: "log", Limit: 50, Window: 200 * ms, Spread: true}, MaxCost: 1}
	one := s.ceiling()
	if want := 8 * 200.0 / (20 + 30) / 50; math.Abs(one-want) > 1e-9 {
		t.Errorf("calls of 1: ceiling %.3f, want the part's %.3f", one, want)
	}
	s.MaxCost = 8
	if got, want := s.ceiling(), one*(8-3.5)/8; math.Abs(got-want) > 1e-9 {
		t.Errorf("calls of up to 8 on a part of 8: ceiling %.3f, want %.3f", got, want)
	}
}

// A replica admits a call again after a fault, unless its calls' deadline
// ends before a script call's answer can come back: it then admits only
// from spares, by chance (seed 547386).
func TestSimCheck_RecoveryIsNotAskedOfDeadlinesShorterThanARoundTrip(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 1, Workers: 4, Policy: simPolicy{Kind: "log", Limit: 50, Window: 100 * ms}, OnError: FailClosed, Mode: Block,
		Latency: []time.Duration{5 * ms}, Join: []time.Duration{0}, Length: 6 * time.Second, Classes: 1, Deadline: 50 * ms,
		Events: []event{{At: 500 * ms, Kind: "flush"}}}
	o := outcome{arrivals: []simArrival{{at: 100 * ms, cost: 1, actual: 1}}}
	if v := recovered(s, o); len(v) != 1 || !strings.Contains(v[0], "admitted no call") {
		t.Errorf("Redis 5 ms away, deadlines of 50 ms, nothing after the flush: %v, want the replica found not recovered", v)
	}
	s.Latency[0] = 30 * ms
	if v := recovered(s, o); len(v) != 0 {
		t.Errorf("Redis 30 ms away, deadlines of 50 ms: %v, want not judged", v)
	}
}

// firstComeSchedule returns the schedule the first come, first served
// checker tests judge (two replicas 1 ms from Redis, Block, a log of 10 a
// second, one class, deadlines of deadline), and the error of a call
// refused for its deadline.
func firstComeSchedule(deadline time.Duration) (schedule, error) {
	const ms = time.Millisecond
	s := schedule{Replicas: 2, Workers: 4, Policy: simPolicy{Kind: "log", Limit: 10, Window: time.Second}, OnError: FailClosed, Mode: Block,
		Latency: []time.Duration{ms, ms}, Join: []time.Duration{0, 0}, Length: 3 * time.Second, Classes: 1, Deadline: deadline}
	return s, &LimitedError{Reason: "the slot lies beyond the context's deadline"}
}

// First come, first served against deadlines: a call refused for its
// deadline fails the check when calls that began a round trip after it
// took more than its cost and a tenth of the limit before its deadline,
// less the half margin within which the deadline guard refuses a slot by
// design (seed 547751).
func TestSimCheck_FirstComeAllowsTheDeadlineGuardsHalfMargin(t *testing.T) {
	const ms = time.Millisecond
	s, refused := firstComeSchedule(50 * ms)
	calls := func(arrived time.Duration) outcome {
		o := outcome{calls: []simCall{{replica: 0, began: 1000 * ms, end: 1002 * ms, err: refused, cost: 1}}}
		for range 4 {
			o.calls = append(o.calls, simCall{replica: 1, began: 1020 * ms, arrived: arrived, cost: 1})
		}
		return o
	}
	if v := firstCome(s, calls(1030*ms)); len(v) != 1 || !strings.Contains(v[0], "took 4 units within it") {
		t.Errorf("4 units taken 20 ms before the refused call's deadline: %v, want first come broken", v)
	}
	if v := firstCome(s, calls(1040*ms)); len(v) != 0 {
		t.Errorf("4 units taken within half a margin of the refused call's deadline: %v, want no violation", v)
	}
}

// Recovery after a fault allows a worker to wait for the calls ahead of it
// in the queue: under a per-key rule, the queue of a key every call may
// ask for, which its own rule serves at half the limit a key window (seed
// 564771: 20 replicas of one worker, calls of up to 10 units on skewed
// keys; a replica's first call after a flush waited 1.3 s in one replay,
// past 2.1 s in another).
func TestSimCheck_RecoveryWaitsForAHotKeysQueue(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 20, Workers: 1, Policy: simPolicy{Kind: "perkey", Limit: 50, Window: 100 * ms}, OnError: FailClosed, Mode: Queue,
		Latency: make([]time.Duration, 20), Join: make([]time.Duration, 20), Length: 4 * time.Second, Classes: 1, MaxCost: 10, Keys: 3,
		Events: []event{{At: 700 * ms, Kind: "flush"}}}
	after := func(d time.Duration) outcome {
		return outcome{arrivals: []simArrival{{at: 100 * ms, cost: 1, actual: 1}, {at: 700*ms + d, cost: 10, actual: 10}}}
	}
	if v := recovered(s, after(2300*ms)); len(v) != 0 {
		t.Errorf("a call 2.3 s after the flush, behind 20 workers' calls of up to 10 units on a key served 25 a window: %v, want recovered", v)
	}
	if v := recovered(s, after(2700*ms)); len(v) != 1 || !strings.Contains(v[0], "admitted no call") {
		t.Errorf("a call 2.7 s after the flush: %v, want the replica found not recovered", v)
	}
}

// First come, first served from a process's first answer: a call that
// began while its process's first script call opened the connection asks
// when that call is answered (outcome.asked), so the calls of other
// processes that began before then may be decided first (seed 728573);
// once its process has been answered, a call is judged from when it began.
func TestSimCheck_FirstComeCountsFromAProcesssFirstAnswer(t *testing.T) {
	const ms = time.Millisecond
	s, refused := firstComeSchedule(100 * ms)
	o := outcome{calls: []simCall{{replica: 0, began: 1000 * ms, end: 1050 * ms, err: refused, cost: 1}}}
	for range 4 {
		o.calls = append(o.calls, simCall{replica: 1, began: 1030 * ms, arrived: 1060 * ms, cost: 1})
	}
	if v := firstCome(s, o); len(v) != 1 || !strings.Contains(v[0], "took 4 units within it") {
		t.Errorf("4 units of calls that began 30 ms after the refused one, its process answered before: %v, want first come broken", v)
	}
	o.firstReply = map[int]time.Duration{0: 1045 * ms, 1: 10 * ms}
	if v := firstCome(s, o); len(v) != 0 {
		t.Errorf("4 units of calls that began before the refused call's process had its first answer: %v, want no violation", v)
	}
	o.firstReply[0] = 500 * ms
	if v := firstCome(s, o); len(v) != 1 {
		t.Errorf("the refused call's process answered long before it began: %v, want first come broken", v)
	}
}

// A higher priority waits for lower ones no more than one window's limit
// and, for each window it waited, the tenth (a unit at least) each lower
// class keeps (seed 601373: two lower classes of a limit of 5, a unit a
// window each).
func TestSimCheck_PrioritiesAllowEachLowerClassItsTenth(t *testing.T) {
	const ms = time.Millisecond
	s := schedule{Replicas: 2, Workers: 4, Policy: simPolicy{Kind: "counter", Limit: 5, Window: time.Second}, OnError: FailClosed, Mode: Queue,
		Latency: []time.Duration{ms, ms}, Join: []time.Duration{0, 0}, Length: 6 * time.Second, Classes: 3}
	calls := func(priority, lowerUnits int) outcome {
		o := outcome{calls: []simCall{{replica: 0, priority: priority, began: 100 * ms, arrived: 4100 * ms, cost: 1, counted: 1}}}
		for i := range lowerUnits {
			o.calls = append(o.calls, simCall{replica: 1, priority: i % priority, began: 200 * ms, arrived: time.Duration(300+i*200) * ms, cost: 1, counted: 1})
		}
		return o
	}
	// 4 s waited: 5 windows, a unit each for each lower class.
	if v := priorities(s, calls(2, 15)); len(v) != 0 {
		t.Errorf("a call of priority 2 waited 4 s while its two lower classes took 15 units: %v, want no violation (5 + 2 × 5 allowed)", v)
	}
	if v := priorities(s, calls(2, 16)); len(v) != 1 {
		t.Errorf("a call of priority 2 waited 4 s while its two lower classes took 16 units: %v, want priorities broken", v)
	}
	if v := priorities(s, calls(1, 11)); len(v) != 1 {
		t.Errorf("a call of priority 1 waited 4 s while its one lower class took 11 units: %v, want priorities broken (5 + 5 allowed)", v)
	}
	// Booked at 2 and settled at 1: the vendor counted 15, the class's
	// log got the rest back (seed 601373).
	settled := calls(2, 15)
	for i := range settled.calls[1:] {
		settled.calls[1+i].cost = 2
	}
	if v := priorities(s, settled); len(v) != 0 {
		t.Errorf("a call of priority 2 waited 4 s while its two lower classes booked 30 units and were counted 15: %v, want no violation (5 + 2 × 5 allowed)", v)
	}
}
