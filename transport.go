package throttle

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/throttlekit/throttle/policies"
)

// Defaults of a Transport (see its fields).
const (
	defaultMaxRetries   = 3
	defaultMaxRetryTime = time.Minute
	defaultPause        = time.Second
)

const (
	// The delay between attempts grows from retryFirst to retryMax, with
	// jitter; a vendor's pause, when longer, replaces it.
	retryFirst = 100 * time.Millisecond
	retryMax   = 10 * time.Second
	// maxKeptBody bounds the body of a refusal kept in memory while the
	// request is retried, to be returned if the retry cannot be made.
	maxKeptBody = 64 << 10
	// maxReasonBody bounds what is read of a refusal's body for its reason.
	maxReasonBody = 8 << 10
	// feedbackTimeout bounds the calls to Redis that make a vendor's
	// answer known, which run even when the request's context has ended.
	feedbackTimeout = time.Second
)

// Transport is an http.RoundTripper that takes every request through a
// Limiter before its base RoundTripper sends it, and makes what the vendor
// answers about its rate limit known to the whole fleet.
//
// A request waits, fails or queues as the limiter's Mode says: in Block mode
// it waits for its slot within the request's context; in FailFast mode a full
// quota fails it at once with an error matching ErrLimited (errors.As finds
// the *LimitedError, with RetryAfter, inside the *url.Error of http.Client);
// in Queue mode it takes its place in the limiter's queue.
//
// The vendor's answer is feedback for every replica: the Transport reads
// its status and headers into an Answer for Permit.Heard, and its body too
// on a Route with FromBody; a Route with a Resource takes only the answers
// about it. A refusal (a 429,
// a 503 with Retry-After, or a 403 that says nothing is left, as GitHub
// sends) pauses the quota until the time the vendor named in Retry-After,
// X-RateLimit-Reset or the IETF RateLimit header, and for DefaultPause
// (with jitter) after a 429 that named none; so does any answer that says
// nothing is left until a reset. A refusal teaches the quota a cap only
// when the vendor says it is about its rate (Answer.AboutRate): a reason it
// documents, in a header or in the error code of a JSON body (the caller
// still reads the whole body), or AboutRate; a 429 that gives no reason
// only pauses. An answer that says fewer calls are left than the shared
// count believes lowers the count. Durations are rounded up and capped at
// an hour. A wrapper of another client (a vendor's SDK, a gRPC stub) does
// the same with Acquire, Permit.Heard and Permit.Settle.
//
// A refused request is then retried, through the limiter again, as a new
// call to the vendor: after growing, jittered delays, at most MaxRetries
// times, within MaxRetryTime and the request's context. Only a request
// that can be sent again is retried: its body is absent or GetBody produces
// it again (a body is read again only through GetBody), and sending it
// twice is safe. That is so for an idempotent method (GET, HEAD, OPTIONS,
// TRACE, PUT, DELETE) and for a request with an Idempotency-Key; any other
// (a POST, a PATCH) is retried only with RetryAnyMethod. net/http gives
// most bodies a GetBody, so GetBody alone says nothing of safety. When the
// retry cannot be made in time (the vendor's pause ends after the budget or
// the context's deadline, or the limiter refuses it), the vendor's refusal
// is returned as it came; so it is in FailFast mode, whose caller chose not
// to wait, and in shadow mode (Mode is FailFast), which sends each request
// once, as no limiter would.
//
// An SDK that retries a refusal itself (openai-go twice by default,
// stripe-go when Stripe-Should-Retry says so) sends each try through the
// Transport, which may retry each in turn: up to (1 + the SDK's retries) ×
// (1 + MaxRetries) sends of one call. Each waits for its slot, so the cap
// holds, but the caller waits longer. Keep one of the two: set MaxRetries
// to -1, or turn the SDK's retries off.
//
// Transport keeps the contract of http.RoundTripper: it does not modify the
// request (a retry sends a clone); it closes the request's body on every
// path, also when the limiter refuses the request before it is sent; and it
// returns a response or an error, never both. The permit of a request is
// released when the response's body is closed, which frees its slot under a
// policies.Concurrency, or at once when the quota has none; the caller must
// close the body, as always. A request that an *http.Transport base failed
// before it got a connection (a dial refused, a context ended) was never
// sent: its call is given back (Permit.Cancel), and counts for nothing.
//
// Set a Transport's fields before its first request: the first request
// reads and checks them, and later changes are not seen. A Transport must
// not be copied after its first request. It is safe for concurrent use. An
// invalid field (a route without a path, a pool with an empty key, a
// negative duration) makes every request fail with an error that names the
// field and the value; nothing panics. Send one request where the program
// starts, or read the error of the first, to find out.
type Transport struct {
	// Base sends the requests. nil means http.DefaultTransport. How late a
	// call starts after its slot, for the spread the fleet's margin follows,
	// is measured when Base has written the request (an *http.Transport
	// reports it): a request that waits for a connection, dials or shakes
	// hands with TLS arrives that much later at the vendor.
	// Give an *http.Transport idle connections for as many requests as run
	// at once (MaxIdleConnsPerHost, 2 by default), or the fleet's margin
	// widens for the dials.
	Base http.RoundTripper
	// Limiter takes every request that matches no route through. nil lets
	// those requests through without limit; a Transport with neither a
	// Limiter nor a Route with one limits nothing, and fails every request
	// with an error that says so.
	Limiter *Limiter
	// Routes send the requests that match them through a limiter of their
	// own, for a vendor whose APIs have quotas of their own. They are tried
	// in order and the first match wins, so give the narrower ones first.
	Routes []Route

	// Key gives the Key of each request: the tenant, user or API token it
	// is for, under policies.PerKey limits. An empty string gives the
	// request no key. Only a limiter with policies.PerKey rules takes it: a
	// route whose quota has none counts its requests without a key.
	Key func(*http.Request) string
	// Cost gives the Cost of each request, in units of the quota (a batch
	// endpoint, an estimate of LLM tokens). It must be at least 1 and at
	// most the quota's smallest limit, or the request fails with the
	// limiter's error. When nil, every request costs 1. It is called once
	// per try: a client that sends a request again (an SDK's retries) sends
	// a new one. The options of the request's context (Track) apply
	// after Key, Cost and Priority: a Cost given there wins over this one.
	Cost func(*http.Request) int
	// ResponseCost reads the actual cost of each request from its
	// response, for a vendor that says what a call cost (a header of
	// tokens or points used): a value of 0 or more settles the call's cost
	// with Permit.Settle before the response is returned, up to the quota's
	// smallest limit; a negative value leaves the cost as it was admitted.
	// It must not read the body. For a cost the body tells, give the
	// route a FromBody (GraphQL points), or read the body, then settle the
	// permit that PermitFrom(resp.Request.Context()) returns (an LLM's usage).
	ResponseCost func(*http.Response) int
	// Priority gives each request's Priority: its class, whose share of a
	// full quota every replica holds for it (see Priority), and its place
	// in the queue of a limiter in Queue mode, higher values first.
	Priority func(*http.Request) int

	// Keys spreads requests over several API keys of one vendor (a GitHub
	// App with 8 installation tokens, several OpenAI projects): for each
	// request the transport picks the key with the most room, takes the
	// request through the limiter as a call of that key (policies.PerKey
	// limits each key), and sets it on the request it sends with SetKey,
	// on a clone: the caller's request is never changed. A key the vendor
	// refused, or paused, is skipped until its reset; when every key is
	// paused, the request waits for the one whose pause ends first.
	//
	// The room of each key is what the latest answers told this process:
	// the shared count's remaining units after the key's latest call, and
	// the vendor's remaining count; a key not used yet counts as roomiest,
	// so that every key is tried. The request still runs in one script
	// call: the pick costs Redis nothing, and the limiter decides the call
	// against the key's own limits whatever this process believed. The
	// keys are the limiter's Keys, hashed before they reach Redis; a
	// limiter without policies.PerKey rules counts the requests of every
	// key as one, and each still goes with the key picked. Keys override
	// Key. An empty key, or Keys without SetKey, is invalid.
	Keys []string
	// SetKey sets the key Keys picked on the request sent.
	SetKey func(r *http.Request, key string)

	// MaxRetries is how many times a request the vendor refused is
	// retried. 0 means 3; a negative value never retries.
	MaxRetries int
	// MaxRetryTime bounds the time spent retrying one request, from the
	// vendor's first refusal: a refusal whose pause ends later is returned
	// at once. 0 means a minute.
	MaxRetryTime time.Duration
	// AboutRate reports whether a refusal that gives none of the reasons
	// the Transport reads (docs/VENDORS.md) is about the vendor's rate
	// limit, which teaches the quota a cap (Answer.AboutRate). When nil,
	// none is: such a refusal pauses the fleet and teaches nothing. Return
	// true for a vendor whose every 429 is about its rate, to follow a cap
	// it lowers without warning. It must not read the body.
	AboutRate func(*http.Response) bool

	// RetryAnyMethod retries a refused request of any method, a POST or
	// a PATCH without an Idempotency-Key too. Set it for a vendor that
	// documents that a refused call was not carried out (Twilio's 20429).
	RetryAnyMethod bool
	// DefaultPause is how long the fleet pauses after a 429 that does not
	// say when to come back; up to a quarter more is added at random. 0
	// means a second.
	DefaultPause time.Duration

	once sync.Once
	t    *transport
}

// A Route sends the requests that match it through Limiter instead of the
// Transport's: GitHub's search API allows 30 calls a minute beside 5000 an
// hour for the rest. A nil Limiter lets the requests that match through
// without limit.
//
// Pattern is a method, which may be left out, a host, which may be left
// out, then a path, as in http.ServeMux ("api.github.com/search/",
// "/v1/chat/", "GET /repos/{owner}/{repo}/issues"): a path ending in a
// slash matches every path under it, any other path matches only itself;
// a segment {name} matches any one segment, a last segment {name...} the
// rest of the path, a last {$} the path's end. No host matches any host,
// no method any method, and GET matches HEAD too. A host with a port
// matches that port only; host names compare without regard to case. A
// vendor that limits each endpoint (Stripe's 25 calls a second, GitHub's
// 900 points a minute) takes a Route per endpoint, in the vendor's own
// notation. A pattern without a slash is invalid. Match, when set instead
// of Pattern, reports whether a request matches; it must not modify the
// request.
type Route struct {
	Pattern string                   // the requests the route takes, as in http.ServeMux (above)
	Match   func(*http.Request) bool // instead of Pattern: whether a request is the route's
	Limiter *Limiter                 // the route's quota; nil lets its requests through

	// Resource is the vendor's name for what the route's quota counts, as
	// its answers name it (GitHub's x-ratelimit-resource: core, search,
	// code_search, graphql). An answer that names another resource tells
	// this quota nothing: neither its counts nor its refusal move it. Empty
	// takes every answer as this quota's.
	Resource string
	// FromBody reads what the vendor states in the body of an answer, for
	// a vendor that counts a call's cost or its own state there (GraphQL
	// APIs: Shopify's extensions.cost, GitHub's data.rateLimit; see the
	// package graphql). It is given the whole body when it is at most 1
	// MiB, before the response is returned, and the Answer read from the
	// status and headers, which it may amend: a count of the vendor's
	// units, or a refusal the body states (Shopify's THROTTLED). It
	// returns the call's actual cost, which settles the call (Permit.Settle)
	// unless the vendor refused it, or a negative value to keep the cost
	// admitted. It must not keep or modify body; the caller still reads
	// the whole body as the vendor sent it. A longer body is not read, and
	// the call keeps the cost it was admitted with.
	FromBody func(body []byte, a *Answer) int
}

// transport is a Transport as its first request read it.
type transport struct {
	base         http.RoundTripper
	lim          *Limiter
	routes       []route
	key          func(*http.Request) string
	cost         func(*http.Request) int
	respCost     func(*http.Response) int
	aboutRate    func(*http.Response) bool
	pool         *keyPool
	priority     func(*http.Request) int
	maxRetries   int
	anyMethod    bool // RetryAnyMethod
	maxRetryTime time.Duration
	pause        time.Duration
	// holds tells the limiters with a policies.Concurrency rule, whose
	// slots a request holds until its response's body is closed.
	holds map[*Limiter]bool
	// keyed tells the limiters with policies.PerKey rules: only those take
	// a request's key, which any other refuses.
	keyed map[*Limiter]bool
	err   error // the first invalid field: every request fails with it
}

type route struct {
	match    func(*http.Request) bool
	lim      *Limiter
	resource string // Route.Resource, in lower case
	fromBody func([]byte, *Answer) int
}

// compile reads and checks the fields of t.
func (t *Transport) compile() *transport {
	c := &transport{
		base: t.Base, lim: t.Limiter, key: t.Key, cost: t.Cost, respCost: t.ResponseCost, aboutRate: t.AboutRate, priority: t.Priority,
		maxRetries: t.MaxRetries, anyMethod: t.RetryAnyMethod, maxRetryTime: t.MaxRetryTime, pause: t.DefaultPause,
	}
	if c.base == nil {
		c.base = http.DefaultTransport
	}
	switch {
	case c.maxRetries == 0:
		c.maxRetries = defaultMaxRetries
	case c.maxRetries < 0:
		c.maxRetries = 0
	}
	if c.maxRetryTime == 0 {
		c.maxRetryTime = defaultMaxRetryTime
	}
	if c.pause == 0 {
		c.pause = defaultPause
	}
	if c.maxRetryTime < 0 {
		c.invalid("MaxRetryTime", "must not be negative, got %v", c.maxRetryTime)
	}
	if c.pause < 0 {
		c.invalid("DefaultPause", "must not be negative, got %v", c.pause)
	}
	c.addRoutes(t.Routes)
	c.holds, c.keyed = map[*Limiter]bool{}, map[*Limiter]bool{}
	for _, lim := range append([]*Limiter{c.lim}, c.routeLimiters()...) {
		if lim != nil {
			lim.view.reads.Store(true)
		}
		c.holds[lim] = hasRule(lim, func(r policies.Rule) bool { return r.Kind == policies.KindConcurrency })
		c.keyed[lim] = hasRule(lim, func(r policies.Rule) bool { return r.PerKey })
	}
	if t.Keys != nil || t.SetKey != nil {
		pool, err := newKeyPool(t.Keys, t.SetKey)
		if err != nil {
			c.invalid("Keys", "%v", err)
		}
		c.pool = pool
	}
	if c.lim == nil && !slices.ContainsFunc(c.routes, func(r route) bool { return r.lim != nil }) {
		c.invalid("Limiter", "is nil and no Route has a Limiter, so no request would be limited: set Limiter, or Routes with their limiters")
	}
	return c
}

// routeLimiters returns the limiters of the transport's routes.
func (t *transport) routeLimiters() []*Limiter {
	lims := make([]*Limiter, len(t.routes))
	for i, r := range t.routes {
		lims[i] = r.lim
	}
	return lims
}

// invalid records that field is invalid, unless a field read before it
// was: every request fails with the first invalid field's error.
func (t *transport) invalid(field, format string, args ...any) {
	if t.err == nil {
		t.err = fmt.Errorf("throttle: Transport.%s: "+format, append([]any{field}, args...)...)
	}
}

// addRoutes reads the Transport's Routes, and records the first invalid
// one.
func (t *transport) addRoutes(routes []Route) {
	for i, r := range routes {
		field := fmt.Sprintf("Routes[%d]", i)
		switch {
		case r.Match != nil && r.Pattern != "":
			t.invalid(field, "set Pattern %q or Match, not both", r.Pattern)
		case r.Match != nil:
			t.routes = append(t.routes, routeOf(r, r.Match))
		default:
			match, err := matchPattern(r.Pattern)
			if err != nil {
				t.invalid(field, "%v", err)
				continue
			}
			t.routes = append(t.routes, routeOf(r, match))
		}
	}
}

// settle replaces the cost of a request admitted by p with n, the cost
// its response states. A failure to reach Redis leaves the admitted cost.
func (t *transport) settle(ctx context.Context, lim *Limiter, p *Permit, n int) {
	if n == p.cost() {
		return
	}
	ctx, stop := context.WithTimeout(context.WithoutCancel(ctx), feedbackTimeout)
	defer stop()
	if err := p.Settle(ctx, Cost(n)); err != nil {
		lim.logger().Warn("throttle: could not settle a request's cost from its response", "quota", lim.Name(), "err", err)
	}
}

// matchPattern returns what matches the requests of a Route's Pattern.
func matchPattern(pattern string) (func(*http.Request) bool, error) {
	method, rest, hasMethod := strings.Cut(pattern, " ")
	if !hasMethod {
		method, rest = "", pattern
	} else if method == "" || strings.ToUpper(method) != method || strings.ContainsAny(method, "/{}") {
		return nil, fmt.Errorf("pattern %q: %q is not a method", pattern, method)
	}
	host, path, ok := strings.Cut(strings.TrimLeft(rest, " "), "/")
	if !ok {
		return nil, fmt.Errorf("pattern %q needs a path starting with /", pattern)
	}
	segments, err := patternSegments(pattern, "/"+path)
	if err != nil {
		return nil, err
	}
	host = strings.ToLower(host)
	return func(r *http.Request) bool {
		if r.URL == nil || (method != "" && r.Method != method && !(method == http.MethodGet && r.Method == http.MethodHead)) {
			return false
		}
		if host != "" {
			h := r.URL.Hostname()
			if strings.Contains(host, ":") {
				h = r.URL.Host
			}
			if strings.ToLower(h) != host {
				return false
			}
		}
		p := r.URL.Path
		if p == "" {
			p = "/"
		}
		return matchSegments(segments, strings.Split(p, "/"))
	}, nil
}

// patternSegments splits a pattern's path at its slashes, and checks its
// wildcards: each a whole segment, {name...} the last. A path ending in a
// slash ends in the segment "{...}", which matches the rest of the path.
func patternSegments(pattern, path string) ([]string, error) {
	segments := strings.Split(path, "/")
	if strings.HasSuffix(path, "/") {
		segments[len(segments)-1] = "{...}"
	}
	for i, seg := range segments {
		open, close := strings.Count(seg, "{"), strings.Count(seg, "}")
		wild := strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}")
		if open+close != 0 && (!wild || open != 1 || close != 1) {
			return nil, fmt.Errorf("pattern %q: a wildcard must be a whole segment, got %q", pattern, seg)
		}
		if (strings.HasSuffix(seg, "...}") || seg == "{$}") && i != len(segments)-1 {
			return nil, fmt.Errorf("pattern %q: %q must be the last segment", pattern, seg)
		}
	}
	return segments, nil
}

// matchSegments reports whether a request's path, split at its slashes,
// matches a pattern's segments.
func matchSegments(pattern, path []string) bool {
	for i, seg := range pattern {
		if i >= len(path) {
			return false
		}
		if strings.HasSuffix(seg, "...}") {
			return true // the rest after the slash, whatever it is
		}
		if seg == "{$}" {
			return path[i] == "" && i == len(path)-1 // the path ends in its slash
		}
		if seg == path[i] || (strings.HasPrefix(seg, "{") && path[i] != "") {
			continue
		}
		return false
	}
	return len(path) == len(pattern)
}

// RoundTrip takes req through the limiter, sends it, feeds the vendor's
// answer back to the limiter, and retries a refused request when it is safe.
// See Transport for the contract it keeps.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	return t.read().roundTrip(req)
}

// CloseIdleConnections closes the idle connections of the base RoundTripper,
// when it has that method, as http.Client.CloseIdleConnections expects.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.read().base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// read returns the Transport's fields as its first use read them.
func (t *Transport) read() *transport {
	t.once.Do(func() { t.t = t.compile() })
	return t.t
}

func (t *transport) roundTrip(req *http.Request) (*http.Response, error) {
	if t.err != nil {
		closeBody(req)
		return nil, t.err
	}
	rt := t.routeFor(req)
	lim := rt.lim
	if lim == nil {
		return t.base.RoundTrip(req)
	}
	ctx := req.Context()
	opts := t.callOptions(req, lim)
	var (
		out     = req           // the request sent by this attempt
		refusal *http.Response  // the vendor's last refusal, kept while a retry is tried
		retries backoff.BackOff // made at the first refusal
		first   time.Time
	)
	for {
		send, callOpts, key := t.pickKey(ctx, lim, out, opts)
		p, err := lim.Acquire(ctx, callOpts...)
		if err != nil {
			closeBody(out)
			return notRetried(ctx, refusal, err)
		}
		discard(refusal)
		refusal = nil
		resp, quiet, retry, err := t.send(ctx, rt, p, send, key)
		if err != nil {
			return nil, err
		}
		if !retry {
			return t.deliver(resp, lim, p), nil
		}
		if retries == nil {
			first = time.Now()
			retries = t.newBackOff()
		}
		next, delay, ok := t.nextAttempt(req, lim, retries, first, quiet)
		if !ok {
			return t.deliver(resp, lim, p), nil
		}
		refusal, ok = keep(resp)
		if !ok {
			closeBody(next)
			return t.deliver(refusal, lim, p), nil
		}
		p.Release()
		if err := waitRetry(ctx, delay); err != nil {
			closeBody(next)
			discard(refusal)
			return nil, err
		}
		out = next
	}
}

// pickKey returns the request an attempt sends for out, the options of
// its call, and the index of its key in the pool (-1 without Keys): with
// Keys, a clone of out that carries the key it picked.
func (t *transport) pickKey(ctx context.Context, lim *Limiter, out *http.Request, opts []CallOption) (*http.Request, []CallOption, int) {
	if t.pool == nil {
		return out, opts, -1
	}
	// Each attempt picks its key: a retry may find another with room.
	key := t.pool.pick(lim)
	callOpts := opts
	if t.keyed[lim] {
		callOpts = append(opts[:len(opts):len(opts)], Key(t.pool.keys[key].key))
	}
	send := out.Clone(ctx)
	t.pool.set(send, t.pool.keys[key].key)
	return send, callOpts, key
}

// notRetried returns what a request the limiter refused with err returns:
// the vendor's last refusal, kept while the retry was tried, as it came,
// or err when there is none or the request's context ended.
func notRetried(ctx context.Context, refusal *http.Response, err error) (*http.Response, error) {
	if refusal != nil && ctx.Err() == nil {
		// The retry cannot be made: the vendor's answer stands.
		return refusal, nil
	}
	discard(refusal)
	return nil, err
}

// send sends req, the request of permit p, and makes the vendor's answer
// known to the limiter and to the pool of keys, key being its index in it
// (-1 for none). It reports how long the vendor asked the fleet to keep
// quiet, and whether to retry the request: the vendor refused it, and did
// not say that a retry would fail too. On an error, p is released.
func (t *transport) send(ctx context.Context, rt route, p *Permit, req *http.Request, key int) (*http.Response, time.Duration, bool, error) {
	lim := rt.lim
	// The request sent carries its permit, which the caller finds with
	// PermitFrom(resp.Request.Context()): to settle the call's cost
	// from the body, once read.
	var conn atomic.Bool
	resp, err := t.base.RoundTrip(req.WithContext(withPermit(traceStart(req.Context(), p, &conn), p)))
	if err != nil {
		t.failed(ctx, p, conn.Load())
		return nil, 0, false, err
	}
	v := parseVendorLimits(resp.Header, time.Now())
	a := t.answerOf(resp.StatusCode, v, t.aboutOf(resp, v.about))
	cost := rt.readBody(resp, &a, v)
	quiet, refused := t.feedback(ctx, p, a)
	if key >= 0 {
		// A quota of no per-key rules counts every key's calls as one.
		count := -1
		if t.keyed[lim] {
			count = p.remaining()
		}
		vendor := -1
		if a.Requests != nil {
			vendor = a.Requests.Remaining
		}
		t.pool.heard(key, count, vendor, quiet)
	}
	if cost < 0 && t.respCost != nil {
		cost = t.respCost(resp)
	}
	if cost >= 0 && !refused {
		t.settle(ctx, lim, p, cost)
	}
	// Stripe-Should-Retry: false says a retry would fail too.
	return resp, quiet, refused && !v.noRetry, nil
}

// traceStart returns ctx with a trace that starts the call of p (Permit.Start)
// when the base RoundTripper has written the request: the call leaves for
// the vendor then, after any wait for a connection of the pool, a dial and
// a TLS handshake, which the fleet's spread must see, as they delay the
// call's arrival at the vendor as much as a late start would. The last
// write counts (Release notes it): an *http.Transport sends the request
// again on another connection when the vendor had closed an idle one,
// perhaps after a dial; a write that failed counts for nothing. A base that
// reports no write (not an *http.Transport, or one that failed before
// writing) leaves the call started when Acquire returned.
// Hooks of a trace already in ctx still run.
// GotConn sets conn: from then on the request may be written, whatever
// becomes of its context (see failed).
func traceStart(ctx context.Context, p *Permit, conn *atomic.Bool) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(httptrace.GotConnInfo) { conn.Store(true) },
		WroteRequest: func(w httptrace.WroteRequestInfo) {
			if w.Err == nil {
				p.Start()
			}
		},
	})
}

// failed ends the permit p of a request its base failed. A request to
// which an *http.Transport gave no connection was never written: its
// context ended first (woken at a slot just before its deadline), or the
// dial failed. It gives its call back (Permit.Cancel), whose units would
// otherwise hold a slot no call used. Once a connection is got, the
// request may be written even after its context ends, and the vendor may
// count it: it is released, its units kept. A base of another type tells
// nothing of its connections, and is released too.
func (t *transport) failed(ctx context.Context, p *Permit, conn bool) {
	if _, ok := t.base.(*http.Transport); ok && !conn && !isOff(offUnsent) {
		ctx, stop := context.WithTimeout(context.WithoutCancel(ctx), feedbackTimeout)
		defer stop()
		_ = p.Cancel(ctx) // a failed Cancel releases too: its units stay counted
		return
	}
	p.Release()
}

// routeFor returns the route of req: the first that matches, or the
// Transport's Limiter as a route of no other field.
func (t *transport) routeFor(req *http.Request) route {
	for _, r := range t.routes {
		if r.match(req) {
			return r
		}
	}
	return route{lim: t.lim}
}

func (t *transport) callOptions(req *http.Request, lim *Limiter) []CallOption {
	var opts []CallOption
	if t.key != nil && t.pool == nil && t.keyed[lim] {
		if k := t.key(req); k != "" {
			opts = append(opts, Key(k))
		}
	}
	if t.cost != nil {
		opts = append(opts, Cost(t.cost(req)))
	}
	if t.priority != nil {
		opts = append(opts, Priority(t.priority(req)))
	}
	// The request's own options come last: each one it gives wins.
	given, _ := optionsFrom(req.Context())
	return append(opts, given...)
}

// feedback tells the limiter what the vendor's answer says (Permit.Heard),
// and reports how long the vendor asked the fleet to keep quiet and whether
// it refused the request. It runs even when the request's context has
// ended, since the fleet needs to know; if Redis cannot be reached the
// feedback is lost and the answer is returned all the same.
func (t *transport) feedback(ctx context.Context, p *Permit, a Answer) (quiet time.Duration, refused bool) {
	ctx, stop := context.WithTimeout(context.WithoutCancel(ctx), feedbackTimeout)
	defer stop()
	quiet, refused, _ = p.Heard(ctx, a)
	return quiet, refused
}

// answerOf returns the Answer that a response's status and headers give,
// about being what the refusal is about.
func (t *transport) answerOf(status int, v vendorLimits, about refusalAbout) Answer {
	a := Answer{
		Status:           status,
		RetryAfter:       v.retryAfter,
		HasRetryAfter:    v.hasRetryAfter,
		Shared:           v.scope == "shared",
		AboutRate:        about == aboutTheRate,
		AboutConcurrency: about == aboutConcurrency,
		DefaultPause:     t.pause,
	}
	if v.remaining >= 0 {
		a.Requests = &Count{Remaining: v.remaining, Reset: v.reset, Limit: v.limit}
	}
	if v.hasTokens {
		a.Tokens = &Count{Remaining: v.tokens, Reset: v.tokensReset}
	}
	for name, c := range v.units {
		if a.Units == nil {
			a.Units = map[string]*Count{}
		}
		a.Units[name] = &c
	}
	return a
}

// aboutOf returns what resp refuses the call about: its reason, read from
// its headers or else from its body, or the rate when it gives none and
// AboutRate says so. Only the statuses that may refuse are read.
func (t *transport) aboutOf(resp *http.Response, about refusalAbout) refusalAbout {
	switch resp.StatusCode {
	case http.StatusTooManyRequests, http.StatusForbidden, http.StatusServiceUnavailable:
	default:
		return aboutNothingSaid
	}
	if about == aboutNothingSaid {
		about = peekAbout(resp)
	}
	if about == aboutNothingSaid && t.aboutRate != nil && t.aboutRate(resp) {
		return aboutTheRate
	}
	return about
}

// peekAbout reads the reason of a refusal from the start of its JSON
// body (bodyAbout); the caller still reads the body as the vendor sent it.
func peekAbout(resp *http.Response) refusalAbout {
	if !strings.Contains(resp.Header.Get("Content-Type"), "json") {
		return aboutNothingSaid
	}
	buf, ok := peekBody(resp, maxReasonBody)
	if !ok {
		return aboutNothingSaid
	}
	return bodyAbout(buf)
}

// nextAttempt prepares the retry of a refused request: a clone of req with
// its body produced again, and the delay before it asks the limiter for a
// slot. It reports false when the request must not or cannot be retried in
// time.
func (t *transport) nextAttempt(req *http.Request, lim *Limiter, retries backoff.BackOff, first time.Time, quiet time.Duration) (*http.Request, time.Duration, bool) {
	if lim.mode() == FailFast || !replayable(req, t.anyMethod) {
		return nil, 0, false
	}
	delay := retries.NextBackOff()
	if delay == backoff.Stop {
		return nil, 0, false
	}
	// The retry runs no earlier than the vendor's pause ends; if that is past
	// the budget or the deadline, waiting for it would only delay the answer.
	ready := time.Now().Add(max(delay, quiet))
	if ready.After(first.Add(t.maxRetryTime)) {
		return nil, 0, false
	}
	if deadline, ok := req.Context().Deadline(); ok && ready.After(deadline) {
		return nil, 0, false
	}
	next := req.Clone(req.Context())
	if req.GetBody != nil {
		body, err := req.GetBody()
		if err != nil {
			return nil, 0, false
		}
		next.Body = body
	}
	return next, delay, true
}

// replayable reports whether a request may be sent again after the vendor
// refused it: its body can be produced again, and sending it twice is safe,
// by its method or its Idempotency-Key, or because anyMethod says so.
func replayable(req *http.Request, anyMethod bool) bool {
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		return false
	}
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return anyMethod || req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != ""
}

// waitRetry waits d before a refused request is retried, or until ctx ends.
func waitRetry(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (t *transport) newBackOff() backoff.BackOff {
	b := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(retryFirst),
		backoff.WithMaxInterval(retryMax),
		backoff.WithMaxElapsedTime(t.maxRetryTime),
	)
	return backoff.WithMaxRetries(b, uint64(t.maxRetries))
}

// deliver hands the response over. Under a policies.Concurrency the permit
// is released when the body is closed, since the call holds the vendor's
// slot until then; otherwise it is released now.
func (t *transport) deliver(resp *http.Response, lim *Limiter, p *Permit) *http.Response {
	if !t.holds[lim] || resp.Body == nil || resp.Body == http.NoBody {
		p.Release()
		return resp
	}
	body := releaseOnClose{ReadCloser: resp.Body, p: p}
	if w, ok := resp.Body.(io.Writer); ok {
		// A 101 Switching Protocols body is also written to.
		resp.Body = &releaseOnCloseWriter{releaseOnClose: body, w: w}
	} else {
		resp.Body = &body
	}
	return resp
}

// hasRule reports whether lim has a rule for which is returns true.
func hasRule(lim *Limiter, is func(policies.Rule) bool) bool {
	return lim != nil && slices.ContainsFunc(lim.Rules(), is)
}

// releaseOnClose releases a permit when the response body is closed.
type releaseOnClose struct {
	io.ReadCloser
	p *Permit
}

func (b *releaseOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.p.Release()
	return err
}

type releaseOnCloseWriter struct {
	releaseOnClose
	w io.Writer
}

func (b *releaseOnCloseWriter) Write(p []byte) (int, error) { return b.w.Write(p) }

// keep reads the body of a refusal into memory and closes it, which frees
// the connection while the retry waits, so that the refusal can still be
// returned as it came. A body too large to keep is left as it is (false).
func keep(resp *http.Response) (*http.Response, bool) {
	if resp.Body == nil || resp.Body == http.NoBody {
		return resp, true
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxKeptBody+1))
	if len(buf) > maxKeptBody {
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), resp.Body), resp.Body}
		return resp, false
	}
	_ = resp.Body.Close()
	var r io.Reader = bytes.NewReader(buf)
	if err != nil {
		r = io.MultiReader(r, errReader{err})
	}
	resp.Body = io.NopCloser(r)
	return resp, true
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// discard drains and closes the body of a response that will not be
// returned.
func discard(resp *http.Response) {
	if resp == nil || resp.Body == nil {
		return
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxKeptBody))
	_ = resp.Body.Close()
}

func closeBody(req *http.Request) {
	if req != nil && req.Body != nil {
		_ = req.Body.Close()
	}
}
