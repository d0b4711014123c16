package vendors

import (
	"context"
	"net/http"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// The Anthropic recipe of docs/VENDORS.md, with prompt caching, compiled
// and run here against the fake.
func readmeAnthropicCache(rdb *redis.Client) (anthropic.Client, error) {
	// README anthropic-cache
	lim, err := throttle.New(rdb, "anthropic", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 50, Window: time.Minute}},
		policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 30_000, Window: time.Minute}},
		policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 8_000, Window: time.Minute}},
	))
	if err != nil {
		return anthropic.Client{}, err
	}
	client := anthropic.NewClient(option.WithMaxRetries(0), // the quota waits: no SDK retry of its refusal
		option.WithHTTPClient(&http.Client{Transport: &throttle.Transport{Limiter: lim}}))
	// README end
	return client, nil
}

// readmeAnthropicCacheCall sends a message whose prompt's uncached part
// is uncached tokens.
func readmeAnthropicCacheCall(ctx context.Context, client anthropic.Client, params anthropic.MessageNewParams, uncached int) (*anthropic.Message, error) {
	// README anthropic-cache-call
	// Estimated: the input after the cache breakpoint, since cache reads are not counted.
	ctx, call := throttle.Track(ctx,
		throttle.CostIn("input_tokens", uncached), throttle.CostIn("output_tokens", int(params.MaxTokens)))
	msg, err := client.Messages.New(ctx, params)
	if err != nil {
		return nil, err
	}
	// Settled: what Anthropic counted, cache writes in, cache reads out.
	u := msg.Usage
	err = call.Settle(ctx, throttle.CostIn("input_tokens", int(u.InputTokens+u.CacheCreationInputTokens)),
		throttle.CostIn("output_tokens", int(u.OutputTokens)))
	if err != nil {
		return nil, err
	}
	// README end
	return msg, nil
}
