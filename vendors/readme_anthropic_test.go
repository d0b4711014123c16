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

// One quota for Anthropic's requests, input and output tokens, each call
// settled from its typed result, run here against the fake (the recipe of
// docs/VENDORS.md, with prompt caching, is readme_anthropic_cache_test.go).
func readmeAnthropic(ctx context.Context, rdb *redis.Client, params anthropic.MessageNewParams, prompt int) (*anthropic.Message, error) {
	lim, err := throttle.New(rdb, "anthropic", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Minute}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 8_000, Window: time.Minute}},
	))
	if err != nil {
		return nil, err
	}
	client := anthropic.NewClient(option.WithHTTPClient(&http.Client{Transport: &throttle.Transport{Limiter: lim}}))
	// Each estimate set once, for every try the SDK sends; settled from the typed result.
	ctx, call := throttle.Track(ctx,
		throttle.CostIn("input_tokens", prompt), throttle.CostIn("output_tokens", int(params.MaxTokens)))
	msg, err := client.Messages.New(ctx, params)
	if err != nil {
		return nil, err
	}
	err = call.Settle(ctx, throttle.CostIn("input_tokens", int(msg.Usage.InputTokens)), throttle.CostIn("output_tokens", int(msg.Usage.OutputTokens)))
	return msg, err
}

func TestREADME_AnthropicSnippetRuns(t *testing.T) {
	v := newAnthropicVendor(50, 30_000, 8_000, time.Minute, 0)
	srv := fakeAnthropic(v)
	defer srv.Close()
	t.Setenv("ANTHROPIC_BASE_URL", srv.URL+"/")
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	s := redistest.Mini(t)
	text := strings.Repeat("tell me more ", 31)
	msg, err := readmeAnthropic(context.Background(), s.Client(t), anthropic.MessageNewParams{
		Model: "claude-sonnet-4-5", MaxTokens: 200,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(text))},
	}, promptTokens(text))
	if err != nil {
		t.Fatal(err)
	}
	lim, err := throttle.New(s.Client(t), "anthropic", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Minute}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 8_000, Window: time.Minute}},
	))
	if err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if u.Rules[0].Used != 1 || u.Rules[1].Used != int(msg.Usage.InputTokens) || u.Rules[2].Used != int(msg.Usage.OutputTokens) {
		t.Fatalf("the quota counts %d requests, %d input and %d output tokens; want 1, %d and %d", u.Rules[0].Used, u.Rules[1].Used, u.Rules[2].Used, msg.Usage.InputTokens, msg.Usage.OutputTokens)
	}
}
