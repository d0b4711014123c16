package throttle

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A Spread admits at most its part's share of a window at once: a burst of
// 30 calls on a limit of 60 a minute, spread in ten parts of a sixth each,
// admits 10 and refuses 20 (FailFast); unspread, it admits all 30. The
// margin is a second (slack), so that a reply late on a busy machine does
// not refuse a call as too late to start in.
func TestSpread_ABurstTakesAPartsShare(t *testing.T) {
	const slack = time.Second
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, c := range []struct {
			policy policies.Policy
			want   int
		}{
			{policies.Spread{Policy: policies.SlidingLog{Limit: 60, Window: time.Minute, Margin: slack}}, 10},
			{policies.Spread{Policy: policies.SlidingCounter{Limit: 60, Window: time.Minute, Margin: slack}, Parts: 4, Most: 0.25}, 15},
			{policies.SlidingLog{Limit: 60, Window: time.Minute, Margin: slack}, 30},
		} {
			lim := newLimiter(t, s.Client(t), c.policy, Options{Mode: FailFast, Prefix: "spread-" + strconv.Itoa(c.want)})
			admitted := 0
			for range 30 {
				if d, err := lim.Allow(context.Background()); err != nil {
					t.Fatal(err)
				} else if d.OK {
					admitted++
				}
			}
			if admitted != c.want {
				t.Errorf("%#v: %d of a burst of 30 admitted, want %d", c.policy, admitted, c.want)
			}
		}
	})
}

// A vendor's refusal teaches a cap to the window's rule, never to its
// part's: the part is the fleet's own pace, which the vendor does not count.
func TestSpread_ARefusalTeachesNoPart(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.Spread{Policy: policies.SlidingLog{Limit: 60, Window: time.Minute}})
		ctx := context.Background()
		var p *Permit
		for range 3 {
			var err error
			if p, err = lim.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if _, refused, err := p.Heard(ctx, Answer{Status: http.StatusTooManyRequests, AboutRate: true}); err != nil || !refused {
			t.Fatalf("Heard(429) = %v, %v", refused, err)
		}
		got := limitInForce(t, lim)
		if len(got) != 2 || got[0] >= 60 || got[1] != 10 {
			t.Errorf("limits in force %v after a refusal, want the window's lowered and the part's 10", got)
		}
	})
}

// A call may cost up to what a part admits; a larger one is refused at
// once, with an error that names the part, not the window's limit.
func TestSpread_ACallLargerThanAPartNamesIt(t *testing.T) {
	lim := newLimiter(t, redistest.Mini(t).Client(t), policies.Spread{Policy: policies.SlidingLog{Limit: 60, Window: time.Minute}})
	_, err := lim.Acquire(context.Background(), Cost(11))
	if err == nil || !strings.Contains(err.Error(), "Cost 11 exceeds the 10 a part of a window admits (Spread.Most") {
		t.Errorf("Acquire(Cost(11)) = %v, want an error naming the part's 10", err)
	}
	if _, err := lim.Acquire(context.Background(), Cost(10)); err != nil {
		t.Errorf("Acquire(Cost(10)) = %v, want a part's whole share admitted", err)
	}
}
