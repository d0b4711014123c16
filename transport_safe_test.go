package throttle

import (
	"bytes"
	"context"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// A POST is sent again only when that is safe: with an Idempotency-Key, or
// when the Transport is told that any method may be retried. A body that
// GetBody can produce again (net/http sets it for a bytes.Reader) is no
// such leave: the vendor may have carried out a refused POST in part.
func TestTransport_RetriesAPostOnlyWithAnIdempotencyKeyOrWhenAsked(t *testing.T) {
	s := redistest.Mini(t)
	for i, tt := range []struct {
		name     string
		key      string
		anyKind  bool
		attempts int
	}{
		{"a bytes.Reader body, no Idempotency-Key", "", false, 1},
		{"an Idempotency-Key", "k-1", false, 2},
		{"RetryAnyMethod", "", true, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newVendorServer(t, refuseFirst(1, "Retry-After", "0"))
			lim := replicaLimiter(t, s, "post-"+strconv.Itoa(i), policies.SlidingLog{Limit: 10, Window: time.Minute})
			req := mustRequest(t, context.Background(), http.MethodPost, srv.URL, bytes.NewReader([]byte(`{"amount":100}`)))
			if req.GetBody == nil {
				t.Fatal("net/http gave a bytes.Reader body no GetBody: the case tests nothing")
			}
			if tt.key != "" {
				req.Header.Set("Idempotency-Key", tt.key)
			}
			resp, err := (&Transport{Limiter: lim, RetryAnyMethod: tt.anyKind}).RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			if n := srv.count(); n != tt.attempts {
				t.Errorf("the vendor saw the POST %d times, want %d", n, tt.attempts)
			}
		})
	}
}

// The options a request's context carries (Track) apply on top of
// what the Transport's Key, Cost and Priority give: a Priority alone leaves
// Transport.Cost in force, and a Cost given there wins over it.
func TestTransport_TracksOptionsApplyOnTopOfTheTransportsCost(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	lim := replicaLimiter(t, s, "with-options", policies.SlidingLog{Limit: 100, Window: time.Minute})
	tr := &Transport{Limiter: lim, Cost: func(*http.Request) int { return 3 }}
	for _, tt := range []struct {
		name string
		opts []CallOption
		want int
	}{
		{"no options", nil, 3},
		{"a Priority alone", []CallOption{Priority(1)}, 3},
		{"a Cost", []CallOption{Priority(1), Cost(5)}, 5},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if tt.opts != nil {
				ctx, _ = Track(ctx, tt.opts...)
			}
			resp, err := tr.RoundTrip(mustRequest(t, ctx, http.MethodGet, srv.URL, nil))
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			if got := PermitFrom(resp.Request.Context()).cost(); got != tt.want {
				t.Errorf("the request cost %d, want %d", got, tt.want)
			}
		})
	}
}

// Key and Keys reach only the limiters whose policy has per-key rules: a
// route whose quota is one for all keys takes its requests without a key,
// where it failed each of them.
func TestTransport_KeysReachOnlyPerKeyLimiters(t *testing.T) {
	s := redistest.Mini(t)
	srv := newVendorServer(t, answer(http.StatusOK, "ok"))
	perToken := policies.PerKey{Policy: policies.SlidingLog{Limit: 100, Window: time.Minute}}
	shared := policies.SlidingLog{Limit: 100, Window: time.Minute}
	for _, tt := range []struct {
		name string
		tr   func(core, search *Limiter) *Transport
	}{
		{"Key", func(core, search *Limiter) *Transport {
			return &Transport{Limiter: core, Routes: []Route{{Pattern: "/search/", Limiter: search}},
				Key: func(r *http.Request) string { return r.Header.Get("X-Token") }}
		}},
		{"Keys", func(core, search *Limiter) *Transport {
			return &Transport{Limiter: core, Routes: []Route{{Pattern: "/search/", Limiter: search}},
				Keys: []string{"t-1", "t-2"}, SetKey: func(r *http.Request, k string) { r.Header.Set("X-Token", k) }}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			core := replicaLimiter(t, s, "keys-core-"+tt.name, perToken)
			search := replicaLimiter(t, s, "keys-search-"+tt.name, shared)
			var tokens []string
			tr := tt.tr(core, search)
			tr.Base = roundTripFunc(func(r *http.Request) (*http.Response, error) {
				tokens = append(tokens, r.Header.Get("X-Token"))
				return http.DefaultTransport.RoundTrip(r)
			})
			for _, path := range []string{"/repos", "/search/code"} {
				req := mustRequest(t, context.Background(), http.MethodGet, srv.URL+path, nil)
				req.Header.Set("X-Token", "t-1")
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Fatalf("%s: %v", path, err)
				}
				readAll(t, resp)
			}
			if len(tokens) != 2 || tokens[0] == "" || tokens[1] == "" {
				t.Errorf("the requests sent carried the tokens %q, want one each", tokens)
			}
			if u, err := search.Usage(context.Background()); err != nil || u.Rules[0].Used != 1 {
				t.Errorf("the search quota counts %+v (%v), want the one request", u, err)
			}
		})
	}
}
