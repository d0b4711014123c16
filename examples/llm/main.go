// Command llm shows an LLM API's quota, requests and tokens per window, held
// by a fleet in one policy: each request is admitted with an estimate of its
// tokens and settled with what the API says it used.
//
// It starts a strict fake LLM API that counts requests and tokens in exact
// sliding windows and answers 429 past either cap, with OpenAI's rate-limit
// headers, and an embedded Redis (or uses -redis). Each replica has its own
// Redis client, limiter and http.Client, as separate processes would. The
// quota is
//
//	policies.All(
//		policies.PerCall{Policy: policies.SlidingLog{Limit: requests, Window: window}},
//		policies.SlidingLog{Limit: tokens, Window: window},
//	)
//
// and the program prints what the API saw each second, then a summary.
//
//	go run ./examples/llm
//	go run ./examples/llm -replicas 4 -workers 8 -requests 60 -tokens 4000
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

type config struct {
	Replicas int
	Workers  int
	Requests int // the API's cap of requests per window
	Tokens   int // the API's cap of tokens per window
	Window   time.Duration
	Duration time.Duration
	Redis    string
}

func main() {
	var cfg config
	flag.IntVar(&cfg.Replicas, "replicas", 3, "replicas sharing the quota")
	flag.IntVar(&cfg.Workers, "workers", 6, "concurrent requests per replica")
	flag.IntVar(&cfg.Requests, "requests", 40, "the API's cap of requests per window")
	flag.IntVar(&cfg.Tokens, "tokens", 3000, "the API's cap of tokens per window")
	flag.DurationVar(&cfg.Window, "window", time.Second, "the API's sliding window")
	flag.DurationVar(&cfg.Duration, "duration", 6*time.Second, "how long the fleet runs")
	flag.StringVar(&cfg.Redis, "redis", "", "a Redis address; empty for an embedded one")
	flag.Parse()
	res, err := run(context.Background(), cfg, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if res.OverRequests+res.OverTokens > 0 {
		os.Exit(1)
	}
}

// result is what the API saw.
type result struct {
	Calls, Tokens            int
	OverRequests, OverTokens int     // arrivals past either cap (429s)
	TokenUse                 float64 // tokens accepted against the cap, from the first window on
}

// completion is the part of a chat completion the fleet reads.
type completion struct {
	Usage struct {
		TotalTokens int `json:"total_tokens"`
	} `json:"usage"`
}

func run(ctx context.Context, cfg config, out io.Writer) (result, error) {
	api := newFakeAPI(cfg.Requests, cfg.Tokens, cfg.Window)
	srv := httptest.NewServer(api)
	defer srv.Close()

	addr := cfg.Redis
	if addr == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return result{}, err
		}
		defer mr.Close()
		addr = mr.Addr()
	}
	policy := policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: cfg.Requests, Window: cfg.Window}},
		policies.SlidingLog{Limit: cfg.Tokens, Window: cfg.Window},
	)
	fmt.Fprintf(out, "API: %d requests and %d tokens per %v; fleet: %d replicas × %d workers\n",
		cfg.Requests, cfg.Tokens, cfg.Window, cfg.Replicas, cfg.Workers)

	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, cfg.Replicas*cfg.Workers)
	for i := range cfg.Replicas {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		defer rdb.Close()
		lim, err := throttle.New(rdb, "llm", policy)
		if err != nil {
			return result{}, err
		}
		client := &http.Client{Transport: throttle.NewTransport(nil, lim,
			// The estimate: the prompt's tokens and the most the reply may use.
			throttle.WithRequestCost(func(r *http.Request) int {
				n, _ := strconv.Atoi(r.Header.Get("X-Estimate"))
				return max(n, 1)
			}))}
		for w := range cfg.Workers {
			rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
			wg.Go(func() {
				for runCtx.Err() == nil {
					if err := complete(runCtx, client, srv.URL, rng); err != nil && runCtx.Err() == nil {
						errs <- err
						return
					}
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return result{}, err
	}
	res := api.report(out)
	return res, nil
}

// complete sends one chat completion: a prompt of 20 to 60 tokens, with a
// reply of at most 100, admitted with the most it can use as its estimate,
// and settled with the tokens the API says it used. An estimate below what
// a call may use would let the fleet past the tokens' cap; what it
// overestimates is held until the call is settled.
func complete(ctx context.Context, client *http.Client, url string, rng *rand.Rand) error {
	prompt, most := 20+rng.IntN(41), 100
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-4o","max_tokens":`+strconv.Itoa(most)+`}`))
	if err != nil {
		return err
	}
	req.Header.Set("X-Estimate", strconv.Itoa(prompt+most))
	req.Header.Set("X-Prompt-Tokens", strconv.Itoa(prompt))
	resp, err := client.Do(req)
	if err != nil {
		return nil // the run ended while the request waited for its slot
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	var c completion
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		return err
	}
	// What the call really used, once the body is read: the estimate's
	// rest goes back to the fleet.
	return throttle.PermitFrom(resp.Request.Context()).Settle(context.WithoutCancel(ctx), c.Usage.TotalTokens)
}

// fakeAPI is a strict LLM API: exact sliding windows of requests and of
// tokens, a 429 past either cap.
type fakeAPI struct {
	requests, tokens int
	window           time.Duration
	start            time.Time
	mu               sync.Mutex
	arrivals         []arrival // accepted, for the windows
	accepted         []arrival // accepted, all of them
	perSecond        map[int][2]int
	over             [2]int
}

type arrival struct {
	at     time.Time
	tokens int
}

func newFakeAPI(requests, tokens int, window time.Duration) *fakeAPI {
	return &fakeAPI{requests: requests, tokens: tokens, window: window, start: time.Now(), perSecond: map[int][2]int{}}
}

func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	prompt, _ := strconv.Atoi(r.Header.Get("X-Prompt-Tokens"))
	used := prompt + 20 + rand.IntN(81) // the reply's tokens
	now := time.Now()
	a.mu.Lock()
	from := now.Add(-a.window)
	for len(a.arrivals) > 0 && !a.arrivals[0].at.After(from) {
		a.arrivals = a.arrivals[1:]
	}
	inTokens := 0
	for _, x := range a.arrivals {
		inTokens += x.tokens
	}
	okRequests, okTokens := len(a.arrivals) < a.requests, inTokens+used <= a.tokens
	if okRequests && okTokens {
		a.arrivals = append(a.arrivals, arrival{now, used})
		a.accepted = append(a.accepted, arrival{now, used})
		s := a.perSecond[int(now.Sub(a.start)/time.Second)]
		a.perSecond[int(now.Sub(a.start)/time.Second)] = [2]int{s[0] + 1, s[1] + used}
		inTokens += used
	} else if !okRequests {
		a.over[0]++
	} else {
		a.over[1]++
	}
	leftRequests, leftTokens := a.requests-len(a.arrivals), a.tokens-inTokens
	a.mu.Unlock()

	h := w.Header()
	h.Set("x-ratelimit-limit-requests", strconv.Itoa(a.requests))
	h.Set("x-ratelimit-remaining-requests", strconv.Itoa(max(leftRequests, 0)))
	h.Set("x-ratelimit-limit-tokens", strconv.Itoa(a.tokens))
	h.Set("x-ratelimit-remaining-tokens", strconv.Itoa(max(leftTokens, 0)))
	if !okRequests || !okTokens {
		h.Set("retry-after-ms", "100")
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	h.Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"object":"chat.completion","usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, prompt, used-prompt, used)
}

// report prints what the API saw each second, and returns the totals.
func (a *fakeAPI) report(out io.Writer) result {
	a.mu.Lock()
	defer a.mu.Unlock()
	var res result
	fmt.Fprintf(out, "%8s %10s %10s\n", "second", "requests", "tokens")
	last := 0
	for s := range a.perSecond {
		last = max(last, s)
	}
	for s := 0; s <= last; s++ {
		n := a.perSecond[s]
		fmt.Fprintf(out, "%8d %10d %10d\n", s, n[0], n[1])
		res.Calls += n[0]
		res.Tokens += n[1]
	}
	// The tokens' use from the end of the first window to a window before
	// the last call, against the cap over that span: the first window runs
	// its burst, the last the calls cut short by the end of the run.
	if len(a.accepted) > 1 {
		from, to := a.accepted[0].at.Add(a.window), a.accepted[len(a.accepted)-1].at.Add(-a.window)
		used := 0
		for _, x := range a.accepted {
			if x.at.After(from) && !x.at.After(to) {
				used += x.tokens
			}
		}
		if span := to.Sub(from); span > 0 {
			res.TokenUse = float64(used) / (float64(a.tokens) * float64(span) / float64(a.window))
		}
	}
	res.OverRequests, res.OverTokens = a.over[0], a.over[1]
	fmt.Fprintf(out, "%d requests, %d tokens; past the cap: %d requests, %d tokens; %.0f%% of the tokens' cap used\n",
		res.Calls, res.Tokens, res.OverRequests, res.OverTokens, 100*res.TokenUse)
	return res
}
