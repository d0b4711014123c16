package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// The README's Go snippets are the regions of this file between a
// "// README name" line and a "// README end" line: each compiles here, and
// TestREADME_SnippetsRun runs it against a real Redis and miniredis.
// TestREADME_SnippetsAreThese checks that the README shows exactly these
// regions (the regions of one name joined in order), so a snippet that no
// longer compiles, or a README that drifts from the code, fails the tests.

// Stand-ins for what the snippets take from the user's program.
type (
	Message struct{ SID string }
	Reply   struct {
		Text  string
		Usage struct{ TotalTokens int }
	}
	smsClient struct{}
)

func (smsClient) Send(ctx context.Context, to, body string) (*Message, error) {
	return &Message{SID: to}, ctx.Err()
}

// readmeClient is the first line of the Use snippet: it dials the user's own
// Redis, so it is compiled but not run.
func readmeClient() *redis.Client {
	// README use
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379", ContextTimeoutEnabled: true})
	// README end
	return rdb
}

func readmeUse(ctx context.Context, rdb *redis.Client) error {
	sms, to, body := smsClient{}, "+15550100", "hello"
	// README use
	lim, err := throttle.New(rdb, "sms",
		policies.SlidingLog{Limit: 100, Window: time.Second},
		throttle.Options{Mode: throttle.Block}, // the default; or FailFast, Queue
	)
	if err != nil {
		return err
	}
	// Wait for a slot, run the call, release it.
	msg, err := throttle.Do(ctx, lim, func(ctx context.Context) (*Message, error) {
		return sms.Send(ctx, to, body)
	})
	if err != nil {
		return err // ErrLimited: no slot before ctx's deadline; a *LimitedError says when to retry
	}
	log.Printf("sent %s", msg.SID)
	// README end
	if msg.SID != to {
		return errors.New("the message was not sent")
	}
	// README use
	// Lower level: Acquire obeys the mode, Allow never waits.
	p, err := lim.Acquire(ctx)
	if err != nil {
		return err
	}
	defer p.Release()
	d, err := lim.Allow(ctx)
	if err != nil {
		return err
	}
	if !d.OK {
		return fmt.Errorf("full: retry after %v", d.RetryAfter)
	}
	// README end
	return nil
}

func readmeHTTPClient(rdb *redis.Client) (*http.Client, error) {
	// README http
	// A vendor's API: 5000 calls an hour per token, of which search 30 a minute.
	api, err := throttle.New(rdb, "vendor-api", policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}})
	if err != nil {
		return nil, err
	}
	search, err := throttle.New(rdb, "vendor-search", policies.PerKey{Policy: policies.SlidingLog{Limit: 30, Window: time.Minute}})
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: &throttle.Transport{ // no Limiter: other hosts are not limited
		Routes: []throttle.Route{
			{Pattern: "api.example.com/search/", Limiter: search},
			{Pattern: "api.example.com/", Limiter: api},
		},
		Key: func(r *http.Request) string { return r.Header.Get("Authorization") }, // one quota per token
	}}
	// README end
	return client, nil
}

func readmeKeyPool(core *throttle.Limiter, tokens []string) *throttle.Transport {
	// README keypool
	tr := &throttle.Transport{Limiter: core, Keys: tokens, SetKey: func(r *http.Request, token string) {
		r.Header.Set("Authorization", "Bearer "+token)
	}}
	// README end
	return tr
}

// readmeSDK stands for an SDK's client (openai-go's), which sends its
// requests over the http.Client it was given.
type readmeSDK struct {
	Chat struct{ Completions readmeCompletions }
}

type readmeCompletions struct{ client *http.Client }

type readmeCompletion struct {
	Usage struct{ TotalTokens int64 }
}

// New posts a completion request, and returns the tokens it used.
func (c readmeCompletions) New(ctx context.Context, params string) (*readmeCompletion, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, params, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, err
	}
	resp.Body.Close()
	out := &readmeCompletion{}
	out.Usage.TotalTokens = 900
	return out, nil
}

func readmeTrack(ctx context.Context, gateway readmeSDK, params string) error {
	// README track
	ctx, call := throttle.Track(ctx)
	completion, err := gateway.Chat.Completions.New(ctx, params)
	if err == nil {
		err = call.Settle(ctx, throttle.Cost(int(completion.Usage.TotalTokens)))
	}
	// README end
	return err
}

func readmeWorkers(ctx context.Context, rdb *redis.Client, policy policies.Policy) error {
	tenant := "tenant-42"
	sendSMS := func(ctx context.Context) (*Message, error) { return smsClient{}.Send(ctx, "+15550100", "hello") }
	// README workers
	lim, err := throttle.New(rdb, "sms-provider", policy, throttle.Options{Mode: throttle.Queue})
	if err != nil {
		return err
	}
	// A ctx that a shutdown signal does not cancel (context.WithoutCancel), so that Close drains.
	f := throttle.Go(ctx, lim, sendSMS, throttle.Key(tenant), throttle.Priority(10)) // returns at once
	// Stop taking jobs; wait until every job has run.
	if err := lim.Close(ctx); err != nil {
		return err
	}
	if _, err := f.Wait(); err != nil {
		return err
	}
	// README end
	return nil
}

func readmePolicies() (policies.Policy, policies.Policy) {
	// README tenants
	// The SMS provider allows 100/s in all, each tenant 10/s of it: both checked in one script.
	sms := policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
	)

	// An API that counts 5000/h per token: each key has its own quota, with no shared one.
	perToken := policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}
	// README end
	return sms, perToken
}

func readmeLLM(ctx context.Context, rdb *redis.Client) (*Reply, error) {
	prompt, estimate := "hello", 1200
	complete := func(ctx context.Context, prompt string) (*Reply, error) {
		r := &Reply{Text: prompt}
		r.Usage.TotalTokens = 900
		return r, ctx.Err()
	}
	// README llm
	// A gateway that counts the tokens calls use: each call settled to its usage.
	lim, err := throttle.New(rdb, "llm-gateway", policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: 500, Window: time.Minute}}, // requests
		policies.SlidingCounter{Limit: 200_000, Window: time.Minute},                   // tokens
	))
	if err != nil {
		return nil, err
	}
	reply, err := throttle.Do(ctx, lim, func(ctx context.Context) (*Reply, error) {
		reply, err := complete(ctx, prompt)
		if err == nil {
			err = throttle.PermitFrom(ctx).Settle(ctx, throttle.Cost(reply.Usage.TotalTokens)) // the tokens only
		}
		return reply, err
	}, throttle.Cost(estimate))
	// README end
	return reply, err
}

// readmeRegions returns this file's README regions by name, each dedented
// by the one tab of a function body, the regions of one name joined.
// readmeRegionFiles hold the regions: this file, and, for the snippets
// that call the vendors' SDKs, the vendors module's tests, which compile
// and run them (the SDKs are no dependency of this module).
var readmeRegionFiles = []string{"readme_test.go",
	"vendors/readme_github_test.go", "vendors/readme_shopify_test.go", "vendors/readme_stripe_test.go",
	"vendors/readme_openai_models_test.go", "vendors/readme_anthropic_cache_test.go", "vendors/readme_twilio_test.go",
	"observe/prometheus/readme_test.go", "observe/otel/readme_test.go"}

func readmeRegions(t *testing.T) map[string]string {
	t.Helper()
	var src []byte
	for _, f := range readmeRegionFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	regions := map[string]string{}
	name := ""
	for _, line := range strings.Split(string(src), "\n") {
		trimmed := strings.TrimSpace(line)
		switch {
		case trimmed == "// README end":
			name = ""
		case strings.HasPrefix(trimmed, "// README ") && name == "":
			name = strings.TrimPrefix(trimmed, "// README ")
		case name != "":
			regions[name] += strings.TrimPrefix(line, "\t") + "\n"
		}
	}
	return regions
}

// readmeDocs are the documents whose Go snippets readme_test.go compiles:
// the README, the page it sends vendors' configurations to, and observe's.
var readmeDocs = []string{"README.md", "docs/VENDORS.md", "observe/README.md"}

// readmeSnippets returns the Go code blocks of readmeDocs, with the
// indentation of a block inside a list item taken off.
func readmeSnippets(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, doc := range readmeDocs {
		out = append(out, docSnippets(t, doc)...)
	}
	return out
}

// docSnippets returns the Go code blocks of the Markdown file name.
func docSnippets(t *testing.T, name string) []string {
	t.Helper()
	src, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	var block []string
	indent, in := "", false
	for _, line := range strings.Split(string(src), "\n") {
		trimmed := strings.TrimLeft(line, " ")
		switch {
		case !in && trimmed == "```go":
			in, indent, block = true, line[:len(line)-len(trimmed)], nil
		case in && trimmed == "```":
			in = false
			out = append(out, strings.Join(block, "\n")+"\n")
		case in:
			block = append(block, strings.TrimPrefix(line, indent))
		}
	}
	return out
}

func TestREADME_SnippetsAreThese(t *testing.T) {
	regions := readmeRegions(t)
	shown := map[string]bool{}
	for _, snippet := range readmeSnippets(t) {
		found := false
		for name, code := range regions {
			if code == snippet {
				shown[name], found = true, true
			}
		}
		if !found {
			t.Errorf("the README shows a Go snippet that readme_test.go does not compile:\n%s", snippet)
		}
	}
	for name := range regions {
		if !shown[name] {
			t.Errorf("readme_test.go's region %q is not in the README as it is here:\n%s", name, regions[name])
		}
	}
	if len(regions) < 9 {
		t.Errorf("%d README regions, want the 9 snippets", len(regions))
	}
}

func TestREADME_SnippetsRun(t *testing.T) {
	_ = readmeClient // dials the user's Redis: compiled only
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rdb := s.Client(t)
		if err := readmeUse(ctx, rdb); err != nil {
			t.Errorf("Use: %v", err)
		}
		checkReadmeHTTP(ctx, t, rdb)
		core, err := throttle.New(rdb, "github-core", policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		var (
			mu   sync.Mutex
			sent []string
		)
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			defer mu.Unlock()
			sent = append(sent, r.Header.Get("Authorization"))
		}))
		defer vendor.Close()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, vendor.URL, nil)
		resp, err := readmeKeyPool(core, []string{"t1", "t2"}).RoundTrip(req)
		if err != nil {
			t.Fatalf("key pool: %v", err)
		}
		resp.Body.Close()
		mu.Lock()
		if len(sent) != 1 || !strings.HasPrefix(sent[0], "Bearer t") {
			t.Errorf("key pool: the vendor saw Authorization %q, want a token of the pool", sent)
		}
		mu.Unlock()
		checkReadmeTrack(ctx, t, rdb, vendor.URL)
		tenants, github := readmePolicies()
		for _, p := range []policies.Policy{tenants, github} {
			if _, err := policies.Rules(p); err != nil {
				t.Errorf("policy %T: %v", p, err)
			}
		}
		if err := readmeWorkers(ctx, rdb, tenants); err != nil {
			t.Errorf("workers: %v", err)
		}
		reply, err := readmeLLM(ctx, rdb)
		if err != nil || reply.Usage.TotalTokens != 900 {
			t.Errorf("LLM: %+v, %v", reply, err)
		}
	})
}

// checkReadmeHTTP sends a search and another request of one token through
// the README's HTTP client, to a vendor served here in api.example.com's
// place: each is counted in its route's quota, under its token.
func checkReadmeHTTP(ctx context.Context, t *testing.T, rdb *redis.Client) {
	t.Helper()
	c, err := readmeHTTPClient(rdb)
	if err != nil {
		t.Fatalf("the HTTP client snippet: %v", err)
	}
	vendor := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer vendor.Close()
	c.Transport.(*throttle.Transport).Base = toServer{vendor.URL}
	for _, path := range []string{"/search/issues", "/repos/a/b"} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://api.example.com"+path, nil)
		req.Header.Set("Authorization", "token t1")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("the HTTP client snippet, GET %s: %v", path, err)
		}
		resp.Body.Close()
	}
	for name, limit := range map[string]int{"vendor-search": 30, "vendor-api": 5000} {
		window := map[string]time.Duration{"vendor-search": time.Minute, "vendor-api": time.Hour}[name]
		lim, err := throttle.New(rdb, name, policies.PerKey{Policy: policies.SlidingLog{Limit: limit, Window: window}})
		if err != nil {
			t.Fatal(err)
		}
		u, err := lim.Usage(ctx, throttle.Key("token t1"))
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Used != 1 {
			t.Errorf("the HTTP client snippet: quota %s counts %d calls of the token, want 1", name, u.Rules[0].Used)
		}
	}
}

// toServer sends each request to the server at url, whatever its host.
type toServer struct{ url string }

func (s toServer) RoundTrip(r *http.Request) (*http.Response, error) {
	u, err := url.Parse(s.url)
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.URL.Scheme, r.URL.Host, r.Host = u.Scheme, u.Host, ""
	return http.DefaultTransport.RoundTrip(r)
}

// checkReadmeTrack runs the README's Track snippet against the vendor at
// url: the call admitted at its estimate is settled at what it used.
func checkReadmeTrack(ctx context.Context, t *testing.T, rdb redis.UniversalClient, url string) {
	t.Helper()
	tracked, err := throttle.New(rdb, "readme-track", policies.SlidingLog{Limit: 100_000, Window: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var gateway readmeSDK
	gateway.Chat.Completions.client = &http.Client{Transport: &throttle.Transport{Limiter: tracked, Cost: func(*http.Request) int { return 1200 }}}
	if err := readmeTrack(ctx, gateway, url); err != nil {
		t.Errorf("Track: %v", err)
	}
	if u, err := tracked.Usage(ctx); err != nil || u.Rules[0].Used != 900 {
		t.Errorf("Track: %+v, %v; want the call settled at 900", u, err)
	}
}
