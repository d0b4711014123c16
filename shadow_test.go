package throttle

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// redisDump reads every key of rdb outside the shadow keyspace, with its
// type, its value and whether it expires: what a live quota sees.
func redisDump(t *testing.T, rdb *redis.Client) map[string]string {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	dump := map[string]string{}
	for _, k := range keys {
		if strings.HasPrefix(k, defaultPrefix+":shadow:") {
			continue
		}
		typ, err := rdb.Type(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		var v any
		switch typ {
		case "string":
			v, err = rdb.Get(ctx, k).Result()
		case "hash":
			v, err = rdb.HGetAll(ctx, k).Result()
		case "zset":
			v, err = rdb.ZRangeWithScores(ctx, k, 0, -1).Result()
		case "set":
			var m []string
			m, err = rdb.SMembers(ctx, k).Result()
			slices.Sort(m)
			v = m
		case "list":
			v, err = rdb.LRange(ctx, k, 0, -1).Result()
		}
		if err != nil {
			t.Fatal(err)
		}
		ttl, err := rdb.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		dump[k] = fmt.Sprintf("%s %v expires:%v", typ, v, ttl > 0)
	}
	return dump
}

// compareDumps reports every key added, removed or changed.
func compareDumps(t *testing.T, before, after map[string]string) {
	t.Helper()
	for k, v := range after {
		if w, ok := before[k]; !ok {
			t.Errorf("a key appeared: %s = %s", k, v)
		} else if w != v {
			t.Errorf("%s changed:\nbefore %s\nafter  %s", k, w, v)
		}
	}
	for k := range before {
		if _, ok := after[k]; !ok {
			t.Errorf("a key went: %s", k)
		}
	}
}

// A shadow fleet in front of a vendor that refuses every call sends each
// request once, as no limiter would, and writes nothing the live quota of
// the same name sees: its decisions, pauses, learned caps, counts,
// settlements and the Local fallback's hand-back stay in a keyspace of
// its own, where it still decides what it would have done.
func TestShadow_ChangesNothingTheVendorOrTheLiveQuotaSees(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		policy := policies.SlidingLog{Limit: 10, Window: time.Minute}
		var refusal atomic.Pointer[error]
		live := replicaLimiter(t, s, "shadowed", policy, Options{Observer: func(e Event) {
			if e.Kind == EventLimited {
				refusal.Store(&e.Err)
			}
		}})
		for range 3 {
			p, err := live.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			p.Release()
		}
		inspect := s.Client(t)
		before := redisDump(t, inspect)
		if len(before) == 0 {
			t.Fatal("the live quota wrote no key: the comparison tests nothing")
		}

		srv := newVendorServer(t, answer(http.StatusTooManyRequests, "no", "Retry-After", "1"))
		shadows, sent := sendThroughShadows(t, s, policy, srv.URL)
		if n := srv.count(); n != sent {
			t.Errorf("%d requests through the shadow fleet reached the vendor %d times, want once each", sent, n)
		}
		// The shadow quota still learns what a live one would have, and is
		// listed under its own prefix.
		if got := limitInForce(t, shadows[1]); got[0] >= 10 {
			t.Errorf("the shadow quota's limit in force is %v after the vendor's refusals, want it lowered", got)
		}
		if qs, err := Quotas(ctx, inspect, defaultPrefix+":shadow"); err != nil || !slices.Contains(qs, QuotaName{Name: "shadowed"}) {
			t.Errorf("Quotas of the shadow prefix: %v, %v; want the shadow quota", qs, err)
		}

		// Every other way a shadow limiter writes to Redis.
		writeEveryOtherWay(t, shadows[0])
		handBackInShadow(t, s, policy)
		compareDumps(t, before, redisDump(t, inspect))
		if got := limitInForce(t, live); got[0] != 10 {
			t.Errorf("the live quota's limit in force is %v, want 10", got)
		}
		// A busy machine may read a reply too late to start in (beside the
		// race run, 16 ms late): that refusal says so, and the call is
		// asked again. Any other refusal is the shadow fleet's doing.
		d, err := live.Allow(ctx)
		for tries := 0; err == nil && !d.OK && lateOnly(*refusal.Load()) && tries < 5; tries++ {
			d, err = live.Allow(ctx)
		}
		if err != nil || !d.OK {
			t.Errorf("the live quota refuses a call after the shadow fleet's refusals: %+v, %v", d, err)
		}
	})
}

// sendThroughShadows sends three requests through the Transport of each
// of three shadow limiters of policy to url, the third a POST with an
// Idempotency-Key, and returns the limiters and the requests sent.
func sendThroughShadows(t *testing.T, s *redistest.Server, policy policies.Policy, url string) ([]*Limiter, int) {
	t.Helper()
	ctx := context.Background()
	var shadows []*Limiter
	sent := 0
	for i := range 3 {
		shadow := replicaLimiter(t, s, "shadowed", policy, Options{Shadow: true, Logger: quiet()})
		shadows = append(shadows, shadow)
		tr := &Transport{Limiter: shadow, AboutRate: func(*http.Response) bool { return true }}
		for j := range 3 {
			req := mustRequest(t, ctx, http.MethodGet, url+fmt.Sprintf("/?r=%d&n=%d", i, j), nil)
			if j == 2 {
				req = mustRequest(t, ctx, http.MethodPost, url, strings.NewReader("{}"))
				req.Header.Set("Idempotency-Key", fmt.Sprintf("k-%d", i))
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			sent++
		}
	}
	return shadows, sent
}

// writeEveryOtherWay takes a permit of shadow and writes to Redis through
// it in every other way a limiter does: Heard, a refusal, Settle, Pause,
// SetRemaining and Release.
func writeEveryOtherWay(t *testing.T, shadow *Limiter) {
	t.Helper()
	ctx := context.Background()
	p, err := shadow.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name string
		do   func() error
	}{
		{"Heard", func() error {
			_, _, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 0, Reset: time.Minute, Limit: 4}})
			return err
		}},
		{"Refused", func() error { return p.refused(ctx, time.Second) }},
		{"Settle", func() error { return p.Settle(ctx, Cost(1)) }},
		{"Pause", func() error { return shadow.Pause(ctx, time.Second) }},
		{"SetRemaining", func() error { return shadow.SetRemaining(ctx, 0, time.Minute) }},
		{"Release", func() error { p.Release(); return nil }},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Errorf("%s: %v", st.name, err)
		}
	}
}

// handBackInShadow has a shadow limiter's Local fallback admit a call,
// then hand it back to Redis.
func handBackInShadow(t *testing.T, s *redistest.Server, policy policies.Policy) {
	t.Helper()
	lim := replicaLimiter(t, s, "shadowed", policy, Options{Shadow: true, OnRedisError: Local, ExpectedReplicas: 1, Logger: quiet()})
	lim.failover.local.begin()
	lim.failover.local.full = time.Now().Add(-2 * time.Minute)
	r := decided(lim.failover.local, lim.scopeFor(call{}), call{cost: 1}, "began", time.Second)
	r.member = "began"
	if !r.admitted || !lim.failover.local.claim(r) {
		t.Fatalf("the Local fallback's call: %+v, want admitted and begun", r)
	}
	if _, err := lim.handBack(); err != nil {
		t.Fatal(err)
	}
}
