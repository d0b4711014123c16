package vendors

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
	"github.com/throttlekit/throttle/tokens"
)

// openaiEstimate is a call's tokens at most: its prompt's, estimated as
// the fakes count them, and its max_completion_tokens.
func openaiEstimate(req *http.Request) int {
	if req.GetBody == nil {
		return 1
	}
	rc, err := req.GetBody()
	if err != nil {
		return 1
	}
	defer rc.Close()
	var body struct {
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
		MaxCompletionTokens int `json:"max_completion_tokens"`
	}
	b, _ := io.ReadAll(rc)
	if json.NewDecoder(bytes.NewReader(b)).Decode(&body) != nil {
		return 1
	}
	var texts []string
	for _, m := range body.Messages {
		texts = append(texts, m.Content)
	}
	return promptTokens(texts...) + body.MaxCompletionTokens
}

// llmRun is a fleet's run against an LLM vendor's fake.
type llmRun struct {
	requests, tokens  int
	window, d         time.Duration
	replicas, workers int
}

// openaiTokensFleet runs replicas × workers openai-go clients through
// throttle's transport, each call admitted at its estimate (the package
// tokens' of its body, or, with settle, openaiEstimate's) and, with
// settle, settled from its typed result, against the fake at baseURL.
func openaiTokensFleet(t *testing.T, s *redistest.Server, name, baseURL string, run llmRun, settle bool) {
	policy := policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: run.requests, Window: run.window}},
		policies.SlidingLog{Limit: run.tokens, Window: run.window},
	)
	clients := make([]openai.Client, run.replicas)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), name, policy)
		if err != nil {
			t.Fatal(err)
		}
		cost := tokens.Cost(tokens.OpenAIChat, tokens.Estimate.Total, run.tokens)
		if settle {
			cost = openaiEstimate
		}
		hc := &http.Client{Transport: &throttle.Transport{Limiter: lim, Cost: cost}}
		clients[i] = openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(baseURL+"/"), option.WithHTTPClient(hc))
	}
	prompt := strings.Repeat("tell me more ", 31) // 100 tokens as the fake counts
	runEach(run.replicas, run.workers, run.d, func(i int) {
		ctx, call := throttle.Track(context.Background())
		completion, err := clients[i].Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:               "gpt-4o",
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(200),
		})
		if err == nil && settle {
			err = call.Settle(ctx, throttle.Cost(int(completion.Usage.TotalTokens)))
		}
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// A fleet whose estimates are half again its usage runs near the tokens
// cap: the units each call's settle gives back move the calls booked
// behind them.
func TestOpenAI_TokensFleetRunsNearTheTokensCap(t *testing.T) {
	// Not in parallel: a fleet that shares the machine with others starts
	// its calls later than the margin covers.
	run := llmRun{requests: 60, tokens: 6000, window: 2 * time.Second, d: fleetRun(12*time.Second, 20*time.Second), replicas: 3, workers: 10}
	s := redistest.Real(t)
	v := newLLMVendor(run.requests, run.tokens, run.window, 100*time.Millisecond)
	srv := fakeOpenAITokens(v)
	defer srv.Close()
	openaiTokensFleet(t, s, "openai-tokens", srv.URL, run, true)
	served, refused, used, usage := v.results()
	windows := int(run.d / run.window)
	got := share(used, run.tokens, windows)
	t.Logf("openai-go, tokens: %d calls served, %d refused after the first window; tokens per window %v; usage %.2f of the estimates; %.3f of the tokens cap; %.2f script calls per call served",
		served, refused, used, usage, got, float64(scriptCalls(t, s))/float64(served))
	if refused != 0 {
		t.Errorf("%d refusals after the first window, want none", refused)
	}
	if got < 0.9 {
		t.Errorf("%.3f of the tokens cap used after the first two windows, want at least 0.9", got)
	}
}

// Against a vendor that counts each request's estimate at arrival and
// never adjusts it, as OpenAI's guide says it counts, the fleet charges
// the same estimate (the package tokens' of the body) and does not settle:
// no refusal, and near the cap as the vendor counts it. The fleet's calls
// come in bursts a little over a window apart, and a window of the
// vendor's that a burst straddles counts a part of it: over the 4 windows
// of a 12 s run, one such window took the share from 0.95 to 0.89; CI's
// run is 20 s long, 8 windows.
func TestOpenAI_ChargesTheEstimateTheVendorCounts(t *testing.T) {
	// Not in parallel: a fleet that shares the machine with others starts
	// its calls later than the margin covers.
	run := llmRun{requests: 60, tokens: 6000, window: 2 * time.Second, d: fleetRun(12*time.Second, 20*time.Second), replicas: 3, workers: 10}
	s := redistest.Real(t)
	v := newLLMVendor(run.requests, run.tokens, run.window, 100*time.Millisecond)
	v.countsEstimate = true
	srv := fakeOpenAITokens(v)
	defer srv.Close()
	openaiTokensFleet(t, s, "openai-estimates", srv.URL, run, false)
	served, refused, counted, _ := v.results()
	windows := int(run.d / run.window)
	got := share(counted, run.tokens, windows)
	t.Logf("openai-go, estimates counted: %d calls served, %d refused after the first window; tokens counted per window %v; %.3f of the tokens cap as the vendor counts it", served, refused, counted, got)
	if refused != 0 {
		t.Errorf("%d refusals after the first window, want none", refused)
	}
	if got < 0.9 {
		t.Errorf("%.3f of the tokens cap, as the vendor counts it, used after the first two windows; want at least 0.9", got)
	}
}
