package vendors

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/graphql"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// shopifyQuery posts a products(first: n) query through client, admitted
// at its requested cost, n + 2.
func shopifyQuery(ctx context.Context, client *http.Client, baseURL string, n int) error {
	body := fmt.Sprintf(`{"query":"query($first: Int!) { products(first: $first) { nodes { id title } } }","variables":{"first":%d}}`, n)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/admin/api/2025-01/graphql.json", strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := readmeShopifyQuery(ctx, client, req, n+2)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if strings.Contains(string(b), "THROTTLED") {
		return fmt.Errorf("throttled: %s", b)
	}
	return nil
}

// The Shopify recipe against the fake, at Shopify's figures: a query
// admitted at its requested cost is settled to its actual cost.
func TestREADME_ShopifyRecipeRuns(t *testing.T) {
	v := newShopifyFake(1000, 50, 0)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Mini(t)
	client, err := readmeShopify(s.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := shopifyQuery(ctx, client, srv.URL, 250); err != nil {
		t.Fatal(err)
	}
	lim, err := throttle.New(s.Client(t), "shopify-graphql", policies.PerKey{Policy: policies.SlidingLog{Limit: 1000, Window: 10 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(ctx, throttle.Key(strings.TrimPrefix(srv.URL, "http://")))
	if err != nil {
		t.Fatal(err)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if want := v.actual[len(v.actual)-1]; u.Rules[0].Used != want {
		t.Errorf("the quota counts %d points, want the %d Shopify charged (of 252 requested)", u.Rules[0].Used, want)
	}
}

// A fleet of 3 × 10 through the recipe, against a bucket of 400 points
// restored at 200 a second (queries asking 22 points, costing 2 to 22):
// after the first 2 s, no THROTTLED answer, and the points Shopify charged
// at 0.9 or more of what the bucket restores, as each query is settled
// to its actualQueryCost.
func TestShopify_FleetRunsAtTheBucketsRestoreRate(t *testing.T) {
	const maxPoints, restore, first = 400, 200, 20
	d := fleetRun(8*time.Second, 20*time.Second)
	v := newShopifyFake(maxPoints, restore, 50*time.Millisecond)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Real(t)
	window := time.Duration(maxPoints/restore) * time.Second
	clients := make([]*http.Client, 3)
	for i := range clients {
		clients[i] = shopifyClient(t, s.Client(t), maxPoints, window)
	}
	ctx := context.Background()
	runEach(3, 10, d, func(i int) {
		if err := shopifyQuery(ctx, clients[i], srv.URL, first); err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	refused, early, share, per := v.results(d)
	t.Logf("Shopify: %d THROTTLED after the first window (%d in it); %.3f of the restore rate; actual points a second %v; the bucket's fullest %.0f of %d",
		refused, early, share, per, v.most, maxPoints)
	if refused != 0 {
		t.Errorf("%d THROTTLED after the first window, want none", refused)
	}
	if share < 0.9 {
		t.Errorf("%.3f of the restore rate, want at least 0.9", share)
	}
}

// shopifyClient is the recipe's client at the fake's figures.
func shopifyClient(t *testing.T, rdb *redis.Client, maxPoints int, window time.Duration) *http.Client {
	lim, err := throttle.New(rdb, "shopify-fleet", policies.PerKey{Policy: policies.SlidingLog{Limit: maxPoints, Window: window}})
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Transport: &throttle.Transport{
		Base:           &http.Transport{MaxIdleConnsPerHost: 16},
		Routes:         []throttle.Route{{Pattern: "/admin/api/", Limiter: lim, FromBody: graphql.Shopify}},
		Key:            func(r *http.Request) string { return r.URL.Host },
		RetryAnyMethod: true,
	}}
}
