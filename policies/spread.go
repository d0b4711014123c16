package policies

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Spread keeps each window's calls of Policy from coming at once: beside
// each SlidingLog and SlidingCounter of Policy, a rule of the same kind
// admits at most Most of its Limit in any Parts-th of its Window. A
// saturated fleet otherwise takes a window's whole limit the moment the
// window opens, a burst that a vendor enforcing its limit in shorter
// slices refuses ("60,000 requests a minute may be enforced as 1,000 a
// second"), and that its servers meet all at once.
//
//	// OpenAI's minute, enforced a second at a time: Parts 60, Most 1/60.
//	policies.Spread{Policy: tokensPerMinute, Parts: 60, Most: 1.0 / 60}
//	// A burst smoothed: no tenth of a window takes more than a sixth.
//	policies.Spread{Policy: policies.SlidingLog{Limit: 100, Window: time.Second}}
//
// A part's rule is the fleet's own: no vendor's count or refusal teaches
// it a cap or measures others against it (throttle.Transport, Heard). Most
// over 1/Parts leaves the window's rule binding: a part's rule gives up
// its own margin too, which Most of exactly 1/Parts leaves unfilled. Token
// buckets and Concurrency rules are not spread: a bucket is already paced
// by its rate.
type Spread struct {
	// Policy is the policy whose windows are spread. It must hold a
	// SlidingLog or a SlidingCounter.
	Policy Policy
	// Parts cuts each window into this many parts, from 2 to 1,000; zero
	// means 10. A part must be at least MinWindow long.
	Parts int
	// Most is the share of a window's Limit a part admits, above 0 and at
	// most 1; zero means 5/(3 × Parts), a sixth of the limit for ten parts.
	// A part admits at least one unit.
	Most float64
}

// DefaultSpreadParts is the Parts of a Spread left zero.
const DefaultSpreadParts = 10

func (p Spread) parts() int {
	if p.Parts == 0 {
		return DefaultSpreadParts
	}
	return p.Parts
}

func (p Spread) most() float64 {
	if p.Most == 0 {
		return 5 / (3 * float64(p.parts()))
	}
	return p.Most
}

// Validate reports whether the parts, the share and the policy are usable.
func (p Spread) Validate() error {
	switch {
	case p.Policy == nil:
		return errors.New("policies: Spread.Policy is nil")
	case p.Parts != 0 && (p.Parts < 2 || p.Parts > 1000):
		return fmt.Errorf("policies: Spread.Parts must be between 2 and 1000, got %d", p.Parts)
	case math.IsNaN(p.Most) || p.Most < 0 || p.Most > 1:
		return fmt.Errorf("policies: Spread.Most must be above 0 and at most 1, got %v", p.Most)
	}
	if err := p.Policy.Validate(); err != nil {
		return fmt.Errorf("policies: Spread.Policy: %w", err)
	}
	spread := 0
	for _, r := range p.Policy.rules(false) {
		if r.Kind != KindSlidingLog && r.Kind != KindSlidingCounter {
			continue
		}
		spread++
		if part := (r.Window - r.Margin) / time.Duration(p.parts()); part < MinWindow {
			return fmt.Errorf("policies: Spread.Parts %d cuts a window of %v into parts of %v, under MinWindow %v", p.parts(), r.Window-r.Margin, part, MinWindow)
		}
	}
	if spread == 0 {
		return errors.New("policies: Spread.Policy holds no SlidingLog or SlidingCounter to spread")
	}
	return nil
}

// rules returns Policy's rules, each sliding one followed by its part's.
func (p Spread) rules(perKey bool) []Rule {
	var out []Rule
	for _, r := range p.Policy.rules(perKey) {
		out = append(out, r)
		if r.Kind != KindSlidingLog && r.Kind != KindSlidingCounter {
			continue
		}
		part := r
		part.Paces = true
		part.Limit = max(int(math.Floor(float64(r.Limit)*p.most()+1e-9)), 1)
		part.Window = (r.Window-r.Margin)/time.Duration(p.parts()) + r.Margin
		if r.Kind == KindSlidingCounter {
			n := max(int((r.Window+r.Bucket/2)/r.Bucket), 1)
			part.Bucket = (part.Window/time.Duration(n) + time.Microsecond - 1).Truncate(time.Microsecond)
		}
		out = append(out, part)
	}
	return out
}
