package throttle

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Three tenants with different loads under a per-key rule of each kind
// come out fullest first, each with the units Usage counts for it (used
// and booked), beside a global rule; the keys a rule's key derives (a
// hint, a class's log) and keys of other quotas are not taken for tenants.
func TestBusiestKeys_ListsTheFullestKeysFirst(t *testing.T) {
	t.Parallel() // a minute's window: nothing in it depends on the machine's load
	perKey := []struct {
		name   string
		policy policies.Policy
	}{
		{"log", policies.SlidingLog{Limit: 10, Window: time.Minute}},
		{"counter", policies.SlidingCounter{Limit: 10, Window: time.Minute}},
		{"bucket", policies.TokenBucket{Rate: 10, Per: time.Minute, Burst: 10}},
		{"concurrency", policies.Concurrency{Max: 10}},
	}
	loads := map[string]int{"tenant-a": 2, "tenant-b": 7, "tenant-c": 4}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, tc := range perKey {
			t.Run(tc.name, func(t *testing.T) {
				ctx := context.Background()
				rdb := s.Client(t)
				lim := callTenants(t, rdb, policies.All(
					policies.SlidingLog{Limit: 1000, Window: time.Minute},
					policies.PerKey{Policy: tc.policy},
				), loads)
				hash := func(tenant string) string { return lim.scopeFor(call{key: tenant}).id }
				for _, k := range []string{lim.cfg.shared[3] + ":next", lim.cfg.shared[3] + ":" + hash("tenant-a") + ":c:high", "throttle:{other}:key:log60000000:" + hash("tenant-z")} {
					if err := rdb.Set(ctx, k, "x", time.Minute).Err(); err != nil {
						t.Fatal(err)
					}
				}

				got, err := lim.BusiestKeys(ctx, 5)
				if err != nil {
					t.Fatal(err)
				}
				var want []KeyLoad
				for _, tenant := range []string{"tenant-b", "tenant-c", "tenant-a"} {
					u, err := lim.Usage(ctx, Key(tenant))
					if err != nil {
						t.Fatal(err)
					}
					if r := u.Rules[1]; r.Used+r.Booked != loads[tenant] {
						t.Fatalf("%s: Usage counts %d used and %d booked, want %d", tenant, r.Used, r.Booked, loads[tenant])
					}
					want = append(want, KeyLoad{Hash: hash(tenant), Used: loads[tenant], Limit: 10})
				}
				if !slices.Equal(got, want) {
					t.Fatalf("BusiestKeys(5) =\n %v\nwant\n %v", got, want)
				}
				if top, err := lim.BusiestKeys(ctx, 1); err != nil || !slices.Equal(top, want[:1]) {
					t.Fatalf("BusiestKeys(1) = %v, %v; want %v", top, err, want[:1])
				}
			})
		}
	})
}

// callTenants makes the calls of each tenant of loads on a quota of
// policy p, and returns a limiter of the quota as another process opens
// it, a dashboard's. Each call has a limiter of its own, which takes no
// spare admissions (spare.go): the quota holds the calls alone. They stay
// in flight until the test ends.
func callTenants(t *testing.T, rdb redis.UniversalClient, p policies.Policy, loads map[string]int) *Limiter {
	t.Helper()
	ctx := context.Background()
	name := newLimiter(t, rdb, p).name
	for tenant, n := range loads {
		for range n {
			// Block, not FailFast: on a busy machine a reply may come
			// later than the margin allows, and the call books again.
			lim, err := New(rdb, name, p)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = lim.Close(ctx) })
			permit, err := lim.Acquire(ctx, Key(tenant))
			for tries := 0; lateOnly(err) && tries < 5; tries++ {
				// Beside CI's race run, a call booked again until its
				// bound and was refused as too late: not the rule's say.
				permit, err = lim.Acquire(ctx, Key(tenant))
			}
			if err != nil {
				t.Fatalf("%s: %v", tenant, err)
			}
			t.Cleanup(permit.Release)
		}
	}
	lim, err := Open(ctx, rdb, QuotaName{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// BusiestKeys names what it cannot do: a quota without per-key rules has
// no keys to list, and n must be positive.
func TestBusiestKeys_FailsWithoutPerKeyRulesOrN(t *testing.T) {
	rdb := redistest.Mini(t).Client(t)
	ctx := context.Background()
	shared := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Second})
	if _, err := shared.BusiestKeys(ctx, 3); err == nil || !strings.Contains(err.Error(), "per-key") {
		t.Errorf("BusiestKeys of a quota without per-key rules: %v, want an error naming them", err)
	}
	keyed := newLimiter(t, rdb, policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}})
	for _, n := range []int{0, -1} {
		if _, err := keyed.BusiestKeys(ctx, n); err == nil || !strings.Contains(err.Error(), fmt.Sprint(n)) {
			t.Errorf("BusiestKeys(%d): %v, want an error naming n", n, err)
		}
	}
	if got, err := keyed.BusiestKeys(ctx, 3); err != nil || len(got) != 0 {
		t.Errorf("BusiestKeys of an unused quota = %v, %v; want none", got, err)
	}
}

// On Redis Cluster, BusiestKeys reads the node of the quota's hash tag.
func TestBusiestKeys_ReadsTheQuotasNodeOnCluster(t *testing.T) {
	t.Parallel() // a Cluster of its own, a minute's window
	rdb := redistest.StartCluster(t).Client(t)
	loads := map[string]int{"tenant-a": 1, "tenant-b": 2, "tenant-c": 3}
	lim := callTenants(t, rdb, policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Minute}}, loads)
	got, err := lim.BusiestKeys(context.Background(), 3)
	if err != nil {
		t.Fatal(err)
	}
	var want []KeyLoad
	for _, tenant := range []string{"tenant-c", "tenant-b", "tenant-a"} {
		want = append(want, KeyLoad{Hash: lim.scopeFor(call{key: tenant}).id, Used: loads[tenant], Limit: 10})
	}
	if !slices.Equal(got, want) {
		t.Fatalf("BusiestKeys on a cluster =\n %v\nwant\n %v", got, want)
	}
}
