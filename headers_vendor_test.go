package throttle

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Each vendor's documented sample of its rate-limit headers, as it answers
// a call within its limit and one over it. Absolute times in the samples
// are moved to headerNow, so that the resets read as durations; the names
// keep the vendors' own case, which net/http canonicalizes.
func TestHeader_Vendors(t *testing.T) {
	for _, tt := range vendorHeaderSamples {
		t.Run(tt.vendor, func(t *testing.T) {
			hdr := http.Header{}
			for k, vs := range tt.header {
				for _, v := range vs {
					hdr.Add(k, v)
				}
			}
			if got := parseVendorLimits(hdr, headerNow); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("parseVendorLimits(%v)\n got  %+v\n want %+v", hdr, got, tt.want)
			}
		})
	}
}

// epoch is headerNow in whole Unix seconds, as the samples write their resets.
var epoch = headerNow.Unix()

// rfc3339 writes the time d after headerNow as Anthropic's resets do.
func rfc3339(d time.Duration) string { return headerNow.Add(d).UTC().Format(time.RFC3339) }

// vendorHeaderSamples are the vendors' documented headers of
// TestHeader_Vendors, with the limits each must be read as.
var vendorHeaderSamples = []struct {
	vendor string
	header map[string][]string
	want   vendorLimits
}{
	{"GitHub, within the limit", h(
		"x-ratelimit-limit", "5000",
		"x-ratelimit-remaining", "4999",
		"x-ratelimit-used", "1",
		"x-ratelimit-reset", itoa(epoch+3600),
		"x-ratelimit-resource", "core",
	), vendorLimits{remaining: 4999, reset: time.Hour, limit: 5000, scope: "core", resource: "core"}},
	{"GitHub, over the primary limit (403 or 429)", h(
		"x-ratelimit-limit", "60",
		"x-ratelimit-remaining", "0",
		"x-ratelimit-used", "60",
		"x-ratelimit-reset", itoa(epoch+1200),
		"x-ratelimit-resource", "core",
	), vendorLimits{remaining: 0, reset: 20 * time.Minute, limit: 60, scope: "core", resource: "core"}},
	{"GitHub, a secondary limit", h(
		"retry-after", "60",
		"x-ratelimit-limit", "5000",
		"x-ratelimit-remaining", "4990",
		"x-ratelimit-reset", itoa(epoch+3000),
		"x-ratelimit-resource", "core",
	), vendorLimits{retryAfter: time.Minute, hasRetryAfter: true, remaining: 4990, reset: 3000 * time.Second, limit: 5000, scope: "core", resource: "core"}},
	{"OpenAI, within the limits", h(
		"x-ratelimit-limit-requests", "60",
		"x-ratelimit-limit-tokens", "150000",
		"x-ratelimit-remaining-requests", "59",
		"x-ratelimit-remaining-tokens", "149984",
		"x-ratelimit-reset-requests", "1s",
		"x-ratelimit-reset-tokens", "6m0s",
	), vendorLimits{remaining: 59, reset: time.Second, limit: 60, tokens: 149984, tokensReset: 6 * time.Minute, hasTokens: true}},
	{"OpenAI, a 429", h(
		"retry-after-ms", "850",
		"retry-after", "1",
		"x-ratelimit-limit-requests", "500",
		"x-ratelimit-remaining-requests", "0",
		"x-ratelimit-reset-requests", "850ms",
		"x-ratelimit-remaining-tokens", "29000",
		"x-ratelimit-reset-tokens", "1m12.5s",
	), vendorLimits{retryAfter: time.Second, hasRetryAfter: true, remaining: 0, reset: 850 * time.Millisecond, limit: 500,
		tokens: 29000, tokensReset: 72500 * time.Millisecond, hasTokens: true}},
	{"Anthropic, within the limits", h(
		"anthropic-ratelimit-requests-limit", "50",
		"anthropic-ratelimit-requests-remaining", "49",
		"anthropic-ratelimit-requests-reset", rfc3339(2*time.Second),
		"anthropic-ratelimit-tokens-limit", "80000",
		"anthropic-ratelimit-tokens-remaining", "79000",
		"anthropic-ratelimit-tokens-reset", rfc3339(time.Second),
		"anthropic-ratelimit-input-tokens-limit", "40000",
		"anthropic-ratelimit-input-tokens-remaining", "39500",
		"anthropic-ratelimit-input-tokens-reset", rfc3339(time.Second),
		"anthropic-ratelimit-output-tokens-limit", "8000",
		"anthropic-ratelimit-output-tokens-remaining", "7500",
		"anthropic-ratelimit-output-tokens-reset", rfc3339(3*time.Second),
	), vendorLimits{remaining: 49, reset: 2 * time.Second, limit: 50, tokens: 7500, tokensReset: 3 * time.Second, hasTokens: true,
		units: map[string]Count{
			"input_tokens":  {Remaining: 39500, Reset: time.Second, Limit: 40000},
			"output_tokens": {Remaining: 7500, Reset: 3 * time.Second, Limit: 8000},
		}}},
	{"Anthropic, a 429", h(
		"retry-after", "12",
		"anthropic-ratelimit-requests-limit", "50",
		"anthropic-ratelimit-requests-remaining", "0",
		"anthropic-ratelimit-requests-reset", rfc3339(12*time.Second),
	), vendorLimits{retryAfter: 12 * time.Second, hasRetryAfter: true, remaining: 0, reset: 12 * time.Second, limit: 50}},
	{"Discord, within the limit", h(
		"X-RateLimit-Limit", "5",
		"X-RateLimit-Remaining", "0",
		"X-RateLimit-Reset", itoa(epoch+1)+".123",
		"X-RateLimit-Reset-After", "1",
		"X-RateLimit-Bucket", "abcd1234",
	), vendorLimits{remaining: 0, reset: 2 * time.Second, limit: 5}},
	{"Discord, a 429 of a shared resource", h(
		"Retry-After", "65",
		"X-RateLimit-Limit", "10",
		"X-RateLimit-Remaining", "0",
		"X-RateLimit-Reset-After", "64.57",
		"X-RateLimit-Bucket", "abcd1234",
		"X-RateLimit-Scope", "shared",
	), vendorLimits{retryAfter: 65 * time.Second, hasRetryAfter: true, remaining: 0, reset: 64570 * time.Millisecond, limit: 10, scope: "shared"}},
	{"Discord, the global limit", h(
		"Retry-After", "1",
		"X-RateLimit-Global", "true",
		"X-RateLimit-Scope", "global",
	), vendorLimits{retryAfter: time.Second, hasRetryAfter: true, remaining: -1, scope: "global"}},
	{"Shopify, within the bucket", h("X-Shopify-Shop-Api-Call-Limit", "32/40"),
		vendorLimits{remaining: 8, limit: 40}},
	{"Shopify, a 429", h("X-Shopify-Shop-Api-Call-Limit", "40/40", "Retry-After", "2.0"),
		vendorLimits{retryAfter: 2 * time.Second, hasRetryAfter: true, remaining: 0, limit: 40}},
	{"Salesforce", h("Sforce-Limit-Info", "api-usage=18/5000"),
		vendorLimits{remaining: 4982, limit: 5000}},
	{"Zendesk", h("ratelimit-limit", "700", "ratelimit-remaining", "699", "ratelimit-reset", "41"),
		vendorLimits{remaining: 699, reset: 41 * time.Second, limit: 700}},
	{"Zendesk, the older names", h("X-Rate-Limit", "700", "X-Rate-Limit-Remaining", "0", "Retry-After", "93"),
		vendorLimits{retryAfter: 93 * time.Second, hasRetryAfter: true, remaining: 0}},
	{"Stripe, a 429 not to retry", h("Stripe-Should-Retry", "false"),
		vendorLimits{remaining: -1, noRetry: true}},
	{"Stripe, a 429 to retry", h("Stripe-Should-Retry", "true"),
		vendorLimits{remaining: -1}},
	{"IETF draft 11", h(
		"RateLimit-Policy", `"burst";q=100;w=60,"daily";q=1000;w=86400`,
		"RateLimit", `"default";r=50;t=30`,
	), vendorLimits{remaining: 50, reset: 30 * time.Second}},
	{"IETF draft 11, two policies", h(
		"RateLimit-Policy", `"burst";q=100;w=60,"daily";q=1000;w=86400`,
		"RateLimit", `"burst";r=0;t=30, "daily";r=420;t=40000`,
	), vendorLimits{remaining: 0, reset: 30 * time.Second, limit: 100}},
	{"IETF draft 11, Retry-After beside t", h(
		"Retry-After", "45",
		"RateLimit-Policy", `"burst";q=100;w=60`,
		"RateLimit", `"burst";r=0;t=30`,
	), vendorLimits{retryAfter: 45 * time.Second, hasRetryAfter: true, remaining: 0, reset: 30 * time.Second, limit: 100}},
	{"IETF draft 11, malformed members ignored", h(
		"RateLimit", `"burst";r=zero;t=30, "daily";r=7;t=soon, ;;`,
	), vendorLimits{remaining: 7}},
}

// The transport keeps the count of what the quota counts: requests, or the
// tokens its requests cost by Transport.Cost; and it does not retry a call
// the vendor said must not be.
func TestTransport_HeedsTheVendorsOwnHeaders(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		var calls atomic.Int64
		vendor := ownHeadersVendor(&calls)
		defer vendor.Close()
		quota := func(prefix string, mode Mode) *Limiter {
			return newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 5000, Window: time.Minute}, Options{Prefix: prefix, Mode: mode})
		}
		// Each count leaves the others what they spent, and a unit more
		// for the jitter of their calls (see Usage.Others).
		if _, u := getThrough(t, &Transport{Limiter: quota("requests", Block)}, vendor.URL+"/openai"); u.Remaining != leftAfter(5000, 1, 3) {
			t.Errorf("a quota of requests has %d left, want %d: the vendor's 3 requests less what the others need more", u.Remaining, leftAfter(5000, 1, 3))
		}
		hundred := func(*http.Request) int { return 100 }
		if _, u := getThrough(t, &Transport{Limiter: quota("tokens", Block), Cost: hundred}, vendor.URL+"/openai"); u.Remaining != leftAfter(5000, 100, 1000) {
			t.Errorf("a quota of tokens has %d left, want %d: the vendor's 1000 tokens less what the others need more", u.Remaining, leftAfter(5000, 100, 1000))
		}
		// Requests and tokens in one quota: each rule follows its count.
		both := newLimiter(t, s.Client(t), policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}},
			policies.SlidingCounter{Limit: 200_000, Window: time.Minute},
		), Options{Prefix: "both"})
		_, u := getThrough(t, &Transport{Limiter: both, Cost: hundred}, vendor.URL+"/openai")
		if r, tk := leftAfter(500, 1, 3), leftAfter(200_000, 100, 1000); u.Rules[0].Remaining != r || u.Rules[1].Remaining != tk {
			t.Errorf("requests and tokens left %d and %d, want %d and %d: each of the vendor's counts",
				u.Rules[0].Remaining, u.Rules[1].Remaining, r, tk)
		}

		// A 403 with Retry-After is GitHub's secondary limit: the token
		// pauses for that long, and its limit stays.
		status, u := getThrough(t, &Transport{Limiter: quota("secondary", FailFast)}, vendor.URL+"/github-secondary")
		if status != http.StatusForbidden || u.Paused < 25*time.Second || u.Rules[0].Limit != 5000 {
			t.Errorf("a secondary limit: status %d, paused %v, limit %d; want the 403, a pause of 30s, the limit kept", status, u.Paused, u.Rules[0].Limit)
		}

		calls.Store(0)
		status, _ = getThrough(t, &Transport{Limiter: quota("stripe", Block), DefaultPause: time.Millisecond}, vendor.URL+"/stripe")
		if status != http.StatusTooManyRequests || calls.Load() != 1 {
			t.Errorf("Stripe-Should-Retry: false: status %d after %d calls, want the 429 after one", status, calls.Load())
		}
	})
}

// ownHeadersVendor answers as three vendors do, by path: GitHub's
// secondary limit (a 403 with Retry-After), Stripe's 429 that says not to
// retry, and else OpenAI's counts of requests and tokens left. It counts
// the calls it gets in calls.
func ownHeadersVendor(calls *atomic.Int64) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		switch r.URL.Path {
		case "/github-secondary":
			w.Header().Set("retry-after", "30")
			w.Header().Set("x-ratelimit-limit", "5000")
			w.Header().Set("x-ratelimit-remaining", "4990")
			w.WriteHeader(http.StatusForbidden)
		case "/stripe":
			w.Header().Set("Stripe-Should-Retry", "false")
			w.WriteHeader(http.StatusTooManyRequests)
		default:
			w.Header().Set("x-ratelimit-remaining-requests", "3")
			w.Header().Set("x-ratelimit-reset-requests", "20s")
			w.Header().Set("x-ratelimit-remaining-tokens", "1000")
			w.Header().Set("x-ratelimit-reset-tokens", "30s")
		}
	}))
}

// getThrough sends a GET to url through tr, and returns the answer's
// status and the usage of tr's limiter after it.
func getThrough(t *testing.T, tr *Transport, url string) (int, Usage) {
	t.Helper()
	resp, err := (&http.Client{Transport: tr}).Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	u, err := tr.Limiter.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, u
}

// An LLM call admitted with an estimate is settled with what the vendor
// says it used: from a header, through Transport.ResponseCost, or from the body,
// through the permit the response's request carries.
func TestTransport_SettlesTheCostFromTheResponse(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Tokens-Used", "120")
			_, _ = w.Write([]byte(`{"usage":{"total_tokens":120}}`))
		}))
		defer vendor.Close()
		ctx := context.Background()
		estimate := func(*http.Request) int { return 500 }
		used := func(lim *Limiter) int {
			u, err := lim.Usage(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return u.Rules[0].Used
		}

		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10000, Window: time.Minute}, Options{Prefix: "header"})
		c := &http.Client{Transport: &Transport{Limiter: lim, Cost: estimate, ResponseCost: func(resp *http.Response) int {
			n, err := strconv.Atoi(resp.Header.Get("X-Tokens-Used"))
			if err != nil {
				return -1
			}
			return n
		}}}
		resp, err := c.Get(vendor.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := used(lim); got != 120 {
			t.Errorf("settled from a header: the quota counts %d, want 120", got)
		}

		lim = newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10000, Window: time.Minute}, Options{Prefix: "body"})
		c = &http.Client{Transport: &Transport{Limiter: lim, Cost: estimate}}
		resp, err = c.Get(vendor.URL)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Usage struct {
				TotalTokens int `json:"total_tokens"`
			} `json:"usage"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if err := PermitFrom(resp.Request.Context()).Settle(ctx, Cost(body.Usage.TotalTokens)); err != nil {
			t.Fatal(err)
		}
		if got := used(lim); got != 120 {
			t.Errorf("settled from the body: the quota counts %d, want 120", got)
		}
	})
}
