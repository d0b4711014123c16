package vendors

import (
	"context"
	"net/http"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/graphql"
	"github.com/throttlekit/throttle/policies"
)

// The Shopify recipe of docs/VENDORS.md, compiled and run here.
func readmeShopify(rdb *redis.Client) (*http.Client, error) {
	// README shopify
	// Each answer states the store's bucket (throttleStatus): 1,000 points restored at 100 a second hold what 10 s restore.
	lim, err := throttle.New(rdb, "shopify-graphql", policies.PerKey{Policy: policies.SlidingLog{Limit: 1000, Window: 10 * time.Second}})
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: &throttle.Transport{
		Routes:         []throttle.Route{{Pattern: "/admin/api/", Limiter: lim, FromBody: graphql.Shopify}},
		Key:            func(r *http.Request) string { return r.URL.Host }, // a bucket per store
		RetryAnyMethod: true,                                               // a THROTTLED query did not run
	}}
	// README end
	return client, nil
}

// readmeShopifyQuery sends a query through the recipe's client.
func readmeShopifyQuery(ctx context.Context, client *http.Client, req *http.Request, requested int) (*http.Response, error) {
	// README shopify-query
	// Admitted at its requested cost, settled to its actual cost.
	ctx, _ = throttle.Track(ctx, throttle.Cost(requested))
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return nil, err
	}
	// README end
	return resp, nil
}
