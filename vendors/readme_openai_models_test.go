package vendors

import (
	"net/http"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
	"github.com/throttlekit/throttle/tokens"
)

// The OpenAI recipe of docs/VENDORS.md, for two models, compiled and run
// here against the fake.
func readmeOpenAIModels(rdb *redis.Client) (openai.Client, error) {
	// README openai-models
	// Each model has limits of its own: a quota and a Route each.
	perModel := func(model string, requests, perMinute int) (throttle.Route, error) {
		lim, err := throttle.New(rdb, "openai "+model, policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: requests, Window: time.Minute}},
			policies.SlidingCounter{Limit: perMinute, Window: time.Minute, Buckets: 40}, // tokens
		))
		return throttle.Route{Match: tokens.Model(model), Limiter: lim}, err
	}
	large, err := perModel("gpt-4o", 500, 30_000)
	if err != nil {
		return openai.Client{}, err
	}
	small, err := perModel("gpt-4o-mini", 500, 200_000)
	if err != nil {
		return openai.Client{}, err
	}
	client := openai.NewClient(option.WithMaxRetries(0), // the quota waits: no SDK retry of its refusal
		option.WithHTTPClient(&http.Client{Transport: &throttle.Transport{
			Routes: []throttle.Route{large, small},
			// Charged as OpenAI counts it when it arrives; nothing is settled.
			Cost: tokens.Cost(tokens.OpenAIChat, tokens.Estimate.Total, 30_000),
		}}))
	// README end
	return client, nil
}
