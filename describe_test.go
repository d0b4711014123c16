package throttle

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// describedPolicy has a rule of each kind, a per-key rule, a named unit and
// a rule counting calls, so that every field of a rule goes through the
// description. Its windows are minutes: the two Usage reads of its test
// must see the same counts, and beside the race run a second (or a token
// a fifth of a second) could go by between them. Every window's margin is
// wide, since a call may start at most half the smallest margin late: with
// 7 ms on the first log, every reply beside the race run came later than
// that. The token bucket's margin is DefaultMargin whatever the others'
// (see the test).
var describedPolicy = policies.All(
	policies.SlidingLog{Limit: 50, Window: time.Minute, Margin: time.Second},
	policies.SlidingCounter{Limit: 1000, Window: time.Minute, Buckets: 12, Margin: time.Second},
	policies.PerKey{Policy: policies.TokenBucket{Rate: 5, Per: time.Minute, Burst: 3}},
	policies.PerCall{Policy: policies.Concurrency{Max: 4, Lease: 30 * time.Second}},
	policies.Unit{Name: "tokens", Policy: policies.SlidingLog{Limit: 900, Window: time.Minute, Margin: time.Second}},
)

// A quota's first call stores its policy with its meta: Quotas lists the
// quota, and Open reads it back with the same rules and keys, so that its
// Usage reads what the fleet's limiter reads. Without the description
// (the acquire script not storing it), Open fails with ErrNotDescribed.
func TestOpen_ReadsAQuotaWithoutItsPolicy(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, describedPolicy)
		for range 3 {
			p, err := lim.Acquire(ctx, Key("tenant-1"), CostIn("tokens", 40))
			// The token bucket's margin is 30 ms: beside CI's other
			// packages, miniredis's replies came more than 15 ms late
			// three times in a row. A call refused as late gave its
			// units back; it asks again, as its error says.
			for try := 0; lateOnly(err) && try < 10; try++ {
				p, err = lim.Acquire(ctx, Key("tenant-1"), CostIn("tokens", 40))
			}
			if err != nil {
				t.Fatal(err)
			}
			defer p.Release()
		}
		names, err := Quotas(ctx, rdb, "")
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(names, QuotaName{Name: lim.name}) {
			t.Fatalf("Quotas = %v, want %q among them", names, lim.name)
		}
		opened, err := Open(ctx, rdb, QuotaName{Name: lim.name})
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(opened.cfg.rules, lim.cfg.rules) || !slices.Equal(opened.cfg.shared, lim.cfg.shared) {
			t.Fatalf("Open's rules and keys:\n %+v %v\nwant\n %+v %v", opened.cfg.rules, opened.cfg.shared, lim.cfg.rules, lim.cfg.shared)
		}
		want, err := lim.Usage(ctx, Key("tenant-1"))
		if err != nil {
			t.Fatal(err)
		}
		got, err := opened.Usage(ctx, Key("tenant-1"))
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range want.Rules {
			if got.Rules[i].Used != r.Used || got.Rules[i].Limit != r.Limit {
				t.Errorf("rule %d: the opened quota reads used %d of %d, the fleet's %d of %d", i, got.Rules[i].Used, got.Rules[i].Limit, r.Used, r.Limit)
			}
		}
		if want.Rules[3].Used != 3 {
			t.Errorf("the concurrency rule holds %d calls, want the 3 in flight", want.Rules[3].Used)
		}
	})
}

// Open says what is missing: a quota with no meta, or a meta without a
// description, fail with ErrNotDescribed and the key read; a bad name with
// its field.
func TestOpen_SaysWhatIsMissing(t *testing.T) {
	s := redistest.Mini(t)
	ctx := context.Background()
	rdb := s.Client(t)
	if _, err := Open(ctx, rdb, QuotaName{Name: "nothing-here"}); !errors.Is(err, ErrNotDescribed) {
		t.Errorf("Open of a missing quota: %v, want ErrNotDescribed", err)
	}
	if err := rdb.HSet(ctx, "throttle:{old}:meta", "epoch", 1).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(ctx, rdb, QuotaName{Name: "old"}); !errors.Is(err, ErrNotDescribed) {
		t.Errorf("Open of a quota without a description: %v, want ErrNotDescribed", err)
	}
	if _, err := Open(ctx, rdb, QuotaName{Name: "a{b"}); err == nil {
		t.Error("Open of a name with a brace: no error")
	}
	if _, err := Open(ctx, nil, QuotaName{Name: "x"}); err == nil {
		t.Error("Open with a nil client: no error")
	}
}

// A quota of a policies.Shared group is listed with its group, and opened
// by it; the shared rule's key is the group's.
func TestQuotas_ListsAGroupsQuotas(t *testing.T) {
	s := redistest.Mini(t)
	ctx := context.Background()
	rdb := s.Client(t)
	shared := policies.Shared{Name: "vendor-x", Policy: policies.Concurrency{Max: 2}}
	for _, name := range []string{"alpha", "beta"} {
		lim, err := New(rdb, name, policies.All(shared, policies.SlidingLog{Limit: 10, Window: time.Second}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Do(ctx, lim, func(context.Context) (int, error) { return 0, nil }); err != nil {
			t.Fatal(err)
		}
	}
	names, err := Quotas(ctx, rdb, "throttle")
	if err != nil {
		t.Fatal(err)
	}
	want := []QuotaName{{Name: "alpha", Group: "vendor-x"}, {Name: "beta", Group: "vendor-x"}}
	if !slices.Equal(names, want) {
		t.Fatalf("Quotas = %v, want %v", names, want)
	}
	opened, err := Open(ctx, rdb, want[1])
	if err != nil {
		t.Fatal(err)
	}
	u, err := opened.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if u.Rules[1].Used != 1 {
		t.Errorf("beta's own log reads %d used, want its 1 call", u.Rules[1].Used)
	}
}

// After Redis loses a quota's data, the quota is described again by the
// call after the one that found the loss (a limiter that described the old
// epoch's meta sends it once more when it sees a new epoch), and Usage says the quota is paused for the loss; a pause
// asked of the quota says the vendor's.
func TestOpen_DescribedAgainAfterALoss(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		rdb := s.Client(t)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: time.Second}, Options{Mode: FailFast})
		if _, err := lim.Allow(ctx); err != nil {
			t.Fatal(err)
		}
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := lim.Allow(ctx); err != nil && !errors.Is(err, ErrLimited) {
				t.Fatal(err)
			}
		}
		opened, err := Open(ctx, rdb, QuotaName{Name: lim.name})
		if err != nil {
			t.Fatalf("Open after a loss: %v", err)
		}
		u, err := opened.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if u.PausedBy != PausedByLoss || u.LastLoss.IsZero() || u.Since.IsZero() {
			t.Errorf("after a loss: paused %v by %q, last loss %v, since %v; want paused by %q", u.Paused, u.PausedBy, u.LastLoss, u.Since, PausedByLoss)
		}
		if err := lim.Pause(ctx, time.Hour); err != nil {
			t.Fatal(err)
		}
		if u, err = opened.Usage(ctx); err != nil || u.PausedBy != PausedByVendor {
			t.Errorf("after Pause: paused %v by %q (%v), want %q", u.Paused, u.PausedBy, err, PausedByVendor)
		}
	})
}

// The description a quota keeps is its newest limiter's, the one made
// last, whatever order the fleet's limiters describe in: an old version's
// limiter whose first call comes after a new one's, or that describes
// again after a loss, leaves the new policy; a rollback's limiter, made
// after both, leaves its own; after Redis's clock goes back an hour, a
// limiter made then is still the newest; and a limiter Open made
// describes nothing, though made after the fleet's. Kept from whichever
// limiter described last, Open rebuilt the old limit in every case but
// the rollback.
func TestOpen_ReadsTheNewestLimitersPolicy(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		for _, c := range newestLimiterCases {
			t.Run(c.name, func(t *testing.T) {
				c.run(&deploys{
					t: t, s: s, rdb: rdb, clock: newClock(),
					name: strings.NewReplacer("/", "-", " ", "-").Replace(t.Name()),
				})
			})
		}
	})
}

// deploys are the limiters of one quota that a case of
// TestOpen_ReadsTheNewestLimitersPolicy makes, on one given clock.
type deploys struct {
	t     *testing.T
	s     *redistest.Server
	rdb   redis.UniversalClient
	name  string
	clock *fixedClock
}

// deploy makes a limiter of the quota, of the given limit, now.
func (r *deploys) deploy(limit int) *Limiter {
	return replicaLimiter(r.t, r.s, r.name, policies.SlidingLog{Limit: limit, Window: time.Second},
		Options{Mode: FailFast, Clock: r.clock.Now})
}

// call makes a call through lim.
func (r *deploys) call(lim *Limiter) {
	r.t.Helper()
	if _, err := lim.Allow(context.Background()); err != nil {
		r.t.Fatal(err)
	}
}

// opened returns the limit of the limiter Open makes of the quota.
func (r *deploys) opened() int {
	r.t.Helper()
	lim, err := Open(context.Background(), r.rdb, QuotaName{Name: r.name})
	if err != nil {
		r.t.Fatal(err)
	}
	return lim.cfg.rules[0].Limit
}

// newestLimiterCases are the orders of deploys and calls of
// TestOpen_ReadsTheNewestLimitersPolicy, each with the limit Open must read.
var newestLimiterCases = []struct {
	name string
	run  func(r *deploys)
}{
	{"an old limiter calls after a new one", func(r *deploys) {
		t, ctx := r.t, context.Background()
		old := r.deploy(100)
		young := r.deploy(50)
		r.call(young)
		r.call(old)
		if got := r.opened(); got != 50 {
			t.Errorf("Open's limit %d, want the newest limiter's 50", got)
		}
		// After a loss each describes again, with its second call.
		r.clock.Add(10 * time.Millisecond) // a new epoch: another time
		if err := r.rdb.Del(ctx, young.cfg.shared[0]).Err(); err != nil {
			t.Fatal(err)
		}
		for _, lim := range []*Limiter{young, young, old, old} {
			r.call(lim)
		}
		if got := r.opened(); got != 50 {
			t.Errorf("after a loss, Open's limit %d, want the newest limiter's 50", got)
		}
	}},
	{"a limiter made after a clock step back is the newest", func(r *deploys) {
		old := r.deploy(100)
		r.call(old)
		r.clock.Add(-time.Hour)
		young := r.deploy(50)
		for _, lim := range []*Limiter{young, young, old, old} {
			r.call(lim)
		}
		if got := r.opened(); got != 50 {
			r.t.Errorf("after Redis's clock went back an hour, Open's limit %d, want the newest limiter's 50", got)
		}
	}},
	{"a rollback's limiter is the newest", func(r *deploys) {
		r.call(r.deploy(100))
		r.clock.Add(time.Second)
		r.call(r.deploy(50))
		r.clock.Add(time.Second)
		r.call(r.deploy(100))
		if got := r.opened(); got != 100 {
			r.t.Errorf("Open's limit %d, want the rollback's 100", got)
		}
	}},
	{"a limiter Open made describes nothing", func(r *deploys) {
		r.call(r.deploy(100))
		r.clock.Add(time.Second)
		young := r.deploy(50)
		r.clock.Add(time.Second)
		tool, err := Open(context.Background(), r.rdb, QuotaName{Name: r.name}, Options{Mode: FailFast, Clock: r.clock.Now})
		if err != nil {
			r.t.Fatal(err)
		}
		r.call(young)
		r.clock.Add(time.Second)
		r.call(tool)
		if got := r.opened(); got != 50 {
			r.t.Errorf("Open's limit %d once a tool's limiter called, want the newest fleet limiter's 50", got)
		}
	}},
}
