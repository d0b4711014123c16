package policies

import (
	"math"
	"testing"
	"time"
)

func TestSpread_Validate(t *testing.T) {
	log := SlidingLog{Limit: 60, Window: time.Minute}
	runValidate(t, []validateCase{
		{"typical", Spread{Policy: log}, nil},
		{"nil policy", Spread{}, []string{"Spread.Policy is nil"}},
		{"parts 1", Spread{Policy: log, Parts: 1}, []string{"Spread.Parts", "between 2 and 1000", got(1)}},
		{"parts -1", Spread{Policy: log, Parts: -1}, []string{"Spread.Parts", got(-1)}},
		{"parts 1001", Spread{Policy: log, Parts: 1001}, []string{"Spread.Parts", got(1001)}},
		{"parts 1000", Spread{Policy: log, Parts: 1000}, nil},
		{"most -0.1", Spread{Policy: log, Most: -0.1}, []string{"Spread.Most", got(-0.1)}},
		{"most 1.5", Spread{Policy: log, Most: 1.5}, []string{"Spread.Most", got(1.5)}},
		{"most NaN", Spread{Policy: log, Most: math.NaN()}, []string{"Spread.Most", "NaN"}},
		{"most 1", Spread{Policy: log, Most: 1}, nil},
		{"invalid policy", Spread{Policy: SlidingLog{Limit: 0, Window: time.Second}}, []string{"Spread.Policy", "SlidingLog.Limit"}},
		{"nothing to spread", Spread{Policy: Concurrency{Max: 5}}, []string{"Spread.Policy holds no SlidingLog or SlidingCounter"}},
		{"parts under MinWindow", Spread{Policy: SlidingLog{Limit: 5, Window: 5 * time.Millisecond}, Parts: 10}, []string{"Spread.Parts 10", "under MinWindow"}},
		{"inside PerCall", PerCall{Policy: Spread{Policy: log}}, nil},
	})
}

// Each sliding rule gets a part's rule beside it, of the same kind, key,
// unit and sharing, at a part of the window with the same margin and a
// share of the limit; a token bucket and a concurrency limit get none.
func TestSpread_RulesAddAPartBesideEachSlidingRule(t *testing.T) {
	rs, err := Rules(Spread{Policy: All(
		PerCall{Policy: SlidingLog{Limit: 60, Window: time.Minute}},
		Unit{Name: "tokens", Policy: SlidingCounter{Limit: 90_000, Window: time.Minute, Buckets: 20}},
		TokenBucket{Rate: 10, Per: time.Second, Burst: 10},
		Concurrency{Max: 5},
	), Parts: 60, Most: 1.0 / 60})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 6 {
		t.Fatalf("%d rules, want 6: %+v", len(rs), rs)
	}
	calls, part := rs[0], rs[1]
	if !part.Paces || calls.Paces || part.Kind != KindSlidingLog || !part.PerCall || part.Limit != 1 ||
		part.Window != time.Second+DefaultMargin || part.Margin != DefaultMargin {
		t.Errorf("the calls' part %+v of %+v, want a log of 1 call a second and the margin, Paces", part, calls)
	}
	tokens, tpart := rs[2], rs[3]
	if !tpart.Paces || tpart.Kind != KindSlidingCounter || tpart.Unit != "tokens" || tpart.Limit != 1500 ||
		tpart.Window != time.Second+DefaultMargin || tpart.Bucket != tpart.Window/20 {
		t.Errorf("the tokens' part %+v of %+v, want a counter of 1,500 a second and the margin in 20 buckets", tpart, tokens)
	}
	if rs[4].Kind != KindTokenBucket || rs[5].Kind != KindConcurrency || rs[4].Paces || rs[5].Paces {
		t.Errorf("a bucket and a concurrency limit are not spread: %+v, %+v", rs[4], rs[5])
	}
	// The default: ten parts of a sixth, a unit at least.
	rs, err = Rules(Spread{Policy: SlidingLog{Limit: 5, Window: time.Second, Margin: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[1].Limit != 1 || rs[1].Window != 110*time.Millisecond {
		t.Errorf("the default's rules %+v, want a part of 1 in 100ms and the 10ms margin", rs)
	}
	if rs, _ := Rules(Spread{Policy: SlidingLog{Limit: 100, Window: time.Second}}); rs[1].Limit != 16 {
		t.Errorf("the default's part of a limit of 100: %d, want 16 (a sixth, rounded down)", rs[1].Limit)
	}
}
