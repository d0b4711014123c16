package fakeapi

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func newTestLLM(cfg LLMConfig) (*LLM, *clock) {
	a, c := NewLLM(cfg), newClock()
	a.now = c.now
	return a, c
}

// chat sends a chat completion with a prompt of words words.
func chat(t *testing.T, a *LLM, words, maxTokens int) *httptest.ResponseRecorder {
	t.Helper()
	body, err := json.Marshal(map[string]any{
		"model":      "gpt-4o",
		"max_tokens": maxTokens,
		"messages":   []map[string]string{{"role": "user", "content": strings.Repeat("word ", words)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	a.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(string(body))))
	return w
}

type usage struct {
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

func TestLLM_AnswersWithTheUsage(t *testing.T) {
	a, _ := newTestLLM(LLMConfig{Requests: 1000, Tokens: 1 << 20, Window: time.Minute})
	for range 200 {
		w := chat(t, a, 30, 100)
		if w.Code != http.StatusOK {
			t.Fatalf("status %d: %s", w.Code, w.Body.String())
		}
		var u usage
		if err := json.Unmarshal(w.Body.Bytes(), &u); err != nil {
			t.Fatal(err)
		}
		if c := u.Usage.CompletionTokens; u.Usage.PromptTokens != 30 || c < 20 || c > 100 || u.Usage.TotalTokens != 30+c {
			t.Fatalf("usage %+v, want a prompt of 30 and a reply of 20 to 100", u.Usage)
		}
	}
	if st := a.Stats(); len(st.Accepted) != 200 || st.OverRequests+st.OverTokens != 0 {
		t.Errorf("Stats: %d accepted, %d and %d refused; want 200 and none", len(st.Accepted), st.OverRequests, st.OverTokens)
	}
}

func TestLLM_CapsTokens(t *testing.T) {
	// A max_tokens of 1 makes every reply 1 token: each call uses 10.
	a, c := newTestLLM(LLMConfig{Requests: 100, Tokens: 25, Window: time.Second})
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		w := chat(t, a, 9, 1)
		if w.Code != want {
			t.Fatalf("call %d: status %d, want %d", i+1, w.Code, want)
		}
		c.advance(100 * time.Millisecond)
	}
	w := chat(t, a, 9, 1)
	h := w.Header()
	if h.Get("x-ratelimit-remaining-tokens") != "5" || h.Get("x-ratelimit-limit-tokens") != "25" ||
		h.Get("x-ratelimit-remaining-requests") != "98" || h.Get("x-ratelimit-limit-requests") != "100" {
		t.Errorf("headers %v", h)
	}
	// The first call, at 0s, leaves at 1s: 700ms from 0.3s.
	if got := h.Get("retry-after-ms"); got != "700" {
		t.Errorf("retry-after-ms = %q, want 700", got)
	}
	// A call that can never fit says no time.
	if w := chat(t, a, 40, 1); w.Code != http.StatusTooManyRequests || w.Header().Get("retry-after-ms") != "" {
		t.Errorf("a call past the whole cap: %d, retry-after-ms %q; want 429 and none", w.Code, w.Header().Get("retry-after-ms"))
	}
	c.advance(700 * time.Millisecond)
	if w := chat(t, a, 9, 1); w.Code != http.StatusOK {
		t.Errorf("once the first call left: status %d, want 200", w.Code)
	}
	st := a.Stats()
	if len(st.Accepted) != 3 || st.OverRequests != 0 || st.OverTokens != 3 {
		t.Errorf("Stats: %d accepted, %d and %d refused; want 3, 0 and 3", len(st.Accepted), st.OverRequests, st.OverTokens)
	}
	if st.Accepted[0].Tokens != 10 {
		t.Errorf("the first call used %d tokens, want 10", st.Accepted[0].Tokens)
	}
}

func TestLLM_CapsRequests(t *testing.T) {
	a, c := newTestLLM(LLMConfig{Requests: 2, Tokens: 1000, Window: time.Second})
	chat(t, a, 5, 10)
	c.advance(250 * time.Millisecond)
	chat(t, a, 5, 10)
	w := chat(t, a, 5, 10)
	if w.Code != http.StatusTooManyRequests || w.Header().Get("retry-after-ms") != "750" || w.Header().Get("x-ratelimit-remaining-requests") != "0" {
		t.Errorf("third call: %d, retry-after-ms %q, remaining %q; want 429, 750 and 0",
			w.Code, w.Header().Get("retry-after-ms"), w.Header().Get("x-ratelimit-remaining-requests"))
	}
	if st := a.Stats(); st.OverRequests != 1 || st.OverTokens != 0 {
		t.Errorf("refused %d for requests and %d for tokens, want 1 and 0", st.OverRequests, st.OverTokens)
	}
}

func TestLLM_RefusesABadBodyUncounted(t *testing.T) {
	a, _ := newTestLLM(LLMConfig{Requests: 1, Tokens: 1000, Window: time.Second})
	for _, body := range []string{"", "{", `{"max_tokens":0}`} {
		w := httptest.NewRecorder()
		a.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/", strings.NewReader(body)))
		if w.Code != http.StatusBadRequest {
			t.Errorf("body %q: status %d, want 400", body, w.Code)
		}
	}
	if w := chat(t, a, 1, 1); w.Code != http.StatusOK {
		t.Errorf("after bad bodies, a good call got %d: they were counted", w.Code)
	}
}
