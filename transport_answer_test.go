package throttle

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// shopifyAnswer is a GraphQL answer that states its cost as Shopify
// does, in extensions.cost, after data of n bytes.
func shopifyAnswer(requested, actual, n int) string {
	return `{"data":{"products":"` + strings.Repeat("x", n) + `"},"extensions":{"cost":{"requestedQueryCost":` +
		strconv.Itoa(requested) + `,"actualQueryCost":` + strconv.Itoa(actual) +
		`,"throttleStatus":{"maximumAvailable":1000,"currentlyAvailable":900,"restoreRate":50}}}}`
}

// actualQueryCost is a Route's FromBody for the answers above.
func actualQueryCost(body []byte, _ *Answer) int {
	var b struct {
		Extensions struct {
			Cost struct{ ActualQueryCost *int }
		}
	}
	if json.Unmarshal(body, &b) != nil || b.Extensions.Cost.ActualQueryCost == nil {
		return -1
	}
	return *b.Extensions.Cost.ActualQueryCost
}

// A GraphQL call is admitted at its requested cost and settled to the
// actual cost its answer states in the body, which the caller still reads
// whole; a body past what is read keeps the cost admitted.
func TestTransport_SettlesTheCostTheBodyStates(t *testing.T) {
	tests := []struct {
		name string
		data int
		want int
	}{
		{"a short answer", 100, 7},
		{"an answer of almost a MiB", maxAnswerBody - 300, 7},
		{"an answer past a MiB", maxAnswerBody + 1, 100},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for i, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				body := shopifyAnswer(100, 7, tt.data)
				vendor := httptest.NewServer(answer(http.StatusOK, body, "Content-Type", "application/json"))
				defer vendor.Close()
				lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Minute},
					Options{Prefix: "body" + strconv.Itoa(i)})
				c := &http.Client{Transport: &Transport{
					Routes: []Route{{Pattern: "/graphql", Limiter: lim, FromBody: actualQueryCost}},
					Cost:   func(*http.Request) int { return 100 },
				}}
				resp, err := c.Post(vendor.URL+"/graphql", "application/json", strings.NewReader(`{"query":"{ products }"}`))
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || string(got) != body {
					t.Errorf("the caller read %d bytes (%v), want the %d the vendor sent", len(got), err, len(body))
				}
				u, err := lim.Usage(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if u.Rules[0].Used != tt.want {
					t.Errorf("the quota counts %d units, want %d", u.Rules[0].Used, tt.want)
				}
			})
		}
	})
}

// FromBody amends the Answer of the headers: a refusal that a GraphQL
// vendor states in a 200's body (Shopify's THROTTLED) pauses the fleet,
// and a refused call is not settled.
func TestTransport_FromBodyStatesARefusal(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		body := `{"errors":[{"message":"Throttled","extensions":{"code":"THROTTLED"}}],"extensions":{"cost":{"requestedQueryCost":100,"actualQueryCost":0}}}`
		vendor := httptest.NewServer(answer(http.StatusOK, body, "Content-Type", "application/json"))
		defer vendor.Close()
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Minute}, Options{Mode: FailFast})
		throttled := func(body []byte, a *Answer) int {
			if strings.Contains(string(body), `"THROTTLED"`) {
				a.Status, a.RetryAfter, a.HasRetryAfter = http.StatusTooManyRequests, 2*time.Second, true
			}
			return actualQueryCost(body, a)
		}
		c := &http.Client{Transport: &Transport{
			Routes: []Route{{Pattern: "/", Limiter: lim, FromBody: throttled}},
			Cost:   func(*http.Request) int { return 100 },
		}}
		resp, err := c.Post(vendor.URL, "application/json", strings.NewReader(`{"query":"{ products }"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		u, err := lim.Usage(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if u.Paused <= time.Second || u.Rules[0].Used != 100 {
			t.Errorf("paused %v, %d units counted; want a pause of 2s, and the call's 100 kept", u.Paused, u.Rules[0].Used)
		}
	})
}

// An answer about another resource than the route's (GitHub's code search,
// 10 a minute, on the search route's quota of 30) neither teaches the
// quota a cap nor pauses it; one about the route's own resource does.
func TestTransport_AnAnswerAboutAnotherResourceLeavesTheQuota(t *testing.T) {
	tests := []struct {
		resource  string
		wantLimit int
		paused    bool
	}{
		{"code_search", 30, false},
		{"search", 15, true}, // halved at most per refusal
		{"", 15, true},       // an answer that names none is the route's
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for i, tt := range tests {
			t.Run(tt.resource, func(t *testing.T) {
				reset := strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
				header := []string{"X-RateLimit-Limit", "10", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", reset}
				if tt.resource != "" {
					header = append(header, "X-RateLimit-Resource", tt.resource)
				}
				vendor := httptest.NewServer(answer(http.StatusForbidden, `{"message":"API rate limit exceeded"}`, header...))
				defer vendor.Close()
				search := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 30, Window: time.Minute},
					Options{Mode: FailFast, Prefix: "resource" + strconv.Itoa(i)})
				c := &http.Client{Transport: &Transport{Routes: []Route{{Pattern: "/search/", Limiter: search, Resource: "Search"}}}}
				resp, err := c.Get(vendor.URL + "/search/code?q=x")
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if got := limitInForce(t, search); got[0] != tt.wantLimit {
					t.Errorf("limit in force %v, want %d", got, tt.wantLimit)
				}
				if paused := search.paused() > 0; paused != tt.paused {
					t.Errorf("paused %v, want %v", paused, tt.paused)
				}
			})
		}
	})
}
