package throttle

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// sharedKey is a strict vendor (a sliding window, X-RateLimit-Limit and
// -Remaining on every answer) whose key another consumer spends beside
// the fleet, at an even pace, asking no one.
type sharedKey struct {
	v     *fakevendor.Vendor
	srv   *httptest.Server
	start time.Time
	mu    sync.Mutex
	ok    []time.Duration // the fleet's calls accepted, since start
	no    []time.Duration // and refused
	other []time.Duration // the other consumer's calls accepted
	turn  []time.Duration // and refused
}

func newSharedKey(t *testing.T, limit int, window time.Duration) *sharedKey {
	k := &sharedKey{v: fakevendor.New(fakevendor.Config{Limit: limit, Window: window}), start: time.Now()}
	h := k.v.Handler()
	k.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at := time.Since(k.start)
		sw := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		h.ServeHTTP(sw, r)
		k.note(sw.status == http.StatusOK, at, &k.ok, &k.no)
	}))
	t.Cleanup(func() { k.srv.Close(); k.v.Close() })
	return k
}

func (k *sharedKey) note(ok bool, at time.Duration, yes, no *[]time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if ok {
		*yes = append(*yes, at)
	} else {
		*no = append(*no, at)
	}
}

// spend sends a call every every until stop is closed, as the other
// consumer does.
func (k *sharedKey) spend(every time.Duration, stop <-chan struct{}) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			at := time.Since(k.start)
			k.note(k.v.Arrive(), at, &k.other, &k.turn)
		}
	}
}

// count returns how many of ts lie in [from, to).
func (k *sharedKey) count(ts []time.Duration, from, to time.Duration) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, t := range ts {
		if t >= from && t < to {
			n++
		}
	}
	return n
}

// sharedKeyFleet runs replicas × workers calls through Transports on the
// shared key from the fleet's start until its end, since the vendor's
// start.
func sharedKeyFleet(t *testing.T, s *redistest.Server, k *sharedKey, limit int, window, from, to time.Duration, obs func(Event)) []*Limiter {
	const replicas, workers = 3, 10
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var lims []*Limiter
	time.Sleep(time.Until(k.start.Add(from)))
	for range replicas {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: limit, Window: window}, Options{Observer: obs})
		lims = append(lims, lim)
		c := &http.Client{Transport: &Transport{Base: &http.Transport{MaxIdleConnsPerHost: workers}, Limiter: lim, MaxRetries: -1}}
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					_, _ = get(ctx, c, k.srv.URL)
				}
			})
		}
	}
	time.Sleep(time.Until(k.start.Add(to)))
	cancel()
	wg.Wait()
	return lims
}

// Another consumer spends 40% of the vendor's key, evenly, from a window
// before the fleet starts, and stops later. The fleet measures it from the
// vendor's counts and leaves it its share: the other consumer's calls find
// room (at most 2% refused), the fleet takes at least 0.7 of what the
// other leaves with no 429 after its first two windows; and once the
// other stops, the fleet takes the whole cap again within four windows
// (three in the vendors' runs).
func TestOthers_LeavesAnotherConsumerItsShare(t *testing.T) {
	long(t) // a fleet of seconds; .ci/run runs it on a quiet machine
	if raceEnabled {
		// Under -race beside the package's tests, the fleet's calls start
		// hundreds of milliseconds late and out of their slots' order, and
		// the vendor's counts measure others that are not there (a share of
		// 20 of 60 held after the other consumer stopped, in one CI run):
		// .ci/run runs it without -race (the switches' step, on and off).
		t.Skip("a figure of a fleet's timing: run without -race")
	}
	t.Parallel()
	const (
		limit  = 60
		window = time.Second
		every  = window * 10 / (limit * 4) // 40% of the cap
		start  = window                    // the fleet's
		stopAt = start + 5*window          // the other consumer's
		end    = stopAt + 5*window + window/2
	)
	s := redistest.Real(t)
	k := newSharedKey(t, limit, window)
	stop := make(chan struct{})
	go k.spend(every, stop)
	time.AfterFunc(stopAt, func() { close(stop) })
	var told othersTold
	lims := sharedKeyFleet(t, s, k, limit, window, start, end, told.observe)

	sent := k.count(k.other, 0, end) + k.count(k.turn, 0, end)
	turned := k.count(k.turn, 0, end)
	settled := start + 2*window
	fleet, refused := k.count(k.ok, settled, stopAt), k.count(k.no, settled, stopAt)
	others := k.count(k.other, settled, stopAt)
	left := float64(limit)*float64(stopAt-settled)/float64(window) - float64(others)
	// The whole cap again: some window starting within four windows of
	// the stop holds it (any window: the fleet's bursts drift through a
	// fixed one). The share is the largest measure of the last window and
	// a half, and the fleet books a window ahead: the burst three windows
	// after the stop is the first booked once the share has fallen. In 4
	// runs of 12 that burst held 45-53 of 60, and the next one 49-60: a
	// measure after the stop erred high (in one run the bursts went 53,
	// 49, 60). The vendors' runs, with 2 s windows, hold it at three.
	// The bursts come a window and its margin apart: the run goes on a
	// window and a half past four windows from the stop.
	after := fakevendor.FullestWindow(k.ok, stopAt+2*window, stopAt+4*window, window)
	t.Logf("the other consumer: %d of %d refused; the fleet: %d calls while it spent %d (%.3f of what it left), %d refused; %d in the fullest window starting two to four windows after it stopped",
		turned, sent, fleet, others, float64(fleet)/left, refused, after)
	if t.Failed() || testing.Verbose() {
		k.dump(t, window, end)
	}
	checkTheShareLeft(t, turned, sent, fleet, refused, left)
	u := told.check(t, lims[0], limit)
	share := float64(window) / float64(window+u.Rules[0].Margin)
	if want := 0.95 * share * float64(limit); float64(after) < want {
		t.Errorf("the fleet took at most %d calls in a window starting within four windows after the other consumer stopped, want at least %.0f",
			after, want)
	}
}

// checkTheShareLeft checks that another consumer had at most 2% of its
// sent calls refused (turned), and that the fleet took at least 0.7 of
// the left calls it left, with none refused after its first two windows.
func checkTheShareLeft(t *testing.T, turned, sent, fleet, refused int, left float64) {
	t.Helper()
	if turned*50 > sent {
		t.Errorf("the other consumer had %d of its %d calls refused, want at most 2%%", turned, sent)
	}
	// 0.93-0.97 alone; beside the package's other tests under -race, or
	// two busy loops, calls that start late measure the others high now
	// and then, and the fleet leaves them more than they need: 0.78-0.86
	// (the vendors' runs, alone, hold 0.9). Without the share: 0.74 and
	// 40-46 429s.
	if float64(fleet) < 0.7*left {
		t.Errorf("the fleet took %d calls of the %.0f the other consumer left, want at least 0.7 of them", fleet, left)
	}
	// Without the share: 40-46. Beside compiles, calls that start late
	// measure the others low now and then (3 and 6 in two CI runs): .ci/run
	// runs it alone, once the nested modules are done.
	if refused > 0 {
		t.Errorf("the fleet had %d calls refused after its first two windows, want none", refused)
	}
}

// othersTold records the Others of each EventOthers.
type othersTold struct {
	mu   sync.Mutex
	told []int
}

func (o *othersTold) observe(e Event) {
	if e.Kind == EventOthers {
		o.mu.Lock()
		o.told = append(o.told, e.Others)
		o.mu.Unlock()
	}
}

// check checks that the observer was told of the share another consumer
// of limit took, at least 40% of it, falling when it stopped, and that
// lim's Usage shows none left to it; it returns that Usage.
func (o *othersTold) check(t *testing.T, lim *Limiter, limit int) Usage {
	t.Helper()
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	told := o.told
	if len(told) < 2 || slices.Max(told) < limit*4/10 || told[len(told)-1] >= slices.Max(told) || u.Rules[0].Others != 0 {
		t.Errorf("EventOthers told %v, Usage shows %d left to others at the end; want a share of at least %d, falling, then none",
			told, u.Rules[0].Others, limit*4/10)
	}
	return u
}

func (k *sharedKey) dump(t *testing.T, window, end time.Duration) {
	for w := time.Duration(0); w < end; w += window / 2 {
		t.Logf("%5v: fleet %3d ok %2d no; other %2d ok %2d no", w, k.count(k.ok, w, w+window/2), k.count(k.no, w, w+window/2),
			k.count(k.other, w, w+window/2), k.count(k.turn, w, w+window/2))
	}
}

// leftToOthers is what a rule leaves other consumers of the key who spent
// n units of a window of the vendor's limit of base (see others_reserve in
// lua/lib.lua): n rounded up to a step of a sixty-fourth of base, and a
// sixteenth more; nothing with the switch others off.
func leftToOthers(n, base int) int {
	if n < 1 || isOff("others") {
		return 0
	}
	if q := max(base/64, 1); !isOff("others_steady") {
		n = min((n+q-1)/q*q, base)
	}
	return n + min(n/16+1, max((base-n)/2, 1))
}

// leftAfter is what a rule of limit base leaves the fleet, which sent
// ours, when the vendor says left are left: less than left by the more
// it leaves others, or left, with shares off, by a charge.
func leftAfter(base, ours, left int) int {
	if isOff("others") {
		return left
	}
	return max(base-leftToOthers(base-left-ours, base)-ours, 0)
}

// A call the vendor refused is in the fleet's record but not in the
// vendor's count: the measure of the others leaves it out (the ':rj' list
// in feedback.lua), or each refusal of the fleet would measure the others
// a unit low, and the lower share let more of the fleet's calls through.
func TestOthers_RefusedCallsAreNotTheFleets(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		// Two replicas, three calls each: a process that calls four times
		// in quick succession takes spare admissions (spare.go), and one
		// not yet used nor given back when the vendor's count comes is in
		// the fleet's record, though never sent (on a busy machine, the
		// others then measured 1).
		policy := policies.SlidingLog{Limit: 10, Window: 10 * time.Second}
		lims := []*Limiter{
			newLimiter(t, s.Client(t), policy, Options{Mode: FailFast, WithoutLearning: true}),
			newLimiter(t, s.Client(t), policy, Options{Mode: FailFast, WithoutLearning: true}),
		}
		lim := lims[0]
		var ps []*Permit
		for i := range 6 {
			p, err := lims[i/3].Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			ps = append(ps, p)
		}
		// The vendor refused the last two; the other four and two calls
		// of another consumer are what it counted.
		for _, p := range ps[4:] {
			if _, refused, err := p.Heard(ctx, Answer{Status: http.StatusTooManyRequests, RetryAfter: time.Millisecond, HasRetryAfter: true}); err != nil || !refused {
				t.Fatalf("Heard a 429: refused %v, %v", refused, err)
			}
		}
		if _, _, err := ps[3].Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 4, Limit: 10}}); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// 2 units, and the spare of one (others_reserve); none with the
		// share off, which the switch table checks.
		if want := 3; u.Rules[0].Others != want {
			t.Errorf("the quota leaves others %d, want %d: they spent 2 of the vendor's 6", u.Rules[0].Others, want)
		}
	})
}

// A count that says nothing is left teaches the limit it states, and a
// refusal a pause: each measures the others too (feedback.lua, a count that
// teaches). The last answer of a burst is the one whose count holds the
// whole burst, and a refusal's says the vendor was full without it; left
// out, a fleet whose bursts each ended in such an answer measured the
// others low for windows (simulation seed 333146: a share of 3 for others
// spending 5, and their calls refused in 2 of 4 replays).
func TestOthers_ACountThatTeachesMeasuresThemToo(t *testing.T) {
	answers := map[string]Answer{
		"nothing left": {Status: http.StatusOK, Requests: &Count{Remaining: 0, Limit: 10}},
		"a refusal": {Status: http.StatusTooManyRequests, RetryAfter: time.Millisecond, HasRetryAfter: true, AboutRate: true,
			Requests: &Count{Remaining: 0, Limit: 10}},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for name, a := range answers {
			t.Run(name, func(t *testing.T) {
				ctx := context.Background()
				// Three replicas, at most three calls each: a process that
				// calls four times in quick succession takes spare
				// admissions (spare.go), in the fleet's record though never
				// sent (TestOthers_RefusedCallsAreNotTheFleets).
				policy := policies.SlidingLog{Limit: 10, Window: 10 * time.Second}
				var lims []*Limiter
				for range 3 {
					lims = append(lims, newLimiter(t, s.Client(t), policy, Options{Mode: FailFast}))
				}
				lim := lims[0]
				var last *Permit
				for i := range 7 {
					p, err := lims[i%3].Acquire(ctx)
					if err != nil {
						t.Fatal(err)
					}
					last = p
				}
				// The vendor counted the fleet's 7 (6 of a refusal) and the
				// others' 3 (4).
				if _, _, err := last.Heard(ctx, a); err != nil {
					t.Fatal(err)
				}
				u, err := lim.Usage(ctx)
				if err != nil {
					t.Fatal(err)
				}
				// What they spent and a spare of one (others_reserve); none
				// with the measure off.
				want := 3 + 1
				if a.Status != http.StatusOK {
					want = 4 + 1
				}
				if u.Rules[0].Others != want {
					t.Errorf("the quota leaves others %d, want %d", u.Rules[0].Others, want)
				}
			})
		}
	})
}

// A process passes on the vendor's counts that say more is left than it
// believed only while it measures the others (tell), and it learns that a
// rule keeps their share from its own replies. News that a limit in force
// dropped (a share rose, a cap was learned) makes every process measure:
// else a share measured by one replica lapses when that replica is cut off
// from Redis, the others' counts being saved, and the other consumer is
// refused for windows (the simulation's seed 613919, 30 runs in 40). Off
// (lowered_measures): b never measures.
func TestOthers_EveryProcessMeasuresOnceALimitDrops(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		policy := policies.SlidingLog{Limit: 10, Window: 10 * time.Second}
		rdb := s.Client(t)
		a := newLimiter(t, rdb, policy, Options{Mode: FailFast})
		b := newLimiter(t, s.Client(t), policy, Options{Mode: FailFast})
		pa, err := a.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
		waitSubscribed(t, rdb, a, 2)
		if b.measuringOthers() {
			t.Fatal("b measures the others before any count")
		}
		// The vendor counted the fleet's 2 and 6 of others': a's count
		// measures them, and the limit in force drops.
		if _, _, err := pa.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 2, Limit: 10}}); err != nil {
			t.Fatal(err)
		}
		u, err := a.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Others < 6 {
			t.Fatalf("the quota leaves others %d, want 6 and a spare", u.Rules[0].Others)
		}
		waitFor(t, b.measuringOthers, "b measuring the others after the drop")
	})
}

// A measure of the others that reaches all the room the limit in force
// left them (their share and its spare) does not say how much more they
// asked: the vendor refused it and counts none of it. The share doubles
// then, so that it reaches what they ask in a few counts, not a spare a
// window (the simulation's seed 420466: a unit a window, and the other
// consumer's calls refused for two windows). Others who spent less than
// their room asked no more. Off (others_grow): 4 and a spare of 1, as they
// spent.
func TestOthers_AShareGrowsWhileTheOthersSpendAllItLeaves(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, left := range []int{0, 1} {
			t.Run(fmt.Sprint(left, " left"), func(t *testing.T) {
				ctx := context.Background()
				// Eight replicas, at most two calls each: no spare
				// admissions (TestOthers_RefusedCallsAreNotTheFleets).
				policy := policies.SlidingLog{Limit: 20, Window: 10 * time.Second}
				var lims []*Limiter
				for range 8 {
					lims = append(lims, newLimiter(t, s.Client(t), policy, Options{Mode: FailFast}))
				}
				var calls int
				acquire := func(n int) *Permit {
					var last *Permit
					for range n {
						p, err := lims[calls%8].Acquire(ctx)
						if err != nil {
							t.Fatalf("call %d: %v", calls, err)
						}
						calls, last = calls+1, p
					}
					return last
				}
				// The others spent 3 of 20 beside the fleet's 7: a share of 3
				// and a spare of 1 (others_reserve), a limit in force of 16.
				if _, _, err := acquire(7).Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 10, Limit: 20}}); err != nil {
					t.Fatal(err)
				}
				// The fleet fills its 16; the others spent their 4, or 3 of
				// them with a unit left.
				if _, _, err := acquire(9).Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: left, Limit: 20}}); err != nil {
					t.Fatal(err)
				}
				u, err := lims[0].Usage(ctx)
				if err != nil {
					t.Fatal(err)
				}
				want := 3 + 1
				if left == 0 {
					want = 8 + 1
				}
				if u.Rules[0].Others != want {
					t.Errorf("the quota leaves others %d, want %d", u.Rules[0].Others, want)
				}
			})
		}
	})
}

// Units that settle refunded after a call's slot were in the vendor's
// count when it answered that call (it counted the refunded call at its
// estimate until it ended): the measure of the others counts them as the
// fleet's still (the ':rf' list of settle.lua), or an LLM fleet whose calls
// settle below their estimates measures others that are not there.
func TestOthers_RefundsAfterTheSlotStillCount(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 20, Window: 10 * time.Second}, Options{Mode: FailFast})
		first, err := lim.Acquire(ctx, Cost(8))
		if err != nil {
			t.Fatal(err)
		}
		second, err := lim.Acquire(ctx, Cost(2))
		if err != nil {
			t.Fatal(err)
		}
		// The first call ends and settles at 3 after the second one's slot;
		// the vendor had counted it at 8, and 3 units of another consumer.
		if err := first.Settle(ctx, Cost(3)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := second.Heard(ctx, Answer{Status: http.StatusOK, Tokens: &Count{Remaining: 7, Limit: 20}}); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if want := leftToOthers(3, 20); u.Rules[0].Others != want {
			t.Errorf("the quota leaves others %d, want %d: they spent 3 of the vendor's 13", u.Rules[0].Others, want)
		}
	})
}

// A vendor sends the counts of the moment it answers: the fleet's calls
// still in flight then are in them, at their estimate. Read against the
// fleet's record up to that moment, they are the fleet's own: no share
// for others, and no gap charged.
func TestOthers_CallsInFlightWhenTheVendorAnswersAreTheFleets(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 20, Window: 10 * time.Second}, Options{Mode: FailFast})
		first, err := lim.Acquire(ctx, Cost(5))
		if err != nil {
			t.Fatal(err)
		}
		first.Start()
		// The second call leaves while the first is in flight, well after
		// its slot, and the vendor counts it before it answers the first.
		time.Sleep(50 * time.Millisecond)
		second, err := lim.Acquire(ctx, Cost(6))
		if err != nil {
			t.Fatal(err)
		}
		second.Start()
		if _, _, err := first.Heard(ctx, Answer{Status: http.StatusOK, Tokens: &Count{Remaining: 9, Limit: 20}}); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Others != 0 {
			t.Errorf("the quota leaves others %d, want 0: the vendor counted the fleet's two calls alone", u.Rules[0].Others)
		}
		if u.Rules[0].Used != 11 {
			t.Errorf("the quota counts %d used, want 11: nothing to charge", u.Rules[0].Used)
		}
	})
}

// A vendor's count is about one of its limits: a quota of two rules that
// count calls takes a count stating a limit for the rule of that limit
// alone (about_rules in feedback.lua). Taken for every rule, a count of
// the minute's 10 charged the hour's rule the 95 calls the minute had not
// left, and measured the minute's others by the hour's calls.
func TestOthers_ACountIsAboutTheRuleOfItsLimit(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		policy := policies.All(policies.SlidingLog{Limit: 10, Window: 10 * time.Second},
			policies.SlidingLog{Limit: 100, Window: 100 * time.Second})
		lim := newLimiter(t, s.Client(t), policy, Options{Mode: FailFast, WithoutLearning: true})
		var last *Permit
		for range 3 {
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			last = p
		}
		// The minute's count: 2 left of 10, the others spent 5 of it.
		if _, _, err := last.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 2, Reset: 10 * time.Second, Limit: 10}}); err != nil {
			t.Fatal(err)
		}
		// The hour's count: 60 left of 100, the others spent 37 of it, and
		// none of the minute's beyond the five above.
		if _, _, err := last.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 60, Reset: 100 * time.Second, Limit: 100}}); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		minute, hour := u.Rules[0], u.Rules[1]
		if minute.Remaining > 2 || hour.Remaining < 30 || hour.Remaining > 60 {
			t.Errorf("remaining %d of the minute, want at most 2, and %d of the hour, want 30 to 60: each count charges its own rule",
				minute.Remaining, hour.Remaining)
		}
		if minute.Others > 8 || hour.Others < 37 {
			t.Errorf("the minute leaves others %d, want at most 8, the hour %d, want at least 37: each count measures its own rule's others",
				minute.Others, hour.Others)
		}
	})
}

// An answer comes its call's latency after the call's slot (an LLM's,
// seconds): the fleet's record of the vendor's window before the slot is
// kept that much longer, or the measure of the others takes the calls
// that left the record, not the vendor's window, for other consumers'
// (Answers' lag in lua/lib.lua). A counter of 40 buckets, a burst of 10,
// then a call 0.85 of a window later: its answer, 0.95 of a window late,
// finds the record short and measures nothing; the lag it leaves keeps
// the next burst, and the next such call's answer, 0.35 of a window late,
// measures the 5 units another consumer spent, and no more. Without the
// lag, the first measured the burst as others' (10) and the second the
// same. A burst whose slots spread over more than a fifth of a window (a
// busy machine) is tried again, up to three times: its first calls may
// lie outside the vendor's window. The lag is written even when nothing
// else of the quota's state changed. Long: its windows are waited out in
// real time, and under -race beside CI's other work miniredis ran its
// scripts hundreds of milliseconds late.
func TestOthers_ALateAnswerFindsTheRecordOfItsWindow(t *testing.T) {
	long(t)
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		const window = 500 * time.Millisecond
		lim := newLimiter(t, s.Client(t), policies.SlidingCounter{Limit: 40, Window: window, Buckets: 40},
			Options{Mode: FailFast, WithoutLearning: true})
		// An answer on time first: the quota has heard a count, and the
		// first late answer's lag is the only news it writes.
		p, err := lim.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := p.Heard(context.Background(), Answer{Status: http.StatusOK, Requests: &Count{Remaining: 39, Limit: 40}}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * window)
		round := func(others int, late time.Duration) int {
			for try := 1; ; try++ {
				got, tight := lateAnswerRound(t, lim, window, others, late)
				if tight || try == 3 {
					return got
				}
				t.Logf("try %d: the burst's slots spread over more than a fifth of a window", try)
				time.Sleep(2 * window)
			}
		}
		// Another consumer spent 1: the count says fewer are left than the
		// quota believed, and goes to Redis with its lateness.
		if got := round(1, window*95/100); got != 0 {
			t.Errorf("the first late answer: the quota leaves others %d, want 0: the record it found was short, and it measures nothing", got)
		}
		time.Sleep(2 * window) // the first round leaves every window
		// 5 and the spare of their share; as low as 3 when a spread burst's
		// first calls lie at the edge of the vendor's window, which the
		// measure counts as the fleet's (it errs low).
		if got := round(5, window*35/100); got < 3 || got > 7 {
			t.Errorf("the second late answer: the quota leaves others %d, want 5 and the spare of their share: the lag kept the record of its window", got)
		}
	})
}

// lateAnswerRound sends a burst of 10 calls, a call 0.85 of a window
// later, answered late by late with a count of the burst's calls in the
// vendor's window, that call and others, and returns the others' share
// the quota leaves then, and whether the burst's slots lay within a fifth
// of a window.
func lateAnswerRound(t *testing.T, lim *Limiter, window time.Duration, others int, late time.Duration) (int, bool) {
	ctx := context.Background()
	var burst []*Permit
	for range 10 {
		p, err := lim.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		burst = append(burst, p)
	}
	time.Sleep(window * 85 / 100)
	p, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(late)
	// A call now trims the record as of now.
	if _, err := lim.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	counted := 1 + others // the call, the others, and the burst's calls in the window
	for _, b := range burst {
		if b.r.slot() > p.r.slot()-window {
			counted++
		}
	}
	if _, _, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 40 - counted, Limit: 40}}); err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return u.Rules[0].Others, burst[len(burst)-1].r.slot()-burst[0].r.slot() <= window/5
}

// A fleet whose estimates are 5% under the vendor's count (OpenAI's, with
// tokens.Estimate) measures "others" that scale with its own calls: a
// twentieth of what it sent. In a lull, when it sent little, the measures
// are low, though the share is there again with its next full window: the
// share is held while no count since saw the fleet as busy as the one that
// measured it. Others that stop while the fleet stays as busy are let go
// a window and a half after, as before. A log of 100 in 10 s, in virtual
// time: 80 calls and a count of 84, then, 12 s later, 20 calls and a count
// of 21, and 20 s in, one more call counted as 22 (the lull): the share
// of 4 stays (2 off). Others of 4 that stop while the fleet sends 80 again
// are gone 20 s in.
func TestOthers_AShareThatScalesWithTheFleetHoldsThroughALull(t *testing.T) {
	for _, c := range []struct {
		name         string
		second       int // calls 12 s in
		vendorSecond int // what the vendor counts of them
		vendorLast   int // and of them and one more, 20 s in
		least, most  int // Others 20 s in
	}{
		{"lull", 20, 21, 22, 5, 100},
		{"others stopped", 80, 80, 81, 0, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				lim := measuringLimiter(t, 100)
				heardAfter(t, lim, 80, 1, 100-84, 100)
				time.Sleep(12 * time.Second)
				heardAfter(t, lim, c.second, 1, 100-c.vendorSecond, 100)
				time.Sleep(8 * time.Second)
				heardAfter(t, lim, 1, 1, 100-c.vendorLast, 100)
				u, err := lim.Usage(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if o := u.Rules[0].Others; o < c.least || o > c.most {
					t.Errorf("the rule leaves others %d 20 s in, want %d to %d", o, c.least, c.most)
				}
			})
		})
	}
}

// measuringLimiter returns a FailFast limiter of a log of limit units in
// 10 s on a simulated Redis, closed at the end of the bubble it is made in.
func measuringLimiter(t *testing.T, limit int) *Limiter {
	r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
	t.Cleanup(r.Close)
	lim := newLimiter(t, simClient(t, r, 0), policies.SlidingLog{Limit: limit, Window: 10 * time.Second},
		Options{Mode: FailFast, WithoutLearning: true, Logger: quiet()})
	t.Cleanup(func() { closeInBubble(lim) })
	return lim
}

// heardAfter admits n calls of cost units each, and has the last hear the
// vendor's count of left units of limit.
func heardAfter(t *testing.T, lim *Limiter, n, cost, left, limit int) {
	t.Helper()
	ctx := context.Background()
	var last *Permit
	for range n {
		p, err := lim.Acquire(ctx, Cost(cost))
		if err != nil {
			t.Fatal(err)
		}
		last = p
	}
	if _, _, err := last.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: left, Reset: 10 * time.Second, Limit: limit}}); err != nil {
		t.Fatal(err)
	}
}

// The measures of a share held steady differ by a few units from one
// burst to the next: the share is left in steps of a sixty-fourth of the
// vendor's limit, so that a rise within a step does not lower the limit in
// force, and every call booked ahead need not book again. A log of 16,000
// tokens in 10 s: 8,000 sent, the vendor counts 8,400 (others 400); 3 s
// later 1,000 more, the vendor counts 9,450 (450): the limit in force
// stays (off: 15,574 then 15,521).
func TestOthers_AShareWithinItsStepLowersNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lim := measuringLimiter(t, 16_000)
		limit := func() (int, int) {
			u, err := lim.Usage(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			return u.Rules[0].Limit, u.Rules[0].Others
		}
		heardAfter(t, lim, 1, 8_000, 16_000-8_400, 16_000)
		first, others := limit()
		if others < 400 {
			t.Fatalf("the rule leaves others %d after a count of 400 more than the fleet sent, want at least 400", others)
		}
		time.Sleep(3 * time.Second)
		heardAfter(t, lim, 1, 1_000, 16_000-9_450, 16_000)
		if second, _ := limit(); second != first {
			t.Errorf("the limit in force went from %d to %d for others measured at 400 then 450, want it to stay", first, second)
		}
	})
}

// A count taken at the call's arrival (Anthropic's, an OpenAI count sent
// at arrival) holds the fleet's calls still in flight then at their
// estimate, though some of them settled lower since: the charge reads
// those units as the vendor does, as the measure of the others does, and
// charges no gap they explain. A log of 1,000 tokens: two calls of 400,
// the first settled to 100 after the second arrived, whose count says 200
// left (800 counted): 500 left, not 200 (charge_refunds off).
func TestOthers_ACountTakenAtArrivalChargesNoRefund(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lim := measuringLimiter(t, 1000)
		ctx := context.Background()
		first := acquire(t, lim, Cost(400))
		second := acquire(t, lim, Cost(400))
		time.Sleep(50 * time.Millisecond)
		if err := first.Settle(ctx, Cost(100)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
		a := Answer{Status: http.StatusOK, Tokens: &Count{Remaining: 200, Reset: 10 * time.Second, Limit: 1000}}
		if _, _, err := second.Heard(ctx, a); err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := u.Rules[0].Remaining; got != 500 {
			t.Errorf("%d tokens left after a count taken before the first call settled, want 500: the settled units are no gap", got)
		}
	})
}
