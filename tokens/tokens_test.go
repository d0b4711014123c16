package tokens

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
)

func TestOpenAIChat(t *testing.T) {
	for _, tc := range []struct {
		body string
		want Estimate
		err  string
	}{
		{`{"messages":[{"role":"user","content":"12345678"}],"max_completion_tokens":100}`, Estimate{Prompt: 2, Most: 100}, ""},
		// Parts: the text counts, not the keys or the image's data.
		{`{"messages":[{"role":"user","content":[{"type":"text","text":"1234567"},{"type":"image_url","image_url":{"url":"data:xxxxxxxxxxxxxxxx"}}]}],"max_tokens":10,"n":3}`, Estimate{Prompt: 2, Most: 30}, ""},
		{`{"messages":[{"role":"user","content":"hi"}]}`, Estimate{}, "neither max_completion_tokens nor max_tokens"},
		{`{"messages":`, Estimate{}, "OpenAIChat"},
	} {
		got, err := OpenAIChat([]byte(tc.body))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: error %v, want one saying %q", tc.body, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %+v, %v; want %+v", tc.body, got, err, tc.want)
		}
	}
}

func TestAnthropicMessages(t *testing.T) {
	body := `{"model":"claude","max_tokens":1024,"system":[{"type":"text","text":"1234","cache_control":{"type":"ephemeral"}}],` +
		`"messages":[{"role":"user","content":"12345678"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get","input":{"q":"1234"}}]}]}`
	got, err := AnthropicMessages([]byte(body))
	// 4 + 8 + "get" 3 + "1234" 4 = 19 bytes: 5 tokens.
	if want := (Estimate{Prompt: 5, Most: 1024}); err != nil || got != want {
		t.Fatalf("%+v, %v; want %+v", got, err, want)
	}
	if _, err := AnthropicMessages([]byte(`{"messages":[]}`)); err == nil || !strings.Contains(err.Error(), "max_tokens") {
		t.Fatalf("a body without max_tokens: %v", err)
	}
}

// The estimate reads the body through GetBody, so the request still sends
// it whole; a body it cannot read costs the fallback, never less.
func TestCost_ReadsTheBodyAgainAndFallsBack(t *testing.T) {
	cost := Cost(OpenAIChat, Estimate.Total, 5000)
	body := `{"messages":[{"content":"12345678"}],"max_completion_tokens":100}`
	req, _ := http.NewRequest(http.MethodPost, "http://x", strings.NewReader(body))
	if n := cost(req); n != 102 {
		t.Fatalf("cost %d, want 102", n)
	}
	if b, _ := io.ReadAll(req.Body); string(b) != body {
		t.Fatalf("the request's body after the estimate: %q", b)
	}
	bad, _ := http.NewRequest(http.MethodPost, "http://x", strings.NewReader(`{"messages":[]}`))
	if n := cost(bad); n != 5000 {
		t.Fatalf("a body without a maximum costs %d, want the fallback 5000", n)
	}
	noGetBody, _ := http.NewRequest(http.MethodPost, "http://x", io.NopCloser(strings.NewReader(body)))
	noGetBody.GetBody = nil
	if n := cost(noGetBody); n != 5000 {
		t.Fatalf("a body that cannot be read twice costs %d, want the fallback 5000", n)
	}
}

// A fallback is never charged unseen: the first of each method, path and
// reason is logged at Warn, the next alike are not; a request without a
// body counts no tokens.
func TestCost_LogsEachFallbackOnce(t *testing.T) {
	var logged bytes.Buffer
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	cost := Cost(OpenAIChat, Estimate.Total, 200_000)
	for range 3 {
		bad, _ := http.NewRequest(http.MethodPost, "http://x/v1/embeddings", strings.NewReader(`{"input":"hi"}`))
		if n := cost(bad); n != 200_000 {
			t.Fatalf("a body without a maximum costs %d, want the fallback", n)
		}
	}
	if n := strings.Count(logged.String(), "charging the fallback"); n != 1 {
		t.Errorf("three fallbacks of one path and reason logged %d times, want once:\n%s", n, logged.String())
	}
	if !strings.Contains(logged.String(), "/v1/embeddings") || !strings.Contains(logged.String(), "fallback=200000") {
		t.Errorf("the warning names neither the path nor the fallback: %s", logged.String())
	}
	list, _ := http.NewRequest(http.MethodGet, "http://x/v1/models", nil)
	if n := cost(list); n != 1 {
		t.Errorf("a GET without a body costs %d, want 1", n)
	}
}

// A Transport's Cost for Anthropic's output tokens: what max_tokens
// allows, or the model's most when the body cannot say.
func ExampleCost() {
	cost := Cost(AnthropicMessages, func(e Estimate) int { return e.Most }, 8192)
	req, _ := http.NewRequest(http.MethodPost, "https://api.anthropic.com/v1/messages",
		strings.NewReader(`{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello"}]}`))
	fmt.Println(cost(req))
	// Output: 1024
}

// A route per model: a request matches the model its body names, read
// through GetBody, and still sends its whole body.
func TestModel_MatchesTheModelTheBodyNames(t *testing.T) {
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`
	req, err := http.NewRequest(http.MethodPost, "https://api.openai.com/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if !Model("gpt-4o-mini")(req) || Model("gpt-4o")(req) {
		t.Errorf("Model matched the wrong model of %s", body)
	}
	sent, err := io.ReadAll(req.Body)
	if err != nil || string(sent) != body {
		t.Errorf("the request sends %q (%v), want %q", sent, err, body)
	}
	get, err := http.NewRequest(http.MethodGet, "https://api.openai.com/v1/models", nil)
	if err != nil {
		t.Fatal(err)
	}
	if Model("gpt-4o")(get) {
		t.Error("a request without a body matched a model")
	}
}
