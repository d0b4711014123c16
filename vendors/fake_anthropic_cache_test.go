package vendors

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"time"
)

// tokenBucket holds up to limit units, refilled continuously at limit a
// window, as Anthropic documents its limits.
type tokenBucket struct {
	limit, level float64
	window       time.Duration
	at           time.Time
}

func newTokenBucket(limit int, window time.Duration) *tokenBucket {
	return &tokenBucket{limit: float64(limit), level: float64(limit), window: window, at: time.Now()}
}

// refill fills the bucket up to now.
func (b *tokenBucket) refill(now time.Time) {
	b.level = min(b.limit, b.level+b.limit*float64(now.Sub(b.at))/float64(b.window))
	b.at = now
}

// full returns when the bucket is full again.
func (b *tokenBucket) full(now time.Time) time.Time {
	return now.Add(time.Duration((b.limit - b.level) / b.limit * float64(b.window)))
}

// anthropicCacheFake answers POST /v1/messages as Anthropic documents its
// limits with prompt caching (docs/VENDORS.md has the sources): requests
// and input tokens in token buckets, counted when a request arrives; the
// input tokens limit counts the tokens after the cache breakpoint
// (usage.input_tokens) and those written to the cache
// (cache_creation_input_tokens), not those read from it
// (cache_read_input_tokens). A prefix is in the cache once a request that
// wrote it has ended: requests that arrive before then write it too.
type anthropicCacheFake struct {
	window, latency time.Duration
	start           time.Time

	mu       sync.Mutex
	requests *tokenBucket
	input    *tokenBucket
	cached   map[string]bool
	counted  []int // input tokens counted, per window of the run
	refused  int   // after the first window
	early    int
	reads    int // cache reads
	writes   int // cache writes
}

func newAnthropicCacheFake(requests, input int, window, latency time.Duration) *anthropicCacheFake {
	return &anthropicCacheFake{window: window, latency: latency, start: time.Now(), cached: map[string]bool{},
		requests: newTokenBucket(requests, window), input: newTokenBucket(input, window)}
}

func (v *anthropicCacheFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	prefix, uncached, maxTokens, ok := readCacheRequest(r)
	if !ok {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	prefixTokens := (len(prefix) + 3) / 4
	now := time.Now()
	v.mu.Lock()
	read := prefix != "" && v.cached[prefix]
	creation, cacheRead := prefixTokens, 0
	if read {
		creation, cacheRead = 0, prefixTokens
	}
	counted := uncached + creation // cache reads are not counted
	v.requests.refill(now)
	v.input.refill(now)
	ok = v.requests.level >= 1 && v.input.level >= float64(counted)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("anthropic-ratelimit-input-tokens-limit", strconv.Itoa(int(v.input.limit)))
	if !ok {
		if now.Sub(v.start) >= v.window {
			v.refused++
		} else {
			v.early++
		}
		h.Set("anthropic-ratelimit-input-tokens-remaining", strconv.Itoa(int(v.input.level)))
		h.Set("anthropic-ratelimit-input-tokens-reset", v.input.full(now).UTC().Format(time.RFC3339))
		v.mu.Unlock()
		h.Set("retry-after", "1")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of input tokens per minute."}}`)
		return
	}
	v.requests.level--
	v.input.level -= float64(counted)
	k := int(now.Sub(v.start) / v.window)
	for len(v.counted) <= k {
		v.counted = append(v.counted, 0)
	}
	v.counted[k] += counted
	if read {
		v.reads++
	} else if prefix != "" {
		v.writes++
	}
	h.Set("anthropic-ratelimit-input-tokens-remaining", strconv.Itoa(int(v.input.level)))
	h.Set("anthropic-ratelimit-input-tokens-reset", v.input.full(now).UTC().Format(time.RFC3339))
	v.mu.Unlock()
	time.Sleep(v.latency)
	if prefix != "" {
		v.mu.Lock()
		v.cached[prefix] = true
		v.mu.Unlock()
	}
	fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn",`+
		`"usage":{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":%d}}`,
		uncached, creation, cacheRead, maxTokens/2)
}

func (v *anthropicCacheFake) results() (refused, early, reads, writes int, counted []int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.refused, v.early, v.reads, v.writes, append([]int(nil), v.counted...)
}

func (v *anthropicCacheFake) serve() *httptest.Server { return httptest.NewServer(v) }

// anthropicRequest is what the fakes read of a Messages request's body.
type anthropicRequest struct {
	System []struct {
		Text         string          `json:"text"`
		CacheControl json.RawMessage `json:"cache_control"`
	} `json:"system"`
	Messages []struct {
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
	} `json:"messages"`
	MaxTokens int `json:"max_tokens"`
}

// readAnthropicRequest reads r's body; ok is false for a body the API
// would refuse.
func readAnthropicRequest(r *http.Request) (b anthropicRequest, ok bool) {
	body, _ := io.ReadAll(r.Body)
	return b, json.Unmarshal(body, &b) == nil && b.MaxTokens != 0
}

// texts returns the texts of the request's messages, block by block.
func (b anthropicRequest) texts() []string {
	var texts []string
	for _, m := range b.Messages {
		for _, c := range m.Content {
			texts = append(texts, c.Text)
		}
	}
	return texts
}

// readCacheRequest reads a Messages request's body as the fake counts it:
// the text of its system blocks marked for the cache (the prefix), the
// tokens of the rest (a token per four bytes), and its max_tokens; ok is
// false for a body the API would refuse.
func readCacheRequest(r *http.Request) (prefix string, uncached, maxTokens int, ok bool) {
	b, ok := readAnthropicRequest(r)
	if !ok {
		return "", 0, 0, false
	}
	for _, s := range b.System {
		if len(s.CacheControl) > 0 {
			prefix += s.Text
		} else {
			uncached += (len(s.Text) + 3) / 4
		}
	}
	for _, text := range b.texts() {
		uncached += (len(text) + 3) / 4
	}
	return prefix, uncached, b.MaxTokens, true
}
