package vendors

import (
	"context"
	"fmt"
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

// openaiModelsPrompt is 100 tokens as the fake counts.
var openaiModelsPrompt = strings.Repeat("tell me more", 33) + "ab"

func openaiModelsCall(ctx context.Context, c openai.Client, model string) error {
	_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:               model,
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(openaiModelsPrompt)},
		MaxCompletionTokens: openai.Int(200),
	})
	return err
}

// The OpenAI recipe against the fake at OpenAI's figures: each model's
// call is charged to its own quota, at the estimate OpenAI counts.
func TestREADME_OpenAIModelsRecipeRuns(t *testing.T) {
	v := newOpenAIModelsFake(time.Minute, 0, map[string][2]int{"gpt-4o": {500, 30_000}, "gpt-4o-mini": {500, 200_000}})
	srv := v.serve()
	defer srv.Close()
	t.Setenv("OPENAI_BASE_URL", srv.URL+"/")
	t.Setenv("OPENAI_API_KEY", "sk-test")
	s := redistest.Mini(t)
	client, err := readmeOpenAIModels(s.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, model := range []string{"gpt-4o", "gpt-4o", "gpt-4o-mini"} {
		if err := openaiModelsCall(ctx, client, model); err != nil {
			t.Fatal(err)
		}
	}
	for model, want := range map[string]int{"gpt-4o": 2 * 300, "gpt-4o-mini": 300} {
		limit := map[string]int{"gpt-4o": 30_000, "gpt-4o-mini": 200_000}[model]
		lim, err := throttle.New(s.Client(t), "openai "+model, policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}},
			policies.SlidingCounter{Limit: limit, Window: time.Minute, Buckets: 40}))
		if err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got := v.counts(model); u.Rules[1].Used != want || len(got) == 0 || got[0] != want {
			t.Errorf("%s: the quota counts %d tokens, the vendor %v; want %d in both", model, u.Rules[1].Used, got, want)
		}
	}
}

// openaiModelsClient is the recipe's client at the fake's figures.
func openaiModelsClient(t *testing.T, rdb *redis.Client, baseURL string, window time.Duration, limits map[string][2]int) openai.Client {
	var routes []throttle.Route
	for _, model := range []string{"gpt-4o", "gpt-4o-mini"} {
		lim, err := throttle.New(rdb, "openai-fleet "+model, policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: limits[model][0], Window: window}},
			policies.SlidingCounter{Limit: limits[model][1], Window: window, Buckets: 40}))
		if err != nil {
			t.Fatal(err)
		}
		routes = append(routes, throttle.Route{Match: tokens.Model(model), Limiter: lim})
	}
	hc := &http.Client{Transport: &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 16}, Routes: routes,
		Cost: tokens.Cost(tokens.OpenAIChat, tokens.Estimate.Total, 4000)}}
	return openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(baseURL+"/"), option.WithHTTPClient(hc))
}

// A fleet of 3 × 10 openai-go clients through the recipe, half of them
// calling each of two models, against a fake that counts each model apart
// (2 s windows: gpt-4o 40 requests and 4,000 tokens, gpt-4o-mini 80 and
// 12,000; each request 300 tokens as OpenAI counts it): after the first
// window no 429, and each model's tokens over the run at 0.9 or more of
// its cap, in a window from any moment (rate). The recipe counts tokens in
// a SlidingCounter of 40 buckets, which frees a call's units once its
// whole bucket left the window: the fleet's calls come in bursts a window
// and a bucket apart (2.08 s here), and gpt-4o's 13 calls of 300 fill
// 3,900 of its 4,000 (docs/TESTING.md).
func TestOpenAI_TwoModelsEachAtItsOwnCap(t *testing.T) {
	const window = 2 * time.Second
	limits := map[string][2]int{"gpt-4o": {40, 4000}, "gpt-4o-mini": {80, 12_000}}
	d := fleetRun(8*time.Second, 20*time.Second)
	v := newOpenAIModelsFake(window, 100*time.Millisecond, limits)
	srv := v.serve()
	defer srv.Close()
	s := redistest.Real(t)
	clients := make([]openai.Client, 3)
	for i := range clients {
		clients[i] = openaiModelsClient(t, s.Client(t), srv.URL, window, limits)
	}
	ctx := context.Background()
	var errs errorCounts
	start := time.Now()
	runEachWorker(3, 10, d, func(i, j, _ int) {
		if err := openaiModelsCall(ctx, clients[i], []string{"gpt-4o", "gpt-4o-mini"}[j%2]); err != nil {
			errs.add(err)
			time.Sleep(10 * time.Millisecond)
		}
	})
	errs.log(t)
	v.mu.Lock()
	refused := v.refused
	v.mu.Unlock()
	for model := range limits {
		got := v.rate(model, start, start.Add(d))
		t.Logf("%s: %.3f of its tokens cap; tokens per window %v; %d 429s after the first window", model, got, v.counts(model), refused[model])
		if refused[model] != 0 {
			t.Errorf("%s: %d 429s after the first window, want none", model, refused[model])
		}
		if got < 0.9 {
			t.Errorf("%s: %.3f of its tokens cap, want at least 0.9", model, got)
		}
	}
}

// OpenAI may enforce a limit in slices shorter than its minute (its rate
// limits page: "60,000 requests/minute may be enforced as 1,000
// requests/second"). A fleet of 3 × 10 openai-go clients of one model
// against a fake that enforces its 2 s window in four slices of 500 ms,
// each a quarter of the limits, every request 250 tokens as OpenAI counts
// it. The recipe's rule of a slice's share beside the window's
// (docs/VENDORS.md) keeps the fleet clear of the slices: after the first
// window no 429, and at least nine tenths of what a slice's rule admits
// (0.83 of the cap). Without it, the fleet's burst of a window's calls
// meets a slice's limit, and the 429s teach the fleet a cap of what the
// vendor accepted: a slice's share a window, a quarter of the cap.
func TestOpenAI_ALimitEnforcedInSlicesIsKeptByASliceRule(t *testing.T) {
	const window, slices = 2 * time.Second, 4
	limits := map[string][2]int{"gpt-4o": {40, 4000}}
	d := fleetRun(6*time.Second, 10*time.Second) // each case
	for _, sliceRule := range []bool{true, false} {
		v := newOpenAIModelsFake(window, 100*time.Millisecond, limits)
		v.sliced(slices)
		srv := v.serve()
		s := redistest.Real(t)
		clients := make([]openai.Client, 3)
		var lim *throttle.Limiter
		for i := range clients {
			clients[i], lim = openaiSlicedClient(t, s.Client(t), srv.URL, window, limits["gpt-4o"], slices, sliceRule)
		}
		start := time.Now()
		runEachWorker(3, 10, d, func(i, _, _ int) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second) // a caller's deadline
			defer cancel()
			_, err := clients[i].Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
				Model:               "gpt-4o",
				Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(openaiModelsPrompt)},
				MaxCompletionTokens: openai.Int(150), // 250 tokens as OpenAI counts the call
			})
			if err != nil {
				time.Sleep(10 * time.Millisecond)
			}
		})
		srv.Close()
		v.mu.Lock()
		refused := v.refused["gpt-4o"]
		v.mu.Unlock()
		got := v.rate("gpt-4o", start, start.Add(d))
		// A slice's rule admits a slice's limit once a slice, its margin
		// and a bucket have passed (Spread's Most of exactly 1/Parts): 0.92
		// of the cap at most, reached in every run (docs/VENDORS.md). The
		// floor is nine tenths of that ceiling, which a busy machine lowers
		// by widening the margin in force.
		part := float64(window / slices)
		want := 0.9 * part / (part + float64(sliceMargin(t, lim)) + part/40)
		t.Logf("with the slice rule %v: %.3f of the tokens cap (floor %.3f); tokens per window %v; %d 429s after the first window",
			sliceRule, got, want, v.counts("gpt-4o"), refused)
		switch {
		case sliceRule && refused != 0:
			t.Errorf("with the slice rule: %d 429s after the first window, want none", refused)
		case sliceRule && got < want:
			t.Errorf("with the slice rule: %.3f of the tokens cap, want at least %.3f", got, want)
		case !sliceRule && refused == 0 && got >= 0.5:
			// Its first burst meets a slice's limit: the 429s teach the
			// fleet a cap of what the vendor accepted, a slice's share a
			// window (0.25 of the cap here).
			t.Errorf("without the slice rule: no 429 and %.3f of the cap, so the fake's slices test nothing", got)
		}
	}
}

// openaiSlicedClient is the recipe's client of one model whose limits
// (requests and tokens a window) the vendor enforces in slices: with
// sliceRule, a rule of each limit's slice share beside the window's.
func openaiSlicedClient(t *testing.T, rdb *redis.Client, baseURL string, window time.Duration, limits [2]int, slices int, sliceRule bool) (openai.Client, *throttle.Limiter) {
	var policy policies.Policy = policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: limits[0], Window: window}},
		policies.SlidingCounter{Limit: limits[1], Window: window, Buckets: 40}, // tokens, as the recipe counts them
	)
	if sliceRule {
		// The recipe: each limit's slice, a rule beside the window's.
		policy = policies.Spread{Policy: policy, Parts: slices, Most: 1 / float64(slices)}
	}
	lim, err := throttle.New(rdb, fmt.Sprintf("openai-sliced-%v", sliceRule), policy)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 16}, Limiter: lim,
		Cost: tokens.Cost(tokens.OpenAIChat, tokens.Estimate.Total, limits[1])}}
	return openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(baseURL+"/"), option.WithMaxRetries(0), option.WithHTTPClient(hc)), lim
}

// sliceMargin returns the widest margin in force of lim's rules, at least
// the default.
func sliceMargin(t *testing.T, lim *throttle.Limiter) time.Duration {
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m := policies.DefaultMargin
	for _, r := range u.Rules {
		m = max(m, r.Margin)
	}
	return m
}
