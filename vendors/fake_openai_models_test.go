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

// strictLog is a strict sliding window of units: a request is refused
// when the units it brings would take any window past the limit.
type strictLog struct {
	limit  int
	window time.Duration
	at     []time.Time
	units  []int
	sum    int
}

// fits drops what left the window before now, and reports whether n more
// units fit.
func (c *strictLog) fits(now time.Time, n int) bool {
	i := 0
	for i < len(c.at) && now.Sub(c.at[i]) >= c.window {
		c.sum -= c.units[i]
		i++
	}
	c.at, c.units = c.at[i:], c.units[i:]
	return c.sum+n <= c.limit
}

func (c *strictLog) add(now time.Time, n int) {
	c.at, c.units = append(c.at, now), append(c.units, n)
	c.sum += n
}

// openaiModel is what OpenAI counts of one model: requests and tokens in
// a window, each request's tokens counted when it arrives, from its
// estimate (the prompt's, a token per four bytes, and its
// max_completion_tokens), and never adjusted to its usage.
type openaiModel struct {
	requests, tokens strictLog
	// The same limits enforced in slices of the window (sliced), each
	// slice its share: nil when the fake enforces the window alone.
	sliceRequests, sliceTokens *strictLog
	counted                    []int // tokens counted, per window of the run
	arrivals                   []arrival
}

// fits reports whether a request of n tokens fits every limit now.
func (m *openaiModel) fits(now time.Time, n int) bool {
	ok := m.requests.fits(now, 1) && m.tokens.fits(now, n)
	if m.sliceTokens != nil {
		ok = ok && m.sliceRequests.fits(now, 1) && m.sliceTokens.fits(now, n)
	}
	return ok
}

// add counts a request of n tokens now: a refused one counts as a request,
// its tokens not.
func (m *openaiModel) add(now time.Time, n int) {
	m.requests.add(now, 1)
	if m.sliceRequests != nil {
		m.sliceRequests.add(now, 1)
	}
	if n > 0 {
		m.tokens.add(now, n)
		if m.sliceTokens != nil {
			m.sliceTokens.add(now, n)
		}
	}
}

// arrival is a request the fake counted: when, and its tokens.
type arrival struct {
	at     time.Time
	tokens int
}

// openaiModelsFake answers POST /chat/completions as OpenAI documents its
// limits (docs/VENDORS.md has the sources): each model its own, failed
// requests counted too, x-ratelimit-* headers of the model's counts, and
// a 429 with the code rate_limit_exceeded and retry-after-ms.
type openaiModelsFake struct {
	window  time.Duration
	latency time.Duration
	start   time.Time

	mu      sync.Mutex
	models  map[string]*openaiModel
	refused map[string]int // after the first window, by model
}

func newOpenAIModelsFake(window, latency time.Duration, limits map[string][2]int) *openaiModelsFake {
	v := &openaiModelsFake{window: window, latency: latency, start: time.Now(), models: map[string]*openaiModel{}, refused: map[string]int{}}
	for model, l := range limits {
		v.models[model] = &openaiModel{requests: strictLog{limit: l[0], window: window}, tokens: strictLog{limit: l[1], window: window}}
	}
	return v
}

// sliced makes the fake enforce each model's limits in n slices of its
// window as well, each slice its share, as OpenAI says it may ("60,000
// requests/minute may be enforced as 1,000 requests/second"): a burst
// that a sliding window of the whole accepts is refused there.
func (v *openaiModelsFake) sliced(n int) {
	for _, m := range v.models {
		m.sliceRequests = &strictLog{limit: m.requests.limit / n, window: v.window / time.Duration(n)}
		m.sliceTokens = &strictLog{limit: m.tokens.limit / n, window: v.window / time.Duration(n)}
	}
}

func (v *openaiModelsFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var b struct {
		Model    string `json:"model"`
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
		MaxCompletionTokens int `json:"max_completion_tokens"`
	}
	body, _ := io.ReadAll(r.Body)
	if json.Unmarshal(body, &b) != nil || b.MaxCompletionTokens == 0 {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	prompt := 0
	for _, m := range b.Messages {
		prompt += (len(m.Content) + 3) / 4
	}
	counted := prompt + b.MaxCompletionTokens
	now := time.Now()
	v.mu.Lock()
	m := v.models[b.Model]
	if m == nil {
		v.mu.Unlock()
		http.Error(w, `{"error":{"code":"model_not_found"}}`, http.StatusNotFound)
		return
	}
	ok := m.fits(now, counted)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("x-ratelimit-limit-requests", strconv.Itoa(m.requests.limit))
	h.Set("x-ratelimit-limit-tokens", strconv.Itoa(m.tokens.limit))
	if !ok {
		if now.Sub(v.start) >= v.window {
			v.refused[b.Model]++
		}
		// "Unsuccessful requests contribute to your per-minute limit": a
		// refused request counts as a request, its tokens not.
		m.add(now, 0)
		v.mu.Unlock()
		h.Set("retry-after-ms", "200")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprintf(w, `{"error":{"message":"Rate limit reached for %s","type":"tokens","code":"rate_limit_exceeded"}}`, b.Model)
		return
	}
	m.add(now, counted)
	k := int(now.Sub(v.start) / v.window)
	for len(m.counted) <= k {
		m.counted = append(m.counted, 0)
	}
	m.counted[k] += counted
	m.arrivals = append(m.arrivals, arrival{now, counted})
	h.Set("x-ratelimit-remaining-requests", strconv.Itoa(m.requests.limit-m.requests.sum))
	h.Set("x-ratelimit-remaining-tokens", strconv.Itoa(m.tokens.limit-m.tokens.sum))
	v.mu.Unlock()
	time.Sleep(v.latency)
	completion := b.MaxCompletionTokens / 2
	fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
		b.Model, prompt, completion, prompt+completion)
}

// rate returns the tokens of model counted in a window, averaged over
// every window from `from` to `to` (windowsMean), as a share of its cap:
// the fleet's rate, wherever its bursts fall. Summed over the span, the
// tokens of a burst more or less in it moved the share by a tenth.
func (v *openaiModelsFake) rate(model string, from, to time.Time) float64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	m := v.models[model]
	taken := make([]taking, 0, len(m.arrivals))
	for _, a := range m.arrivals {
		taken = append(taken, taking{a.at.Sub(from), a.tokens})
	}
	return windowsMean(taken, 0, to.Sub(from), v.window) / float64(m.tokens.limit)
}

// counts returns each model's tokens counted per window.
func (v *openaiModelsFake) counts(model string) []int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]int(nil), v.models[model].counted...)
}

func (v *openaiModelsFake) serve() *httptest.Server { return httptest.NewServer(v) }
