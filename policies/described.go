package policies

import (
	"errors"
	"fmt"
	"time"
)

// FromRules returns the policy whose Rules are rs, as they are: for tools
// that read a quota's rules back (throttle.Open reads those its fleet
// stored in Redis) and need a Policy to read the quota with. Its Validate
// checks each rule as the policy it came from would.
func FromRules(rs []Rule) Policy { return fromRules(append([]Rule(nil), rs...)) }

type fromRules []Rule

func (p fromRules) Validate() error {
	if len(p) == 0 {
		return errors.New("policies: FromRules needs at least one rule, got none")
	}
	for i, r := range p {
		if err := r.validate(); err != nil {
			return fmt.Errorf("policies: FromRules rule %d: %w", i, err)
		}
	}
	return sharedNames(p)
}

func (p fromRules) rules(perKey bool) []Rule {
	rs := append([]Rule(nil), p...)
	for i := range rs {
		rs[i].PerKey = rs[i].PerKey || perKey
	}
	return rs
}

// validate checks r as the policy that yields it would check itself.
func (r Rule) validate() error {
	if err := r.validateKind(); err != nil {
		return err
	}
	if r.Unit != "" && !unitName.MatchString(r.Unit) {
		return fmt.Errorf("Unit must be lower-case letters, digits and underscores, a letter first, at most 32 bytes, got %q", r.Unit)
	}
	if r.Shared != "" && !sharedName.MatchString(r.Shared) {
		return fmt.Errorf("Shared must be letters, digits, '.', '_' and '-', 1 to 64 bytes, got %q", r.Shared)
	}
	return nil
}

// validateKind checks r's parameters as its kind's policy checks its own.
func (r Rule) validateKind() error {
	switch r.Kind {
	case KindSlidingLog:
		return SlidingLog{Limit: r.Limit, Window: r.Window - r.Margin, Margin: r.Margin}.Validate()
	case KindSlidingCounter:
		if r.Bucket <= 0 || r.Bucket > r.Window {
			return fmt.Errorf("SlidingCounter's bucket must be between 1µs and its window %v, got %v", r.Window, r.Bucket)
		}
		return SlidingCounter{Limit: r.Limit, Window: r.Window - r.Margin, Margin: r.Margin}.Validate()
	case KindTokenBucket:
		// Rate and Per are gone: the rule keeps their interval alone.
		switch {
		case r.Every < time.Microsecond || r.Every > MaxWindow:
			return fmt.Errorf("TokenBucket's interval must be between 1µs and %v, got %v", MaxWindow, r.Every)
		case r.Limit <= 0 || r.Limit > 1<<30 || float64(r.Limit)*float64(r.Every) > float64(MaxWindow):
			return fmt.Errorf("TokenBucket's burst must be between 1 and %d and refill within %v, got %d every %v", 1<<30, MaxWindow, r.Limit, r.Every)
		}
		return nil
	case KindConcurrency:
		return Concurrency{Max: r.Limit, Lease: r.Lease}.Validate()
	}
	return fmt.Errorf("unknown Kind %d", r.Kind)
}
