package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// Every replica wraps its http.Client the same way; together they send at
// most 2 requests a minute. In FailFast mode the third request fails at
// once with an error that matches ErrLimited through http.Client's
// *url.Error. Had the vendor answered 429, the Transport would have paused
// the whole fleet until its Retry-After, and retried.
func ExampleTransport() {
	mr := miniredis.NewMiniRedis() // stands in for the Redis the fleet shares
	if err := mr.Start(); err != nil {
		fmt.Println(err)
		return
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello")
	}))
	defer vendor.Close()

	lim, err := throttle.New(rdb, "vendor-api", policies.SlidingLog{Limit: 2, Window: time.Minute},
		throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}
	client := &http.Client{Transport: &throttle.Transport{Limiter: lim}}

	for range 3 {
		resp, err := client.Get(vendor.URL)
		var limited *throttle.LimitedError
		if errors.Is(err, throttle.ErrLimited) && errors.As(err, &limited) {
			fmt.Println("limited, retry after about", limited.RetryAfter.Round(time.Second))
			continue
		}
		if err != nil {
			fmt.Println(err)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body))
	}
	// Output:
	// 200 hello
	// 200 hello
	// limited, retry after about 1m0s
}

// GitHub allows 30 search requests a minute beside 5000 requests an hour for
// the rest of its API: a route sends the search requests through a quota of
// their own.
func ExampleRoute() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		fmt.Println(err)
		return
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	github := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer github.Close()
	host := strings.TrimPrefix(github.URL, "http://") // api.github.com in real life

	core, err := throttle.New(rdb, "github-core", policies.SlidingLog{Limit: 5000, Window: time.Hour},
		throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}
	search, err := throttle.New(rdb, "github-search", policies.SlidingLog{Limit: 30, Window: time.Minute},
		throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		fmt.Println(err)
		return
	}
	client := &http.Client{Transport: &throttle.Transport{
		Limiter: core,
		Routes:  []throttle.Route{{Pattern: host + "/search/", Limiter: search}},
	}}

	refused := map[string]int{}
	for _, path := range []string{"/search/issues", "/repos/golang/go"} {
		for range 40 {
			resp, err := client.Get(github.URL + path)
			if err != nil {
				refused[path]++
				continue
			}
			resp.Body.Close()
		}
	}
	fmt.Println("search refused:", refused["/search/issues"])
	fmt.Println("core refused:", refused["/repos/golang/go"])
	// Output:
	// search refused: 10
	// core refused: 0
}

// A call made through a vendor's SDK over a Transport is settled from the
// SDK's typed result: Track gives the caller a permit that stands for the
// call the Transport sent with its context. Here the "SDK" is a function
// that posts a prompt and decodes the tokens the vendor says it used.
func ExampleTrack() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		fmt.Println(err)
		return
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "120") // the tokens the call used
	}))
	defer vendor.Close()

	lim, err := throttle.New(rdb, "llm-tokens", policies.SlidingLog{Limit: 100_000, Window: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Each request is admitted at an estimate of its tokens.
	client := &http.Client{Transport: &throttle.Transport{Limiter: lim, Cost: func(*http.Request) int { return 500 }}}
	complete := func(ctx context.Context, prompt string) (tokens int, err error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, vendor.URL, strings.NewReader(prompt))
		resp, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, err = fmt.Fscan(resp.Body, &tokens)
		return tokens, err
	}

	ctx, call := throttle.Track(context.Background())
	tokens, err := complete(ctx, "Say hello")
	if err == nil {
		err = call.Settle(ctx, throttle.Cost(tokens)) // the estimate of 500 becomes 120
	}
	u, _ := lim.Usage(ctx)
	fmt.Println(tokens, err, u.Rules[0].Used)
	// Output: 120 <nil> 120
}
