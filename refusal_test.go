package throttle

import (
	"context"
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

// The vendors' documented refusals that are about something else than the
// rate: Stripe's object lock (an error code, no Stripe-Rate-Limited-Reason,
// https://docs.stripe.com/error-codes#lock-timeout), Stripe's concurrency
// limiters, OpenAI's billing quota, GitHub's secondary limit.
const (
	stripeLockTimeout = `{"error":{"code":"lock_timeout","doc_url":"https://stripe.com/docs/error-codes/lock-timeout",` +
		`"message":"This object cannot be accessed right now because another API request or Stripe process is currently accessing it.",` +
		`"type":"invalid_request_error"}}`
	stripeRateLimit = `{"error":{"code":"rate_limit","message":"Request rate limit exceeded.","type":"invalid_request_error"}}`
	openAIQuota     = `{"error":{"message":"You exceeded your current quota, please check your plan and billing details.",` +
		`"type":"insufficient_quota","param":null,"code":"insufficient_quota"}}`
	openAIRate = `{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 500, Used 500, Requested 1.",` +
		`"type":"requests","param":null,"code":"rate_limit_exceeded"}}`
	gitHubSecondary = `{"message":"You have exceeded a secondary rate limit. Please wait a few minutes before you try again.",` +
		`"documentation_url":"https://docs.github.com/rest/overview/rate-limits-for-the-rest-api#about-secondary-rate-limits","status":"403"}`
)

// A refusal teaches the quota a cap only when the vendor says it is about
// its rate: a documented reason (Stripe's global-rate or endpoint-rate,
// OpenAI's rate_limit_exceeded), or Transport.AboutRate for a vendor whose
// every refusal is. A refusal that gives no reason, or one about a lock, a
// concurrency limit, a billing quota or a secondary limit, pauses the fleet
// and leaves the limit in force alone. The caller reads the body as sent.
func TestTransport_ARefusalTeachesACapOnlyWhenAboutTheRate(t *testing.T) {
	json := []string{"Content-Type", "application/json"}
	large := `{"error":{"code":"rate_limit_exceeded","message":"` + strings.Repeat("x", 20<<10) + `"}}`
	tests := []struct {
		name      string
		status    int
		header    []string
		body      string
		aboutRate func(*http.Response) bool
		want      int
	}{
		{"a 429 with no reason", 429, nil, "slow down", nil, 100},
		{"a 429 with no reason, AboutRate", 429, nil, "slow down", func(*http.Response) bool { return true }, 50},
		{"Stripe lock_timeout", 429, append([]string{"Stripe-Should-Retry", "true"}, json...), stripeLockTimeout, nil, 100},
		{"Stripe lock_timeout, AboutRate", 429, append([]string{"Stripe-Should-Retry", "true"}, json...), stripeLockTimeout,
			func(*http.Response) bool { return true }, 100},
		{"Stripe global-concurrency", 429, append([]string{"Stripe-Rate-Limited-Reason", "global-concurrency"}, json...), stripeRateLimit, nil, 100},
		{"Stripe endpoint-concurrency", 429, append([]string{"Stripe-Rate-Limited-Reason", "endpoint-concurrency"}, json...), stripeRateLimit, nil, 100},
		{"Stripe resource-specific", 429, append([]string{"Stripe-Rate-Limited-Reason", "resource-specific"}, json...), stripeRateLimit, nil, 100},
		{"Stripe global-rate", 429, append([]string{"Stripe-Rate-Limited-Reason", "global-rate"}, json...), stripeRateLimit, nil, 50},
		{"Stripe endpoint-rate", 429, append([]string{"Stripe-Rate-Limited-Reason", "endpoint-rate"}, json...), stripeRateLimit, nil, 50},
		{"OpenAI insufficient_quota", 429, json, openAIQuota, nil, 100},
		{"OpenAI insufficient_quota, AboutRate", 429, json, openAIQuota, func(*http.Response) bool { return true }, 100},
		{"OpenAI rate_limit_exceeded", 429, json, openAIRate, nil, 50},
		{"GitHub secondary limit", 403, append([]string{"Retry-After", "1"}, json...), gitHubSecondary, nil, 100},
		{"a body past what is read", 429, json, large, nil, 100},
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for i, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				vendor := httptest.NewServer(answer(tt.status, tt.body, tt.header...))
				defer vendor.Close()
				lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 100, Window: time.Second},
					Options{Mode: FailFast, Prefix: "reason" + strconv.Itoa(i)})
				c := &http.Client{Transport: &Transport{Limiter: lim, MaxRetries: -1, AboutRate: tt.aboutRate}}
				resp, err := c.Get(vendor.URL)
				if err != nil {
					t.Fatal(err)
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || string(body) != tt.body {
					t.Errorf("the caller read %d bytes (%v), want the %d the vendor sent", len(body), err, len(tt.body))
				}
				if got := limitInForce(t, lim); got[0] != tt.want {
					t.Errorf("limit in force %v after the refusal, want %d", got, tt.want)
				}
				if d := lim.paused(); d <= 0 {
					t.Errorf("Paused() = %v, want the refusal to pause the quota", d)
				}
			})
		}
	})
}

// Permit.Heard learns a cap from a refusal with no counts only when the
// Answer says it is about the vendor's rate.
func TestHeard_ARefusalTeachesACapOnlyWhenAboutTheRate(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, about := range []bool{false, true} {
			lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 10, Window: time.Minute},
				Options{Prefix: "heard-about-" + strconv.FormatBool(about)})
			p, err := lim.Acquire(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			_, refused, err := p.Heard(context.Background(), Answer{Status: http.StatusTooManyRequests, RetryAfter: time.Second,
				HasRetryAfter: true, AboutRate: about})
			if err != nil || !refused {
				t.Fatalf("Heard(429) = %v, %v", refused, err)
			}
			want := 10
			if about {
				want = 5
			}
			if got := limitInForce(t, lim); got[0] != want {
				t.Errorf("AboutRate %v: limit in force %v after a 429, want %d", about, got, want)
			}
		}
	})
}

// The reasons read from a refusal's headers and body, in the shapes the
// vendors send and a few they might: a reason not known is no rate reason.
func TestRefusalReason_ReadsTheDocumentedFields(t *testing.T) {
	for _, tt := range []struct {
		name, header, body string
		want               refusalAbout
	}{
		{"Stripe global-rate", "global-rate", "", aboutTheRate},
		{"Stripe endpoint-rate, any case", " Endpoint-Rate ", "", aboutTheRate},
		{"Stripe global-concurrency", "global-concurrency", "", aboutConcurrency},
		{"Stripe endpoint-concurrency", "endpoint-concurrency", "", aboutConcurrency},
		{"Stripe resource-specific", "resource-specific", "", aboutOther},
		{"Twilio 20429", "", `{"code":20429,"message":"Too Many Requests","status":429}`, aboutConcurrency},
		{"Twilio, another code", "", `{"code":20003,"message":"Authenticate","status":401}`, aboutNothingSaid},
		{"Stripe, a reason added later", "weekly-volume", "", aboutOther},
		{"Stripe lock_timeout", "", stripeLockTimeout, aboutOther},
		{"Stripe rate_limit code alone", "", stripeRateLimit, aboutNothingSaid},
		{"OpenAI rate_limit_exceeded", "", openAIRate, aboutTheRate},
		{"OpenAI insufficient_quota", "", openAIQuota, aboutOther},
		{"OpenAI billing code under insufficient_quota", "", `{"error":{"type":"insufficient_quota","code":"project_spend_limit_exceeded"}}`, aboutOther},
		{"GitHub secondary limit", "", gitHubSecondary, aboutOther},
		{"GitHub primary limit", "", `{"message":"API rate limit exceeded for user ID 1."}`, aboutNothingSaid},
		{"an error that is a string", "", `{"error":"rate_limit_exceeded"}`, aboutNothingSaid},
		{"a null code", "", `{"error":{"code":null,"type":null}}`, aboutNothingSaid},
		{"not JSON", "", "slow down", aboutNothingSaid},
		{"nothing", "", "", aboutNothingSaid},
	} {
		got := stripeAbout(tt.header)
		if got == aboutNothingSaid {
			got = bodyAbout([]byte(tt.body))
		}
		if got != tt.want {
			t.Errorf("%s: reason %d, want %d", tt.name, got, tt.want)
		}
	}
}
