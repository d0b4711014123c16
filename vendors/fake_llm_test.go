package vendors

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"time"
)

// counting is when and what an LLM vendor counts of a request's tokens.
type counting int

const (
	// countEstimate counts the prompt's estimate and the most the answer
	// may take when the request arrives, never adjusted: OpenAI, as its
	// rate-limit guide describes its count.
	countEstimate counting = iota
	// countMostThenUsed counts the input when the request arrives, and
	// its output as max_tokens, replaced by the output used when the
	// answer is sent: Anthropic, as its rate-limit page describes its
	// output tokens.
	countMostThenUsed
	// countUsed counts the tokens used, when the answer is sent: a
	// gateway or a self-hosted model's server. A request is refused only
	// when a count is already full.
	countUsed
)

func (c counting) String() string {
	return [...]string{"estimate", "max-then-used", "used"}[c]
}

// llmCounts is an LLM vendor's strict sliding-window counts of requests,
// input and output tokens, or of requests and all tokens (OpenAI's one
// tokens limit, when output is 0). Each request is an entry whose units
// and time may change when its answer is sent.
type llmCounts struct {
	mu               sync.Mutex
	window           time.Duration
	requests         int
	input, output    int // limits; output 0: input limits all tokens
	entries          []*llmEntry
	start            time.Time
	served, refused  int         // refused: after the first window
	counted          map[int]int // tokens of the binding count, by window
	countBy          counting
	reportAtResponse bool
}

// llmEntry is what the vendor counts of one request, at its time.
type llmEntry struct {
	at            time.Time
	calls         int // 1, or 0 for the tokens of a request counted apart
	input, output int
}

func newLLMCounts(by counting, requests, input, output int, window time.Duration) *llmCounts {
	return &llmCounts{window: window, requests: requests, input: input, output: output, start: time.Now(),
		counted: map[int]int{}, countBy: by, reportAtResponse: true}
}

// sums drops the entries that left the window and returns the requests,
// the input (all tokens, with one tokens limit) and output tokens counted.
func (c *llmCounts) sums(now time.Time) (requests, input, output int) {
	i := 0
	for i < len(c.entries) && now.Sub(c.entries[i].at) >= c.window {
		i++
	}
	c.entries = c.entries[i:]
	for _, e := range c.entries {
		requests += e.calls
		input += e.input
		output += e.output
		if c.output == 0 {
			input += e.output
		}
	}
	return requests, input, output
}

// arrive admits a request that counts prompt input tokens and may answer
// up to most: it returns its entry, or nil when a count is full.
func (c *llmCounts) arrive(prompt, most int) *llmEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	req, in, out := c.sums(now)
	e := &llmEntry{at: now, calls: 1, input: prompt, output: most}
	if c.countBy == countUsed {
		e.input, e.output = 0, 0
	}
	fits := req+1 <= c.requests && in+e.input+c.tokensIn(e) <= c.input && (c.output == 0 || out+e.output <= c.output)
	if c.countBy == countUsed {
		fits = req < c.requests && in < c.input && (c.output == 0 || out < c.output)
	}
	if !fits {
		if now.Sub(c.start) >= c.window {
			c.refused++
		}
		return nil
	}
	c.entries = append(c.entries, e)
	c.served++
	return e
}

// tokensIn is what e adds to the input count beside its input: its output,
// when one limit counts all tokens.
func (c *llmCounts) tokensIn(e *llmEntry) int {
	if c.output == 0 {
		return e.output
	}
	return 0
}

// answer counts what the request of e used when its answer is sent, and
// adds its units, as finally counted, to the window of their time.
func (c *llmCounts) answer(e *llmEntry, prompt, used int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.countBy {
	case countMostThenUsed:
		e.output = used
	case countUsed:
		// The tokens are counted now, at the time the answer is sent.
		e = &llmEntry{at: time.Now(), input: prompt, output: used}
		c.entries = append(c.entries, e)
	}
	k := int(e.at.Sub(c.start) / c.window)
	units := e.output
	if c.output == 0 {
		units += e.input
	}
	c.counted[k] += units
}

// left returns what is left of each count now, and when the newest entry
// leaves the window.
func (c *llmCounts) left(now time.Time) (requests, input, output int, reset time.Duration) {
	req, in, out := c.sums(now)
	reset = time.Millisecond
	if n := len(c.entries); n > 0 {
		reset = max(c.entries[n-1].at.Add(c.window).Sub(now), time.Millisecond)
	}
	return c.requests - req, max(c.input-in, 0), max(c.output-out, 0), reset
}

// binding returns the units counted of the binding tokens count in the
// whole windows after the first of a run of d, as a share of its limit,
// and the units per window.
func (c *llmCounts) binding(d time.Duration) (float64, []int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	windows := int(d / c.window)
	limit := c.output
	if limit == 0 {
		limit = c.input
	}
	per := make([]int, windows)
	sum := 0
	for k := range windows {
		per[k] = c.counted[k]
		if k >= 1 {
			sum += per[k]
		}
	}
	return float64(sum) / float64(limit*(windows-1)), per
}

// llmFake is a fake LLM API: OpenAI's POST /chat/completions or
// Anthropic's POST /v1/messages, with its rate-limit headers, counting in c.
type llmFake struct {
	c         *llmCounts
	anthropic bool
	mu        sync.Mutex
	rng       *rand.Rand
	latency   time.Duration // the mean; each answer takes 50% to 150% of it
}

func (f *llmFake) draw(n int) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rng.IntN(n)
}

// request reads a request's prompt, in tokens as the fakes count them, and
// its most tokens of answer.
func (f *llmFake) request(r *http.Request) (prompt, most int, ok bool) {
	var body struct {
		Messages []struct {
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
		MaxTokens           int `json:"max_tokens"`
		MaxCompletionTokens int `json:"max_completion_tokens"`
	}
	b, _ := io.ReadAll(r.Body)
	if json.Unmarshal(b, &body) != nil {
		return 0, 0, false
	}
	var texts []string
	for _, m := range body.Messages {
		var s string
		var blocks []struct {
			Text string `json:"text"`
		}
		if json.Unmarshal(m.Content, &s) == nil {
			texts = append(texts, s)
		} else if json.Unmarshal(m.Content, &blocks) == nil {
			for _, b := range blocks {
				texts = append(texts, b.Text)
			}
		}
	}
	most = max(body.MaxTokens, body.MaxCompletionTokens)
	return promptTokens(texts...), most, most > 0
}

func (f *llmFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	prompt, most, ok := f.request(r)
	if !ok {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	e := f.c.arrive(prompt, most)
	var at []string
	if !f.c.reportAtResponse || e == nil {
		at = f.headers()
	}
	if e == nil {
		f.write(w, at, http.StatusTooManyRequests, prompt, 0)
		return
	}
	used := min(50+f.draw(351), most) // 50 to 400 tokens
	time.Sleep(f.latency/2 + time.Duration(f.draw(int(f.latency)+1)))
	f.c.answer(e, prompt, used)
	if at == nil {
		at = f.headers()
	}
	f.write(w, at, http.StatusOK, prompt, used)
}

// headers returns the rate-limit headers of the counts now, as name,
// value pairs.
func (f *llmFake) headers() []string {
	c := f.c
	c.mu.Lock()
	defer c.mu.Unlock()
	req, in, out, reset := c.left(time.Now())
	if !f.anthropic {
		return []string{
			"x-ratelimit-limit-requests", strconv.Itoa(c.requests), "x-ratelimit-remaining-requests", strconv.Itoa(req),
			"x-ratelimit-reset-requests", reset.String(),
			"x-ratelimit-limit-tokens", strconv.Itoa(c.input), "x-ratelimit-remaining-tokens", strconv.Itoa(in),
			"x-ratelimit-reset-tokens", reset.String(),
		}
	}
	at := time.Now().Add(reset).UTC().Format(time.RFC3339)
	return []string{
		"anthropic-ratelimit-requests-limit", strconv.Itoa(c.requests), "anthropic-ratelimit-requests-remaining", strconv.Itoa(req),
		"anthropic-ratelimit-requests-reset", at,
		"anthropic-ratelimit-input-tokens-limit", strconv.Itoa(c.input), "anthropic-ratelimit-input-tokens-remaining", strconv.Itoa(in),
		"anthropic-ratelimit-input-tokens-reset", at,
		"anthropic-ratelimit-output-tokens-limit", strconv.Itoa(c.output), "anthropic-ratelimit-output-tokens-remaining", strconv.Itoa(out),
		"anthropic-ratelimit-output-tokens-reset", at,
	}
}

func (f *llmFake) write(w http.ResponseWriter, headers []string, status, prompt, used int) {
	h := w.Header()
	for i := 0; i < len(headers); i += 2 {
		h.Set(headers[i], headers[i+1])
	}
	h.Set("Content-Type", "application/json")
	if status == http.StatusTooManyRequests {
		if f.anthropic {
			h.Set("retry-after", "1")
			w.WriteHeader(status)
			fmt.Fprint(w, `{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your rate limit"}}`)
			return
		}
		h.Set("retry-after-ms", "200")
		w.WriteHeader(status)
		fmt.Fprint(w, `{"error":{"message":"Rate limit reached for tokens","type":"tokens","code":"rate_limit_exceeded"}}`)
		return
	}
	if f.anthropic {
		fmt.Fprintf(w, `{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"output_tokens":%d}}`, prompt, used)
		return
	}
	fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
		prompt, used, prompt+used)
}

// newLLMFake serves f over HTTP.
func newLLMFake(c *llmCounts, anthropic bool, latency time.Duration) (*llmFake, *httptest.Server) {
	f := &llmFake{c: c, anthropic: anthropic, rng: rand.New(rand.NewPCG(3, 4)), latency: latency}
	return f, httptest.NewServer(f)
}
