package throttle

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/model"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// The script and the brute-force reference model must take the same decision,
// to the microsecond, for every call of a random history: random arrival
// times (many in the same microsecond), costs, keys, waits and cancellations,
// under one, two or three limits.
//
// redis-server, which users run, checks 40 histories of each mix of
// kinds; miniredis 10, for what its Lua and its TIME do differently: it
// runs the scripts in the test's process, five times slower under -race.
// The default run checks a fifth of them (8 and 2, both of miniredis's
// clocks); THROTTLE_LONG=1 without -race checks them all.
func TestScript_MatchesModel(t *testing.T) {
	skipLongModelUnderRace(t)
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		seeds := 40
		if !s.Real {
			seeds = 10
		}
		checkAgainstModel(t, s.Client(t), s.Mini, modelSeeds(seeds))
	})
}

// Room given back moves the calls booked after it (move.go): random
// histories of bookings, refunds, cancels and moves, on every kind of rule
// but the token bucket (which can take back only its latest call's units,
// so its calls never move), decided by the script and the model alike; no
// window ever holds more than its limit, and no moved call ends later
// than it was.
func TestScript_MovesMatchModel(t *testing.T) {
	skipLongModelUnderRace(t)
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		seeds := modelSeeds(20)
		if !s.Real {
			seeds = modelSeeds(5)
		}
		var stats moveStats
		for _, kinds := range [][]policies.Kind{
			{policies.KindSlidingLog},
			{policies.KindSlidingCounter},
			{policies.KindConcurrency, policies.KindSlidingLog},
			{policies.KindSlidingLog, policies.KindSlidingCounter, policies.KindConcurrency},
		} {
			for seed := range seeds {
				rng := rand.New(rand.NewPCG(uint64(seed), 99+uint64(len(kinds))))
				run := modelRun{name: fmt.Sprint(kinds), tc: randomPolicy(rng, kinds), steps: 200, maxCost: 3, moves: &stats}
				checkSeed(t, s.Client(t), s.Mini, rng, run, uint64(seed))
			}
		}
		// Both ways out of a move were taken, often.
		if stats.earlier < 3*seeds || stats.kept < 3*seeds {
			t.Fatalf("the histories moved %d calls earlier and kept %d at their slots: too few to tell", stats.earlier, stats.kept)
		}
		t.Logf("moved %d calls earlier, kept %d, sent %d back (a class's hold lowered its limit since they were booked)", stats.earlier, stats.kept, stats.sentBack)
	})
}

func TestScript_MatchesModelOnCluster(t *testing.T) {
	skipLongModelUnderRace(t)
	t.Parallel()
	c := redistest.StartCluster(t)
	checkAgainstModel(t, c.Client(t), nil, modelSeeds(15))
}

// skipLongModelUnderRace skips a model check under -race with
// THROTTLE_LONG=1: .ci/run runs every history of it without -race, and one
// goroutine replays a history, where the race detector finds nothing.
func skipLongModelUnderRace(t *testing.T) {
	if raceEnabled && longRun() {
		t.Skip("run whole without -race in .ci/run's second step")
	}
}

// modelSeeds is how many histories of each kind a model check runs: all
// of them with THROTTLE_LONG=1 without -race, a fifth (at least one)
// without -race otherwise, a twentieth under it. One goroutine replays a
// history: the race detector finds nothing more in the long runs, and
// makes them minutes (.ci/run runs them all without it; the README's
// go test -race ./... keeps to its 90 s).
func modelSeeds(all int) int {
	switch {
	case longRun() && !raceEnabled:
		return all
	case raceEnabled:
		return max(all/20, 1)
	}
	return max(all/5, 1)
}

type modelCase struct {
	policy policies.Policy
	rules  []model.Rule
}

func toModel(r policies.Rule) model.Rule {
	return model.Rule{
		Kind:   model.Kind(r.Kind),
		Limit:  r.Limit,
		Window: r.Window.Microseconds(),
		Width:  r.Bucket.Microseconds(),
		Every:  r.Every.Microseconds(),
		Lease:  r.Lease.Microseconds(),
		PerKey: r.PerKey,
		Span:   (r.Window - r.Margin).Microseconds(),
	}
}

// randomPolicy draws one to three rules of any kind, some of them per key.
func randomPolicy(rng *rand.Rand, kinds []policies.Kind) modelCase {
	ms := func(lo, hi int) time.Duration { return time.Duration(lo+rng.IntN(hi-lo)) * time.Millisecond }
	one := func() policies.Policy {
		switch kinds[rng.IntN(len(kinds))] {
		case policies.KindSlidingCounter:
			return policies.SlidingCounter{Limit: 1 + rng.IntN(12), Window: ms(5, 50), Buckets: 1 + rng.IntN(8), Margin: time.Duration(rng.IntN(3)) * time.Millisecond}
		case policies.KindTokenBucket:
			return policies.TokenBucket{Rate: 1 + rng.IntN(5), Per: ms(5, 50), Burst: rng.IntN(5)}
		case policies.KindConcurrency:
			return policies.Concurrency{Max: 1 + rng.IntN(4), Lease: ms(5, 100)}
		}
		return policies.SlidingLog{Limit: 1 + rng.IntN(8), Window: ms(5, 55), Margin: time.Duration(rng.IntN(3)) * time.Millisecond}
	}
	var ps []policies.Policy
	for range 1 + rng.IntN(3) {
		p := one()
		if rng.IntN(3) == 0 {
			p = policies.PerKey{Policy: p}
		}
		ps = append(ps, p)
	}
	policy := policies.All(ps...)
	if _, err := policies.Rules(policy); err != nil {
		panic(err)
	}
	tc := modelCase{policy: policy}
	for _, p := range ps {
		tc.rules = append(tc.rules, modelRules(p, false)...)
	}
	return tc
}

// modelRules builds the model's rules from a policy's fields as their
// documentation states them, not from policies.Rules: a slip in the
// flattening (a margin or a default dropped, a bucket width off) then shows
// as a difference between the script and the model.
func modelRules(p policies.Policy, perKey bool) []model.Rule {
	us := func(d time.Duration) int64 { return d.Microseconds() }
	// A margin of zero means DefaultMargin; it widens the window.
	widened := func(w, margin time.Duration) time.Duration {
		if margin == 0 {
			margin = policies.DefaultMargin
		}
		return w + margin
	}
	// Rounded up to the microsecond, as the script counts.
	ceilUS := func(d time.Duration) int64 { return (d.Nanoseconds() + 999) / 1000 }
	switch p := p.(type) {
	case policies.PerKey:
		return modelRules(p.Policy, true)
	case policies.SlidingLog:
		// A margin of at least 2ms may grow to a tenth of the window, at
		// most a second; while a warming quota's first calls are held, the
		// margin in force is halfway to that, or to 200ms if less, rounded
		// up.
		m, w := us(widened(0, p.Margin)), us(p.Window)
		ceiling := m
		if m >= 2000 {
			ceiling = max(m, min(w/10, 1_000_000))
		}
		warm := max(m, min(ceiling, 200_000))
		return []model.Rule{{Kind: model.Kind(policies.KindSlidingLog), Limit: p.Limit, Window: w + m, PerKey: perKey,
			Keep: w + ceiling, Warm: (m+warm+1)/2 - m, Span: w}}
	case policies.SlidingCounter:
		w := widened(p.Window, p.Margin)
		n := p.Buckets
		if n == 0 {
			n = policies.DefaultBuckets
		}
		return []model.Rule{{Kind: model.Kind(policies.KindSlidingCounter), Limit: p.Limit, Window: us(w), Width: ceilUS(w / time.Duration(n)), PerKey: perKey,
			Keep: us(w), Span: us(p.Window)}}
	case policies.TokenBucket:
		// Burst zero means 1; one unit every Per/Rate.
		return []model.Rule{{Kind: model.Kind(policies.KindTokenBucket), Limit: max(p.Burst, 1), Every: ceilUS(p.Per / time.Duration(p.Rate)), PerKey: perKey}}
	case policies.Concurrency:
		lease := p.Lease
		if lease == 0 {
			lease = policies.DefaultLease
		}
		return []model.Rule{{Kind: model.Kind(policies.KindConcurrency), Limit: p.Max, Lease: us(lease), PerKey: perKey}}
	}
	panic(fmt.Sprintf("modelRules: no model of %T", p))
}

func checkAgainstModel(t *testing.T, rdb redis.UniversalClient, mini *miniredis.Miniredis, seeds int) {
	for _, kinds := range [][]policies.Kind{
		{policies.KindSlidingLog},
		{policies.KindSlidingCounter},
		{policies.KindTokenBucket},
		{policies.KindConcurrency, policies.KindSlidingLog},
		{policies.KindSlidingLog, policies.KindSlidingCounter, policies.KindTokenBucket, policies.KindConcurrency},
	} {
		for seed := range seeds {
			rng := rand.New(rand.NewPCG(uint64(seed), uint64(len(kinds))*7+uint64(kinds[0])))
			run := modelRun{name: fmt.Sprint(kinds), tc: randomPolicy(rng, kinds), steps: 150, maxCost: 3}
			checkSeed(t, rdb, mini, rng, run, uint64(seed))
		}
	}
}

// held is a call the script admitted or booked, as a history holds it.
type held struct {
	c call
	r result
}

// modelHistory is one random history under way: the limiter and the model
// it is checked against, the script's clock, and the calls held so far.
type modelHistory struct {
	t        *testing.T
	rng      *rand.Rand
	mini     *miniredis.Miniredis // when not nil and useTIME, the script reads its clock
	useTIME  bool
	lim      *Limiter
	m        *model.Model
	run      modelRun
	seed     uint64
	now      int64
	booked   []held
	admitted []held
	pauses   map[string]int64 // Redis time until which the quota ("") or a key is paused
}

// moveBookings gives one booking back, mostly, and moves one to four of
// the calls booked, in one script call with some new calls, as the
// sleeping calls of a process do when the fleet gives units back: the script and the model must take the same
// decisions, no moved call may end later than it was, and the calls that
// moved replace their old bookings in what it returns.
func (mh *modelHistory) moveBookings(where string) {
	mh.t.Helper()
	if len(mh.booked) > 1 && mh.rng.IntN(4) > 0 {
		// What sets calls moving: one gives its booking back.
		h := mh.take(&mh.booked)
		mh.lim.cancel(context.Background(), h.c, h.r)
		mh.m.Cancel(h.r.member, h.c.key, h.c.cost, h.r.slot().Microseconds(), mh.now)
	}
	batch, moving := mh.pickMoves()
	if len(batch) == 0 {
		return
	}
	mh.lim.decide(batch[0].sc, batch)
	mh.m.Script(mh.now)
	for _, req := range batch { // every booking given back first, as the script does
		if h, ok := moving[req]; ok {
			mh.m.Cancel(h.r.member, h.c.key, h.c.cost, h.r.slot().Microseconds(), mh.now)
		}
	}
	for _, req := range batch { // decide sorted them: moves first, by their slots
		mh.checkMove(req, moving, len(batch), where)
	}
	mh.m.EndScript(mh.now)
}

// pickMoves takes one to four booked calls to move, each with the wait
// left before its slot, and adds up to two new calls beside them.
func (mh *modelHistory) pickMoves() (batch []*request, moving map[*request]held) {
	rng, lim, now := mh.rng, mh.lim, mh.now
	moving = map[*request]held{}
	for range 1 + rng.IntN(4) {
		if len(mh.booked) == 0 {
			break
		}
		i := rng.IntN(len(mh.booked))
		h := mh.booked[i]
		// A wait past the slot too: the process reckons it before its
		// call waits in the lane behind another script call.
		gain := []int64{0, 2000, -3000}[rng.IntN(3)]
		left := h.r.slot().Microseconds() - now - gain
		if left <= 0 || h.r.slot().Microseconds() <= now {
			continue
		}
		mh.booked = append(mh.booked[:i], mh.booked[i+1:]...)
		c := h.c
		c.moves = true
		r := h.r
		req := &request{sc: lim.scopeFor(c), c: c, maxWait: time.Duration(left) * time.Microsecond, member: lim.newMember(), late: &r, done: make(chan struct{})}
		batch = append(batch, req)
		moving[req] = h
	}
	for range rng.IntN(3) {
		c := call{key: "k" + strconv.Itoa(rng.IntN(3)), hasKey: true, cost: 1}
		batch = append(batch, &request{sc: lim.scopeFor(c), c: c, maxWait: 40 * time.Millisecond, member: lim.newMember(), done: make(chan struct{})})
	}
	return batch, moving
}

// checkMove compares the script's decision on one call of a batch of
// moves with the model's, and keeps the call when it is booked.
func (mh *modelHistory) checkMove(req *request, moving map[*request]held, size int, where string) {
	t, m, now := mh.t, mh.m, mh.now
	t.Helper()
	r, c := req.res, req.c
	if req.err != nil {
		t.Fatalf("%s: %v", where, req.err)
	}
	pause := max(mh.pauses[""], mh.pauses[c.key])
	h, moved := moving[req]
	maxWait := req.maxWait.Microseconds()
	if moved {
		// Only a slot before its own moves it.
		maxWait = min(maxWait, h.r.slot().Microseconds()-now-1)
	}
	want := m.AcquireIn(now, pause, r.member, c.key, c.priority, c.cost, maxWait)
	if moved && !want.Admitted {
		if kept, ok := m.KeepIn(now, r.member, c.key, c.priority, c.cost, h.r.slot().Microseconds()); ok {
			want = kept
		}
	}
	got := model.Decision{Admitted: r.admitted, Wait: r.wait.Microseconds(), Remaining: r.remaining, Room: r.room, Busy: r.reason == reasonBusy}
	if got != want {
		t.Fatalf("%s: moving %v, key %s cost %d maxWait %v (batch of %d): script %+v, model %+v", where, moved, c.key, c.cost, req.maxWait, size, got, want)
	}
	if moved && r.admitted && r.slot() > h.r.slot() {
		t.Fatalf("%s: a call moved from slot %d to %d, later", where, h.r.slot().Microseconds(), r.slot().Microseconds())
	}
	switch {
	case moved && !r.admitted:
		mh.run.moves.sentBack++
	case moved && r.slot() < h.r.slot():
		mh.run.moves.earlier++
	case moved:
		mh.run.moves.kept++
	}
	if r.admitted && r.wait > 0 {
		mh.booked = append(mh.booked, held{c, r})
	}
}

// modelRun is one random history checked against the model.
type modelRun struct {
	name    string
	tc      modelCase
	steps   int
	maxCost int
	moves   *moveStats // when not nil, some steps move bookings earlier, as room given back makes sleeping calls do
}

// moveStats counts what the moves of model histories did.
type moveStats struct{ earlier, kept, sentBack int }

// checkSeed replays the random history of seed on lim and on the model:
// every decision must agree, the model keep its promise, and no window in
// Redis hold more than its limit.
func checkSeed(t *testing.T, rdb redis.UniversalClient, mini *miniredis.Miniredis, rng *rand.Rand, run modelRun, seed uint64) {
	mh := startHistory(t, rdb, mini, rng, run, seed)
	for i := range run.steps {
		mh.advance()
		mh.step(i)
	}
	if v := mh.m.Violations(); len(v) > 0 {
		t.Fatalf("kinds %s seed %d: the model broke its promise: %v", run.name, seed, v)
	}
	checkRedisWindows(t, rdb, mh.lim, run.tc.rules)
}

// startHistory makes the limiter of a history, on the test's clock or on
// the clock of miniredis, and the model beside it.
func startHistory(t *testing.T, rdb redis.UniversalClient, mini *miniredis.Miniredis, rng *rand.Rand, run modelRun, seed uint64) *modelHistory {
	mh := &modelHistory{t: t, rng: rng, mini: mini, run: run, seed: seed, pauses: map[string]int64{}}
	mh.now = int64(1_700_000_000_000_000) + int64(seed)*1_000_000_000
	var opts Options
	mh.useTIME = mini != nil && seed%2 == 0
	if mh.useTIME {
		// miniredis answers TIME from its settable clock, so the script's
		// own TIME path is checked too.
		mini.SetTime(time.UnixMicro(mh.now))
	} else {
		opts.Clock = func() time.Time { return time.UnixMicro(mh.now) }
	}
	name := fmt.Sprintf("model-%v-%d-%d", run.name, seed, time.Now().UnixNano())
	lim, err := New(rdb, strings.NewReplacer(" ", "", "[", "", "]", "").Replace(name), run.tc.policy, opts)
	if err != nil {
		t.Fatal(err)
	}
	if mh.useTIME {
		// Redis's clock runs as the test says, far faster than this
		// process's: the limiter reads it as the test's clock, not as a
		// clock that keeps stepping forward.
		lim.timing = newTiming(func() time.Time { return time.UnixMicro(mh.now) })
	}
	mh.lim, mh.m = lim, model.New(run.tc.rules...)
	return mh
}

// modelStep is the mean time between a history's steps, in microseconds.
const modelStep = int64(20_000)

// advance moves the clock to the next step: the same microsecond, a
// little later, or up to one and a half steps later.
func (mh *modelHistory) advance() {
	switch mh.rng.IntN(3) {
	case 0: // same microsecond
	case 1:
		mh.now += mh.rng.Int64N(modelStep / 4)
	default:
		mh.now += mh.rng.Int64N(modelStep * 3 / 2)
	}
	if mh.useTIME {
		mh.mini.SetTime(time.UnixMicro(mh.now))
	}
}

// step does one thing a fleet does to the quota, drawn at random.
func (mh *modelHistory) step(i int) {
	ctx, t, lim, m, now := context.Background(), mh.t, mh.lim, mh.m, mh.now
	switch op := mh.rng.IntN(12); {
	case op == 0 && len(mh.booked) > 0:
		h := mh.take(&mh.booked)
		lim.cancel(ctx, h.c, h.r)
		m.Cancel(h.r.member, h.c.key, h.c.cost, h.r.slot().Microseconds(), now)
	case op == 1 && len(mh.admitted) > 0:
		h := mh.take(&mh.admitted)
		lim.permit(h.c, h.r, 0).Release()
		m.Release(h.r.member, h.c.key, now)
	case op == 3:
		mh.pause(i)
	case op >= 4 && op <= 6 && mh.run.moves != nil && len(mh.booked) > 0:
		mh.moveBookings(mh.where(i))
	case op == 2 && len(mh.admitted) > 0:
		// Settle refunds only: a charge may exceed the limit on purpose.
		h := mh.take(&mh.admitted)
		to := mh.rng.IntN(h.c.cost)
		if err := lim.permit(h.c, h.r, 0).Settle(ctx, Cost(to)); err != nil {
			t.Fatalf("%s: Settle: %v", mh.where(i), err)
		}
		m.Settle(h.r.member, h.c.key, h.c.cost, to, h.r.slot().Microseconds(), now)
	default:
		mh.decideCalls(i)
	}
}

// take removes a call at random from hs and returns it.
func (mh *modelHistory) take(hs *[]held) held {
	i := mh.rng.IntN(len(*hs))
	h := (*hs)[i]
	*hs = append((*hs)[:i], (*hs)[i+1:]...)
	return h
}

// where names the history and its step i in a failure.
func (mh *modelHistory) where(i int) string {
	return fmt.Sprintf("kinds %s seed %d step %d (%+v)", mh.run.name, mh.seed, i, mh.run.tc.rules)
}

// pause is the vendor asking the fleet to pause: no call is admitted
// before the pause ends, and nothing counts as free during it. A quota
// with only per-key limits pauses one key.
func (mh *modelHistory) pause(i int) {
	d := time.Duration(mh.rng.Int64N(30_000)) * time.Microsecond
	var opts []CallOption
	key := ""
	if !mh.lim.cfg.hasShared {
		key = "k" + strconv.Itoa(mh.rng.IntN(3))
		opts = append(opts, Key(key))
	}
	if err := mh.lim.Pause(context.Background(), d, opts...); err != nil {
		mh.t.Fatalf("%s: Pause: %v", mh.where(i), err)
	}
	if d > 0 {
		mh.pauses[key] = max(mh.pauses[key], mh.now+d.Microseconds())
	}
}

// decideCalls decides new calls in one script call, sometimes several,
// as concurrent calls of a process do, of one key or of several: they
// are decided in order, as the model decides them.
func (mh *modelHistory) decideCalls(i int) {
	t, rng, lim, m, now := mh.t, mh.rng, mh.lim, mh.m, mh.now
	key := "k" + strconv.Itoa(rng.IntN(3))
	var batch []*request
	for range 1 + rng.IntN(3)*rng.IntN(3) {
		if rng.IntN(2) == 0 {
			key = "k" + strconv.Itoa(rng.IntN(3))
		}
		// Priorities too, now and then: a class above the others
		// is held its share of the rules (see Classes).
		prio := []int{0, 0, 0, 3, 7}[rng.IntN(5)]
		c := call{key: key, hasKey: true, cost: 1 + rng.IntN(min(mh.run.maxCost, lim.cfg.maxCost)), priority: prio}
		batch = append(batch, &request{
			sc:      lim.scopeFor(c),
			c:       c,
			maxWait: []time.Duration{0, 7 * time.Millisecond, 40 * time.Millisecond, 200 * time.Millisecond}[rng.IntN(4)],
			member:  lim.newMember(),
			done:    make(chan struct{}),
		})
	}
	lim.decide(batch[0].sc, batch)
	m.Script(now)
	for _, req := range batch {
		r, c := req.res, req.c
		if req.err != nil {
			t.Fatalf("%s: %v", mh.where(i), req.err)
		}
		want := m.AcquireIn(now, max(mh.pauses[""], mh.pauses[c.key]), r.member, c.key, c.priority, c.cost, req.maxWait.Microseconds())
		got := model.Decision{Admitted: r.admitted, Wait: r.wait.Microseconds(), Remaining: r.remaining, Room: r.room, Busy: r.reason == reasonBusy}
		if got != want {
			t.Fatalf("%s: key %s priority %d cost %d maxWait %v (batch of %d): script %+v, model %+v", mh.where(i), c.key, c.priority, c.cost, req.maxWait, len(batch), got, want)
		}
		if r.now.Microseconds() != now {
			t.Fatalf("%s: script used time %d, want %d", mh.where(i), r.now.Microseconds(), now)
		}
		if r.admitted && r.wait > 0 {
			mh.booked = append(mh.booked, held{c, r})
		} else if r.admitted {
			mh.admitted = append(mh.admitted, held{c, r})
		}
	}
	m.EndScript(now)
}

// checkRedisWindows reads every log the limiter wrote straight from Redis and
// checks, by brute force, that no window holds more than its limit.
func checkRedisWindows(t *testing.T, rdb redis.UniversalClient, lim *Limiter, rules []model.Rule) {
	t.Helper()
	ctx := context.Background()
	for i, r := range rules {
		if r.Kind != model.Log {
			continue
		}
		keys := []string{lim.cfg.shared[2+i]}
		if r.PerKey {
			keys = keys[:0]
			for k := range 3 {
				keys = append(keys, lim.scopeFor(call{key: "k" + strconv.Itoa(k), hasKey: true}).keys[2+i])
			}
		}
		for _, key := range keys {
			zs, err := rdb.ZRangeWithScores(ctx, key, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			at := make([]int64, len(zs))
			for j, z := range zs {
				at[j] = int64(z.Score)
			}
			sort.Slice(at, func(a, b int) bool { return at[a] < at[b] })
			for j := range at {
				n := 0
				for k := j; k >= 0 && at[k] > at[j]-r.Window; k-- {
					n++
				}
				if n > r.Limit {
					t.Fatalf("%s: %d units in the window ending at %d, limit %d", key, n, at[j], r.Limit)
				}
			}
		}
	}
}
