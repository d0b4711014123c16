package vendors

import (
	"context"
	"net/http"
	"strings"
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
	// A token's limits, shared by the quotas below: requests in flight,
	// core requests an hour, content-creating requests a minute and an hour.
	perToken := func(p policies.Policy) policies.Policy { return policies.PerKey{Policy: p} }
	calls := func(limit int, window time.Duration) policies.Policy {
		return perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: limit, Window: window}})
	}
	inFlight := perToken(policies.PerCall{Policy: policies.Concurrency{Max: 100}})
	reads := policies.Shared{Name: "github", Policy: policies.All(inFlight, calls(5000, time.Hour))}
	writes := policies.Shared{Name: "github", Policy: policies.All(inFlight, calls(5000, time.Hour),
		calls(80, time.Minute), calls(500, time.Hour))} // GitHub does not list which endpoints create content: every POST
	// A quota per REST endpoint the job calls, each with its 900 points a
	// minute (1 a read, 5 a write: Cost below); the others' in one each.
	var routes []throttle.Route
	for _, e := range []struct{ name, pattern string }{
		{"github-issues", "GET /repos/{owner}/{repo}/issues"},
		{"github-pulls", "GET /repos/{owner}/{repo}/pulls"},
		{"github-new-issue", "POST /repos/{owner}/{repo}/issues"},
		{"github-other-posts", "POST /"},
		{"github-other-core", "/"},
	} {
		limits := reads
		if strings.HasPrefix(e.pattern, "POST ") {
			limits = writes
		}
		lim, err := throttle.New(rdb, e.name, policies.All(limits, perToken(policies.SlidingLog{Limit: 900, Window: time.Minute})))
		if err != nil {
			return nil, err
		}
		routes = append(routes, throttle.Route{Pattern: e.pattern, Limiter: lim, Resource: "core"})
	}
	search, err := throttle.New(rdb, "github-search", policies.All(policies.Shared{Name: "github", Policy: inFlight}, calls(30, time.Minute)))
	if err != nil {
		return nil, err
	}
	codeSearch, err := throttle.New(rdb, "github-code-search", policies.All(policies.Shared{Name: "github", Policy: inFlight}, calls(10, time.Minute)))
	if err != nil {
		return nil, err
	}
	// GraphQL's secondary points a minute: 1 a query, 5 a mutation (CostIn below).
	secondary := policies.Unit{Name: "secondary", Policy: perToken(policies.SlidingLog{Limit: 2000, Window: time.Minute})}
	gql, err := throttle.New(rdb, "github-graphql", policies.All(policies.Shared{Name: "github", Policy: inFlight},
		perToken(policies.SlidingLog{Limit: 5000, Window: time.Hour}), secondary)) // points an hour
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: &throttle.Transport{
		Routes: append([]throttle.Route{
			{Pattern: "/graphql", Limiter: gql, Resource: "graphql", FromBody: graphql.GitHub},
			{Pattern: "/search/code", Limiter: codeSearch, Resource: "code_search"},
			{Pattern: "/search/", Limiter: search, Resource: "search"},
		}, routes...), // the first route that matches takes the request
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
