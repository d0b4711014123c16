package throttle

import (
	"net/http"
	"reflect"
	"strconv"
	"testing"
	"time"
)

// headerNow is a fixed "now" with a fraction of a second, so that rounding
// up to whole seconds shows.
var headerNow = time.Date(2025, 3, 1, 12, 0, 0, 300_000_000, time.UTC)

func TestHeader_RetryAfter(t *testing.T) {
	tests := []struct {
		in     string
		want   time.Duration
		wantOK bool
	}{
		{"120", 120 * time.Second, true},
		{" 7 ", 7 * time.Second, true},
		{"0", 0, true},
		{"1.2", 1200 * time.Millisecond, true},
		{"0.0000001", time.Microsecond, true}, // rounded up, never down
		{"999999999", maxPause, true},
		{"99999999999999999999999999999999", maxPause, true},
		// An HTTP date 2.7s after now waits 3s: whole seconds, rounded up.
		{"Sat, 01 Mar 2025 12:00:03 GMT", 3 * time.Second, true},
		{"Saturday, 01-Mar-25 12:00:03 GMT", 3 * time.Second, true}, // RFC 850
		{"Sat Mar  1 12:00:03 2025", 3 * time.Second, true},         // ANSI C
		{"Sat, 01 Mar 2025 11:00:00 GMT", 0, true},                  // in the past
		{"Sun, 01 Mar 2026 12:00:00 GMT", maxPause, true},
		{"", 0, false},
		{"-5", 0, false},
		{"+5", 0, false},
		{"1e3", 0, false},
		{"0x10", 0, false},
		{"NaN", 0, false},
		{"Inf", 0, false},
		{"1.", 0, false},
		{".5", 0, false},
		{"soon", 0, false},
	}
	for _, tt := range tests {
		got, ok := parseRetryAfter(tt.in, headerNow)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("parseRetryAfter(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestHeader_Reset(t *testing.T) {
	epoch := headerNow.Unix() // whole seconds, 0.3s before now
	tests := []struct {
		in     string
		want   time.Duration
		wantOK bool
	}{
		{"30", 30 * time.Second, true}, // delta seconds
		{"0", 0, true},
		{"2.5", 2500 * time.Millisecond, true},
		{itoa(epoch + 60), 60 * time.Second, true}, // epoch seconds: 59.7s, rounded up
		{itoa(epoch - 60), 0, true},                // epoch in the past
		{itoa(epoch*1000 + 60_000), 60 * time.Second, true},
		{itoa(epoch + 1e7), maxPause, true},
		{"1000000001", 0, true}, // just past the cut: an epoch, long gone
		{"999999999", maxPause, true},
		{"6m0s", 6 * time.Minute, true}, // as some LLM APIs send it
		{"250ms", 250 * time.Millisecond, true},
		{"9999999h", 0, false}, // past what time.Duration holds
		{"-1", 0, false},
		{"ms", 0, false},
		{"", 0, false},
	}
	for _, tt := range tests {
		got, ok := parseReset(tt.in, headerNow)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("parseReset(%q) = %v, %v; want %v, %v", tt.in, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestHeader_VendorLimits(t *testing.T) {
	epoch := headerNow.Unix()
	tests := []struct {
		name   string
		header map[string][]string
		want   vendorLimits
	}{
		{"none", nil, vendorLimits{remaining: -1}},
		{"retry after", h("Retry-After", "3"), vendorLimits{retryAfter: 3 * time.Second, hasRetryAfter: true, remaining: -1}},
		{"retry after zero", h("Retry-After", "0"), vendorLimits{hasRetryAfter: true, remaining: -1}},
		{"retry after garbage", h("Retry-After", "later"), vendorLimits{remaining: -1}},
		{"two retry afters, the longer", h("Retry-After", "2", "Retry-After", "5"), vendorLimits{retryAfter: 5 * time.Second, hasRetryAfter: true, remaining: -1}},
		{"GitHub", h("X-RateLimit-Remaining", "0", "X-RateLimit-Reset", itoa(epoch+42)),
			vendorLimits{remaining: 0, reset: 42 * time.Second}},
		{"remaining without reset", h("X-RateLimit-Remaining", "17"), vendorLimits{remaining: 17}},
		{"reset without remaining", h("X-RateLimit-Reset", "30"), vendorLimits{remaining: -1}},
		{"Twitter", h("X-Rate-Limit-Remaining", "0", "X-Rate-Limit-Reset", itoa(epoch+10)),
			vendorLimits{remaining: 0, reset: 10 * time.Second}},
		{"Discord reset after", h("X-RateLimit-Remaining", "0", "X-RateLimit-Reset-After", "1.234"),
			vendorLimits{remaining: 0, reset: 1234 * time.Millisecond}},
		{"remaining garbage", h("X-RateLimit-Remaining", "-3"), vendorLimits{remaining: -1}},
		{"remaining huge", h("X-RateLimit-Remaining", "99999999999999999999"), vendorLimits{remaining: maxRemaining}},
		{"IETF draft 03", h("RateLimit-Limit", "100", "RateLimit-Remaining", "0", "RateLimit-Reset", "30"),
			vendorLimits{remaining: 0, reset: 30 * time.Second, limit: 100}},
		{"IETF draft 07 dictionary", h("RateLimit", "limit=100, remaining=4, reset=9"),
			vendorLimits{remaining: 4, reset: 9 * time.Second, limit: 100}},
		{"IETF structured", h("RateLimit", `"default";r=0;t=30`, "RateLimit-Policy", `"default";q=100;w=60`),
			vendorLimits{remaining: 0, reset: 30 * time.Second, limit: 100}},
		{"IETF structured, token name", h("RateLimit", `default;r=5;t=2`), vendorLimits{remaining: 5, reset: 2 * time.Second}},
		{"IETF structured, the tightest limit", h("RateLimit", `"hour";r=100;t=3000, "minute";r=0;t=30`),
			vendorLimits{remaining: 0, reset: 30 * time.Second}},
		{"IETF structured, two fields", h("RateLimit", `"hour";r=0;t=3000`, "RateLimit", `"minute";r=0;t=30`),
			vendorLimits{remaining: 0, reset: 3000 * time.Second}},
		{"IETF structured, no t: the policy's window", h("RateLimit", `"burst";r=0`, "RateLimit-Policy", `"burst";q=10;w=1, "day";q=1000;w=86400`),
			vendorLimits{remaining: 0, reset: time.Second, limit: 10}},
		{"IETF structured, partition key", h("RateLimit", `"default";r=3;t=5;pk=:dXNlcjE=:`), vendorLimits{remaining: 3, reset: 5 * time.Second}},
		{"IETF structured, quoted comma", h("RateLimit", `"a,b";r=1;t=2`), vendorLimits{remaining: 1, reset: 2 * time.Second}},
		{"IETF structured, garbage", h("RateLimit", `;;,,"unterminated;r=0`), vendorLimits{remaining: -1}},
		{"all at once, the fewest left", h("Retry-After", "1", "X-RateLimit-Remaining", "3", "RateLimit", `"q";r=1;t=4`),
			vendorLimits{retryAfter: time.Second, hasRetryAfter: true, remaining: 1, reset: 4 * time.Second}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hdr := http.Header{}
			for k, vs := range tt.header {
				for _, v := range vs {
					hdr.Add(k, v)
				}
			}
			if got := parseVendorLimits(hdr, headerNow); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("parseVendorLimits(%v) = %+v, want %+v", hdr, got, tt.want)
			}
		})
	}
}

// h builds a header map from name, value pairs; a name may repeat.
func h(kv ...string) map[string][]string {
	m := map[string][]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = append(m[kv[i]], kv[i+1])
	}
	return m
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// checkBounded fails when a parsed duration is negative or past maxPause.
func checkBounded(t *testing.T, what string, d time.Duration) {
	t.Helper()
	if d < 0 || d > maxPause {
		t.Fatalf("%s = %v, want within [0, %v]", what, d, maxPause)
	}
}

func FuzzRetryAfter(f *testing.F) {
	for _, s := range []string{
		"0", "1", "120", "1.5", "999999999", "99999999999999999999999", "-1", "",
		"Sat, 01 Mar 2025 12:00:03 GMT", "Saturday, 01-Mar-25 12:00:03 GMT", "Sat Mar  1 12:00:03 2025",
		"Fri, 31 Dec 9999 23:59:59 GMT", "Mon, 01 Jan 0001 00:00:00 GMT", "1e9", "NaN", "6m0s",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, ok := parseRetryAfter(s, headerNow)
		checkBounded(t, "Retry-After "+s, d)
		if !ok && d != 0 {
			t.Fatalf("parseRetryAfter(%q) = %v but not ok", s, d)
		}
		d, _ = parseReset(s, headerNow)
		checkBounded(t, "reset "+s, d)
	})
}

func FuzzRateLimitHeaders(f *testing.F) {
	f.Add("1", "0", "1740830460", `"default";r=0;t=30`, `"default";q=100;w=60`)
	f.Add("", "17", "30", "limit=100, remaining=4, reset=9", "")
	f.Add("Sat, 01 Mar 2025 12:00:03 GMT", "", "", `"hour";r=100;t=3000, "minute";r=0;t=30`, `"minute";q=10;w=60`)
	f.Add("-1", "-1", "-1", `"a,b";r=1;t=2;pk=:dXNlcjE=:`, `;;,,`)
	f.Add("99999999999", "99999999999999999999", "99999999999999", `x;r=99999999999999999999;t=1e9`, `x;w=999999999999`)
	f.Add("0", "0", "6m0s", `"unterminated;r=0`, `"q\";r=";w=5`)
	f.Fuzz(func(t *testing.T, retryAfter, remaining, reset, rateLimit, policy string) {
		hdr := http.Header{}
		hdr.Set("Retry-After", retryAfter)
		hdr.Set("X-RateLimit-Remaining", remaining)
		hdr.Set("X-RateLimit-Reset", reset)
		hdr.Set("RateLimit-Remaining", remaining)
		hdr.Set("RateLimit-Reset", reset)
		hdr.Set("RateLimit", rateLimit)
		hdr.Set("RateLimit-Policy", policy)
		v := parseVendorLimits(hdr, headerNow)
		checkBounded(t, "retryAfter", v.retryAfter)
		checkBounded(t, "reset", v.reset)
		if v.remaining < -1 || v.remaining > maxRemaining {
			t.Fatalf("remaining = %d, want -1 or within [0, %d]", v.remaining, maxRemaining)
		}
		if v.remaining == -1 && v.reset != 0 {
			t.Fatalf("reset %v with no remaining count", v.reset)
		}
	})
}
