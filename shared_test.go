package throttle

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// githubLike returns a route's policy: its own limit per token, and the
// secondary limit of 3 in flight per token, shared with every route.
func githubLike(perHour int) policies.Policy {
	return policies.All(
		policies.PerKey{Policy: policies.SlidingLog{Limit: perHour, Window: time.Hour}},
		policies.Shared{Name: "gh", Policy: policies.PerKey{Policy: policies.Concurrency{Max: 3, Lease: time.Minute}}},
	)
}

// newRoute returns the limiter of a route's quota, named after the test.
func newRoute(t *testing.T, rdb redis.UniversalClient, route string, p policies.Policy, opts ...Options) *Limiter {
	t.Helper()
	forgetTimingAtEnd(t, rdb)
	lim, err := New(rdb, route+"-"+strings.NewReplacer("/", "-", " ", "-").Replace(t.Name()), p, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// sharedRoutes checks that two quotas hold one Concurrency of a token
// between them, each deciding in one script call: 2 calls of core and 1
// of search take the token's 3; a fourth, on either, is refused; a call of
// another token is not; a slot core frees goes to search.
func sharedRoutes(t *testing.T, rdb redis.UniversalClient) {
	ctx := context.Background()
	core := newRoute(t, rdb, "core", githubLike(5000), Options{Mode: FailFast})
	search := newRoute(t, rdb, "search", githubLike(30), Options{Mode: FailFast})
	var held []*Permit
	for _, lim := range []*Limiter{core, core, search} {
		p, err := lim.Acquire(ctx, Key("token-a"))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
	}
	for _, lim := range []*Limiter{core, search} {
		if _, err := lim.Acquire(ctx, Key("token-a")); !errors.Is(err, ErrLimited) {
			t.Fatalf("a fourth call of token-a on %s: %v; want ErrLimited: the token's 3 in flight are taken on both routes", lim.Name(), err)
		}
	}
	if _, err := search.Acquire(ctx, Key("token-b")); err != nil {
		t.Fatalf("token-b, whose slots are free: %v", err)
	}
	held[0].Release()
	if _, err := search.Acquire(ctx, Key("token-a")); err != nil {
		t.Fatalf("a slot core freed, taken by search: %v", err)
	}
	u, err := core.Usage(ctx, Key("token-a"))
	if err != nil {
		t.Fatal(err)
	}
	if used := u.Rules[1].Used; used != 3 {
		t.Errorf("core's Usage shows %d of token-a's shared slots in use, want 3 (1 of core's, 2 of search's)", used)
	}
}

func TestShared_OneConcurrencyAcrossTwoQuotas(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		sharedRoutes(t, s.Client(t))
	})
}

// On Redis Cluster, every key of both quotas carries the group's hash
// tag: one script call reaches the shared rule and each quota's own.
func TestShared_OneConcurrencyAcrossTwoQuotasOnCluster(t *testing.T) {
	t.Parallel() // a Cluster of its own
	c := redistest.StartCluster(t)
	sharedRoutes(t, c.Client(t))
}

// Both quotas name the shared rule's key alike, and each keeps its own
// keys apart from the other's, all under the group's hash tag.
func TestShared_KeysCarryTheGroupsHashTag(t *testing.T) {
	s := redistest.Mini(t)
	core := newRoute(t, s.Client(t), "core", githubLike(5000))
	search := newRoute(t, s.Client(t), "search", githubLike(30))
	for _, lim := range []*Limiter{core, search} {
		for _, k := range lim.shared {
			if !strings.HasPrefix(k, "throttle:{gh}/") {
				t.Errorf("%s: key %q, want the hash tag {gh} and a slash after it", lim.Name(), k)
			}
		}
	}
	if core.shared[3] != search.shared[3] || core.shared[2] == search.shared[2] || core.shared[0] == search.shared[0] {
		t.Errorf("keys core %q, search %q: want the shared rule's alike, the others apart", core.shared, search.shared)
	}
}

func TestShared_BadConfigurationsAreErrors(t *testing.T) {
	rdb := redistest.Mini(t).Client(t)
	conc := policies.Concurrency{Max: 8}
	for _, tc := range []struct {
		name   string
		policy policies.Policy
		opts   Options
		want   string
	}{
		{"empty name", policies.Shared{Policy: conc}, Options{}, `Shared.Name`},
		{"a brace in the name", policies.Shared{Name: "g{h}", Policy: conc}, Options{}, `"g{h}"`},
		{"no policy", policies.Shared{Name: "gh"}, Options{}, `Shared "gh": Policy is nil`},
		{"nested", policies.Shared{Name: "gh", Policy: policies.Shared{Name: "x", Policy: conc}}, Options{}, "another Shared"},
		{"two names", policies.All(policies.Shared{Name: "a", Policy: conc}, policies.Shared{Name: "b", Policy: policies.SlidingLog{Limit: 1, Window: time.Second}}), Options{}, `"a" and "b"`},
		{"a bad policy", policies.Shared{Name: "gh", Policy: policies.Concurrency{Max: -1}}, Options{}, `Shared "gh"`},
		{"the Local fallback", policies.Shared{Name: "gh", Policy: conc}, Options{OnRedisError: Local, ExpectedReplicas: 2}, "Local"},
	} {
		_, err := New(rdb, "q", tc.policy, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New = %v, want an error naming %s", tc.name, err, tc.want)
		}
	}
}
