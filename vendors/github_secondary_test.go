package vendors

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/google/go-github/v84/github"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// secondaryVendor is GitHub's secondary limit: at most max requests of a
// token in flight, whatever the endpoint; one more is refused with a 403
// and Retry-After.
type secondaryVendor struct {
	max  int
	work time.Duration

	mu       sync.Mutex
	inFlight map[string]int
	most     map[string]int // the most in flight at once, per token
	served   map[string]int // per path prefix
	refused  int
}

func (v *secondaryVendor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	token := r.Header.Get("Authorization")
	route := "core"
	if len(r.URL.Path) > 8 && r.URL.Path[:8] == "/search/" {
		route = "search"
	}
	v.mu.Lock()
	v.inFlight[token]++
	n := v.inFlight[token]
	v.most[token] = max(v.most[token], n)
	if n > v.max {
		v.inFlight[token]--
		v.refused++
		v.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"message":"You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}`)
		return
	}
	v.mu.Unlock()
	time.Sleep(v.work)
	v.mu.Lock()
	v.inFlight[token]-- // done before the answer leaves: a client may send again once it has it
	v.served[route]++
	v.mu.Unlock()
	h := w.Header()
	h.Set("Content-Type", "application/json; charset=utf-8")
	h.Set("x-ratelimit-limit", "5000")
	h.Set("x-ratelimit-remaining", "4000")
	h.Set("x-ratelimit-resource", route)
	if route == "search" {
		fmt.Fprint(w, `{"total_count":1,"incomplete_results":false,"items":[{"login":"octocat","id":1}]}`)
		return
	}
	fmt.Fprint(w, `{"login":"octocat","id":1}`)
}

// Four tokens, core and search through one Transport, GitHub's secondary
// limit of 8 requests in flight per token enforced as one rule across
// both routes (policies.Shared): no secondary refusal, and each token
// keeps up to 8 in flight, split between the routes as the calls come.
func TestGitHub_OneSecondaryLimitAcrossCoreAndSearch(t *testing.T) {
	const replicas, workers, perToken = 3, 16, 8
	tokens := []string{"token-a", "token-b", "token-c", "token-d"}
	s := redistest.Real(t)
	v := &secondaryVendor{max: perToken, work: 20 * time.Millisecond,
		inFlight: map[string]int{}, most: map[string]int{}, served: map[string]int{}}
	srv := httptest.NewServer(v)
	defer srv.Close()
	base, err := url.Parse(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	clients := make([]*github.Client, replicas)
	for i := range clients {
		clients[i] = secondaryClient(t, s.Client(t), base, tokens, perToken, workers)
	}
	ctx := context.Background()
	var failed sync.Map
	runEach(replicas, workers, 4*time.Second, func(i int) {
		var err error
		if rand.IntN(3) == 0 {
			_, _, err = clients[i].Search.Users(ctx, "octocat", nil)
		} else {
			_, _, err = clients[i].Users.Get(ctx, "octocat")
		}
		if err != nil {
			failed.Store(err.Error(), true)
			time.Sleep(10 * time.Millisecond)
		}
	})
	v.mu.Lock()
	defer v.mu.Unlock()
	t.Logf("served %v; most in flight per token %v; %d secondary refusals", v.served, v.most, v.refused)
	failed.Range(func(k, _ any) bool { t.Log("error: ", k); return true })
	if v.refused != 0 {
		t.Errorf("%d secondary refusals, want none", v.refused)
	}
	for _, tok := range tokens {
		if v.most["Bearer "+tok] != perToken {
			t.Errorf("%s had at most %d requests in flight, want %d: the fleet keeps each token's limit full", tok, v.most["Bearer "+tok], perToken)
		}
	}
	if v.served["core"] == 0 || v.served["search"] == 0 {
		t.Errorf("served %v, want both routes", v.served)
	}
}

// secondaryClient is one replica's go-github client: core and search
// through one Transport, each a quota of its own per token, and the
// secondary limit of perToken requests in flight per token one
// policies.Shared rule of both.
func secondaryClient(t *testing.T, rdb *redis.Client, base *url.URL, tokens []string, perToken, workers int) *github.Client {
	t.Helper()
	secondary := policies.Shared{Name: "github", Policy: policies.PerKey{Policy: policies.Concurrency{Max: perToken}}}
	core, err := throttle.New(rdb, "github-core", policies.All(
		policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}, secondary))
	if err != nil {
		t.Fatal(err)
	}
	search, err := throttle.New(rdb, "github-search", policies.All(
		policies.PerKey{Policy: policies.SlidingLog{Limit: 3000, Window: time.Minute}}, secondary))
	if err != nil {
		t.Fatal(err)
	}
	tr := &throttle.Transport{
		Base:    &http.Transport{MaxIdleConnsPerHost: workers},
		Limiter: core,
		Routes:  []throttle.Route{{Pattern: "/search/", Limiter: search}},
		Keys:    tokens,
		SetKey:  func(r *http.Request, key string) { r.Header.Set("Authorization", "Bearer "+key) },
	}
	c := github.NewClient(&http.Client{Transport: tr})
	c.BaseURL = base
	return c
}
