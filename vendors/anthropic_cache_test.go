package vendors

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// cachedParams is a message whose system prompt of prefix tokens is cached
// and whose question is 100 tokens, as the fake counts.
func cachedParams(prefix int) anthropic.MessageNewParams {
	return anthropic.MessageNewParams{
		Model:     "claude-sonnet-4-5",
		MaxTokens: 200,
		System: []anthropic.TextBlockParam{{Text: strings.Repeat("abcd", prefix),
			CacheControl: anthropic.NewCacheControlEphemeralParam()}},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(strings.Repeat("what now", 50)))},
	}
}

// The Anthropic recipe against the fake at Anthropic's figures: the first
// call writes the cache and is settled up to what it wrote, the second
// reads it and is counted its question alone.
func TestREADME_AnthropicCacheRecipeRuns(t *testing.T) {
	v := newAnthropicCacheFake(50, 30_000, time.Minute, 0)
	srv := v.serve()
	defer srv.Close()
	t.Setenv("ANTHROPIC_BASE_URL", srv.URL+"/")
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	s := redistest.Mini(t)
	client, err := readmeAnthropicCache(s.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 2 {
		if _, err := readmeAnthropicCacheCall(ctx, client, cachedParams(2000), 100); err != nil {
			t.Fatal(err)
		}
	}
	lim, err := throttle.New(s.Client(t), "anthropic", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Minute}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 8_000, Window: time.Minute}}))
	if err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, _, reads, writes, counted := v.results()
	if reads != 1 || writes != 1 || u.Rules[1].Used != counted[0] || counted[0] != 2000+2*100 {
		t.Errorf("%d reads, %d writes; the quota counts %d input tokens, the vendor %v; want 1, 1 and 2,200 in both",
			reads, writes, u.Rules[1].Used, counted)
	}
}

// anthropicCacheClient is the recipe's client at the fake's figures.
func anthropicCacheClient(t *testing.T, rdb *redis.Client, baseURL string, requests, input int, window time.Duration) anthropic.Client {
	lim, err := throttle.New(rdb, "anthropic-cache", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: requests, Window: window}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: input, Window: window}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 100_000, Window: window}}))
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 16}, Limiter: lim}}
	return anthropic.NewClient(option.WithAPIKey("sk-ant-test"), option.WithBaseURL(baseURL+"/"), option.WithHTTPClient(hc))
}

// A fleet of 3 × 10 anthropic-sdk-go clients through the recipe, each
// message a cached system prompt of 2,000 tokens and a question of 100,
// against a fake counting as Anthropic documents (token buckets of 200
// requests and 6,000 input tokens refilled every 2 s): each call estimated at its question,
// settled to what Anthropic counted (the first calls' cache writes in,
// every later call's cache read out). After the first window no 429, and
// after the first two (the cold cache's writes and their refusals settle)
// the input tokens at 0.9 or more of their cap.
func TestAnthropic_CacheReadsAreNotCountedAsInput(t *testing.T) {
	const requests, input, window = 200, 6000, 2 * time.Second
	d := fleetRun(8*time.Second, 20*time.Second)
	v := newAnthropicCacheFake(requests, input, window, 100*time.Millisecond)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Real(t)
	clients := make([]anthropic.Client, 3)
	for i := range clients {
		clients[i] = anthropicCacheClient(t, s.Client(t), srv.URL, requests, input, window)
	}
	ctx := context.Background()
	runEach(3, 10, d, func(i int) {
		if _, err := readmeAnthropicCacheCall(ctx, clients[i], cachedParams(2000), 100); err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
	refused, early, reads, writes, counted := v.results()
	got := share(counted, input, int(d/window))
	t.Logf("anthropic-sdk-go with a cached prompt: %d cache writes, %d reads; %d 429s in the first window, %d after it; input tokens per window %v; %.3f of the input tokens cap",
		writes, reads, early, refused, counted, got)
	if refused != 0 {
		t.Errorf("%d 429s after the first window, want none", refused)
	}
	if got < 0.9 {
		t.Errorf("%.3f of the input tokens cap, want at least 0.9", got)
	}
}
