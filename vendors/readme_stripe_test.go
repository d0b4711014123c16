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
	// Live mode: 100 a second in all, 25 per endpoint (25 and 25 in test mode).
	account := policies.Shared{Name: "stripe", Policy: policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.Concurrency{Max: 20}, // Stripe does not publish it: set it below its refusals
	)}
	endpoint := func(method, path string) (throttle.Route, error) {
		lim, err := throttle.New(rdb, "stripe "+method+" "+path, policies.All(account, policies.SlidingLog{Limit: 25, Window: time.Second}))
		match := func(r *http.Request) bool { return r.Method == method && strings.HasPrefix(r.URL.Path, path) }
		return throttle.Route{Match: match, Limiter: lim}, err
	}
	var routes []throttle.Route
	for _, e := range [][2]string{{"POST", "/v1/payment_intents"}, {"GET", "/v1/payment_intents/"},
		{"GET", "/v1/customers/"}, {"POST", "/v1/refunds"}} {
		route, err := endpoint(e[0], e[1])
		if err != nil {
			return nil, err
		}
		routes = append(routes, route)
	}
	others, err := endpoint("", "/") // every other endpoint, as one
	if err != nil {
		return nil, err
	}
	sc := stripe.NewClient(key, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               apiURL,
		HTTPClient:        &http.Client{Transport: &throttle.Transport{Limiter: others.Limiter, Routes: routes}},
		MaxNetworkRetries: stripe.Int64(0), // the Transport retries, knowing Stripe's reasons
	})))
	// README end
	return sc, nil
}
