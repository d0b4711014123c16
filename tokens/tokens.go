// Package tokens estimates what an LLM API call may count against a
// tokens quota, from its request body, before it is sent: the prompt's
// tokens, by the rule of thumb the vendors give (about four bytes of
// English text a token), and the most the completion may use (its
// max_tokens). A quota admits the call at such an estimate.
//
// Whether to settle it afterwards depends on how the vendor counts:
// OpenAI counts such an estimate when a request arrives and keeps it, so
// charge it and settle nothing; Anthropic counts input at arrival and
// output as max_tokens until the request ends, so settle from the usage
// the answer reports (throttle.Track, Permit.Settle). docs/VENDORS.md says
// which, per vendor.
//
// Each function reads one body: Transport.Cost calls its function once per
// try of a request (an SDK's retries are new requests, whose bodies are
// read again). A caller who knows the estimate from the typed parameters
// it gives the SDK sets it once with throttle.Track instead.
package tokens

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
)

// Estimate is what a call may count, in tokens.
type Estimate struct {
	// Prompt is the prompt's tokens, estimated from its text: system
	// prompt, messages and tool results (a token per four bytes, rounded up).
	Prompt int
	// Most is the most tokens the completion may use: max_tokens (or
	// OpenAI's max_completion_tokens), times the completions asked for.
	Most int
}

// Total is Prompt + Most: the most the call may count in all.
func (e Estimate) Total() int { return e.Prompt + e.Most }

// text is any JSON value whose strings are a prompt's text: a string, or
// content blocks, or anything holding them.
type text int

// UnmarshalJSON counts the bytes of every string in the value, but the
// ones of keys that are not text (a block's "type", an image's data).
func (t *text) UnmarshalJSON(b []byte) error {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*t = text(textBytes(v))
	return nil
}

// notText are the keys of content blocks whose strings are no prompt text.
var notText = map[string]bool{"type": true, "role": true, "id": true, "tool_use_id": true, "media_type": true, "data": true, "url": true, "cache_control": true}

func textBytes(v any) int {
	switch v := v.(type) {
	case string:
		return len(v)
	case []any:
		n := 0
		for _, x := range v {
			n += textBytes(x)
		}
		return n
	case map[string]any:
		n := 0
		for k, x := range v {
			if !notText[k] {
				n += textBytes(x)
			}
		}
		return n
	}
	return 0
}

// promptTokens rounds bytes of text up to tokens, four bytes a token.
func promptTokens(bytes int) int { return (bytes + 3) / 4 }

// OpenAIChat estimates a body of OpenAI's POST /v1/chat/completions: the
// messages' text, and max_completion_tokens (or the older max_tokens)
// times n. A body without either maximum is an error: the completion's
// tokens could then be anything up to the model's output limit.
func OpenAIChat(body []byte) (Estimate, error) {
	var b struct {
		Messages            []struct{ Content text } `json:"messages"`
		Tools               text                     `json:"tools"`
		MaxCompletionTokens int                      `json:"max_completion_tokens"`
		MaxTokens           int                      `json:"max_tokens"`
		N                   int                      `json:"n"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return Estimate{}, fmt.Errorf("tokens: OpenAIChat: %w", err)
	}
	most := b.MaxCompletionTokens
	if most == 0 {
		most = b.MaxTokens
	}
	if most <= 0 {
		return Estimate{}, errors.New("tokens: OpenAIChat: the body sets neither max_completion_tokens nor max_tokens")
	}
	bytes := int(b.Tools)
	for _, m := range b.Messages {
		bytes += int(m.Content)
	}
	return Estimate{Prompt: promptTokens(bytes), Most: most * max(b.N, 1)}, nil
}

// AnthropicMessages estimates a body of Anthropic's POST /v1/messages:
// the system prompt's, the messages' and the tools' text, and max_tokens,
// which the API requires.
func AnthropicMessages(body []byte) (Estimate, error) {
	var b struct {
		System    text                     `json:"system"`
		Messages  []struct{ Content text } `json:"messages"`
		Tools     text                     `json:"tools"`
		MaxTokens int                      `json:"max_tokens"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return Estimate{}, fmt.Errorf("tokens: AnthropicMessages: %w", err)
	}
	if b.MaxTokens <= 0 {
		return Estimate{}, errors.New("tokens: AnthropicMessages: the body sets no max_tokens")
	}
	bytes := int(b.System) + int(b.Tools)
	for _, m := range b.Messages {
		bytes += int(m.Content)
	}
	return Estimate{Prompt: promptTokens(bytes), Most: b.MaxTokens}, nil
}

// Cost returns a Transport.Cost that estimates each request's body with
// estimate and charges what pick makes of it (Estimate.Total, say).
//
// A request without a body (a GET of the models' list on the same client)
// counts no tokens and costs 1. A body that cannot be read or estimated (no
// GetBody, no max tokens, another endpoint's body) costs fallback: the most
// a call of the endpoint may count, so that a request the function cannot
// read is never admitted for less than it may cost. Each such fallback is
// logged through slog.Default at Warn, once per method, path and reason,
// since a fallback as large as a minute's tokens takes the whole window.
func Cost(estimate func([]byte) (Estimate, error), pick func(Estimate) int, fallback int) func(*http.Request) int {
	w := &warnings{seen: map[string]bool{}}
	return func(req *http.Request) int {
		if req.Body == nil || req.Body == http.NoBody {
			return 1
		}
		e, err := FromRequest(req, estimate)
		if err != nil {
			w.fallback(req, fallback, err)
			return fallback
		}
		return pick(e)
	}
}

// warnings remembers which fallbacks a Cost function has logged, up to
// maxWarnings of them: paths that hold ids would otherwise grow it without end.
type warnings struct {
	mu   sync.Mutex
	seen map[string]bool
}

const maxWarnings = 64

// fallback logs that req was charged fallback for err, unless a request
// of the same method and path was, for the same reason, before.
func (w *warnings) fallback(req *http.Request, fallback int, err error) {
	key := req.Method + " " + req.URL.Path + ": " + err.Error()
	w.mu.Lock()
	logIt := !w.seen[key] && len(w.seen) < maxWarnings
	if logIt {
		w.seen[key] = true
	}
	w.mu.Unlock()
	if logIt {
		slog.Default().Warn("tokens: charging the fallback: the request's body gave no estimate",
			"method", req.Method, "path", req.URL.Path, "fallback", fallback, "err", err)
	}
}

// FromRequest estimates req's body with estimate, reading it through
// req.GetBody, so that the request still sends its whole body. A request
// without GetBody (its body cannot be read twice) is an error.
func FromRequest(req *http.Request, estimate func([]byte) (Estimate, error)) (Estimate, error) {
	if req.GetBody == nil {
		return Estimate{}, errors.New("tokens: the request's body cannot be read twice (no GetBody)")
	}
	rc, err := req.GetBody()
	if err != nil {
		return Estimate{}, err
	}
	defer rc.Close()
	body, err := io.ReadAll(rc)
	if err != nil {
		return Estimate{}, err
	}
	return estimate(body)
}

// Model returns a Route.Match for the requests whose body names model, as
// OpenAI's and Anthropic's do in their "model" field: each model has
// limits of its own, kept by a quota of its own. The body is read through
// GetBody; a request whose body cannot be read twice matches no model.
func Model(model string) func(*http.Request) bool {
	return func(req *http.Request) bool {
		if req.Body == nil || req.Body == http.NoBody {
			return false
		}
		var named string
		_, err := FromRequest(req, func(body []byte) (Estimate, error) {
			var b struct {
				Model string `json:"model"`
			}
			err := json.Unmarshal(body, &b)
			named = b.Model
			return Estimate{}, err
		})
		return err == nil && named == model
	}
}
