package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// warmingMargin is the margin in force of a one-second log with the default
// margin while the calls a warming quota admitted at once are held: half its
// own 30ms, and half its ceiling of a tenth of the window.
const warmingMargin = 65 * time.Millisecond

// warmMargin is the same for a log of any window with the default margin:
// half of 30ms, and half of a tenth of the window, at most 200ms.
func warmMargin(window time.Duration) time.Duration {
	m := policies.DefaultMargin
	return (m + max(m, min(window/10, 200*time.Millisecond)) + time.Microsecond) / 2 / time.Microsecond * time.Microsecond
}

// warmUp takes the quotas of lims, whose longest window is window, past
// their warm-up on clock: it calls each at once, a little less than a
// window apart, until the quota has warmed up and the calls it admitted
// meanwhile have left their windows.
func warmUp(t *testing.T, clock *fixedClock, window time.Duration, lims ...*Limiter) {
	t.Helper()
	for i := range 4 {
		if i > 0 {
			clock.Add(window * 9 / 10)
		}
		for _, l := range lims {
			if _, err := l.Allow(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A quota the fleet starts calling (new, or idle for a minute) warms up: the calls it admits at once then may reach the vendor
// late (each opens a connection), so the window after them keeps half the
// margin's ceiling from them. Once warm, the quota keeps its own margin,
// even after a pause of a few windows; after an idle minute it warms up
// again.
func TestWarmUp_HoldsTheFirstCallsOfAColdQuota(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		clock := newClock()
		lim := newLimiter(t, s.Client(t), perSecond, Options{Clock: clock.Now})
		ctx := context.Background()
		// full admits the five calls of the window at once, and returns
		// the RetryAfter of the next one.
		full := func(when string) time.Duration {
			t.Helper()
			for i := range 5 {
				if d, err := lim.Allow(ctx); err != nil || !d.OK {
					t.Fatalf("%s: call %d: %+v, %v; want admitted", when, i, d, err)
				}
			}
			d, err := lim.Allow(ctx)
			if err != nil || d.OK {
				t.Fatalf("%s: sixth call: %+v, %v; want refused", when, d, err)
			}
			return d.RetryAfter
		}
		if got, want := full("new quota"), time.Second+warmingMargin; got != want {
			t.Errorf("new quota: RetryAfter %v, want %v: the first calls are held to the widened margin", got, want)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m := u.Rules[0].Margin; m != warmingMargin {
			t.Errorf("Usage margin %v while the first calls are held, want %v", m, warmingMargin)
		}

		// Past the window and its hold, the quota is warm, even after a
		// few idle windows.
		clock.Add(5 * time.Second)
		if got, want := full("warm quota"), time.Second+policies.DefaultMargin; got != want {
			t.Errorf("warm quota: RetryAfter %v, want %v: its own margin", got, want)
		}

		// Idle for a minute: it warms up again.
		clock.Add(time.Minute + time.Second)
		if got, want := full("after an idle minute"), time.Second+warmingMargin; got != want {
			t.Errorf("after an idle minute: RetryAfter %v, want %v", got, want)
		}
	})
}
