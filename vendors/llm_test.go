package vendors

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
)

// slidingCount is a vendor's strict count of units (requests, tokens) in
// a sliding window: a request is refused when the units it brings would
// take any window past the limit.
type slidingCount struct {
	limit  int
	window time.Duration
	at     []time.Time
	units  []int
	sum    int
}

// fits drops what left the window before now, and reports whether n more
// units fit.
func (c *slidingCount) fits(now time.Time, n int) bool {
	i := 0
	for i < len(c.at) && now.Sub(c.at[i]) >= c.window {
		c.sum -= c.units[i]
		i++
	}
	c.at, c.units = c.at[i:], c.units[i:]
	return c.sum+n <= c.limit
}

func (c *slidingCount) add(now time.Time, n int) {
	c.at, c.units = append(c.at, now), append(c.units, n)
	c.sum += n
}

// llmVendor is an LLM API's count: requests and tokens per window, strict
// sliding windows, a request counted at arrival with the tokens it will
// use (the prompt's, and the completion's, drawn up to its max_tokens).
// A vendor that adjusts to the real usage when the request ends counts
// the same; one that counts an estimate at arrival is another fake.
type llmVendor struct {
	mu        sync.Mutex
	requests  slidingCount
	tokens    slidingCount
	start     time.Time
	rng       *rand.Rand
	latency   time.Duration
	served    int
	refused   int   // after the first window; a first window's refusals are the vendor's burst, not the fleet's pace
	used      []int // tokens used, per window of the run
	estimated int   // tokens the fleet's requests asked for at most
	usedAll   int
	// countsEstimate makes the vendor count a request's prompt and its
	// max_completion_tokens at arrival, never adjusted: OpenAI's count, as
	// its guide and reports describe it.
	countsEstimate bool
}

func newLLMVendor(requests, tokens int, window, latency time.Duration) *llmVendor {
	return &llmVendor{
		requests: slidingCount{limit: requests, window: window},
		tokens:   slidingCount{limit: tokens, window: window},
		start:    time.Now(), rng: rand.New(rand.NewPCG(1, 2)), latency: latency,
	}
}

// admit decides a request of prompt tokens that may complete up to most
// tokens: it returns the completion's tokens, or false when a count is full.
func (v *llmVendor) admit(prompt, most int) (int, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	now := time.Now()
	completion := most/4 + v.rng.IntN(most/2+1) // a quarter to three quarters of the most
	counted := prompt + completion
	if v.countsEstimate {
		counted = prompt + most
	}
	if !v.requests.fits(now, 1) || !v.tokens.fits(now, counted) {
		if now.Sub(v.start) >= v.tokens.window {
			v.refused++
		}
		return 0, false
	}
	v.requests.add(now, 1)
	v.tokens.add(now, counted)
	v.served++
	k := int(now.Sub(v.start) / v.tokens.window)
	for len(v.used) <= k {
		v.used = append(v.used, 0)
	}
	v.used[k] += counted
	v.usedAll += prompt + completion
	v.estimated += prompt + most
	return completion, true
}

// results returns the requests served and refused, and the tokens used
// in each window.
func (v *llmVendor) results() (served, refused int, used []int, usage float64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.served, v.refused, append([]int(nil), v.used...), float64(v.usedAll) / float64(max(v.estimated, 1))
}

// promptTokens counts a prompt's tokens as the fakes do, and as the
// fleet's estimate does: a token per four bytes of the messages' text.
func promptTokens(texts ...string) int {
	n := 0
	for _, t := range texts {
		n += len(t)
	}
	return (n + 3) / 4
}

// fakeOpenAITokens answers POST /chat/completions as api.openai.com does,
// counting requests and tokens in v, with OpenAI's headers for both.
func fakeOpenAITokens(v *llmVendor) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
			MaxCompletionTokens int `json:"max_completion_tokens"`
		}
		b, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(b, &body); err != nil || body.MaxCompletionTokens == 0 {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		var texts []string
		for _, m := range body.Messages {
			texts = append(texts, m.Content)
		}
		prompt := promptTokens(texts...)
		completion, ok := v.admit(prompt, body.MaxCompletionTokens)
		h := w.Header()
		h.Set("Content-Type", "application/json")
		v.mu.Lock()
		h.Set("x-ratelimit-limit-requests", strconv.Itoa(v.requests.limit))
		h.Set("x-ratelimit-limit-tokens", strconv.Itoa(v.tokens.limit))
		v.mu.Unlock()
		if !ok {
			h.Set("retry-after-ms", "200")
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprint(w, `{"error":{"message":"Rate limit reached for tokens","type":"tokens","code":"rate_limit_exceeded"}}`)
			return
		}
		time.Sleep(v.latency)
		fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
			prompt, completion, prompt+completion)
	}))
}

// scriptCalls returns how many scripts the Redis of s ran.
func scriptCalls(t *testing.T, s *redistest.Server) int {
	info, err := s.Client(t).Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(info, "\n") {
		if strings.HasPrefix(line, "cmdstat_evalsha:") || strings.HasPrefix(line, "cmdstat_eval:") {
			f := strings.TrimPrefix(strings.Split(line, ",")[0], strings.Split(line, ":")[0]+":calls=")
			c, _ := strconv.Atoi(f)
			n += c
		}
	}
	return n
}

// share returns the tokens used in the windows after the first two (the
// fleet's start: connections, the quota's warm-up), as a share of what
// the cap allows in them.
func share(used []int, limit, windows int) float64 {
	if len(used) > windows {
		used = used[:windows]
	}
	sum := 0
	for _, u := range used[2:] {
		sum += u
	}
	return float64(sum) / float64(limit*(windows-2))
}

// rngSource draws the fakes' usage, the same on every run.
type rngSource struct{ r *rand.Rand }

func newRNG() *rngSource { return &rngSource{rand.New(rand.NewPCG(1, 2))} }

func (s *rngSource) intN(n int) int { return s.r.IntN(n) }
