package vendors

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-github/v84/github"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// fakeGitHub answers GET /users/{name} as api.github.com does, with its
// rate-limit headers, counting calls in v.
func fakeGitHub(v *fixedWindow) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok, remaining, reset := v.take(false)
		h := w.Header()
		h.Set("Content-Type", "application/json; charset=utf-8")
		h.Set("x-ratelimit-limit", strconv.Itoa(v.limit))
		h.Set("x-ratelimit-remaining", strconv.Itoa(remaining))
		h.Set("x-ratelimit-used", strconv.Itoa(v.limit-remaining))
		h.Set("x-ratelimit-reset", strconv.FormatInt(reset.Add(time.Second-1).Unix(), 10))
		h.Set("x-ratelimit-resource", "core")
		if !ok {
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprint(w, `{"message":"API rate limit exceeded for user ID 1.","documentation_url":"https://docs.github.com/rest/overview/resources-in-the-rest-api#rate-limiting"}`)
			return
		}
		fmt.Fprint(w, `{"login":"octocat","id":1}`)
	}))
}

// githubFleet runs replicas × workers go-github clients through throttle's
// transport, each replica with its own limiter and Redis client, for d.
func githubFleet(t *testing.T, s *redistest.Server, name, baseURL string, limit int, window, d time.Duration) {
	const replicas, workers = 3, 5
	base, err := url.Parse(baseURL + "/")
	if err != nil {
		t.Fatal(err)
	}
	clients := make([]*github.Client, replicas)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), name, policies.PerKey{Policy: policies.SlidingLog{Limit: limit, Window: window}})
		if err != nil {
			t.Fatal(err)
		}
		tr := &throttle.Transport{
			Base:    http.DefaultTransport,
			Limiter: lim,
			Key:     func(r *http.Request) string { return r.Header.Get("Authorization") },
		}
		c := github.NewClient(&http.Client{Transport: tr}).WithAuthToken("token-a")
		c.BaseURL = base
		clients[i] = c
	}
	ctx := context.Background()
	runEach(replicas, workers, d, func(i int) {
		if _, _, err := clients[i].Users.Get(ctx, "octocat"); err != nil {
			// go-github refuses on its own until the reset it saw.
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func TestGitHub_NoRefusalAtTheRightConfiguration(t *testing.T) {
	t.Parallel()
	const limit, window, windows = 40, 2 * time.Second, 3
	s := redistest.Real(t)
	v := newFixedWindow(limit, window)
	srv := fakeGitHub(v)
	defer srv.Close()
	githubFleet(t, s, "github-right", srv.URL, limit, window, windows*window)
	ours, refused, per := v.results()
	t.Logf("go-github: %d calls served, %d refused; per window %v", ours, refused, per)
	if refused != 0 {
		t.Errorf("%d refusals, want none", refused)
	}
	if min := limit * (windows - 1) * 9 / 10; ours < min {
		t.Errorf("%d calls served in %d windows of %d, want at least %d", ours, windows, limit, min)
	}
}

// Another service spends 40% of the same token's calls: the fleet follows
// the vendor's count, and takes most of what is left. A few of its calls in
// flight at a window's start meet the other service's first calls of it:
// 3 to 18 refusals in all over 18 runs here, 6 a window when the fleet's
// first burst took the whole first window ([40 31 31 31 14] per window),
// about 1 when it did not; of its 15 workers, at most a third a window.
func TestGitHub_FollowsATokenAnotherConsumerSpends(t *testing.T) {
	t.Parallel()
	const limit, window, windows = 40, 2 * time.Second, 4
	s := redistest.Real(t)
	v := newFixedWindow(limit, window)
	srv := fakeGitHub(v)
	defer srv.Close()
	stop := make(chan struct{})
	go otherConsumer(v, 0.4, stop)
	githubFleet(t, s, "github-shared", srv.URL, limit, window, windows*window)
	close(stop)
	ours, refused, per := v.results()
	t.Logf("go-github beside another consumer: %d calls served, %d refused; per window %v", ours, refused, per)
	if refused > 5*(windows+1) {
		t.Errorf("%d refusals, want at most a handful per window", refused)
	}
	if min := limit * (windows - 1) * 48 / 100; ours < min {
		t.Errorf("%d calls served, want at least %d: most of what the other consumer leaves", ours, min)
	}
}
