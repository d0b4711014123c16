package throttle

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
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

// A refusal about calls in flight (Stripe's concurrency reasons, Twilio's
// 20429) is the Concurrency rule's: on a quota that has one it pauses
// nothing and teaches no cap, and the request is retried when its slot
// frees. On a quota without one it pauses the fleet, as any refusal.
func TestTransport_AConcurrencyRefusalGoesToTheConcurrencyRule(t *testing.T) {
	t.Parallel()
	json := []string{"Content-Type", "application/json"}
	tests := []struct {
		name   string
		header []string
		body   string
		conc   bool
		paused bool
	}{
		{"Stripe endpoint-concurrency, with a Concurrency rule", append([]string{"Stripe-Rate-Limited-Reason", "endpoint-concurrency"}, json...), stripeRateLimit, true, false},
		{"Stripe global-concurrency, with a Concurrency rule", append([]string{"Stripe-Rate-Limited-Reason", "global-concurrency"}, json...), stripeRateLimit, true, false},
		{"Twilio 20429, with a Concurrency rule", json, twilioTooMany, true, false},
		{"Stripe endpoint-concurrency, no Concurrency rule", append([]string{"Stripe-Rate-Limited-Reason", "endpoint-concurrency"}, json...), stripeRateLimit, false, true},
		{"Stripe global-rate, with a Concurrency rule", append([]string{"Stripe-Rate-Limited-Reason", "global-rate"}, json...), stripeRateLimit, true, true},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for i, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				vendor := httptest.NewServer(refuseFirstWith(1, tt.body, tt.header...))
				defer vendor.Close()
				var p policies.Policy = policies.SlidingLog{Limit: 100, Window: time.Second}
				if tt.conc {
					p = policies.All(p, policies.Concurrency{Max: 10})
				}
				lim := newLimiter(t, s.Client(t), p, Options{Prefix: "conc" + strconv.Itoa(i)})
				c := &http.Client{Transport: &Transport{Limiter: lim, RetryAnyMethod: true}}
				start := time.Now()
				resp, err := c.Post(vendor.URL, "application/x-www-form-urlencoded", strings.NewReader("amount=100"))
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				took := time.Since(start)
				if resp.StatusCode != http.StatusOK {
					t.Errorf("status %d, want the retry's 200", resp.StatusCode)
				}
				if got := limitInForce(t, lim); got[0] != 100 && !strings.Contains(tt.name, "global-rate") {
					t.Errorf("limit in force %v, want 100", got)
				}
				if paused := took >= time.Second; paused != tt.paused {
					t.Errorf("the retry came after %v; want a pause of the fleet %v", took, tt.paused)
				}
			})
		}
	})
}

// twilioTooMany is Twilio's refusal of a call over its concurrency limit
// (https://www.twilio.com/docs/api/errors/20429).
const twilioTooMany = `{"code":20429,"message":"Too Many Requests","more_info":"https://www.twilio.com/docs/errors/20429","status":429}`

// refuseFirstWith answers the first n requests with a 429 of body and
// headers, and the rest with 200 "ok".
func refuseFirstWith(n int, body string, header ...string) http.HandlerFunc {
	var mu sync.Mutex
	seen := 0
	return func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen++
		refuse := seen <= n
		mu.Unlock()
		if refuse {
			answer(http.StatusTooManyRequests, body, header...)(w, r)
			return
		}
		answer(http.StatusOK, "ok")(w, r)
	}
}
