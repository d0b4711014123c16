package fakeapi

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// LLMConfig describes an LLM.
type LLMConfig struct {
	// Requests is how many requests the API accepts in any window.
	Requests int
	// Tokens is how many tokens the API accepts in any window, counting
	// what each accepted request used: its prompt and its reply.
	Tokens int
	// Window is the length of both sliding windows. It must be positive.
	Window time.Duration
}

// Completion is one request an LLM accepted.
type Completion struct {
	// At is when it arrived.
	At time.Time
	// Tokens is what it used, prompt and reply.
	Tokens int
}

// LLMStats is what an LLM has seen since NewLLM.
type LLMStats struct {
	// Accepted holds the accepted requests in the order they arrived.
	Accepted []Completion
	// OverRequests is the requests refused because the requests' cap was
	// reached.
	OverRequests int
	// OverTokens is the requests refused, within the requests' cap,
	// because their tokens did not fit the tokens' cap.
	OverTokens int
}

// LLM is a fake chat-completions API with two caps in exact sliding
// windows, as OpenAI and Anthropic have: requests, and tokens. It takes a
// POST of a JSON body such as
//
//	{"model": "gpt-4o", "max_tokens": 100, "messages": [{"role": "user", "content": "..."}]}
//
// counts each word of the messages' contents as a token of the prompt, and
// writes a reply of between a fifth of max_tokens and max_tokens tokens, at
// random. It accepts the request when the requests accepted in the window
// ending now are under the requests' cap and the tokens they used, with
// this request's prompt and reply, fit the tokens' cap; it then answers 200
// with the usage, as OpenAI does:
//
//	{"object": "chat.completion", "usage": {"prompt_tokens": 31, "completion_tokens": 57, "total_tokens": 88}}
//
// and otherwise 429 with retry-after-ms, the time until the request would
// have fitted. Every answer carries OpenAI's x-ratelimit-limit-requests,
// x-ratelimit-remaining-requests, x-ratelimit-limit-tokens and
// x-ratelimit-remaining-tokens. A body that is not such JSON, or a
// max_tokens below 1, gets 400 and is not counted.
//
// An LLM is safe for concurrent use.
type LLM struct {
	requests, tokens int
	now              func() time.Time // the clock; tests in this package replace it

	mu        sync.Mutex
	calls     window // accepted requests, a unit each
	used      window // accepted requests, by their tokens
	last      time.Time
	completed []Completion
	over      [2]int // past the requests' cap, past the tokens'
}

// NewLLM returns an LLM configured by cfg. It panics when cfg.Window is not
// positive or a cap is negative.
func NewLLM(cfg LLMConfig) *LLM {
	if cfg.Window <= 0 || cfg.Requests < 0 || cfg.Tokens < 0 {
		panic("fakeapi: LLMConfig needs a positive Window and no negative cap")
	}
	return &LLM{
		requests: cfg.Requests,
		tokens:   cfg.Tokens,
		now:      time.Now,
		calls:    window{length: cfg.Window},
		used:     window{length: cfg.Window},
	}
}

// chatRequest is the part of a chat completion request the API reads.
type chatRequest struct {
	MaxTokens int `json:"max_tokens"`
	Messages  []struct {
		Content string `json:"content"`
	} `json:"messages"`
}

// ServeHTTP answers one chat completion request; see LLM.
func (a *LLM) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	t := a.now()
	var req chatRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.MaxTokens < 1 {
		http.Error(w, "want a JSON body with max_tokens of 1 or more", http.StatusBadRequest)
		return
	}
	prompt := 0
	for _, m := range req.Messages {
		prompt += len(strings.Fields(m.Content))
	}
	least := max(req.MaxTokens/5, 1)
	reply := least + rand.IntN(req.MaxTokens-least+1)

	ok, retryAfter, leftRequests, leftTokens := a.arrive(t, prompt+reply)
	h := w.Header()
	h.Set("x-ratelimit-limit-requests", strconv.Itoa(a.requests))
	h.Set("x-ratelimit-remaining-requests", strconv.Itoa(leftRequests))
	h.Set("x-ratelimit-limit-tokens", strconv.Itoa(a.tokens))
	h.Set("x-ratelimit-remaining-tokens", strconv.Itoa(leftTokens))
	if !ok {
		if retryAfter > 0 {
			ms := (retryAfter + time.Millisecond - 1) / time.Millisecond
			h.Set("retry-after-ms", strconv.FormatInt(int64(ms), 10))
		}
		http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
		return
	}
	h.Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"object":"chat.completion","usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`+"\n",
		prompt, reply, prompt+reply)
}

// arrive counts a request using n tokens that arrived at t. It returns
// whether the API accepted it, how long until it would have fitted (0 if
// accepted, or if it never fits), and the requests and tokens left in the
// window once it is counted.
func (a *LLM) arrive(t time.Time, n int) (ok bool, retryAfter time.Duration, leftRequests, leftTokens int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if t.Before(a.last) {
		t = a.last
	}
	a.last = t
	a.calls.trim(t)
	a.used.trim(t)
	switch {
	case a.calls.sum >= a.requests:
		a.over[0]++
		retryAfter = a.calls.freeIn(t, a.calls.sum+1-a.requests)
	case a.used.sum+n > a.tokens:
		a.over[1]++
		if n <= a.tokens {
			retryAfter = a.used.freeIn(t, a.used.sum+n-a.tokens)
		}
	default:
		ok = true
		a.calls.add(t, 1)
		a.used.add(t, n)
		a.completed = append(a.completed, Completion{At: t, Tokens: n})
	}
	return ok, retryAfter, max(0, a.requests-a.calls.sum), max(0, a.tokens-a.used.sum)
}

// Stats returns what the API has seen so far.
func (a *LLM) Stats() LLMStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return LLMStats{Accepted: slices.Clone(a.completed), OverRequests: a.over[0], OverTokens: a.over[1]}
}
