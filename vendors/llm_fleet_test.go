package vendors

import (
	"context"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// llmCase is one vendor's way of counting and reporting, and the fleet's
// estimate error: the fleet estimates each call at (1 + over) of what the
// vendor counts of it (OpenAI: all of it; Anthropic: its input).
type llmCase struct {
	anthropic  bool
	by         counting
	atArrival  bool // the counts are taken when the request arrives, not with the answer
	over       float64
	sdkRetries bool // the SDK's own retries left on
}

func (c llmCase) name() string {
	v := "openai"
	if c.anthropic {
		v = "anthropic"
	}
	at := "with-response"
	if c.atArrival {
		at = "at-arrival"
	}
	return fmt.Sprintf("%s/%s/%s/%+.0f%%", v, c.by, at, 100*c.over)
}

// llmFigures is what one fleet run measured.
type llmFigures struct {
	share              float64 // of the binding cap, after the first window
	perWindow          []int
	refused            int            // 429s after the first window
	calls, late, other int            // calls, refused for a deadline, failed otherwise
	again              map[string]int // calls booked again, by reason (EventBookedAgain)
}

func (f llmFigures) String() string {
	return fmt.Sprintf("%.3f of the binding cap, %d 429s after the first window, %d of %d calls refused for a deadline (%.1f%%), %d failed otherwise; booked again %v; per window %v",
		f.share, f.refused, f.late, f.calls, 100*float64(f.late)/float64(max(f.calls, 1)), f.other, f.again, f.perWindow)
}

const (
	llmWindow   = 2 * time.Second // a minute
	llmDeadline = 10 * time.Second
	llmMost     = 400 // max tokens
)

// runLLMFleet runs 3 replicas × 10 workers, each call through the vendor's
// SDK over throttle's Transport, with a deadline of llmDeadline, against a
// fake that counts as c says, for d.
func runLLMFleet(t *testing.T, c llmCase, d time.Duration) llmFigures {
	s := redistest.Real(t)
	var counts *llmCounts
	var policy policies.Policy
	if c.anthropic {
		counts = newLLMCounts(c.by, 60, 16_000, 4_000, llmWindow)
		policy = policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: 60, Window: llmWindow}},
			policies.Unit{Name: "input_tokens", Policy: policies.SlidingLog{Limit: 16_000, Window: llmWindow}},
			policies.Unit{Name: "output_tokens", Policy: policies.SlidingLog{Limit: 4_000, Window: llmWindow}},
		)
	} else {
		counts = newLLMCounts(c.by, 60, 16_000, 0, llmWindow)
		policy = policies.All(
			policies.PerCall{Policy: policies.SlidingLog{Limit: 60, Window: llmWindow}},
			policies.SlidingLog{Limit: 16_000, Window: llmWindow},
		)
	}
	counts.reportAtResponse = !c.atArrival
	_, srv := newLLMFake(counts, c.anthropic, 40*time.Millisecond)
	defer srv.Close()
	const replicas, workers = 3, 10
	call := make([]func(ctx context.Context, prompt string) error, replicas)
	var againMu sync.Mutex
	again := map[string]int{}
	observe := throttle.Options{Observer: func(e throttle.Event) {
		if e.Kind == throttle.EventBookedAgain {
			againMu.Lock()
			again[e.Reason]++
			againMu.Unlock()
		}
	}}
	for i := range call {
		lim, err := throttle.New(s.Client(t), "llm", policy, observe)
		if err != nil {
			t.Fatal(err)
		}
		call[i] = llmCaller(c, &http.Client{Transport: &throttle.Transport{Limiter: lim}}, srv.URL)
	}
	var calls, late, other atomic.Int64
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(5, 6))
	runEach(replicas, workers, d, func(i int) {
		mu.Lock()
		n := 200 + rng.IntN(1401) // 200 to 1,600 characters
		mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), llmDeadline)
		defer cancel()
		calls.Add(1)
		err := call[i](ctx, strings.Repeat("x", n))
		switch {
		case err == nil:
		case strings.Contains(err.Error(), "deadline"):
			late.Add(1)
		default:
			other.Add(1)
			time.Sleep(10 * time.Millisecond)
		}
	})
	share, per := counts.binding(d)
	counts.mu.Lock()
	refused := counts.refused
	counts.mu.Unlock()
	againMu.Lock()
	defer againMu.Unlock()
	return llmFigures{share: share, perWindow: per, refused: refused, calls: int(calls.Load()), late: int(late.Load()), other: int(other.Load()), again: maps.Clone(again)}
}

// llmCaller returns a call through the SDK of c's vendor over hc, charged
// and settled as docs/VENDORS.md says for its way of counting.
func llmCaller(c llmCase, hc *http.Client, url string) func(ctx context.Context, prompt string) error {
	if c.anthropic {
		opts := []aoption.RequestOption{aoption.WithAPIKey("sk-ant-test"), aoption.WithBaseURL(url + "/"), aoption.WithHTTPClient(hc)}
		if !c.sdkRetries {
			opts = append(opts, aoption.WithMaxRetries(0))
		}
		client := anthropic.NewClient(opts...)
		return func(ctx context.Context, prompt string) error {
			input := int(math.Round(float64(promptTokens(prompt)) * (1 + c.over)))
			ctx, p := throttle.Track(ctx, throttle.CostIn("input_tokens", input), throttle.CostIn("output_tokens", llmMost))
			msg, err := client.Messages.New(ctx, anthropic.MessageNewParams{
				Model: "claude-sonnet-4-5", MaxTokens: llmMost,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(prompt))},
			})
			if err != nil {
				return err
			}
			return p.Settle(ctx, throttle.CostIn("input_tokens", int(msg.Usage.InputTokens)), throttle.CostIn("output_tokens", int(msg.Usage.OutputTokens)))
		}
	}
	opts := []option.RequestOption{option.WithAPIKey("sk-test"), option.WithBaseURL(url + "/"), option.WithHTTPClient(hc)}
	if !c.sdkRetries {
		opts = append(opts, option.WithMaxRetries(0))
	}
	client := openai.NewClient(opts...)
	return func(ctx context.Context, prompt string) error {
		estimate := int(math.Round(float64(promptTokens(prompt)+llmMost) * (1 + c.over)))
		ctx, p := throttle.Track(ctx, throttle.Cost(estimate))
		completion, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:               "gpt-4o",
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(llmMost),
		})
		if err != nil || c.by == countEstimate {
			return err // OpenAI keeps its estimate: nothing to settle
		}
		return p.Settle(ctx, throttle.Cost(int(completion.Usage.TotalTokens)))
	}
}

// The cases the fleet is measured on: each vendor as documented, its
// counts sent with the answer, estimates exact and 5% either way; each
// counting as used; and the counts taken at arrival.
var llmCases = []llmCase{
	{by: countEstimate},
	{by: countEstimate, over: 0.05},
	{by: countEstimate, over: -0.05},
	{by: countEstimate, atArrival: true},
	{by: countUsed},
	{anthropic: true, by: countMostThenUsed},
	{anthropic: true, by: countMostThenUsed, over: 0.05},
	{anthropic: true, by: countMostThenUsed, over: -0.05},
	{anthropic: true, by: countMostThenUsed, atArrival: true},
	{anthropic: true, by: countUsed},
}

// An LLM fleet of 3 replicas × 10 workers, each call with a deadline of 5
// windows, uses the binding cap against vendors that count and report as
// they document: no 429 after the first window, at least 0.9 of the cap,
// and under 1% of the calls refused for their deadline (docs/VENDORS.md,
// "LLM fleets under callers' deadlines", has each run's figures). A
// measurement of 230 s, run with THROTTLE_LLM_FLEETS=1, not in CI.
func TestLLMFleet_UsesTheCapWithinCallersDeadlines(t *testing.T) {
	if os.Getenv("THROTTLE_LLM_FLEETS") != "1" {
		t.Skip("a measurement, 20 s a case: THROTTLE_LLM_FLEETS=1")
	}
	for _, c := range llmCases {
		t.Run(c.name(), func(t *testing.T) {
			f := runLLMFleet(t, c, 20*time.Second)
			t.Logf("%s: %v", c.name(), f)
			if f.refused != 0 {
				t.Errorf("%d 429s after the first window, want none", f.refused)
			}
			if f.share < 0.9 {
				t.Errorf("%.3f of the binding cap, want at least 0.9", f.share)
			}
			if f.late*100 >= f.calls {
				t.Errorf("%d of %d calls refused for their deadline, want under 1%%", f.late, f.calls)
			}
		})
	}
}
