package throttle

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// batchCall is one call of a batch a test decides at once.
type batchCall struct {
	key     string
	cost    int
	maxWait time.Duration
}

// decideBatch decides calls in one script call, as the lane does with the
// calls that queued while a decision was on its way.
func decideBatch(l *Limiter, calls []batchCall) []result {
	batch := make([]*request, len(calls))
	for i, bc := range calls {
		c := call{key: bc.key, hasKey: true, cost: bc.cost}
		batch[i] = &request{sc: l.scopeFor(c), c: c, maxWait: bc.maxWait, member: l.newMember(), done: make(chan struct{})}
	}
	l.decide(batch[0].sc, batch)
	out := make([]result, len(batch))
	for i, req := range batch {
		out[i] = req.res
	}
	return out
}

// One script call decides the calls of several keys of a quota, each as if
// it came alone, in order: against the shared rule and its own key's rule,
// in the windows the calls before it left. The same calls decided one at a
// time on another quota get the same decisions, to the microsecond.
func TestBatch_DecidesTheCallsOfSeveralKeysAsIfAlone(t *testing.T) {
	policies := map[string]policies.Policy{
		"shared and per key": policies.All(
			policies.SlidingLog{Limit: 6, Window: time.Second},
			policies.PerKey{Policy: policies.SlidingLog{Limit: 2, Window: time.Second}},
			policies.PerKey{Policy: policies.SlidingCounter{Limit: 3, Window: time.Second, Buckets: 10}},
		),
		"per key alone": policies.PerKey{Policy: policies.All(
			policies.SlidingLog{Limit: 2, Window: time.Second},
			policies.TokenBucket{Rate: 4, Per: time.Second, Burst: 3},
		)},
	}
	var calls []batchCall
	for i := range 24 {
		calls = append(calls, batchCall{
			key:     fmt.Sprintf("tenant-%d", i*7%4),
			cost:    1 + i%3/2,
			maxWait: time.Duration(i%4) * 700 * time.Millisecond,
		})
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for name, p := range policies {
			t.Run(name, func(t *testing.T) {
				clock := newClock()
				batched, err := New(s.Client(t), "batched", p, Options{Clock: clock.Now})
				if err != nil {
					t.Fatal(err)
				}
				alone, err := New(s.Client(t), "alone", p, Options{Clock: clock.Now})
				if err != nil {
					t.Fatal(err)
				}
				// Warm, so that the margins in force are the same whether
				// the calls come in one script call or one by one.
				for i := range 4 {
					if i > 0 {
						clock.Add(900 * time.Millisecond)
					}
					for _, l := range []*Limiter{batched, alone} {
						if _, err := l.Allow(context.Background(), Key("warm")); err != nil {
							t.Fatal(err)
						}
					}
				}
				clock.Add(3 * time.Second)
				for round := range 3 {
					got := decideBatch(batched, calls)
					for i, bc := range calls {
						want := decideBatch(alone, []batchCall{bc})[0]
						g := got[i]
						if g.admitted != want.admitted || g.wait != want.wait || g.remaining != want.remaining || g.reason != want.reason || g.scope.id != want.scope.id {
							t.Errorf("round %d, call %d (%+v): batched %v/%v/%d/%d, alone %v/%v/%d/%d",
								round, i, bc, g.admitted, g.wait, g.remaining, g.reason, want.admitted, want.wait, want.remaining, want.reason)
						}
					}
					clock.Add(450 * time.Millisecond)
				}
			})
		}
	})
}

// A key's pause holds its calls in a batch of several keys, and only them.
func TestBatch_APauseOfOneKeyHoldsOnlyItsCalls(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}}, Options{Clock: clock.Now})
		ctx := context.Background()
		if err := lim.Pause(ctx, 5*time.Second, Key("paused")); err != nil {
			t.Fatal(err)
		}
		got := decideBatch(lim, []batchCall{
			{key: "free", cost: 1},
			{key: "paused", cost: 1},
			{key: "free", cost: 1, maxWait: time.Minute},
			{key: "paused", cost: 1, maxWait: time.Minute},
		})
		if !got[0].admitted || got[0].wait != 0 || !got[2].admitted || got[2].wait != 0 {
			t.Errorf("calls of the free key: %+v, %+v, want both admitted now", got[0], got[2])
		}
		if got[1].admitted {
			t.Errorf("a call of the paused key that may not wait was admitted: %+v", got[1])
		}
		if !got[3].admitted || got[3].wait < 5*time.Second {
			t.Errorf("a call of the paused key that may wait: %+v, want booked after the pause", got[3])
		}
		if got[3].pause == 0 || got[0].pause != 0 {
			t.Errorf("pauses in the replies: free key %v, paused key %v", got[0].pause, got[3].pause)
		}
	})
}
