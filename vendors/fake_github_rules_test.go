package vendors

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"time"
)

// githubRules is what GitHub counts of each token, from its docs
// (docs/VENDORS.md has the sources): primary limits per resource, named
// in x-ratelimit-resource (core requests an hour, search and code_search
// requests a minute, graphql points an hour, a query's points the
// requests its connections need, divided by 100), and secondary limits
// (requests in flight across REST and GraphQL; points a minute per
// endpoint, 1 a read and 5 a write, 1 a GraphQL query and 5 a mutation;
// content-creating requests a minute and an hour). A fleet test
// compresses the minute and the hour.
type githubRules struct {
	minute, hour       time.Duration
	core, graphql      int // an hour
	search, codeSearch int // a minute
	inFlight           int
	restPoints         int // a minute, per endpoint
	graphqlPoints      int // a minute, the GraphQL endpoint's secondary
	createsMinute      int
	createsHour        int
	latency            time.Duration
}

// githubFake answers as api.github.com does, counting as githubRules say.
type githubFake struct {
	rules  githubRules
	counts *counts
	mu     sync.Mutex
	flying map[string]int
	most   int            // the most requests of one token in flight
	refusd map[string]int // refusals after the first hour, by the limit refused
	early  int            // refusals in the first hour
}

func newGitHubFake(r githubRules) *githubFake {
	return &githubFake{rules: r, counts: newCounts(), flying: map[string]int{}, refusd: map[string]int{}}
}

// charge is what a request takes of the token's counts, and the primary
// resource it is about.
func (g *githubFake) charge(r *http.Request, token string) (resource string, take map[string]int, limits map[string]limit, cost int) {
	rl := g.rules
	take, limits = map[string]int{}, map[string]limit{}
	add := func(name string, n int, l limit) { take[token+" "+name], limits[token+" "+name] = n, l }
	switch p := r.URL.Path; {
	case strings.HasSuffix(p, "/graphql"):
		var points int
		cost, points = graphqlCost(r)
		resource = "graphql"
		add("graphql", cost, limit{rl.graphql, rl.hour})
		add("points POST /graphql", points, limit{rl.graphqlPoints, rl.minute})
	case strings.HasPrefix(p, "/search/code"):
		resource = "code_search"
		add(resource, 1, limit{rl.codeSearch, rl.minute})
	case strings.HasPrefix(p, "/search/"):
		resource = "search"
		add(resource, 1, limit{rl.search, rl.minute})
	default:
		resource, cost = "core", 1
		points := 1
		if r.Method != http.MethodGet && r.Method != http.MethodHead && r.Method != http.MethodOptions {
			points = 5
		}
		add("core", 1, limit{rl.core, rl.hour})
		add("points "+endpoint(r), points, limit{rl.restPoints, rl.minute})
		if r.Method == http.MethodPost {
			add("creates a minute", 1, limit{rl.createsMinute, rl.minute})
			add("creates an hour", 1, limit{rl.createsHour, rl.hour})
		}
	}
	return resource, take, limits, cost
}

// githubEndpoints are the REST endpoints the fake knows, as GitHub's REST
// reference names them: its secondary limit of 900 points a minute is per
// endpoint, so that a repository's issues and another's are one count.
var githubEndpoints = func() *http.ServeMux {
	mux := http.NewServeMux()
	for _, e := range []string{
		"GET /repos/{owner}/{repo}", "GET /repos/{owner}/{repo}/issues", "POST /repos/{owner}/{repo}/issues",
		"GET /repos/{owner}/{repo}/issues/{issue_number}", "PATCH /repos/{owner}/{repo}/issues/{issue_number}",
		"GET /repos/{owner}/{repo}/issues/{issue_number}/comments", "POST /repos/{owner}/{repo}/issues/{issue_number}/comments",
		"GET /repos/{owner}/{repo}/pulls", "POST /repos/{owner}/{repo}/pulls", "GET /repos/{owner}/{repo}/pulls/{pull_number}",
		"GET /users/{username}", "GET /user", "GET /orgs/{org}/repos",
	} {
		mux.Handle(e, http.NotFoundHandler())
	}
	return mux
}()

// endpoint returns the REST endpoint r calls, as GitHub's reference names
// it ("GET /repos/{owner}/{repo}/issues"), or "" when the fake knows no
// such endpoint (it answers 404: a count by the literal path would let a
// fleet spend 900 points a minute on each repository).
func endpoint(r *http.Request) string {
	_, pattern := githubEndpoints.Handler(r)
	return pattern
}

// isREST reports whether r calls a REST endpoint of the core resource.
func isREST(r *http.Request) bool {
	p := r.URL.Path
	return !strings.HasSuffix(p, "/graphql") && !strings.HasPrefix(p, "/search/")
}

// graphqlCost is a request's points as GitHub documents them: of the
// hour, the requests its connections need (the repositories, then each
// one's issues), over 100, rounded, at least 1; of the minute's secondary
// limit, 5 for a request with a mutation (its document begins with the
// word), else 1.
func graphqlCost(r *http.Request) (points, secondary int) {
	var b struct {
		Query     string          `json:"query"`
		Variables struct{ N int } `json:"variables"`
	}
	body, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(body, &b)
	secondary = 1
	if strings.HasPrefix(strings.TrimSpace(b.Query), "mutation") {
		secondary = 5
	}
	return max(1, int(math.Round(float64(1+b.Variables.N)/100))), secondary
}

func (g *githubFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if isREST(r) && endpoint(r) == "" {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"message":"Not Found: the fake knows no endpoint %s %s"}`, r.Method, r.URL.Path)
		return
	}
	token := r.Header.Get("Authorization")
	now := time.Now()
	resource, take, limits, cost := g.charge(r, token)
	g.mu.Lock()
	g.flying[token]++
	g.most = max(g.most, g.flying[token])
	over := g.flying[token] > g.rules.inFlight
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		g.flying[token]--
		g.mu.Unlock()
	}()
	full := "in flight"
	if !over {
		full = g.counts.take(now, take, limits)
	}
	primary := token + " " + resource
	left, reset := g.counts.state(now, primary, limits[primary])
	h := w.Header()
	h.Set("Content-Type", "application/json; charset=utf-8")
	h.Set("x-ratelimit-limit", strconv.Itoa(limits[primary].n))
	h.Set("x-ratelimit-remaining", strconv.Itoa(left))
	h.Set("x-ratelimit-used", strconv.Itoa(limits[primary].n-left))
	h.Set("x-ratelimit-reset", strconv.FormatInt(reset.Unix(), 10))
	h.Set("x-ratelimit-resource", resource)
	if full != "" {
		g.refused(now, full)
		if full == primary {
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprint(w, `{"message":"API rate limit exceeded for user ID 1.","documentation_url":"https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"}`)
			return
		}
		h.Set("retry-after", "1")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"message":"You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}`)
		return
	}
	time.Sleep(g.rules.latency)
	switch resource {
	case "graphql":
		fmt.Fprintf(w, `{"data":{"viewer":{"login":"octocat"},"rateLimit":{"cost":%d,"remaining":%d}}}`, cost, left)
	case "search", "code_search":
		fmt.Fprint(w, `{"total_count":1,"incomplete_results":false,"items":[]}`)
	default:
		if r.Method == http.MethodPost {
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, `{"id":1,"number":1,"title":"found"}`)
			return
		}
		fmt.Fprint(w, `[{"id":1,"number":1,"title":"found"}]`)
	}
}

// refused notes a refusal by the limit named full.
func (g *githubFake) refused(now time.Time, full string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if now.Sub(g.counts.start) < g.rules.hour {
		g.early++
		return
	}
	g.refusd[full]++
}

func (g *githubFake) serve() *httptest.Server { return httptest.NewServer(g) }
