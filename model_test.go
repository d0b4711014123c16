package throttle

import (
	"context"
	"math/rand/v2"
	"sort"
	"strconv"
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
func TestScript_MatchesModel(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		checkAgainstModel(t, s.Client(t), s.Mini, 60)
	})
}

func TestScript_MatchesModelOnCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	checkAgainstModel(t, c.Client(t), nil, 30)
}

type modelCase struct {
	policy policies.Policy
	rules  []model.Rule
}

func randomCase(rng *rand.Rand) modelCase {
	log := func(perKey bool) (policies.SlidingLog, model.Rule) {
		p := policies.SlidingLog{
			Limit:  1 + rng.IntN(8),
			Window: time.Duration(5+rng.IntN(50)) * time.Millisecond,
			Margin: time.Duration(rng.IntN(3)) * time.Millisecond,
		}
		return p, model.Rule{Limit: p.Limit, Window: p.EffectiveWindow().Microseconds(), PerKey: perKey}
	}
	g, gr := log(false)
	switch rng.IntN(4) {
	case 0:
		return modelCase{g, []model.Rule{gr}}
	case 1:
		k, kr := log(true)
		return modelCase{policies.PerKey{Policy: k}, []model.Rule{kr}}
	case 2:
		k, kr := log(true)
		return modelCase{policies.All(g, policies.PerKey{Policy: k}), []model.Rule{gr, kr}}
	default:
		g2, g2r := log(false)
		k, kr := log(true)
		return modelCase{policies.All(g, g2, policies.PerKey{Policy: k}), []model.Rule{gr, g2r, kr}}
	}
}

func checkAgainstModel(t *testing.T, rdb redis.UniversalClient, mini *miniredis.Miniredis, seeds int) {
	ctx := context.Background()
	for seed := range seeds {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		tc := randomCase(rng)
		now := int64(1_700_000_000_000_000) + int64(seed)*1_000_000_000
		var opts []Option
		useTIME := mini != nil && seed%2 == 0
		if useTIME {
			// miniredis answers TIME from its settable clock, so the script's
			// own TIME path is checked too.
			mini.SetTime(time.UnixMicro(now))
		} else {
			opts = append(opts, WithClock(func() time.Time { return time.UnixMicro(now) }))
		}
		name := "model-" + strconv.Itoa(seed) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
		lim, err := New(rdb, name, tc.policy, opts...)
		if err != nil {
			t.Fatal(err)
		}
		m := model.New(tc.rules...)
		window := tc.rules[0].Window
		type booking struct {
			c call
			r result
		}
		var booked []booking
		for step := range 150 {
			switch rng.IntN(3) {
			case 0: // same microsecond
			case 1:
				now += rng.Int64N(window / 4)
			default:
				now += rng.Int64N(window * 3 / 2)
			}
			if useTIME {
				mini.SetTime(time.UnixMicro(now))
			}
			if len(booked) > 0 && rng.IntN(8) == 0 {
				i := rng.IntN(len(booked))
				b := booked[i]
				booked = append(booked[:i], booked[i+1:]...)
				lim.cancel(ctx, b.c, b.r)
				m.Cancel(b.r.member)
				continue
			}
			c := call{key: "k" + strconv.Itoa(rng.IntN(3)), hasKey: true, cost: 1 + rng.IntN(min(3, lim.maxCost))}
			maxWait := []time.Duration{0, time.Duration(window/3) * time.Microsecond, time.Duration(window*2) * time.Microsecond, time.Duration(window*10) * time.Microsecond}[rng.IntN(4)]
			r, err := lim.acquire(ctx, c, maxWait)
			if err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
			want := m.Acquire(now, r.member, c.key, c.cost, maxWait.Microseconds())
			got := model.Decision{Admitted: r.admitted, Wait: r.wait.Microseconds(), Remaining: r.remaining}
			if got != want {
				t.Fatalf("seed %d step %d (%+v, key %s cost %d maxWait %v): script %+v, model %+v",
					seed, step, tc.rules, c.key, c.cost, maxWait, got, want)
			}
			if r.now.Microseconds() != now {
				t.Fatalf("seed %d step %d: script used time %d, want %d", seed, step, r.now.Microseconds(), now)
			}
			if r.admitted && r.wait > 0 {
				booked = append(booked, booking{c, r})
			}
		}
		for log, n := range m.MaxInWindow() {
			if limit := tc.rules[log[0]-'0'].Limit; n > limit {
				t.Fatalf("seed %d: model log %s held %d units in one window, limit %d", seed, log, n, limit)
			}
		}
		checkRedisWindows(t, rdb, lim, tc.rules)
	}
}

// checkRedisWindows reads every log the limiter wrote straight from Redis and
// checks, by brute force, that no window holds more than its limit.
func checkRedisWindows(t *testing.T, rdb redis.UniversalClient, lim *Limiter, rules []model.Rule) {
	t.Helper()
	ctx := context.Background()
	for i, r := range rules {
		keys := []string{lim.shared[2+i]}
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
