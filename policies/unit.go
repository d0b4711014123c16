package policies

import (
	"errors"
	"fmt"
	"regexp"
)

// Unit counts, under Policy, the units of one name that a call costs
// (throttle.CostIn), instead of its Cost: a vendor that caps input and
// output tokens apart, each at its own limit, beside requests.
//
//	policies.All(
//		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
//		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Minute}},
//		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 8_000, Window: time.Minute}},
//	)
//
// One script decides every rule of the quota, each counting its own unit:
// a call is admitted when each of its units fits. A call of a quota that
// counts a unit must say what it costs in it; Permit.Settle, with CostIn, settles
// each unit from what the vendor reports. A vendor's counts reach the
// rules of the call's Cost and the PerCall ones only (see
// throttle.Transport), not the ones of a Unit.
type Unit struct {
	// Name is the unit's name: lower-case letters, digits and underscores,
	// a letter first, 32 bytes at most.
	Name string
	// Policy counts the unit: a SlidingLog, SlidingCounter or TokenBucket,
	// or an All or PerKey of them.
	Policy Policy
}

var unitName = regexp.MustCompile(`^[a-z][a-z0-9_]{0,31}$`)

func isUnit(p Policy) bool { _, ok := p.(Unit); return ok }

// Validate reports whether the unit's name and policy are usable.
func (p Unit) Validate() error {
	if !unitName.MatchString(p.Name) {
		return fmt.Errorf("policies: Unit.Name must be lower-case letters, digits and underscores, a letter first, at most 32 bytes, got %q", p.Name)
	}
	if p.Policy == nil {
		return errors.New("policies: Unit.Policy is nil")
	}
	if holds(p.Policy, isUnit) || hasPerCall(p.Policy) {
		return fmt.Errorf("policies: Unit %q: Policy must not contain a Unit or a PerCall", p.Name)
	}
	if holds(p.Policy, func(q Policy) bool { _, ok := q.(Concurrency); return ok }) {
		return fmt.Errorf("policies: Unit %q: Policy must not contain a Concurrency, which counts calls in flight", p.Name)
	}
	if err := p.Policy.Validate(); err != nil {
		return fmt.Errorf("policies: Unit %q: %w", p.Name, err)
	}
	return nil
}

func (p Unit) rules(perKey bool) []Rule {
	rs := p.Policy.rules(perKey)
	for i := range rs {
		rs[i].Unit = p.Name
	}
	return rs
}
