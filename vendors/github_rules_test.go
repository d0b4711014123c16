package vendors

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-github/v84/github"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/graphql"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// githubClient returns a go-github client of baseURL over hc, with token.
func githubClient(t *testing.T, hc *http.Client, baseURL, token string) *github.Client {
	base, err := url.Parse(baseURL + "/")
	if err != nil {
		t.Fatal(err)
	}
	c := github.NewClient(hc).WithAuthToken(token)
	c.BaseURL = base
	return c
}

// githubQuery posts a GraphQL query whose connections need 1 + n
// requests, with an estimate of its points.
func githubQuery(ctx context.Context, hc *http.Client, baseURL, token string, n, estimate int) error {
	const query = "query($n: Int!) { viewer { repositories(first: $n) { nodes { issues(first: 100) { totalCount } } } } rateLimit { cost remaining } }"
	return githubGraphQL(ctx, hc, baseURL, token, query, n, estimate)
}

// githubMutation posts a GraphQL mutation, a point of the hour's (GitHub
// states no cost of a mutation in its body) and 5 of the minute's
// secondary points.
func githubMutation(ctx context.Context, hc *http.Client, baseURL, token string) error {
	const mutation = `mutation { addComment(input: {subjectId: "I_1", body: "found"}) { clientMutationId } }`
	return githubGraphQL(ctx, hc, baseURL, token, mutation, 0, 1)
}

// githubGraphQL posts the GraphQL document with $n, estimated at estimate
// points.
func githubGraphQL(ctx context.Context, hc *http.Client, baseURL, token, document string, n, estimate int) error {
	body, err := json.Marshal(map[string]any{"query": document, "variables": map[string]int{"n": n}})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/graphql", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := readmeGitHubQuery(ctx, hc, req, document, estimate)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GraphQL: %s", resp.Status)
	}
	return nil
}

// The GitHub recipe against a fake that counts GitHub's own figures: each
// kind of call goes through the quota of what it counts, with no refusal,
// and a GraphQL query admitted at 5 points is settled to the 1 it cost.
func TestREADME_GitHubRecipeRuns(t *testing.T) {
	g := newGitHubFake(githubRules{minute: time.Minute, hour: time.Hour, core: 5000, graphql: 5000, search: 30, codeSearch: 10,
		inFlight: 100, restPoints: 900, graphqlPoints: 2000, createsMinute: 80, createsHour: 500})
	srv := g.serve()
	defer srv.Close()
	s := redistest.Mini(t)
	hc, err := readmeGitHub(s.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.WithValue(context.Background(), github.BypassRateLimitCheck, true)
	c := githubClient(t, hc, srv.URL, "token-a")
	if _, _, err := c.Issues.ListByRepo(ctx, "o", "r", nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.PullRequests.List(ctx, "o", "r", nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Issues.Create(ctx, "o", "r", &github.IssueRequest{Title: github.Ptr("found")}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Search.Issues(ctx, "is:open", nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Search.Code(ctx, "throttle", nil); err != nil {
		t.Fatal(err)
	}
	if err := githubQuery(ctx, hc, srv.URL, "token-a", 100, 5); err != nil {
		t.Fatal(err)
	}
	gql, err := throttle.New(s.Client(t), "github-graphql", policies.All(
		policies.Shared{Name: "github", Policy: policies.All(policies.PerKey{Policy: policies.PerCall{Policy: policies.Concurrency{Max: 100}}})},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}},
		policies.Unit{Name: "secondary", Policy: policies.PerKey{Policy: policies.SlidingLog{Limit: 2000, Window: time.Minute}}}))
	if err != nil {
		t.Fatal(err)
	}
	u, err := gql.Usage(ctx, throttle.Key("Bearer token-a"))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range u.Rules {
		if r.Rule.Kind == policies.KindSlidingLog && r.Rule.Window == time.Hour && r.Used != 1 {
			t.Errorf("the GraphQL quota counts %d points, want the 1 GitHub counted", r.Used)
		}
	}
	if len(g.refusd)+g.early != 0 {
		t.Errorf("refused %v, %d early; want none", g.refusd, g.early)
	}
}

// githubFleetTransport is the recipe's Transport over rules, whose
// minute and hour are compressed for a fleet's run.
func githubFleetTransport(t *testing.T, rdb *redis.Client, r githubRules) *http.Client {
	perToken := func(p policies.Policy) policies.Policy { return policies.PerKey{Policy: p} }
	calls := func(limit int, window time.Duration) policies.Policy {
		return perToken(policies.PerCall{Policy: policies.SlidingLog{Limit: limit, Window: window}})
	}
	inFlight := perToken(policies.PerCall{Policy: policies.Concurrency{Max: r.inFlight}})
	reads := policies.Shared{Name: "gh", Policy: policies.All(inFlight, calls(r.core, r.hour))}
	writes := policies.Shared{Name: "gh", Policy: policies.All(inFlight, calls(r.core, r.hour), calls(r.createsMinute, r.minute), calls(r.createsHour, r.hour))}
	newLim := func(name string, p policies.Policy) *throttle.Limiter {
		lim, err := throttle.New(rdb, name, p)
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}
	var routes []throttle.Route
	for _, e := range []struct{ name, pattern string }{
		{"gh-issues", "GET /repos/{owner}/{repo}/issues"},
		{"gh-pulls", "GET /repos/{owner}/{repo}/pulls"},
		{"gh-new-issue", "POST /repos/{owner}/{repo}/issues"},
		{"gh-other-posts", "POST /"},
		{"gh-other-core", "/"},
	} {
		limits := reads
		if strings.HasPrefix(e.pattern, "POST ") {
			limits = writes
		}
		lim := newLim(e.name, policies.All(limits, perToken(policies.SlidingLog{Limit: r.restPoints, Window: r.minute})))
		routes = append(routes, throttle.Route{Pattern: e.pattern, Limiter: lim, Resource: "core"})
	}
	flying := policies.Shared{Name: "gh", Policy: inFlight}
	search := newLim("gh-search", policies.All(flying, calls(r.search, r.minute)))
	codeSearch := newLim("gh-code-search", policies.All(flying, calls(r.codeSearch, r.minute)))
	gql := newLim("gh-graphql", policies.All(flying, perToken(policies.SlidingLog{Limit: r.graphql, Window: r.hour}),
		policies.Unit{Name: "secondary", Policy: perToken(policies.SlidingLog{Limit: r.graphqlPoints, Window: r.minute})}))
	return &http.Client{Transport: &throttle.Transport{
		Base: &http.Transport{MaxIdleConnsPerHost: 16},
		Routes: append([]throttle.Route{
			{Pattern: "/graphql", Limiter: gql, Resource: "graphql", FromBody: graphql.GitHub},
			{Pattern: "/search/code", Limiter: codeSearch, Resource: "code_search"},
			{Pattern: "/search/", Limiter: search, Resource: "search"},
		}, routes...),
		Key: func(r *http.Request) string { return r.Header.Get("Authorization") },
		Cost: func(r *http.Request) int {
			if r.Method == http.MethodGet || r.Method == http.MethodHead || r.URL.Path == "/graphql" {
				return 1
			}
			return 5
		},
	}}
}

// githubRulesFleet serves a fake with rules, and gives each of replicas a
// client through the recipe's transport, on one redis-server.
func githubRulesFleet(t *testing.T, r githubRules, replicas int) (*githubFake, *httptest.Server, []*http.Client) {
	g := newGitHubFake(r)
	srv := g.serve()
	t.Cleanup(srv.Close)
	s := redistest.Real(t)
	clients := make([]*http.Client, replicas)
	for i := range clients {
		clients[i] = githubFleetTransport(t, s.Client(t), r)
	}
	return g, srv, clients
}

// A fleet of 3 × 10 go-github and GraphQL clients on one token, through
// the recipe, against a fake that counts as GitHub documents with its
// minute compressed to 1 s and its hour to 3 s: after the first hour, no
// refusal of any limit, and each kind of call at 0.9 or more of the limit
// that binds it (the fleet's first seconds warm its quotas up): reads at the endpoint's points, creates at content
// creation an hour, searches at their minute, GraphQL at its points an
// hour, as GitHub counted them (each query admitted at 5 points, settled
// to its rateLimit { cost }: 3 on average), in a window from any moment
// (meanShare). The fleet sends each minute's reads in a burst of about
// 300 ms, a window and its margin apart: the burst drifts across the
// fake's fixed windows, and while it straddles their edges, for eight to
// ten of them every thirty, each holds 0.87 of the limit; a run's fixed
// windows read 0.944 or 1.000 by where the drift fell, for one rate.
func TestGitHub_FleetKeepsEveryLimitOfAToken(t *testing.T) {
	r := githubRules{minute: time.Second, hour: 3 * time.Second, core: 600, graphql: 120, search: 20, codeSearch: 5,
		inFlight: 24, restPoints: 100, graphqlPoints: 200, createsMinute: 12, createsHour: 24, latency: 20 * time.Millisecond}
	d := fleetRun(9*time.Second, 21*time.Second)
	const replicas, workers = 3, 10
	g, srv, clients := githubRulesFleet(t, r, replicas)
	ctx := context.WithValue(context.Background(), github.BypassRateLimitCheck, true)
	runEachWorker(replicas, workers, d, func(i, j, _ int) {
		gh := githubClient(t, clients[i], srv.URL, "token-a")
		var err error
		switch j {
		case 0, 1, 5, 6, 7: // four repositories' issues, one endpoint's points
			_, _, err = gh.Issues.ListByRepo(ctx, "o", "r"+strconv.Itoa(i*workers+j), nil)
		case 2:
			_, _, err = gh.Issues.Create(ctx, "o", "r", &github.IssueRequest{Title: github.Ptr("found")})
		case 3:
			_, _, err = gh.Search.Issues(ctx, "is:open", nil)
		case 8:
			_, _, err = gh.Search.Code(ctx, "throttle", nil)
		default:
			err = githubQuery(ctx, clients[i], srv.URL, "token-a", 100+rand.IntN(401), 5)
		}
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	tok := "Bearer token-a "
	results := []struct {
		name, count string
	}{
		{"reads, points of the endpoint", tok + "points GET /repos/{owner}/{repo}/issues"},
		{"creates, an hour", tok + "creates an hour"},
		{"search, a minute", tok + "search"},
		{"code search, a minute", tok + "code_search"},
		{"GraphQL points, an hour", tok + "graphql"},
	}
	g.mu.Lock()
	t.Logf("most in flight %d of %d; %d refusals in the first hour, after it %v", g.most, r.inFlight, g.early, g.refusd)
	if len(g.refusd) != 0 {
		t.Errorf("refusals after the first hour: %v, want none", g.refusd)
	}
	g.mu.Unlock()
	for _, res := range results {
		_, per := g.counts.share(res.count, d, r.hour)
		got := g.counts.meanShare(res.count, d, r.hour)
		t.Logf("%s: %.3f of the limit; per window %v", res.name, got, per)
		if got < 0.9 {
			t.Errorf("%s: %.3f of the limit that binds it, want at least 0.9", res.name, got)
		}
	}
}

// GitHub's GraphQL takes 5 of a minute's secondary points for a request
// with a mutation, 1 for a query (docs/VENDORS.md). A fleet of 3 × 10, half
// of them sending mutations and half small queries, through the recipe's
// transport and its CostIn of graphql.Mutation, against a fake that counts
// so, with its minute compressed to 1 s: after the first minute no
// refusal, and the secondary points at 0.9 or more of their limit, in a
// window from any moment (meanShare).
// Charged 1 a request, as a PerCall rule would, the mutations took five
// times what the fleet counted, and the fake refused them.
func TestGitHub_AMutationTakesFiveSecondaryPoints(t *testing.T) {
	r := githubRules{minute: time.Second, hour: time.Second, core: 600, graphql: 100_000, search: 20, codeSearch: 5,
		inFlight: 24, restPoints: 100, graphqlPoints: 100, createsMinute: 12, createsHour: 24, latency: 20 * time.Millisecond}
	d := fleetRun(6*time.Second, 10*time.Second)
	const replicas, workers = 3, 10
	g, srv, clients := githubRulesFleet(t, r, replicas)
	ctx := context.Background()
	runEachWorker(replicas, workers, d, func(i, j, _ int) {
		var err error
		if j < workers/2 {
			err = githubMutation(ctx, clients[i], srv.URL, "token-a")
		} else {
			err = githubQuery(ctx, clients[i], srv.URL, "token-a", 0, 1)
		}
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	g.judgeMinutes(t, d, "Bearer token-a points POST /graphql")
}

// GitHub's secondary limit of 900 points a minute is per REST endpoint
// (docs/VENDORS.md): a fleet of 3 × 10 go-github clients, half listing
// issues and half pull requests, each of a repository of its own (an
// endpoint is its template: a fake counting each path apart let the
// workers' 30 repositories take 30 times the points), through the recipe's
// quota per endpoint, against a fake that counts so with its minute
// compressed to 1 s: after the first minute no refusal, and each
// endpoint's points at 0.9 or more of their limit, in a window from any
// moment (meanShare). With one points rule per token, as the recipe had
// before, the two endpoints shared one limit, each at about half of its
// own.
func TestGitHub_EachRESTEndpointHasItsOwnPoints(t *testing.T) {
	r := githubRules{minute: time.Second, hour: time.Second, core: 100_000, graphql: 100_000, search: 20, codeSearch: 5,
		inFlight: 24, restPoints: 100, graphqlPoints: 100, createsMinute: 12, createsHour: 24, latency: 20 * time.Millisecond}
	d := fleetRun(6*time.Second, 10*time.Second)
	const replicas, workers = 3, 10
	g, srv, clients := githubRulesFleet(t, r, replicas)
	ctx := context.WithValue(context.Background(), github.BypassRateLimitCheck, true)
	runEachWorker(replicas, workers, d, func(i, j, _ int) {
		gh := githubClient(t, clients[i], srv.URL, "token-a")
		var err error
		repo := "r" + strconv.Itoa(i*workers+j)
		if j%2 == 0 {
			_, _, err = gh.Issues.ListByRepo(ctx, "o", repo, nil)
		} else {
			_, _, err = gh.PullRequests.List(ctx, "o", repo, nil)
		}
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	g.judgeMinutes(t, d, "Bearer token-a points GET /repos/{owner}/{repo}/issues", "Bearer token-a points GET /repos/{owner}/{repo}/pulls")
}

// judgeMinutes checks a fleet's run of d against g: no refusal after the
// first minute, and each named count at 0.9 or more of its limit in a
// window from any moment (meanShare: the fleet's calls come in bursts a
// window and its margin apart).
func (g *githubFake) judgeMinutes(t *testing.T, d time.Duration, names ...string) {
	t.Helper()
	g.mu.Lock()
	t.Logf("%d refusals in the first minute, after it %v", g.early, g.refusd)
	if len(g.refusd) != 0 {
		t.Errorf("refusals after the first minute: %v, want none", g.refusd)
	}
	g.mu.Unlock()
	for _, name := range names {
		_, per := g.counts.share(name, d, g.rules.minute)
		got := g.counts.meanShare(name, d, g.rules.minute)
		t.Logf("%s: %.3f of its limit; per window %v", name, got, per)
		if got < 0.9 {
			t.Errorf("%s: %.3f of its limit, want at least 0.9", name, got)
		}
	}
}

// The GitHub fake counts a REST endpoint's points by its template, as
// GitHub's docs name endpoints: issues listed of two repositories take one
// endpoint's points, a pull request list another's; a path it knows no
// endpoint for is answered 404, not counted apart.
func TestGitHubFake_CountsAnEndpointByItsTemplate(t *testing.T) {
	g := newGitHubFake(githubRules{minute: time.Minute, hour: time.Hour, core: 5000, graphql: 5000, search: 30, codeSearch: 10,
		inFlight: 100, restPoints: 900, graphqlPoints: 2000, createsMinute: 80, createsHour: 500})
	srv := g.serve()
	defer srv.Close()
	gh := githubClient(t, srv.Client(), srv.URL, "token-a")
	ctx := context.WithValue(context.Background(), github.BypassRateLimitCheck, true)
	for _, repo := range []string{"r", "s", "t"} {
		if _, _, err := gh.Issues.ListByRepo(ctx, "o", repo, nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := gh.PullRequests.List(ctx, "p", "q", nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := gh.Issues.Create(ctx, "o", "r", &github.IssueRequest{Title: github.Ptr("found")}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for name, want := range map[string]int{
		"points GET /repos/{owner}/{repo}/issues":  3,
		"points GET /repos/{owner}/{repo}/pulls":   1,
		"points POST /repos/{owner}/{repo}/issues": 5,
		"points GET /repos/o/r/issues":             0,
	} {
		l := limit{900, time.Minute}
		if left, _ := g.counts.state(now, "Bearer token-a "+name, l); 900-left != want {
			t.Errorf("%s: %d points, want %d", name, 900-left, want)
		}
	}
	_, resp, err := gh.Repositories.ListBranches(ctx, "o", "r", nil)
	if resp == nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("an endpoint the fake does not know: %v, %v; want 404", resp, err)
	}
}
