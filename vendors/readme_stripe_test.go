package vendors

import (
	"net/http"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stripe/stripe-go/v82"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// The Stripe recipe of docs/VENDORS.md, compiled and run here; apiURL is
// nil for api.stripe.com.
func readmeStripe(rdb *redis.Client, key string, apiURL *string) (*stripe.Client, error) {
	// README stripe
	// 100 a second in all in live mode, 25 in a sandbox (a test key); 25 per endpoint.
	global := 100
	if strings.HasPrefix(key, "sk_test_") || strings.HasPrefix(key, "rk_test_") {
		global = 25
	}
	account := policies.Shared{Name: "stripe", Policy: policies.All(
		policies.SlidingLog{Limit: global, Window: time.Second},
		policies.Concurrency{Max: 20}, // Stripe does not publish it: set it below its refusals
	)}
	var routes []throttle.Route
	for _, e := range []struct{ name, pattern string }{ // a quota per endpoint, as Stripe names it
		{"stripe-create-intent", "POST /v1/payment_intents"},
		{"stripe-read-intent", "GET /v1/payment_intents/{id}"},
		{"stripe-read-customer", "GET /v1/customers/{id}"},
		{"stripe-refund", "POST /v1/refunds"},
		{"stripe-others", "/"}, // every other endpoint, as one
	} {
		lim, err := throttle.New(rdb, e.name, policies.All(account, policies.SlidingLog{Limit: 25, Window: time.Second}))
		if err != nil {
			return nil, err
		}
		routes = append(routes, throttle.Route{Pattern: e.pattern, Limiter: lim})
	}
	sc := stripe.NewClient(key, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               apiURL,
		HTTPClient:        &http.Client{Transport: &throttle.Transport{Routes: routes}},
		MaxNetworkRetries: stripe.Int64(0), // the Transport retries, knowing Stripe's reasons
	})))
	// README end
	return sc, nil
}
