package throttle

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxRemaining bounds a remaining count read from a header, so that a
// garbled value cannot overflow the arithmetic of the scripts.
const maxRemaining = math.MaxInt32

// vendorLimits is what a vendor's response says about its rate limit. Every
// duration lies in [0, MaxPause], rounded up: waiting a little too long costs
// a little of the quota, calling too early costs a 429.
type vendorLimits struct {
	// retryAfter is the Retry-After header, when hasRetryAfter.
	retryAfter    time.Duration
	hasRetryAfter bool
	// remaining is the fewest units the vendor said are left under any of
	// its limits, or -1 when it said nothing.
	remaining int
	// reset is how long until the window of that limit resets, or 0 when
	// unknown.
	reset time.Duration
}

// note keeps the tightest of the limits seen: the fewest units left, and for
// equal counts the later reset.
func (v *vendorLimits) note(remaining int, reset time.Duration) {
	if remaining < 0 {
		return
	}
	if v.remaining < 0 || remaining < v.remaining || remaining == v.remaining && reset > v.reset {
		v.remaining, v.reset = remaining, reset
	}
}

// parseVendorLimits reads the rate-limit headers vendors send:
//
//   - Retry-After, in delta seconds or as an HTTP date (RFC 9110);
//   - X-RateLimit-Remaining with X-RateLimit-Reset (GitHub, Twitter's
//     X-Rate-Limit-*), the reset in delta seconds, epoch seconds or epoch
//     milliseconds, told apart by size, or X-RateLimit-Reset-After in delta
//     seconds;
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
	for _, prefix := range []string{"X-RateLimit-", "X-Rate-Limit-", "RateLimit-"} {
		remaining, ok := parseRemaining(h.Values(prefix + "Remaining"))
		if !ok {
			continue
		}
		reset, _ := parseReset(h.Get(prefix+"Reset"), now)
		if after, ok := parseSeconds(h.Get(prefix + "Reset-After")); ok {
			reset = max(reset, after)
		}
		v.note(remaining, reset)
	}
	parseRateLimitField(h, &v)
	return v
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
			return MaxPause, true
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
// the microsecond and capped at MaxPause.
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
	if d >= MaxPause {
		return MaxPause, true
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
// capped at MaxPause.
func secondsCeil(f float64) time.Duration {
	if f >= MaxPause.Seconds() {
		return MaxPause
	}
	return time.Duration(math.Ceil(f*1e6)) * time.Microsecond
}

// untilCeil is the time from now until t, rounded up to whole seconds (the
// resolution of HTTP dates and epochs in seconds), within [0, MaxPause].
func untilCeil(t, now time.Time) time.Duration {
	d := t.Sub(now)
	if d <= 0 {
		return 0
	}
	if d >= MaxPause {
		return MaxPause
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
	windows := map[string]time.Duration{}
	for _, m := range sfList(strings.Join(h.Values("RateLimit-Policy"), ",")) {
		if w, ok := parseSeconds(m.params["w"]); ok {
			windows[m.item] = w
		}
	}
	dict := vendorLimits{remaining: -1}
	var dictReset time.Duration
	for _, m := range sfList(field) {
		if key, val, ok := strings.Cut(m.item, "="); ok {
			// A dictionary member of draft 07.
			switch strings.ToLower(strings.TrimSpace(key)) {
			case "remaining":
				if n, ok := parseCount(val); ok {
					dict.note(n, 0)
				}
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
		v.note(r, reset)
	}
	if dict.remaining >= 0 {
		v.note(dict.remaining, dictReset)
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
