package vendors

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/go-github/v84/github"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/fakevendor"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// sharedKey is a vendor's strict sliding window of requests on one API
// key, which the fleet and another consumer spend: it notes when each of
// them was served and refused.
type sharedKey struct {
	mu    sync.Mutex
	count slidingCount
	start time.Time
	fleet [2][]time.Duration // served, refused; since start
	other [2][]time.Duration
}

func newSharedKey(limit int, window time.Duration) *sharedKey {
	return &sharedKey{count: slidingCount{limit: limit, window: window}, start: time.Now()}
}

// take counts a request, the other consumer's when other, and returns
// whether it fits, what is left of the limit, and when the oldest request
// counted leaves the window (when one more fits).
func (k *sharedKey) take(other bool) (ok bool, remaining int, free time.Time) {
	now := time.Now()
	k.mu.Lock()
	defer k.mu.Unlock()
	ok = k.count.fits(now, 1)
	if ok {
		k.count.add(now, 1)
	}
	who := &k.fleet
	if other {
		who = &k.other
	}
	i := 0
	if !ok {
		i = 1
	}
	who[i] = append(who[i], now.Sub(k.start))
	free = now
	if len(k.count.at) > 0 {
		free = k.count.at[0].Add(k.count.window)
	}
	return ok, k.count.limit - k.count.sum, free
}

// between counts the times of ts in [from, to).
func (k *sharedKey) between(ts []time.Duration, from, to time.Duration) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, t := range ts {
		if t >= from && t < to {
			n++
		}
	}
	return n
}

// spend sends a request every every with a plain http.Client, from now
// until stop is closed: another service on the same key, asking no one.
func (k *sharedKey) spend(url string, every time.Duration, stop <-chan struct{}) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	c := &http.Client{Timeout: 5 * time.Second}
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			go func() {
				req, _ := http.NewRequest(http.MethodPost, url, nil)
				req.Header.Set("X-Other", "1")
				if resp, err := c.Do(req); err == nil {
					resp.Body.Close()
				}
			}()
		}
	}
}

// openAIShape answers as api.openai.com does, with its headers of requests.
func openAIShape(w http.ResponseWriter, ok bool, limit, remaining int, free time.Time) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("x-ratelimit-limit-requests", strconv.Itoa(limit))
	h.Set("x-ratelimit-remaining-requests", strconv.Itoa(remaining))
	h.Set("x-ratelimit-reset-requests", max(time.Until(free), 0).Round(time.Millisecond).String())
	h.Set("x-ratelimit-limit-tokens", "1000000")
	h.Set("x-ratelimit-remaining-tokens", "999000")
	h.Set("x-ratelimit-reset-tokens", "6m0s")
	if !ok {
		h.Set("retry-after-ms", strconv.FormatInt(max(time.Until(free), 0).Milliseconds(), 10))
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error":{"message":"Rate limit reached for requests","type":"requests","code":"rate_limit_exceeded"}}`)
		return
	}
	fmt.Fprint(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
}

// gitHubShape answers as api.github.com does, with its headers.
func gitHubShape(w http.ResponseWriter, ok bool, limit, remaining int, free time.Time) {
	h := w.Header()
	h.Set("Content-Type", "application/json; charset=utf-8")
	h.Set("x-ratelimit-limit", strconv.Itoa(limit))
	h.Set("x-ratelimit-remaining", strconv.Itoa(remaining))
	h.Set("x-ratelimit-used", strconv.Itoa(limit-remaining))
	h.Set("x-ratelimit-reset", strconv.FormatInt(free.Add(time.Second-1).Unix(), 10))
	h.Set("x-ratelimit-resource", "core")
	if !ok {
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"message":"API rate limit exceeded for user ID 1."}`)
		return
	}
	fmt.Fprint(w, `{"login":"octocat","id":1}`)
}

// serve returns the vendor's server, answering in shape.
func (k *sharedKey) serve(t *testing.T, shape func(http.ResponseWriter, bool, int, int, time.Time)) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok, remaining, free := k.take(r.Header.Get("X-Other") != "")
		shape(w, ok, k.count.limit, remaining, free)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// The run of a shared key: a window of the other consumer alone, then
// the fleet beside it for five windows, then the fleet alone for four.
// One run at a time: a machine busy with another fleet starts the calls
// late, and a late call makes the vendor's count measure the others low
// (two at once in CI: 10 of 144 of the other's calls refused).
const (
	sharedLimit  = 60
	sharedWindow = 2 * time.Second
	sharedEvery  = 83 * time.Millisecond // 40% of the cap
	sharedStart  = sharedWindow
	sharedStop   = sharedStart + 5*sharedWindow
	// A window and a half past four windows after the stop: the fleet's
	// bursts come a window and its margin apart, so the first one four
	// windows after the stop starts up to a third of a window later.
	sharedEnd = sharedStop + 5*sharedWindow + sharedWindow/2
)

// sharedKeyRun runs the other consumer and the fleet, whose call sends
// one request through the client of its replica, and checks the figures:
// the other consumer finds room (at most 4% refused after the fleet's
// first window, 4% in all), the fleet takes at
// least 0.85 of what it leaves with no refusal after its first two
// windows, and the whole cap again within four windows once the other
// consumer stops (as the root package's TestOthers reads it: a measure
// made as the other stops may err high, and one CI run's fleet took 56
// of 60 in the windows starting two to three windows after the stop).
func sharedKeyRun(t *testing.T, k *sharedKey, srv *httptest.Server, call func(replica int)) {
	stop := make(chan struct{})
	go k.spend(srv.URL, sharedEvery, stop)
	time.AfterFunc(time.Until(k.start.Add(sharedStop)), func() { close(stop) })
	time.Sleep(time.Until(k.start.Add(sharedStart)))
	runEach(3, 10, time.Until(k.start.Add(sharedEnd)), call)

	settled := sharedStart + 2*sharedWindow
	sent := k.between(k.other[0], 0, sharedEnd) + k.between(k.other[1], 0, sharedEnd)
	turned := k.between(k.other[1], 0, sharedEnd)
	// The fleet's first window is its cold start: before the vendor's
	// first answers reach Redis it books as if alone, and its first
	// measures of the others, in its first burst, err low.
	warm := sharedStart + sharedWindow
	sentWarm := k.between(k.other[0], warm, sharedEnd) + k.between(k.other[1], warm, sharedEnd)
	turnedWarm := k.between(k.other[1], warm, sharedEnd)
	fleet, refused := k.between(k.fleet[0], settled, sharedStop), k.between(k.fleet[1], settled, sharedStop)
	others := k.between(k.other[0], settled, sharedStop)
	left := float64(sharedLimit)*float64(sharedStop-settled)/float64(sharedWindow) - float64(others)
	// The whole cap again: some window of the vendor's, starting within
	// four windows of the stop, holds a whole cap of the fleet's calls
	// (any window: the fleet's bursts drift through the test's own).
	after := fakevendor.FullestWindow(k.fleet[0], sharedStop+2*sharedWindow, sharedStop+4*sharedWindow, sharedWindow)
	cap := float64(sharedLimit)
	t.Logf("the other consumer: %d of %d refused (%d of %d after the fleet's first window); the fleet: %d while the other spent %d (%.3f of what it left), %d refused after its first two windows, %d refused in all; %.3f of the cap in a window from four windows after the other stopped",
		turned, sent, turnedWarm, sentWarm, fleet, others, float64(fleet)/left, refused, len(k.fleet[1]), float64(after)/cap)
	if refused > 0 || turned > 0 {
		k.mu.Lock()
		t.Logf("refused, since the other consumer started: the fleet's at %v, the other's at %v", k.fleet[1], k.other[1])
		k.mu.Unlock()
	}
	// 0-2 of 96 in 15 of 16 runs on 11-27, 3 in a CI run on 11-28 (after
	// a cold start that measured the others low); 18-20 without the share.
	if turnedWarm*25 > sentWarm {
		t.Errorf("the other consumer had %d of its %d requests after the fleet's first window refused, want at most 4%%", turnedWarm, sentWarm)
	}
	// In all, its cold start too: 5 of 144 once on 12-04 (openai-go, run
	// alone: 2 in the fleet's first window, 3 after it).
	if turned*25 > sent {
		t.Errorf("the other consumer had %d of its %d requests refused, want at most 4%%", turned, sent)
	}
	// 0.917-0.954 in 16 runs on 11-27; 0.898 once in CI on 11-28, a slower
	// day (the fleet's bursts fall against the other's stream differently
	// from run to run). Without the share the fleet takes more, and the
	// other's refusals above fail.
	if float64(fleet) < 0.85*left {
		t.Errorf("the fleet took %d of the %.0f requests the other consumer left, want at least 0.85 of them", fleet, left)
	}
	if refused > 0 {
		t.Errorf("the fleet had %d requests refused after its first two windows, want none", refused)
	}
	// A sliding log runs at its window and margin (30ms of 2s).
	if float64(after) < 0.95*cap {
		t.Errorf("the fleet took at most %d requests in a window starting within four windows after the other consumer stopped, want at least %.0f",
			after, 0.95*cap)
	}
}

// Another consumer of the key (a plain http.Client) spends 40% of it,
// evenly, from a window before the fleet starts: openai-go through the
// Transport measures it from x-ratelimit-remaining-requests and leaves it
// its share.
func TestOpenAI_LeavesAnotherConsumerItsShare(t *testing.T) {
	s := redistest.Real(t)
	k := newSharedKey(sharedLimit, sharedWindow)
	srv := k.serve(t, openAIShape)
	clients := make([]openai.Client, 3)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), "openai-shared-key", policies.SlidingLog{Limit: sharedLimit, Window: sharedWindow})
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Transport: &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 10}, Limiter: lim}}
		clients[i] = openai.NewClient(option.WithAPIKey("sk-test"), option.WithBaseURL(srv.URL+"/"), option.WithHTTPClient(hc),
			option.WithMaxRetries(0))
	}
	sharedKeyRun(t, k, srv, func(i int) {
		_, err := clients[i].Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model:    "gpt-4o",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
		})
		if err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// The same through go-github: GitHub's x-ratelimit-remaining, -used and
// -reset (in whole seconds, of when the oldest request leaves).
func TestGitHub_LeavesAnotherConsumerItsShare(t *testing.T) {
	s := redistest.Real(t)
	k := newSharedKey(sharedLimit, sharedWindow)
	srv := k.serve(t, gitHubShape)
	base, err := url.Parse(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	clients := make([]*github.Client, 3)
	for i := range clients {
		lim, err := throttle.New(s.Client(t), "github-shared-key", policies.SlidingLog{Limit: sharedLimit, Window: sharedWindow})
		if err != nil {
			t.Fatal(err)
		}
		tr := &throttle.Transport{Base: &http.Transport{MaxIdleConnsPerHost: 10}, Limiter: lim, MaxRetries: -1}
		c := github.NewClient(&http.Client{Transport: tr}).WithAuthToken("token-a")
		c.BaseURL = base
		clients[i] = c
	}
	// go-github refuses on its own, until the reset it saw, once a count
	// says nothing is left: throttle decides, so its check is bypassed.
	ctx := context.WithValue(context.Background(), github.BypassRateLimitCheck, true)
	sharedKeyRun(t, k, srv, func(i int) {
		if _, _, err := clients[i].Users.Get(ctx, "octocat"); err != nil {
			time.Sleep(10 * time.Millisecond)
		}
	})
}
