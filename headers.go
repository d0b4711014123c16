package throttle

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxHeard bounds every delay read from a vendor's headers, as Permit.Heard
// bounds a pause: a hostile or broken header cannot stop a fleet for days.
const maxHeard = time.Hour

// maxRemaining bounds a remaining count read from a header, so that a
// garbled value cannot overflow the arithmetic of the scripts.
const maxRemaining = math.MaxInt32

// vendorLimits is what a vendor's response says about its rate limit. Every
// duration lies in [0, maxHeard], rounded up: waiting a little too long costs
// a little of the quota, calling too early costs a 429.
type vendorLimits struct {
	// retryAfter is the Retry-After header (or OpenAI's retry-after-ms),
	// when hasRetryAfter.
	retryAfter    time.Duration
	hasRetryAfter bool
	// remaining is the fewest requests, or units of no stated kind, the
	// vendor said are left under any of its limits, or -1 when it said
	// nothing.
	remaining int
	// reset is how long until the window of that limit resets, or 0 when
	// unknown.
	reset time.Duration
	// limit is that limit's size, when the vendor said it, or 0.
	limit int
	// tokens and tokensReset are the same for the vendor's limits on
	// tokens (OpenAI's -tokens headers, Anthropic's tokens, input-tokens
	// and output-tokens), when hasTokens.
	tokens      int
	tokensReset time.Duration
	hasTokens   bool
	// units are the vendor's counts of named kinds of tokens (Anthropic's
	// input and output tokens), by the names a policies.Unit gives them:
	// "input_tokens", "output_tokens".
	units map[string]Count
	// noRetry reports a vendor that said the call must not be sent again
	// (Stripe-Should-Retry: false).
	noRetry bool
	// scope is what a refusal is about, when the vendor said so: Discord's
	// X-RateLimit-Scope (user, global, shared), GitHub's
	// x-ratelimit-resource (core, search, graphql).
	scope string
	// resource is GitHub's x-ratelimit-resource, in lower case: the limit
	// the answer's counts are about (core, search, code_search, graphql).
	resource string
	// about is whether the vendor said a refusal is about its rate:
	// Stripe-Rate-Limited-Reason, or an error code of the body (bodyAbout).
	about refusalAbout
}

// refusalAbout is what a vendor's documented reason says a refusal is
// about: only one about its rate teaches the quota a cap.
type refusalAbout int

const (
	aboutNothingSaid refusalAbout = iota // no reason given, or none the Transport reads
	aboutTheRate                         // its rate limit
	aboutConcurrency                     // its limit of calls in flight
	aboutOther                           // a lock, a concurrency limit, a billing quota, a secondary limit
)

// stripeAbout reads Stripe-Rate-Limited-Reason: its rate limiters, global
// and per endpoint, or one of the others (concurrency, a resource's own).
// A reason Stripe adds later is taken for one of the others.
func stripeAbout(s string) refusalAbout {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "":
		return aboutNothingSaid
	case "global-rate", "endpoint-rate":
		return aboutTheRate
	case "global-concurrency", "endpoint-concurrency":
		return aboutConcurrency
	}
	return aboutOther
}

// bodyAbout reads the reason of a refusal from its JSON body: OpenAI's
// error code rate_limit_exceeded, or insufficient_quota (a bill, in its
// code or type); Stripe's lock_timeout (an object another request holds);
// GitHub's message of a secondary rate limit; Twilio's code 20429.
func bodyAbout(body []byte) refusalAbout {
	var b struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
		Code    any             `json:"code"`
	}
	if json.Unmarshal(body, &b) != nil {
		return aboutNothingSaid
	}
	if b.Code == float64(20429) {
		return aboutConcurrency // Twilio's: over the account's calls in flight
	}
	var e struct{ Code, Type any }
	_ = json.Unmarshal(b.Error, &e)
	code, _ := e.Code.(string)
	typ, _ := e.Type.(string)
	switch {
	case code == "rate_limit_exceeded":
		return aboutTheRate
	case code == "insufficient_quota" || typ == "insufficient_quota" || code == "lock_timeout":
		return aboutOther
	case strings.Contains(strings.ToLower(b.Message), "secondary rate limit"):
		return aboutOther
	}
	return aboutNothingSaid
}

// note keeps the tightest of the limits seen: the fewest units left, and for
// equal counts the later reset.
func (v *vendorLimits) note(remaining int, reset time.Duration, limit int) {
	if remaining < 0 {
		return
	}
	if v.remaining < 0 || remaining < v.remaining || remaining == v.remaining && reset > v.reset {
		v.remaining, v.reset, v.limit = remaining, reset, limit
	}
}

// noteTokens is note for a limit on tokens.
func (v *vendorLimits) noteTokens(remaining int, reset time.Duration) {
	if remaining < 0 {
		return
	}
	if !v.hasTokens || remaining < v.tokens || remaining == v.tokens && reset > v.tokensReset {
		v.tokens, v.tokensReset, v.hasTokens = remaining, reset, true
	}
}

// parseVendorLimits reads the rate-limit headers vendors send:
//
//   - Retry-After, in delta seconds (fractions too, as Shopify sends) or as
//     an HTTP date (RFC 9110), and OpenAI's retry-after-ms;
//   - X-RateLimit-Remaining with X-RateLimit-Limit and X-RateLimit-Reset
//     (GitHub, Discord, Twitter's X-Rate-Limit-*, Zendesk's
//     ratelimit-*), the reset in delta seconds, epoch seconds (fractions
//     too, as Discord sends) or epoch milliseconds, told apart by size, or
//     X-RateLimit-Reset-After in delta seconds; x-ratelimit-resource
//     (GitHub) and X-RateLimit-Scope (Discord) as the refusal's scope;
//   - OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}, the
//     resets as durations ("1s", "6m0s", "850ms");
//   - Anthropic's anthropic-ratelimit-{requests,tokens,input-tokens,
//     output-tokens}-{limit,remaining,reset}, the resets in RFC 3339;
//   - Shopify's X-Shopify-Shop-Api-Call-Limit ("32/40": used of the
//     bucket) and Salesforce's Sforce-Limit-Info ("api-usage=18/5000");
//   - Stripe-Should-Retry and Stripe-Rate-Limited-Reason;
//   - the IETF headers of draft-ietf-httpapi-ratelimit-headers: the
//     structured RateLimit ("default";r=0;t=30, several limits in a list)
//     with RateLimit-Policy ("default";q=100;w=60), the dictionary of draft 07
//     (limit=100, remaining=0, reset=30), and the separate RateLimit-Remaining
//     and RateLimit-Reset of the earlier drafts.
//
// A value it cannot read is ignored, never an error: a vendor's header must
// not make a call fail. now is the time to measure HTTP dates and epochs
// from.
func parseVendorLimits(h http.Header, now time.Time) vendorLimits {
	v := vendorLimits{remaining: -1}
	for _, s := range h.Values("Retry-After") {
		if d, ok := parseRetryAfter(s, now); ok {
			v.retryAfter = max(v.retryAfter, d)
			v.hasRetryAfter = true
		}
	}
	if ms, ok := parseNumber(strings.TrimSpace(h.Get("Retry-After-Ms"))); ok {
		v.retryAfter = max(v.retryAfter, secondsCeil(ms/1000))
		v.hasRetryAfter = true
	}
	for _, prefix := range []string{"X-RateLimit-", "X-Rate-Limit-", "RateLimit-"} {
		remaining, ok := parseRemaining(h.Values(prefix + "Remaining"))
		if !ok {
			continue
		}
		reset, _ := parseReset(h.Get(prefix+"Reset"), now)
		if after, ok := parseSeconds(h.Get(prefix + "Reset-After")); ok {
			reset = max(reset, after)
		}
		limit, _ := parseRemaining(h.Values(prefix + "Limit"))
		v.note(remaining, reset, limit)
	}
	for _, name := range []string{"X-RateLimit-Scope", "X-RateLimit-Resource"} {
		if s := strings.ToLower(strings.TrimSpace(h.Get(name))); s != "" {
			v.scope = s
		}
	}
	v.resource = strings.ToLower(strings.TrimSpace(h.Get("X-RateLimit-Resource")))
	parseTwoKinds(h, &v, now)
	parseUsedOf(h, &v)
	if s := strings.ToLower(strings.TrimSpace(h.Get("Stripe-Should-Retry"))); s == "false" {
		v.noRetry = true
	}
	parseRateLimitField(h, &v)
	v.about = stripeAbout(h.Get("Stripe-Rate-Limited-Reason"))
	return v
}

// parseTwoKinds reads the headers of the LLM APIs, which count requests and
// tokens apart: OpenAI's x-ratelimit-*-requests and -tokens, with resets
// as durations, and Anthropic's anthropic-ratelimit-*, with resets in RFC
// 3339.
func parseTwoKinds(h http.Header, v *vendorLimits, now time.Time) {
	for _, kind := range []string{"requests", "tokens"} {
		remaining, ok := parseRemaining(h.Values("X-Ratelimit-Remaining-" + kind))
		if !ok {
			continue
		}
		reset, _ := parseSeconds(h.Get("X-Ratelimit-Reset-" + kind))
		if kind == "requests" {
			limit, _ := parseRemaining(h.Values("X-Ratelimit-Limit-" + kind))
			v.note(remaining, reset, limit)
		} else {
			v.noteTokens(remaining, reset)
		}
	}
	for _, kind := range []string{"requests", "tokens", "input-tokens", "output-tokens"} {
		prefix := "Anthropic-Ratelimit-" + kind + "-"
		remaining, ok := parseRemaining(h.Values(prefix + "Remaining"))
		if !ok {
			continue
		}
		var reset time.Duration
		if t, err := time.Parse(time.RFC3339, strings.TrimSpace(h.Get(prefix+"Reset"))); err == nil {
			reset = untilCeil(t, now)
		}
		limit, _ := parseRemaining(h.Values(prefix + "Limit"))
		switch kind {
		case "requests":
			v.note(remaining, reset, limit)
		case "input-tokens", "output-tokens":
			if v.units == nil {
				v.units = map[string]Count{}
			}
			v.units[strings.ReplaceAll(kind, "-", "_")] = Count{Remaining: remaining, Reset: reset, Limit: limit}
			fallthrough
		default:
			v.noteTokens(remaining, reset)
		}
	}
}

// parseUsedOf reads the headers that give the units used of a limit:
// Shopify's X-Shopify-Shop-Api-Call-Limit ("32/40") and Salesforce's
// Sforce-Limit-Info ("api-usage=18/5000"). Neither says when units come
// back.
func parseUsedOf(h http.Header, v *vendorLimits) {
	usedOf := func(s string) {
		used, limit, ok := strings.Cut(strings.TrimSpace(s), "/")
		if !ok {
			return
		}
		u, ok1 := parseCount(used)
		l, ok2 := parseCount(limit)
		if ok1 && ok2 {
			v.note(max(l-u, 0), 0, l)
		}
	}
	if s := h.Get("X-Shopify-Shop-Api-Call-Limit"); s != "" {
		usedOf(s)
	}
	for part := range strings.SplitSeq(h.Get("Sforce-Limit-Info"), ",") {
		if k, val, ok := strings.Cut(part, "="); ok && strings.EqualFold(strings.TrimSpace(k), "api-usage") {
			usedOf(val)
		}
	}
}

// parseRetryAfter reads a Retry-After value: delta seconds (fractions
// accepted, though the RFC has none) or an HTTP date. A date in the past is
// 0; a date's distance is rounded up to whole seconds, its resolution.
func parseRetryAfter(s string, now time.Time) (time.Duration, bool) {
	s = strings.TrimSpace(s)
	if d, ok := parseSeconds(s); ok {
		return d, true
	}
	t, err := http.ParseTime(s)
	if err != nil {
		return 0, false
	}
	return untilCeil(t, now), true
}

// parseReset reads the reset of an X-RateLimit-Reset style header. Vendors
// send delta seconds (Twitch, the IETF drafts), epoch seconds (GitHub) or
// epoch milliseconds; a delta of 1e9 seconds is 31 years, so any larger
// value is an epoch, and past 1e12 one in milliseconds.
func parseReset(s string, now time.Time) (time.Duration, bool) {
	s = strings.TrimSpace(s)
	f, ok := parseNumber(s)
	if !ok {
		return parseSeconds(s)
	}
	switch {
	case f > 1e12:
		ms := math.Ceil(f)
		if ms >= 1e15 { // past the year 33000: never
			return maxHeard, true
		}
		return untilCeil(time.UnixMilli(int64(ms)), now), true
	case f > 1e9:
		return untilCeil(time.Unix(int64(math.Ceil(f)), 0), now), true
	}
	return secondsCeil(f), true
}

// parseRemaining reads a remaining count: the smallest non-negative integer
// among the values, or false when none is one.
func parseRemaining(values []string) (int, bool) {
	n, found := 0, false
	for _, s := range values {
		// Some vendors repeat the count for several limits in one field.
		for part := range strings.SplitSeq(s, ",") {
			r, ok := parseCount(part)
			if ok && (!found || r < n) {
				n, found = r, true
			}
		}
	}
	return n, found
}

// parseCount reads a non-negative integer, capped at maxRemaining.
func parseCount(s string) (int, bool) {
	s = strings.TrimSpace(s)
	if s == "" || strings.Trim(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n > maxRemaining {
		// All digits, so only too large to parse: plenty left.
		return maxRemaining, true
	}
	return int(n), true
}

// parseSeconds reads a duration in seconds ("30", "1.5"), or a Go-style
// duration with units ("6m0s", "250ms") as some LLM APIs send, rounded up to
// the microsecond and capped at maxHeard.
func parseSeconds(s string) (time.Duration, bool) {
	s = strings.TrimSpace(s)
	if f, ok := parseNumber(s); ok {
		return secondsCeil(f), true
	}
	if s == "" || s[0] < '0' || s[0] > '9' {
		return 0, false
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, false
	}
	if d >= maxHeard {
		return maxHeard, true
	}
	// Rounded up to the microsecond, as seconds are.
	return (d + time.Microsecond - 1).Truncate(time.Microsecond), true
}

// parseNumber reads an unsigned decimal number: digits, with at most one
// point between digits. It refuses the signs, exponents, hex forms, NaN and
// infinities that strconv.ParseFloat would take.
func parseNumber(s string) (float64, bool) {
	intPart, frac, hasPoint := strings.Cut(s, ".")
	if intPart == "" || strings.Trim(intPart, "0123456789") != "" {
		return 0, false
	}
	if hasPoint && (frac == "" || strings.Trim(frac, "0123456789") != "") {
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		// Only out of range is left, for hundreds of digits.
		return math.MaxFloat64, true
	}
	return f, true
}

// secondsCeil turns seconds into a duration rounded up to the microsecond,
// capped at maxHeard.
func secondsCeil(f float64) time.Duration {
	if f >= maxHeard.Seconds() {
		return maxHeard
	}
	return time.Duration(math.Ceil(f*1e6)) * time.Microsecond
}

// untilCeil is the time from now until t, rounded up to whole seconds (the
// resolution of HTTP dates and epochs in seconds), within [0, maxHeard].
func untilCeil(t, now time.Time) time.Duration {
	d := t.Sub(now)
	if d <= 0 {
		return 0
	}
	if d >= maxHeard {
		return maxHeard
	}
	return (d + time.Second - 1).Truncate(time.Second)
}

// parseRateLimitField reads the IETF RateLimit field in both of its shapes:
// a list of limits with parameters ("hour";r=100;t=3000, "minute";r=0;t=30)
// and the older dictionary (limit=100, remaining=0, reset=30). A limit with
// r but no t waits the window w of its RateLimit-Policy, the longest its
// count can take to come back.
func parseRateLimitField(h http.Header, v *vendorLimits) {
	field := strings.Join(h.Values("RateLimit"), ",")
	if strings.TrimSpace(field) == "" {
		return
	}
	windows, quotas := map[string]time.Duration{}, map[string]int{}
	for _, m := range sfList(strings.Join(h.Values("RateLimit-Policy"), ",")) {
		if w, ok := parseSeconds(m.params["w"]); ok {
			windows[m.item] = w
		}
		if q, ok := parseCount(m.params["q"]); ok {
			quotas[m.item] = q
		}
	}
	dict := vendorLimits{remaining: -1}
	var dictReset time.Duration
	var dictLimit int
	for _, m := range sfList(field) {
		if key, val, ok := strings.Cut(m.item, "="); ok {
			// A dictionary member of draft 07.
			switch strings.ToLower(strings.TrimSpace(key)) {
			case "remaining":
				if n, ok := parseCount(val); ok {
					dict.note(n, 0, 0)
				}
			case "limit":
				dictLimit, _ = parseCount(val)
			case "reset":
				dictReset, _ = parseSeconds(val)
			}
			continue
		}
		r, ok := parseCount(m.params["r"])
		if !ok {
			continue
		}
		reset, ok := parseSeconds(m.params["t"])
		if !ok {
			reset = windows[m.item]
		}
		v.note(r, reset, quotas[m.item])
	}
	if dict.remaining >= 0 {
		v.note(dict.remaining, dictReset, dictLimit)
	}
}

// sfMember is one member of a structured field list (RFC 8941): its bare
// item, unquoted, and its parameters, with lower-case keys.
type sfMember struct {
	item   string
	params map[string]string
}

// sfList splits a structured field list leniently: members at commas and
// parameters at semicolons outside quoted strings, quotes removed. Inner
// lists and byte sequences are kept as text; a caller that finds nothing it
// understands in a member ignores it.
func sfList(s string) []sfMember {
	var out []sfMember
	for _, member := range splitOutsideQuotes(s, ',') {
		parts := splitOutsideQuotes(member, ';')
		m := sfMember{item: unquote(parts[0]), params: map[string]string{}}
		for _, p := range parts[1:] {
			key, val, ok := strings.Cut(p, "=")
			key = strings.ToLower(strings.TrimSpace(key))
			if !ok {
				val = "?1" // a bare parameter is boolean true
			}
			if _, dup := m.params[key]; !dup {
				m.params[key] = unquote(val)
			}
		}
		if m.item != "" || len(m.params) > 0 {
			out = append(out, m)
		}
	}
	return out
}

// splitOutsideQuotes splits s at sep where it is not inside a quoted string;
// a backslash escapes the next character inside quotes.
func splitOutsideQuotes(s string, sep byte) []string {
	var parts []string
	start, quoted := 0, false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case quoted && c == '\\':
			i++
		case c == '"':
			quoted = !quoted
		case !quoted && c == sep:
			parts = append(parts, s[start:i])
			start = i + 1
		}
	}
	return append(parts, s[start:])
}

// unquote trims s and removes the quotes of a quoted string, undoing its
// escapes.
func unquote(s string) string {
	s = strings.TrimSpace(s)
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return s
	}
	var b strings.Builder
	for i := 1; i < len(s)-1; i++ {
		if s[i] == '\\' && i+1 < len(s)-1 {
			i++
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
