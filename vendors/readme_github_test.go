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

// The GitHub recipe of docs/VENDORS.md, compiled and run here against the
// fake (the root module's readme_test.go checks that the page shows it as
// it is here, between the "README" lines).
func readmeGitHub(rdb *redis.Client) (*http.Client, error) {
	// README github
	// GitHub's secondary limits, per token, shared by the quotas below.
	perToken := func(p policies.Policy) policies.Policy { return policies.PerKey{Policy: p} }
	inFlight := perToken(policies.PerCall{Policy: policies.Concurrency{Max: 100}})
	hour := perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}) // core
	shared := func(p ...policies.Policy) policies.Policy {
		return policies.Shared{Name: "github", Policy: policies.All(p...)}
	}
	points := perToken(policies.SlidingLog{Limit: 900, Window: time.Minute}) // an endpoint's: 1 a read, 5 a write
	core, err := throttle.New(rdb, "github-core", policies.All(shared(hour, inFlight), points))
	if err != nil {
		return nil, err
	}
	creates, err := throttle.New(rdb, "github-creates", policies.All(shared(hour, inFlight), points,
		perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: 80, Window: time.Minute}}),
		perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Hour}})))
	if err != nil {
		return nil, err
	}
	search, err := throttle.New(rdb, "github-search", policies.All(shared(inFlight), perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: 30, Window: time.Minute}})))
	if err != nil {
		return nil, err
	}
	codeSearch, err := throttle.New(rdb, "github-code-search", policies.All(shared(inFlight), perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: 10, Window: time.Minute}})))
	if err != nil {
		return nil, err
	}
	// GraphQL's secondary points a minute: 1 a query, 5 a mutation (CostIn below).
	secondary := policies.Unit{Name: "secondary", Policy: perToken(policies.SlidingLog{Limit: 2000, Window: time.Minute})}
	gql, err := throttle.New(rdb, "github-graphql", policies.All(shared(inFlight),
		perToken(policies.SlidingLog{Limit: 5000, Window: time.Hour}), secondary)) // points an hour
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: &throttle.Transport{
		Routes: []throttle.Route{
			{Pattern: "/graphql", Limiter: gql, Resource: "graphql", FromBody: graphql.GitHub},
			{Pattern: "/search/code", Limiter: codeSearch, Resource: "code_search"},
			{Pattern: "/search/", Limiter: search, Resource: "search"},
			{Match: func(r *http.Request) bool { return r.Method == http.MethodPost }, Limiter: creates, Resource: "core"},
			{Pattern: "/", Limiter: core, Resource: "core"},
		},
		Key: func(r *http.Request) string { return r.Header.Get("Authorization") }, // a quota per token
		Cost: func(r *http.Request) int { // secondary points: 5 a REST write, else 1
			if r.Method == http.MethodGet || r.Method == http.MethodHead || r.URL.Path == "/graphql" {
				return 1
			}
			return 5
		},
	}}
	// README end
	return client, nil
}

// readmeGitHubQuery sends a GraphQL request of query (a query or a
// mutation) through the recipe's client.
func readmeGitHubQuery(ctx context.Context, client *http.Client, req *http.Request, query string, estimate int) (*http.Response, error) {
	// README github-query
	// A query is admitted at its estimate in points, settled to rateLimit { cost };
	// it takes 1 of the minute's secondary points, a mutation 5.
	secondary := 1
	if graphql.Mutation(query) {
		secondary = 5
	}
	ctx, _ = throttle.Track(ctx, throttle.Cost(estimate), throttle.CostIn("secondary", secondary))
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return nil, err
	}
	// README end
	return resp, nil
}
