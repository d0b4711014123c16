package vendors

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
	"github.com/throttlekit/throttle/tokens"
)

// The README's OpenAI snippet, compiled and run here against the fake.
func readmeOpenAI(ctx context.Context, rdb *redis.Client, params openai.ChatCompletionNewParams) (*openai.ChatCompletion, error) {
	// README openai
	lim, err := throttle.New(rdb, "openai", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}}, // requests
		policies.SlidingCounter{Limit: 200_000, Window: time.Minute},                   // tokens
	))
	if err != nil {
		return nil, err
	}
	client := openai.NewClient(option.WithMaxRetries(0), // the quota waits: no SDK retry of its refusal
		option.WithHTTPClient(&http.Client{Transport: &throttle.Transport{Limiter: lim,
			Cost: tokens.Cost(tokens.OpenAIChat, tokens.Estimate.Total, 20_000)}})) // the prompt's estimate + max tokens
	return client.Chat.Completions.New(ctx, params)
	// README end
}

func TestREADME_OpenAISnippetRuns(t *testing.T) {
	v := newLLMVendor(500, 200_000, time.Minute, 0)
	v.countsEstimate = true
	srv := fakeOpenAITokens(v)
	defer srv.Close()
	t.Setenv("OPENAI_BASE_URL", srv.URL+"/")
	t.Setenv("OPENAI_API_KEY", "sk-test")
	s := redistest.Mini(t)
	text := strings.Repeat("tell me more ", 31)
	if _, err := readmeOpenAI(context.Background(), s.Client(t), openai.ChatCompletionNewParams{
		Model:               "gpt-4o",
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
		MaxCompletionTokens: openai.Int(200),
	}); err != nil {
		t.Fatal(err)
	}
	lim, err := throttle.New(s.Client(t), "openai", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}},
		policies.SlidingCounter{Limit: 200_000, Window: time.Minute},
	))
	if err != nil {
		t.Fatal(err)
	}
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if want := promptTokens(text) + 200; u.Rules[0].Used != 1 || u.Rules[1].Used != want {
		t.Fatalf("the quota counts %d requests and %d tokens; want 1 and %d, what the vendor counted", u.Rules[0].Used, u.Rules[1].Used, want)
	}
}
