package policies

import (
	"fmt"
	"regexp"
)

// Shared makes Policy one limit across every quota that declares it: a
// limit a vendor counts across routes that a fleet limits apart. GitHub's
// secondary limit counts a token's requests in flight on every endpoint,
// while its search API has a limit of its own beside the core one:
//
//	secondary := policies.Shared{Name: "github", Policy: policies.PerKey{Policy: policies.Concurrency{Max: 8}}}
//	core, _ := throttle.New(rdb, "github-core", policies.All(
//		policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}, secondary))
//	search, _ := throttle.New(rdb, "github-search", policies.All(
//		policies.PerKey{Policy: policies.SlidingLog{Limit: 30, Window: time.Minute}}, secondary))
//
// Each quota still decides a call in one script call, its own rules and
// the shared ones together: every key of a quota with a Shared policy
// carries the hash tag {Name} instead of the quota's name, so that one
// script reaches them on Redis Cluster too. Quotas share a rule when they
// declare the same Name and the same rule (its kind and window: a Shared
// policy's limit may differ between them, as a rule's may across a
// deploy, but should not); declare it once, as a variable, and give it to
// each. A quota's Shared policies must all have the same Name.
//
// The quotas that share a Name are a group, and decide the shared rules as
// one: a cap that one of them learns from the vendor, and the share it
// leaves other consumers, hold in all; the margin follows the spread of
// all their calls; and a limit lowered, or room given back, reaches all
// their waiting calls (docs/PROTOCOL.md, 3.12).
type Shared struct {
	// Name names what the quotas share: letters, digits, '.', '_' and
	// '-', 64 bytes at most.
	Name string
	// Policy is the shared limit: any policy but another Shared.
	Policy Policy
}

var sharedName = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

func isShared(p Policy) bool { _, ok := p.(Shared); return ok }

// Validate reports whether the name and the policy are usable.
func (p Shared) Validate() error {
	if !sharedName.MatchString(p.Name) {
		return fmt.Errorf("policies: Shared.Name must be letters, digits, '.', '_' and '-', 1 to 64 bytes, got %q", p.Name)
	}
	if p.Policy == nil {
		return fmt.Errorf("policies: Shared %q: Policy is nil", p.Name)
	}
	if holds(p.Policy, isShared) {
		return fmt.Errorf("policies: Shared %q: Policy must not contain another Shared", p.Name)
	}
	if err := p.Policy.Validate(); err != nil {
		return fmt.Errorf("policies: Shared %q: %w", p.Name, err)
	}
	return nil
}

func (p Shared) rules(perKey bool) []Rule {
	rs := p.Policy.rules(perKey)
	for i := range rs {
		rs[i].Shared = p.Name
	}
	return rs
}

// sharedNames checks that the Shared policies of p have one Name.
func sharedNames(rs []Rule) error {
	name := ""
	for _, r := range rs {
		switch {
		case r.Shared == "" || r.Shared == name:
		case name == "":
			name = r.Shared
		default:
			return fmt.Errorf("policies: a quota's Shared policies must have one Name, got %q and %q", name, r.Shared)
		}
	}
	return nil
}
