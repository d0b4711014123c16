package vendors

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// fakeOpenAI answers POST /chat/completions as api.openai.com does, with
// its rate-limit headers on requests, counting calls in v.
func fakeOpenAI(v *fixedWindow) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok, remaining, reset := v.take(false)
		h := w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("x-ratelimit-limit-requests", strconv.Itoa(v.limit))
		h.Set("x-ratelimit-remaining-requests", strconv.Itoa(remaining))
		h.Set("x-ratelimit-reset-requests", time.Until(reset).Round(time.Millisecond).String())
		h.Set("x-ratelimit-limit-tokens", "1000000")
		h.Set("x-ratelimit-remaining-tokens", "999000")
		h.Set("x-ratelimit-reset-tokens", "6m0s")
		if !ok {
			after := time.Until(reset)
			h.Set("retry-after-ms", strconv.FormatInt(after.Milliseconds(), 10))
			h.Set("retry-after", strconv.Itoa(int((after+time.Second-1)/time.Second)))
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprint(w, `{"error":{"message":"Rate limit reached for requests","type":"requests","code":"rate_limit_exceeded"}}`)
			return
		}
		fmt.Fprint(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
	}))
}

// openaiFleet runs replicas × workers openai-go clients, with their own
// retries, through throttle's transport, each replica with its own limiter
// and Redis client, for d.
func openaiFleet(t *testing.T, s *redistest.Server, name, baseURL string, limit int, window, d time.Duration) {
	const replicas, workers = 3, 5
	clients := make([]openai.Client, replicas)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), name, policies.SlidingLog{Limit: limit, Window: window})
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Transport: &throttle.Transport{Base: http.DefaultTransport, Limiter: lim}}
		clients[i] = openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(baseURL+"/"), option.WithHTTPClient(hc))
	}
	ctx := context.Background()
	runEach(replicas, workers, d, func(i int) {
		_, err := clients[i].Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:    "gpt-4o",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
		})
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func TestOpenAI_NoRefusalAtTheRightConfiguration(t *testing.T) {
	t.Parallel()
	const limit, window, windows = 40, 2 * time.Second, 3
	s := redistest.Real(t)
	v := newFixedWindow(limit, window)
	srv := fakeOpenAI(v)
	defer srv.Close()
	openaiFleet(t, s, "openai-right", srv.URL, limit, window, windows*window)
	ours, refused, per := v.results()
	t.Logf("openai-go: %d calls served, %d refused; per window %v", ours, refused, per)
	if refused != 0 {
		t.Errorf("%d refusals, want none", refused)
	}
	if min := limit * (windows - 1) * 9 / 10; ours < min {
		t.Errorf("%d calls served in %d windows of %d, want at least %d", ours, windows, limit, min)
	}
}

// Another service spends 40% of the same key's requests: the fleet reads
// x-ratelimit-remaining-requests, and takes most of what is left.
func TestOpenAI_FollowsAKeyAnotherConsumerSpends(t *testing.T) {
	t.Parallel()
	const limit, window, windows = 40, 2 * time.Second, 4
	s := redistest.Real(t)
	v := newFixedWindow(limit, window)
	srv := fakeOpenAI(v)
	defer srv.Close()
	stop := make(chan struct{})
	go otherConsumer(v, 0.4, stop)
	openaiFleet(t, s, "openai-shared", srv.URL, limit, window, windows*window)
	close(stop)
	ours, refused, per := v.results()
	t.Logf("openai-go beside another consumer: %d calls served, %d refused; per window %v", ours, refused, per)
	if refused > 3*(windows+1) {
		t.Errorf("%d refusals, want at most a handful per window", refused)
	}
	if min := limit * (windows - 1) * 48 / 100; ours < min {
		t.Errorf("%d calls served, want at least %d: most of what the other consumer leaves", ours, min)
	}
}

// A call made through openai-go is settled from its typed result in one
// line, with the permit Track gives: of the request's last try, when the
// SDK sent it again. The fake fails the first request with a 500, which
// openai-go retries by itself; each try was admitted at the estimate of
// 100 tokens, the first stays counted (the vendor may have counted it),
// the second is settled at the 11 tokens the answer says it used.
func TestOpenAI_SettlesFromTheTypedResult(t *testing.T) {
	t.Parallel()
	s := redistest.Mini(t)
	var tries int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tries++
		w.Header().Set("Content-Type", "application/json")
		if tries == 1 {
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, `{"error":{"message":"overloaded","type":"server_error"}}`)
			return
		}
		fmt.Fprint(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
	}))
	defer srv.Close()
	lim, err := throttle.New(s.Client(t), "openai-settle", policies.SlidingLog{Limit: 100_000, Window: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &throttle.Transport{Limiter: lim, Cost: func(*http.Request) int { return 100 }}}
	client := openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(srv.URL+"/"), option.WithHTTPClient(hc),
		option.WithRequestTimeout(5*time.Second))

	ctx, call := throttle.Track(context.Background())
	completion, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "gpt-4o",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
	})
	if err == nil {
		err = call.Settle(ctx, throttle.Cost(int(completion.Usage.TotalTokens)))
	}
	if err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if tries != 2 || u.Rules[0].Used != 100+11 {
		t.Errorf("%d tries, %d tokens counted; want 2 tries, and 111 (the first try's estimate, the second settled)", tries, u.Rules[0].Used)
	}
}
