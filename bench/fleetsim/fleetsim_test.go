package main

import (
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

// randomLog returns a log of n entries at random times in [0, span).
func randomLog(rng *rand.Rand, n int, span int64) *slidingLog {
	l := &slidingLog{}
	for i := range n {
		l.add(rng.Int64N(span), int64(i), 0)
	}
	return l
}

func TestEarliest_MatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 3000 {
		limit := 1 + rng.IntN(4)
		w := int64(5 + rng.IntN(40))
		l := randomLog(rng, rng.IntN(12), 80)
		from := rng.Int64N(100) - 10
		budget := 1 << 30
		got := l.earliest(from, limit, w, &budget)
		want := l.bruteEarliest(from, limit, w)
		if got != want {
			t.Fatalf("case %d: limit %d, window %d, log %v, from %d: earliest %d, brute force %d", i, limit, w, l.e, from, got, want)
		}
	}
}

func TestEarliest_SettlesForAnAllowedTimeWhenTheBudgetRunsOut(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 500 {
		limit := 1 + rng.IntN(3)
		w := int64(5 + rng.IntN(20))
		l := randomLog(rng, 5+rng.IntN(20), 200)
		from := rng.Int64N(50)
		budget := rng.IntN(12)
		got := l.earliest(from, limit, w, &budget)
		least := l.bruteEarliest(from, limit, w)
		if got < least || l.bruteEarliest(got, limit, w) != got {
			t.Fatalf("case %d: limit %d, window %d, log %v, from %d: %d is not an allowed time at or after %d", i, limit, w, l.e, from, got, least)
		}
	}
}

func TestPaced_KeepsTheGapFromEveryEntry(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 1000 {
		l := randomLog(rng, rng.IntN(paceRead), 100)
		from, pace := rng.Int64N(100), int64(1+rng.IntN(10))
		got, _ := l.paced(from, pace)
		if got < from {
			t.Fatalf("case %d: paced %d before %d", i, got, from)
		}
		for _, e := range l.e {
			if d := max(got-e.at, e.at-got); d < pace {
				t.Fatalf("case %d: log %v, from %d, pace %d: %d lies %d from %d", i, l.e, from, pace, got, d, e.at)
			}
		}
	}
}

func TestAcquire_BooksAWindowAfterAFullLog(t *testing.T) {
	q := newQuota(3, 1_000_000, 30_000)
	report := [lateBuckets]int{}
	calls := func(ids ...int64) []scriptCall {
		var cs []scriptCall
		for _, id := range ids {
			cs = append(cs, scriptCall{id: id, maxWait: 10e6})
		}
		return cs
	}
	waits := func(rep scriptReply) []int64 {
		var ws []int64
		for _, d := range rep.calls {
			ws = append(ws, d.wait)
		}
		return ws
	}
	// The script that creates the quota knows no warm-up yet: the window in
	// force is the window and the configured margin.
	first := q.acquire(5_000_000, &report, nil, calls(1, 2, 3, 4))
	if want := []int64{0, 0, 0, 1_030_000}; !slices.Equal(waits(first), want) {
		t.Fatalf("first script: waits %v, want %v", waits(first), want)
	}
	// The calls it admitted at once are held as if booked with the warm
	// margin (the 100ms ceiling): the margin in force is (30 + 100) / 2 ms.
	second := q.acquire(5_000_010, &report, nil, calls(5))
	if want := []int64{1_065_000 - 10}; !slices.Equal(waits(second), want) {
		t.Fatalf("second script: waits %v, want %v", waits(second), want)
	}
}

func TestAcquire_GivingBackFreesTheSlot(t *testing.T) {
	q := newQuota(1, 1_000_000, 30_000)
	report := [lateBuckets]int{}
	first := q.acquire(0, &report, nil, []scriptCall{{id: 1, maxWait: 10e6}})
	if !first.calls[0].admitted || first.calls[0].wait != 0 {
		t.Fatalf("first call: %+v", first.calls[0])
	}
	second := q.acquire(10, &report, []booking{{id: 1, at: 0}}, []scriptCall{{id: 2, maxWait: 10e6}})
	if !second.calls[0].admitted || second.calls[0].wait != 0 {
		t.Fatalf("a call after the only entry was given back: %+v, want admitted at once", second.calls[0])
	}
}

// guardSim is a simulation of one worker whose process has seen its
// fastest reply, for the late-start guard.
func guardSim() (*sim, *worker) {
	f := Fleet{Processes: 1, Limiters: 1, Workers: 1, Limit: 10, Window: 1_000_000, Margin: 30_000, Duration: 10_000_000}
	s := &sim{f: f, c: Defaults(), rng: rand.New(rand.NewPCG(1, 1)), q: newQuota(f.Limit, f.Window, f.Margin)}
	w := &worker{lim: &limiter{proc: &process{fast: 100, haveFast: true}}}
	return s, w
}

func TestLate_HalfTheMarginIsAsLateAsACallMayStart(t *testing.T) {
	s, w := guardSim()
	adm := admission{id: 1, slot: 1000, starts: 1000, margin: 30_000}
	for _, tc := range []struct {
		now     int64
		tooLate bool
	}{
		{now: 1000 + 100 + 15_000, tooLate: false},
		{now: 1000 + 100 + 15_001, tooLate: true},
	} {
		s.now = tc.now
		if _, tooLate := s.late(w, adm); tooLate != tc.tooLate {
			t.Errorf("at %d: too late %v, want %v", tc.now, tooLate, tc.tooLate)
		}
	}
	s.now = 1_000_000
	if _, tooLate := s.late(w, admission{starts: 0, margin: minGuardedMargin - 1}); tooLate {
		t.Errorf("a margin under %d µs guards nothing", minGuardedMargin)
	}
}

func TestSettle_BooksAgainThreeTimesThenFails(t *testing.T) {
	s, w := guardSim()
	adm := admission{id: 1, slot: 0, starts: 0, margin: 30_000}
	s.now = 50_000
	for i := range maxRebooks {
		s.settle(w, adm, 50_000, true, true)
		if w.rebooks != i+1 || s.lateFails != 0 {
			t.Fatalf("rebook %d: %d rebooks, %d failures", i+1, w.rebooks, s.lateFails)
		}
		if w.lead != int64(i+1)*50_000 {
			t.Fatalf("rebook %d: lead %d, want the lateness of each late reply added", i+1, w.lead)
		}
	}
	scripts := s.scripts
	s.settle(w, adm, 50_000, true, true)
	if s.lateFails != 1 {
		t.Fatalf("after %d rebooks: %d late-start failures, want 1", maxRebooks+1, s.lateFails)
	}
	if s.scripts != scripts+1 {
		t.Fatalf("a failing call sent %d script calls, want 1 (its cancel)", s.scripts-scripts)
	}
}

func TestSimulate_IsDeterministicForASeed(t *testing.T) {
	f := Fleet{Name: "small", Processes: 1, Limiters: 200, Workers: 1, Limit: 200, Window: 1_000_000, Margin: 30_000, Duration: 3_000_000}
	a, b := Simulate(f, Defaults(), 7), Simulate(f, Defaults(), 7)
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("two runs of seed 7 differ:\n%+v\n%+v", a, b)
	}
	if c := Simulate(f, Defaults(), 8); reflect.DeepEqual(a, c) {
		t.Fatalf("seeds 7 and 8 gave the same run")
	}
}

func TestSimulate_StaysUnderTheCap(t *testing.T) {
	f := Fleet{Name: "replicas-1000", Processes: 1, Limiters: 1000, Workers: 1, Limit: 1000, Window: 1_000_000, Margin: 30_000, Duration: 5_000_000}
	r := Simulate(f, Defaults(), 1)
	if r.MaxInWindow > f.Limit {
		t.Fatalf("%d calls in one vendor window, cap %d", r.MaxInWindow, f.Limit)
	}
	if r.Utilization < 0.5 || r.Admitted == 0 {
		t.Fatalf("utilization %.3f, %d admitted: the fleet did not run", r.Utilization, r.Admitted)
	}
}

const conditionsOutput = `2 CPUs, go1.26.8 linux/amd64, redis-server 7.0.15; 10s per scenario

| scenario        | admitted | 429s | max/cap   | utilization | scripts/admitted | wait p50 / p99 (ms) | errors (late starts) | unavailable (timed out) | spread / margin (ms) |
| --------------- | -------- | ---- | --------- | ----------- | ---------------- | ------------------- | -------------------- | ----------------------- | -------------------- |
| replicas-1000   | 8681     | 0    | 1000/1000 | 0.875       | 1.251            | 1055 / 2239         | 3 (2)                | 0 (0)                   | 8.0 / 30.0           |

| scenario        | script round trip p50 / p99 / max (ms) | fn start to vendor p50 / p99 / max (ms) | max/cap by fn start | EVALSHA µs in Redis | Redis CPU (s) | failed at the end: slot past it / context / context in a round trip | load |
| --------------- | -------------------------------------- | --------------------------------------- | ------------------- | ------------------- | ------------- | ------------------------------------------------------------------- | ---- |
| replicas-1000   | 0.4 / 171 / 176                        | 0.1 / 18.5 / 53.9                       | 1000/1000           | 176                 | 2.4           | 989 / 0 / 0                                                         | 0.57 |
`

func TestParseConditions_ReadsBothTables(t *testing.T) {
	runs, err := parseConditions(conditionsOutput + "\n" + conditionsOutput)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 2 {
		t.Fatalf("%d runs read, want 2", len(runs))
	}
	rows := runs[1]
	want := Measured{
		Name: "replicas-1000", Admitted: 8681, Utilization: 0.875, ScriptsPerAdmitted: 1.251,
		WaitP50: 1055, WaitP99: 2239, LateStarts: 2, RoundTripP50: 0.4, RoundTripP99: 171,
		WayP50: 0.1, WayP99: 18.5, RedisMicros: 176,
	}
	if got := rows["replicas-1000"]; got == nil || *got != want {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
}
