// Command llm shows an LLM API's quota, requests and tokens per window, held
// by a fleet in one policy: each request is admitted with an estimate of its
// tokens and settled with what the API says it used.
//
// It starts a strict fake LLM API that counts the tokens each request used
// (as a gateway or a self-hosted model's server does: OpenAI itself counts
// an estimate at arrival and keeps it, and its calls are charged that
// estimate and not settled; docs/VENDORS.md says so per vendor) in exact
// sliding windows, answers 429 past either cap with rate-limit headers, and
// an embedded Redis (or uses -redis). Each replica has its own
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
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/examples/fakeapi"
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

// completion is the part of a chat completion's answer the fleet reads.
type completion struct {
	Usage struct {
		TotalTokens int `json:"total_tokens"`
	} `json:"usage"`
}

// A call's prompt is of promptLeast to promptMost tokens, and its reply of
// replyMost at most.
const (
	promptLeast, promptMost = 20, 60
	replyMost               = 100
)

// estimateKey is the context key of a request's estimate of its tokens.
type estimateKey struct{}

// estimate is the Cost of a request: the tokens complete put in its
// context, and 1 for a request without.
func estimate(r *http.Request) int {
	n, _ := r.Context().Value(estimateKey{}).(int)
	return max(n, 1)
}

// run checks cfg, starts the fake API and, without -redis, a miniredis,
// runs the fleet for cfg.Duration and reports what the API saw.
func run(ctx context.Context, cfg config, out io.Writer) (result, error) {
	if cfg.Replicas < 1 || cfg.Workers < 1 || cfg.Requests < 1 || cfg.Window <= 0 || cfg.Duration <= 0 {
		return result{}, errors.New("every flag must be positive")
	}
	if cfg.Tokens < promptMost+replyMost {
		return result{}, fmt.Errorf("-tokens must be at least %d, the most a call may use", promptMost+replyMost)
	}
	api := fakeapi.NewLLM(fakeapi.LLMConfig{Requests: cfg.Requests, Tokens: cfg.Tokens, Window: cfg.Window})
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
	// One quota, two limits: PerCall counts each request as 1 whatever it
	// costs; the tokens' limit counts each request's Cost.
	policy := policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: cfg.Requests, Window: cfg.Window}},
		policies.SlidingLog{Limit: cfg.Tokens, Window: cfg.Window},
	)
	fmt.Fprintf(out, "API: %d requests and %d tokens per %v; fleet: %d replicas × %d workers\n",
		cfg.Requests, cfg.Tokens, cfg.Window, cfg.Replicas, cfg.Workers)

	start := time.Now()
	if err := runFleet(ctx, cfg, addr, policy, srv.URL); err != nil {
		return result{}, err
	}
	return report(out, api.Stats(), start, cfg), nil
}

// runFleet runs cfg's replicas, each with its own Redis client at addr and
// limiter of policy, whose workers send completions to url until cfg's
// duration ends, and returns the first error of any.
func runFleet(ctx context.Context, cfg config, addr string, policy policies.Policy, url string) error {
	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, cfg.Replicas*cfg.Workers)
	for i := range cfg.Replicas {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		defer rdb.Close()
		lim, err := throttle.New(rdb, "llm", policy)
		if err != nil {
			return err
		}
		// Each request is admitted with its estimate of the tokens it
		// may use; complete settles it with what the API says it used.
		client := &http.Client{Transport: &throttle.Transport{Limiter: lim, Cost: estimate}}
		for w := range cfg.Workers {
			rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
			wg.Go(func() {
				for runCtx.Err() == nil {
					if err := complete(runCtx, client, url, rng); err != nil && runCtx.Err() == nil {
						errs <- err
						return
					}
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	return <-errs // nil when none failed
}

// complete sends one chat completion: a prompt of promptLeast to promptMost
// tokens (words, as the fake API counts them), with a reply of replyMost at
// most, admitted with the most it can use as its estimate, and settled with the tokens the API
// says it used. An estimate below what a call may use would let the fleet
// past the tokens' cap; what it overestimates is held until the call is
// settled.
func complete(ctx context.Context, client *http.Client, url string, rng *rand.Rand) error {
	prompt, most := promptLeast+rng.IntN(promptMost-promptLeast+1), replyMost
	body, err := json.Marshal(map[string]any{
		"model":      "gpt-4o",
		"max_tokens": most,
		"messages":   []map[string]string{{"role": "user", "content": strings.Repeat("word ", prompt)}},
	})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(context.WithValue(ctx, estimateKey{}, prompt+most),
		http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
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
	return throttle.PermitFrom(resp.Request.Context()).Settle(context.WithoutCancel(ctx), throttle.Cost(c.Usage.TotalTokens))
}

// report prints what the API accepted each second since start, and returns
// the totals.
func report(out io.Writer, st fakeapi.LLMStats, start time.Time, cfg config) result {
	var res result
	var perSecond [][2]int // requests and tokens
	for _, c := range st.Accepted {
		s := int(c.At.Sub(start) / time.Second)
		for len(perSecond) <= s {
			perSecond = append(perSecond, [2]int{})
		}
		perSecond[s][0]++
		perSecond[s][1] += c.Tokens
		res.Calls++
		res.Tokens += c.Tokens
	}
	fmt.Fprintf(out, "%8s %10s %10s\n", "second", "requests", "tokens")
	for s, n := range perSecond {
		fmt.Fprintf(out, "%8d %10d %10d\n", s, n[0], n[1])
	}
	// The tokens' use from the end of the first window to a window before
	// the last call, against the cap over that span: the first window runs
	// its burst, the last the calls cut short by the end of the run.
	if n := len(st.Accepted); n > 1 {
		from, to := st.Accepted[0].At.Add(cfg.Window), st.Accepted[n-1].At.Add(-cfg.Window)
		used := 0
		for _, c := range st.Accepted {
			if c.At.After(from) && !c.At.After(to) {
				used += c.Tokens
			}
		}
		if span := to.Sub(from); span > 0 {
			res.TokenUse = float64(used) / (float64(cfg.Tokens) * float64(span) / float64(cfg.Window))
		}
	}
	res.OverRequests, res.OverTokens = st.OverRequests, st.OverTokens
	fmt.Fprintf(out, "%d requests, %d tokens; past the cap: %d requests, %d tokens; %.0f%% of the tokens' cap used\n",
		res.Calls, res.Tokens, res.OverRequests, res.OverTokens, 100*res.TokenUse)
	return res
}
