// The bounds tested here (a SlidingCounter's Limit of 1<<40) need a 64-bit
// int; the package itself builds on 32-bit platforms too.

//go:build !(386 || arm || mips || mipsle)

package policies

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

// The package's constants are part of its promise: the tests below compare
// against literal values, not against the constants themselves, so that a
// change of the constants' arithmetic shows.
func TestConstants(t *testing.T) {
	tests := []struct {
		name      string
		got, want any
	}{
		{"DefaultMargin", DefaultMargin, time.Duration(30_000_000)},
		{"MaxMarginCeiling", MaxMarginCeiling, time.Duration(1_000_000_000)},
		{"MinWindow", MinWindow, time.Duration(1_000_000)},
		{"MaxWindow", MaxWindow, time.Duration(31_622_400_000_000_000)},
		{"MaxLogLimit", MaxLogLimit, 100_000},
		{"DefaultBuckets", DefaultBuckets, 10},
		{"MaxBuckets", MaxBuckets, 1000},
		{"DefaultLease", DefaultLease, time.Duration(60_000_000_000)},
		{"KindSlidingLog", KindSlidingLog, Kind(1)},
		{"KindSlidingCounter", KindSlidingCounter, Kind(2)},
		{"KindTokenBucket", KindTokenBucket, Kind(3)},
		{"KindConcurrency", KindConcurrency, Kind(4)},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %v, want %v", tt.name, tt.got, tt.want)
		}
	}
}

// validateCase is one policy and what Validate says of it: nil wantErr means
// valid; otherwise every string in wantErr must appear in the error.
type validateCase struct {
	name    string
	p       Policy
	wantErr []string
}

func runValidate(t *testing.T, tests []validateCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.p.Validate()
			rules, rerr := Rules(tt.p)
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				if rerr != nil {
					t.Fatalf("Rules() error = %v, want nil", rerr)
				}
				if len(rules) == 0 {
					t.Fatalf("Rules() = no rules for a valid policy")
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want an error containing %q", tt.wantErr)
			}
			for _, s := range tt.wantErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("Validate() = %q, want it to contain %q", err, s)
				}
			}
			if !strings.HasPrefix(err.Error(), "policies: ") {
				t.Errorf("Validate() = %q, want the prefix %q", err, "policies: ")
			}
			if rerr == nil || rerr.Error() != err.Error() {
				t.Errorf("Rules() error = %v, want %v", rerr, err)
			}
			if rules != nil {
				t.Errorf("Rules() = %v with an error, want nil", rules)
			}
		})
	}
}

// got formats the value an error message must quote after "got ".
func got(v any) string { return "got " + fmt.Sprint(v) }

const (
	ns   = time.Nanosecond
	us   = time.Microsecond
	maxW = 366 * 24 * time.Hour
)

func TestSlidingLogValidate(t *testing.T) {
	sl := func(limit int, window, margin time.Duration) SlidingLog {
		return SlidingLog{Limit: limit, Window: window, Margin: margin}
	}
	runValidate(t, []validateCase{
		{"typical", sl(10, time.Second, 0), nil},
		// Limit.
		{"limit -1", sl(-1, time.Second, 0), []string{"SlidingLog.Limit", got(-1)}},
		{"limit 0", sl(0, time.Second, 0), []string{"SlidingLog.Limit", "> 0", got(0)}},
		{"limit 1", sl(1, time.Second, 0), nil},
		{"limit max", sl(100_000, time.Second, 0), nil},
		{"limit max+1", sl(100_001, time.Second, 0), []string{"SlidingLog.Limit", "at most 100000", got(100_001)}},
		// Window.
		{"window 0", sl(10, 0, 0), []string{"SlidingLog.Window", got(time.Duration(0))}},
		{"window -1ns", sl(10, -ns, 0), []string{"SlidingLog.Window", got(-ns)}},
		{"window min-1ns", sl(10, time.Millisecond-ns, 0), []string{"SlidingLog.Window", "between 1ms and 8784h0m0s", got(999_999 * ns)}},
		{"window min", sl(10, time.Millisecond, 0), nil},
		{"window max", sl(10, maxW, 0), nil},
		{"window max+1ns", sl(10, maxW+ns, 0), []string{"SlidingLog.Window", got(maxW + ns)}},
		// Margin.
		{"margin -1ns", sl(10, time.Second, -ns), []string{"SlidingLog.Margin", "negative", got(-ns)}},
		{"margin 0", sl(10, time.Second, 0), nil},
		{"margin 1ns", sl(10, time.Second, ns), nil},
		{"margin window", sl(10, time.Second, time.Second), nil},
		{"margin window+1ns", sl(10, time.Second, time.Second+ns), []string{"SlidingLog.Margin", "Window 1s", got(time.Second + ns)}},
		{"margin min window", sl(10, time.Millisecond, time.Millisecond), nil},
		{"margin max window", sl(10, maxW, maxW), nil},
	})
}

func TestSlidingCounterValidate(t *testing.T) {
	sc := func(limit int, window time.Duration, buckets int, margin time.Duration) SlidingCounter {
		return SlidingCounter{Limit: limit, Window: window, Buckets: buckets, Margin: margin}
	}
	runValidate(t, []validateCase{
		{"typical", sc(50_000, time.Minute, 0, 0), nil},
		// Limit.
		{"limit -1", sc(-1, time.Second, 0, 0), []string{"SlidingCounter.Limit", got(-1)}},
		{"limit 0", sc(0, time.Second, 0, 0), []string{"SlidingCounter.Limit", "> 0", got(0)}},
		{"limit 1", sc(1, time.Second, 0, 0), nil},
		{"limit above log max", sc(100_001, time.Second, 0, 0), nil},
		{"limit max", sc(1<<40, time.Second, 0, 0), nil},
		{"limit max+1", sc(1<<40+1, time.Second, 0, 0), []string{"SlidingCounter.Limit", "at most 1099511627776", got(1<<40 + 1)}},
		// Window.
		{"window 0", sc(10, 0, 0, 0), []string{"SlidingCounter.Window", got(time.Duration(0))}},
		{"window min-1ns", sc(10, time.Millisecond-ns, 0, 0), []string{"SlidingCounter.Window", "between 1ms and 8784h0m0s", got(999_999 * ns)}},
		{"window min", sc(10, time.Millisecond, 0, 0), nil},
		{"window max", sc(10, maxW, 0, 0), nil},
		{"window max+1ns", sc(10, maxW+ns, 0, 0), []string{"SlidingCounter.Window", got(maxW + ns)}},
		// Buckets.
		{"buckets -1", sc(10, time.Second, -1, 0), []string{"SlidingCounter.Buckets", "between 0 and 1000", got(-1)}},
		{"buckets 0", sc(10, time.Second, 0, 0), nil},
		{"buckets 1", sc(10, time.Second, 1, 0), nil},
		{"buckets max", sc(10, time.Second, 1000, 0), nil},
		{"buckets max+1", sc(10, time.Second, 1001, 0), []string{"SlidingCounter.Buckets", got(1001)}},
		// Margin.
		{"margin -1ns", sc(10, time.Second, 0, -ns), []string{"SlidingCounter.Margin", got(-ns)}},
		{"margin 0", sc(10, time.Second, 0, 0), nil},
		{"margin 1ns", sc(10, time.Second, 0, ns), nil},
		{"margin window", sc(10, time.Second, 0, time.Second), nil},
		{"margin window+1ns", sc(10, time.Second, 0, time.Second+ns), []string{"SlidingCounter.Margin", "Window 1s", got(time.Second + ns)}},
		// The shortest bucket: MinWindow / MaxBuckets is exactly 1µs, so
		// every window and bucket count the other checks accept is long enough.
		{"min window max buckets", sc(10, time.Millisecond, 1000, 0), nil},
		{"min window default buckets", sc(10, time.Millisecond, 0, 0), nil},
		{"max window max buckets", sc(10, maxW, 1000, maxW), nil},
		{"max window one bucket", sc(1<<40, maxW, 1, 0), nil},
	})
}

func TestTokenBucketValidate(t *testing.T) {
	tb := func(rate int, per time.Duration, burst int) TokenBucket {
		return TokenBucket{Rate: rate, Per: per, Burst: burst}
	}
	runValidate(t, []validateCase{
		{"typical", tb(100, time.Second, 10), nil},
		// Rate.
		{"rate -1", tb(-1, time.Second, 0), []string{"TokenBucket.Rate", got(-1)}},
		{"rate 0", tb(0, time.Second, 0), []string{"TokenBucket.Rate", "> 0", got(0)}},
		{"rate 1", tb(1, time.Second, 0), nil},
		// Per.
		{"per 0", tb(1, 0, 0), []string{"TokenBucket.Per", got(time.Duration(0))}},
		{"per min-1ns", tb(1, time.Millisecond-ns, 0), []string{"TokenBucket.Per", "between 1ms and 8784h0m0s", got(999_999 * ns)}},
		{"per min", tb(1, time.Millisecond, 0), nil},
		{"per max", tb(1, maxW, 0), nil},
		{"per max+1ns", tb(1, maxW+ns, 0), []string{"TokenBucket.Per", got(maxW + ns)}},
		// Burst.
		{"burst -1", tb(1000, time.Millisecond, -1), []string{"TokenBucket.Burst", "between 0 and 1073741824", got(-1)}},
		{"burst 0", tb(1000, time.Millisecond, 0), nil},
		{"burst 1", tb(1000, time.Millisecond, 1), nil},
		{"burst max", tb(1000, time.Millisecond, 1<<30), nil},
		{"burst max+1", tb(1000, time.Millisecond, 1<<30+1), []string{"TokenBucket.Burst", got(1<<30 + 1)}},
		// One unit per microsecond at most.
		{"one per µs", tb(1000, time.Millisecond, 0), nil},
		{"more than one per µs", tb(1001, time.Millisecond, 0), []string{"TokenBucket.Rate 1001 per 1ms", "microsecond"}},
		{"one per µs over a second", tb(1_000_000, time.Second, 0), nil},
		{"more than one per µs over a second", tb(1_000_001, time.Second, 0), []string{"TokenBucket.Rate 1000001 per 1s"}},
		// A full burst refills within MaxWindow: Burst*Per/Rate <= MaxWindow.
		{"refill max, burst 0", tb(1, maxW, 0), nil},
		{"refill max, burst 1", tb(1, maxW, 1), nil},
		{"refill over max, burst 2", tb(1, maxW, 2), []string{"TokenBucket.Burst 2", "8784h0m0s", "at 1 per 8784h0m0s"}},
		{"refill max, rate 2", tb(2, maxW, 2), nil},
		{"refill over max, rate 2", tb(2, maxW, 3), []string{"TokenBucket.Burst 3", "at 2 per 8784h0m0s"}},
		{"refill max, per second", tb(1, time.Second, 31_622_400), nil},
		{"refill over max, per second", tb(1, time.Second, 31_622_401), []string{"TokenBucket.Burst 31622401", "at 1 per 1s"}},
		{"refill max, rate 3 per 3s", tb(3, 3*time.Second, 31_622_400), nil},
		{"refill over max, rate 3 per 3s", tb(3, 3*time.Second, 31_622_401), []string{"TokenBucket.Burst 31622401", "at 3 per 3s"}},
	})
}

func TestConcurrencyValidate(t *testing.T) {
	c := func(maxCalls int, lease time.Duration) Concurrency {
		return Concurrency{Max: maxCalls, Lease: lease}
	}
	runValidate(t, []validateCase{
		{"typical", c(10, 0), nil},
		// Max.
		{"max -1", c(-1, 0), []string{"Concurrency.Max", "between 1 and 100000", got(-1)}},
		{"max 0", c(0, 0), []string{"Concurrency.Max", got(0)}},
		{"max 1", c(1, 0), nil},
		{"max max", c(100_000, 0), nil},
		{"max max+1", c(100_001, 0), []string{"Concurrency.Max", got(100_001)}},
		// Lease.
		{"lease -1ns", c(1, -ns), []string{"Concurrency.Lease", got(-ns)}},
		{"lease 0", c(1, 0), nil},
		{"lease 1ns", c(1, ns), []string{"Concurrency.Lease", "zero or between 1ms and 8784h0m0s", got(ns)}},
		{"lease min-1ns", c(1, time.Millisecond-ns), []string{"Concurrency.Lease", got(999_999 * ns)}},
		{"lease min", c(1, time.Millisecond), nil},
		{"lease max", c(1, maxW), nil},
		{"lease max+1ns", c(1, maxW+ns), []string{"Concurrency.Lease", got(maxW + ns)}},
	})
}

func TestCombinatorsValidate(t *testing.T) {
	ok := SlidingLog{Limit: 10, Window: time.Second}
	bad := SlidingLog{Limit: 0, Window: time.Second}
	runValidate(t, []validateCase{
		// All.
		{"all one", All(ok), nil},
		{"all several", All(ok, SlidingCounter{Limit: 1, Window: time.Second}, TokenBucket{Rate: 1, Per: time.Second}, Concurrency{Max: 1}), nil},
		{"all empty", All(), []string{"All needs at least one policy, got none"}},
		{"all nil first", All(nil, ok), []string{"All policy 0 is nil"}},
		{"all nil second", All(ok, nil), []string{"All policy 1 is nil"}},
		{"all invalid second", All(ok, bad), []string{"All policy 1: ", "SlidingLog.Limit", got(0)}},
		{"all invalid first", All(bad, ok), []string{"All policy 0: ", "SlidingLog.Limit"}},
		{"all nested empty", All(ok, All()), []string{"All policy 1: ", "All needs at least one policy"}},
		{"all nested", All(All(ok), ok), nil},
		{"all of per keys", All(PerKey{Policy: ok}, PerKey{Policy: ok}), nil},
		{"all of per calls", All(PerCall{Policy: ok}, PerCall{Policy: ok}), nil},
		// PerKey.
		{"per key", PerKey{Policy: ok}, nil},
		{"per key nil", PerKey{}, []string{"PerKey.Policy is nil"}},
		{"per key invalid", PerKey{Policy: bad}, []string{"PerKey.Policy: ", "SlidingLog.Limit", got(0)}},
		{"per key of all", PerKey{Policy: All(ok, ok)}, nil},
		{"per key of per call", PerKey{Policy: PerCall{Policy: ok}}, nil},
		{"per key in per key", PerKey{Policy: PerKey{Policy: ok}}, []string{"PerKey.Policy must not contain another PerKey"}},
		{"per key in all in per key", PerKey{Policy: All(ok, PerKey{Policy: ok})}, []string{"must not contain another PerKey"}},
		{"per key first in all in per key", PerKey{Policy: All(PerKey{Policy: ok}, ok)}, []string{"must not contain another PerKey"}},
		{"per key in per call in per key", PerKey{Policy: PerCall{Policy: PerKey{Policy: ok}}}, []string{"must not contain another PerKey"}},
		{"per key in all in per key in all", All(ok, PerKey{Policy: All(ok, PerKey{Policy: ok})}), []string{"All policy 1: ", "must not contain another PerKey"}},
		{"per key of all with nil", PerKey{Policy: All(ok, nil)}, []string{"PerKey.Policy: ", "All policy 1 is nil"}},
		// PerCall.
		{"per call", PerCall{Policy: ok}, nil},
		{"per call nil", PerCall{}, []string{"PerCall.Policy is nil"}},
		{"per call invalid", PerCall{Policy: bad}, []string{"PerCall.Policy: ", "SlidingLog.Limit", got(0)}},
		{"per call of all", PerCall{Policy: All(ok, ok)}, nil},
		{"per call of per key", PerCall{Policy: PerKey{Policy: ok}}, nil},
		{"per call in per call", PerCall{Policy: PerCall{Policy: ok}}, []string{"PerCall.Policy must not contain another PerCall"}},
		{"per call in all in per call", PerCall{Policy: All(ok, PerCall{Policy: ok})}, []string{"must not contain another PerCall"}},
		{"per call first in all in per call", PerCall{Policy: All(PerCall{Policy: ok}, ok)}, []string{"must not contain another PerCall"}},
		{"per call in per key in per call", PerCall{Policy: PerKey{Policy: PerCall{Policy: ok}}}, []string{"must not contain another PerCall"}},
		{"per call of all with nil", PerCall{Policy: All(ok, nil)}, []string{"PerCall.Policy: ", "All policy 1 is nil"}},
	})
}

func TestValidateWraps(t *testing.T) {
	bad := SlidingLog{Limit: 0, Window: time.Second}
	inner := bad.Validate()
	for _, p := range []Policy{All(bad), PerKey{Policy: bad}, PerCall{Policy: bad}} {
		err := p.Validate()
		if err == nil {
			t.Fatalf("%#v.Validate() = nil, want an error", p)
		}
		if u := errors.Unwrap(err); u == nil || u.Error() != inner.Error() {
			t.Errorf("errors.Unwrap(%q) = %v, want %q", err, u, inner)
		}
	}
}

func TestHasPerKeyHasPerCall(t *testing.T) {
	ok := SlidingLog{Limit: 10, Window: time.Second}
	tests := []struct {
		name            string
		p               Policy
		perKey, perCall bool
	}{
		{"nil", nil, false, false},
		{"log", ok, false, false},
		{"counter", SlidingCounter{}, false, false},
		{"bucket", TokenBucket{}, false, false},
		{"concurrency", Concurrency{}, false, false},
		{"per key", PerKey{Policy: ok}, true, false},
		{"per call", PerCall{Policy: ok}, false, true},
		{"per key of per call", PerKey{Policy: PerCall{Policy: ok}}, true, true},
		{"per call of per key", PerCall{Policy: PerKey{Policy: ok}}, true, true},
		{"empty all", All(), false, false},
		{"all plain", All(ok, ok, nil), false, false},
		{"all with per key last", All(ok, nil, PerKey{Policy: ok}), true, false},
		{"all with per call last", All(ok, nil, PerCall{Policy: ok}), false, true},
		{"all with per key first", All(PerKey{Policy: ok}, ok), true, false},
		{"all with per call first", All(PerCall{Policy: ok}, ok), false, true},
		{"all in all", All(ok, All(ok, PerKey{Policy: PerCall{Policy: ok}})), true, true},
		{"per key of all of per call", PerKey{Policy: All(ok, PerCall{Policy: ok})}, true, true},
		{"per call of all of per key", PerCall{Policy: All(ok, PerKey{Policy: ok})}, true, true},
		{"per key of all", PerKey{Policy: All(ok)}, true, false},
		{"per call of all", PerCall{Policy: All(ok)}, false, true},
	}
	for _, tt := range tests {
		if got := hasPerKey(tt.p); got != tt.perKey {
			t.Errorf("%s: hasPerKey = %v, want %v", tt.name, got, tt.perKey)
		}
		if got := hasPerCall(tt.p); got != tt.perCall {
			t.Errorf("%s: hasPerCall = %v, want %v", tt.name, got, tt.perCall)
		}
	}
}

func TestEffectiveWindow(t *testing.T) {
	tests := []struct {
		window, margin, want time.Duration
	}{
		{time.Second, 0, time.Second + 30*time.Millisecond},
		{time.Millisecond, 0, 31 * time.Millisecond},
		{time.Second, ns, time.Second + ns},
		{time.Second, 5 * time.Millisecond, 1005 * time.Millisecond},
		{time.Second, time.Second, 2 * time.Second},
		{time.Minute, 2 * time.Second, 62 * time.Second},
		{maxW, maxW, 2 * maxW},
	}
	for _, tt := range tests {
		p := SlidingLog{Limit: 1, Window: tt.window, Margin: tt.margin}
		if got := p.EffectiveWindow(); got != tt.want {
			t.Errorf("SlidingLog{Window: %v, Margin: %v}.EffectiveWindow() = %v, want %v", tt.window, tt.margin, got, tt.want)
		}
	}
}

func TestMarginCeiling(t *testing.T) {
	tests := []struct {
		w, configured, want time.Duration
	}{
		{time.Second, 0, 100 * time.Millisecond},
		{time.Second, 30 * time.Millisecond, 100 * time.Millisecond},
		{time.Second, 100 * time.Millisecond, 100 * time.Millisecond},
		{time.Second, 200 * time.Millisecond, 200 * time.Millisecond},
		{time.Millisecond, 30 * time.Millisecond, 30 * time.Millisecond},
		{time.Millisecond, 0, 100 * time.Microsecond},
		{1234 * time.Millisecond, ns, 123_400 * us},
		{9 * time.Second, 0, 900 * time.Millisecond},
		{10 * time.Second, 0, time.Second},
		{11 * time.Second, 0, time.Second},
		{time.Minute, 30 * time.Millisecond, time.Second},
		{time.Minute, 3 * time.Second, 3 * time.Second},
		{maxW, 0, time.Second},
	}
	for _, tt := range tests {
		if got := MarginCeiling(tt.w, tt.configured); got != tt.want {
			t.Errorf("MarginCeiling(%v, %v) = %v, want %v", tt.w, tt.configured, got, tt.want)
		}
	}
}

func TestRules(t *testing.T) {
	for _, tt := range rulesOfPolicies {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Rules(tt.p)
			if err != nil {
				t.Fatalf("Rules() error = %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Rules() =\n%+v\nwant\n%+v", got, tt.want)
			}
			// The same policy always yields the same rules.
			again, _ := Rules(tt.p)
			if !reflect.DeepEqual(again, got) {
				t.Errorf("Rules() again = %+v, want %+v", again, got)
			}
		})
	}
}

// The sample policies of rulesOfPolicies, and their rules.
var (
	sampleLog         = SlidingLog{Limit: 10, Window: time.Second}
	sampleLogRule     = Rule{Kind: KindSlidingLog, Limit: 10, Window: 1030 * time.Millisecond, Margin: 30 * time.Millisecond}
	sampleCounter     = SlidingCounter{Limit: 50_000, Window: time.Minute}
	sampleCounterRule = Rule{Kind: KindSlidingCounter, Limit: 50_000, Window: 60030 * time.Millisecond, Bucket: 6003 * time.Millisecond, Margin: 30 * time.Millisecond}
	sampleBucket      = TokenBucket{Rate: 4, Per: time.Second}
	sampleBucketRule  = Rule{Kind: KindTokenBucket, Limit: 1, Every: 250 * time.Millisecond, Margin: 30 * time.Millisecond}
	sampleConc        = Concurrency{Max: 3}
	sampleConcRule    = Rule{Kind: KindConcurrency, Limit: 3, Lease: time.Minute}
)

// markPerKey returns r marked per key.
func markPerKey(r Rule) Rule { r.PerKey = true; return r }

// markPerCall returns r marked per call.
func markPerCall(r Rule) Rule { r.PerCall = true; return r }

// rulesOfPolicies are policies of every kind, alone and combined, with
// the rules TestRules expects of each.
var rulesOfPolicies = []struct {
	name string
	p    Policy
	want []Rule
}{
	// SlidingLog.
	{"log default margin", sampleLog, []Rule{sampleLogRule}},
	{"log margin", SlidingLog{Limit: 7, Window: time.Second, Margin: 5 * time.Millisecond},
		[]Rule{{Kind: KindSlidingLog, Limit: 7, Window: 1005 * time.Millisecond, Margin: 5 * time.Millisecond}}},
	{"log margin 1ns", SlidingLog{Limit: 1, Window: time.Minute, Margin: ns},
		[]Rule{{Kind: KindSlidingLog, Limit: 1, Window: time.Minute + ns, Margin: ns}}},
	{"log min window", SlidingLog{Limit: 100_000, Window: time.Millisecond},
		[]Rule{{Kind: KindSlidingLog, Limit: 100_000, Window: 31 * time.Millisecond, Margin: 30 * time.Millisecond}}},
	// SlidingCounter: the bucket is the effective window over the
	// buckets, rounded up to a whole microsecond.
	{"counter defaults", sampleCounter, []Rule{sampleCounterRule}},
	{"counter exact bucket", SlidingCounter{Limit: 5, Window: time.Second, Buckets: 1000},
		[]Rule{{Kind: KindSlidingCounter, Limit: 5, Window: 1030 * time.Millisecond, Bucket: 1030 * us, Margin: 30 * time.Millisecond}}},
	{"counter rounded bucket", SlidingCounter{Limit: 7, Window: time.Second, Buckets: 3, Margin: ns},
		[]Rule{{Kind: KindSlidingCounter, Limit: 7, Window: time.Second + ns, Bucket: 333_334 * us, Margin: ns}}},
	{"counter bucket just over a µs", SlidingCounter{Limit: 7, Window: time.Second, Buckets: 1, Margin: ns},
		[]Rule{{Kind: KindSlidingCounter, Limit: 7, Window: time.Second + ns, Bucket: time.Second + us, Margin: ns}}},
	{"counter rounded bucket default margin", SlidingCounter{Limit: 7, Window: time.Millisecond, Buckets: 7},
		[]Rule{{Kind: KindSlidingCounter, Limit: 7, Window: 31 * time.Millisecond, Bucket: 4429 * us, Margin: 30 * time.Millisecond}}},
	{"counter shortest bucket", SlidingCounter{Limit: 1, Window: time.Millisecond, Buckets: 1000, Margin: time.Millisecond},
		[]Rule{{Kind: KindSlidingCounter, Limit: 1, Window: 2 * time.Millisecond, Bucket: 2 * us, Margin: time.Millisecond}}},
	{"counter one bucket", SlidingCounter{Limit: 1 << 40, Window: time.Hour, Buckets: 1, Margin: time.Second},
		[]Rule{{Kind: KindSlidingCounter, Limit: 1 << 40, Window: time.Hour + time.Second, Bucket: time.Hour + time.Second, Margin: time.Second}}},
	// TokenBucket: the emission interval is Per/Rate rounded up to a
	// whole microsecond; Burst 0 is 1.
	{"bucket defaults", sampleBucket, []Rule{sampleBucketRule}},
	{"bucket burst", TokenBucket{Rate: 3, Per: time.Second, Burst: 5},
		[]Rule{{Kind: KindTokenBucket, Limit: 5, Every: 333_334 * us, Margin: 30 * time.Millisecond}}},
	{"bucket burst 1", TokenBucket{Rate: 1, Per: time.Minute, Burst: 1},
		[]Rule{{Kind: KindTokenBucket, Limit: 1, Every: time.Minute, Margin: 30 * time.Millisecond}}},
	{"bucket fastest", TokenBucket{Rate: 1000, Per: time.Millisecond, Burst: 1 << 30},
		[]Rule{{Kind: KindTokenBucket, Limit: 1 << 30, Every: us, Margin: 30 * time.Millisecond}}},
	{"bucket just over a µs", TokenBucket{Rate: 999, Per: time.Millisecond},
		[]Rule{{Kind: KindTokenBucket, Limit: 1, Every: 2 * us, Margin: 30 * time.Millisecond}}},
	// Concurrency.
	{"concurrency default lease", sampleConc, []Rule{sampleConcRule}},
	{"concurrency lease", Concurrency{Max: 2, Lease: 5 * time.Second},
		[]Rule{{Kind: KindConcurrency, Limit: 2, Lease: 5 * time.Second}}},
	{"concurrency min lease", Concurrency{Max: 100_000, Lease: time.Millisecond},
		[]Rule{{Kind: KindConcurrency, Limit: 100_000, Lease: time.Millisecond}}},
	// PerKey and PerCall mark their rules, at any depth.
	{"per key", PerKey{Policy: sampleLog}, []Rule{markPerKey(sampleLogRule)}},
	{"per call", PerCall{Policy: sampleBucket}, []Rule{markPerCall(sampleBucketRule)}},
	{"per key of per call", PerKey{Policy: PerCall{Policy: sampleConc}}, []Rule{markPerKey(markPerCall(sampleConcRule))}},
	{"per call of per key", PerCall{Policy: PerKey{Policy: sampleCounter}}, []Rule{markPerKey(markPerCall(sampleCounterRule))}},
	{"per key of all", PerKey{Policy: All(sampleLog, sampleConc)}, []Rule{markPerKey(sampleLogRule), markPerKey(sampleConcRule)}},
	{"per call of all", PerCall{Policy: All(sampleLog, PerKey{Policy: sampleConc})}, []Rule{markPerCall(sampleLogRule), markPerKey(markPerCall(sampleConcRule))}},
	// All flattens in order.
	{"all one", All(sampleLog), []Rule{sampleLogRule}},
	{"all in order", All(sampleLog, sampleCounter, sampleBucket, sampleConc), []Rule{sampleLogRule, sampleCounterRule, sampleBucketRule, sampleConcRule}},
	{"all reversed", All(sampleConc, sampleBucket, sampleCounter, sampleLog), []Rule{sampleConcRule, sampleBucketRule, sampleCounterRule, sampleLogRule}},
	{"all nested", All(All(sampleLog, sampleCounter), All(sampleBucket), sampleConc), []Rule{sampleLogRule, sampleCounterRule, sampleBucketRule, sampleConcRule}},
	{"all mixed", All(
		sampleLog,
		PerKey{Policy: All(sampleCounter, PerCall{Policy: sampleBucket})},
		PerCall{Policy: sampleConc},
	), []Rule{sampleLogRule, markPerKey(sampleCounterRule), markPerKey(markPerCall(sampleBucketRule)), markPerCall(sampleConcRule)}},
}

// The rules of a policy ignore the perKey of their caller except to pass it
// on: a PerKey marks its rules whatever it is called with.
func TestRulesPerKeyArgument(t *testing.T) {
	log := SlidingLog{Limit: 10, Window: time.Second}
	for _, perKey := range []bool{false, true} {
		for _, p := range []Policy{
			log,
			SlidingCounter{Limit: 1, Window: time.Second},
			TokenBucket{Rate: 1, Per: time.Second},
			Concurrency{Max: 1},
			All(log, log),
			PerCall{Policy: log},
		} {
			for _, r := range p.rules(perKey) {
				if r.PerKey != perKey {
					t.Errorf("%#v.rules(%v): PerKey = %v", p, perKey, r.PerKey)
				}
			}
		}
		for _, r := range (PerKey{Policy: log}).rules(perKey) {
			if !r.PerKey {
				t.Errorf("PerKey.rules(%v): PerKey = false", perKey)
			}
		}
	}
}

func TestRulesNil(t *testing.T) {
	rules, err := Rules(nil)
	if err == nil || err.Error() != "policies: policy is nil" {
		t.Errorf("Rules(nil) error = %v, want %q", err, "policies: policy is nil")
	}
	if rules != nil {
		t.Errorf("Rules(nil) = %v, want nil", rules)
	}
}

func TestRuleID(t *testing.T) {
	tests := []struct {
		name string
		r    Rule
		want string
	}{
		{"log", Rule{Kind: KindSlidingLog, Limit: 10, Window: 1030 * time.Millisecond, Margin: 30 * time.Millisecond}, "log1000000"},
		{"log no margin", Rule{Kind: KindSlidingLog, Window: time.Second}, "log1000000"},
		{"log sub-µs", Rule{Kind: KindSlidingLog, Window: time.Second + ns, Margin: ns}, "log1000000"},
		{"log per key", Rule{Kind: KindSlidingLog, PerKey: true, Window: 65 * time.Second, Margin: 5 * time.Second}, "log60000000"},
		{"counter", Rule{Kind: KindSlidingCounter, Limit: 5, Window: 60030 * time.Millisecond, Bucket: 6003 * time.Millisecond, Margin: 30 * time.Millisecond}, "counter60000000/6003000"},
		{"counter small", Rule{Kind: KindSlidingCounter, Window: 3 * time.Millisecond, Bucket: 2 * us, Margin: time.Millisecond}, "counter2000/2"},
		{"bucket", Rule{Kind: KindTokenBucket, Limit: 5, Every: 333_334 * us, Margin: 30 * time.Millisecond}, "bucket333334"},
		{"bucket fastest", Rule{Kind: KindTokenBucket, Every: us}, "bucket1"},
		{"concurrency", Rule{Kind: KindConcurrency, Limit: 3, Lease: time.Minute}, "concurrency"},
		{"per call log", Rule{Kind: KindSlidingLog, PerCall: true, Window: 2 * time.Second, Margin: time.Second}, "calls:log1000000"},
		{"per call counter", Rule{Kind: KindSlidingCounter, PerCall: true, Window: 4 * time.Second, Bucket: 400 * time.Millisecond, Margin: 2 * time.Second}, "calls:counter2000000/400000"},
		{"per call bucket", Rule{Kind: KindTokenBucket, PerCall: true, Every: 250 * time.Millisecond}, "calls:bucket250000"},
		{"per call concurrency", Rule{Kind: KindConcurrency, PerCall: true}, "calls:concurrency"},
		{"unknown kind 0", Rule{Window: time.Second}, "kind0"},
		{"unknown kind 5", Rule{Kind: 5, Window: time.Second}, "kind5"},
		{"unknown kind -1", Rule{Kind: -1}, "kind-1"},
		{"unknown kind 12", Rule{Kind: 12}, "kind12"},
		{"per call unknown kind", Rule{Kind: 9, PerCall: true}, "calls:kind9"},
	}
	for _, tt := range tests {
		if got := tt.r.ID(); got != tt.want {
			t.Errorf("%s: %+v.ID() = %q, want %q", tt.name, tt.r, got, tt.want)
		}
	}
}

// The ID of a flattened rule names its window without the margin: a deploy
// that only changes a SlidingLog's margin or limit keeps the rule's data.
func TestRulesID(t *testing.T) {
	tests := []struct {
		p    Policy
		want []string
	}{
		{SlidingLog{Limit: 10, Window: time.Second}, []string{"log1000000"}},
		{SlidingLog{Limit: 99, Window: time.Second, Margin: 200 * time.Millisecond}, []string{"log1000000"}},
		{SlidingCounter{Limit: 10, Window: time.Second}, []string{"counter1000000/103000"}},
		{SlidingCounter{Limit: 10, Window: time.Second, Buckets: 4, Margin: time.Second}, []string{"counter1000000/500000"}},
		{TokenBucket{Rate: 3, Per: time.Second, Burst: 9}, []string{"bucket333334"}},
		{Concurrency{Max: 4}, []string{"concurrency"}},
		{All(
			PerCall{Policy: SlidingLog{Limit: 500, Window: time.Minute}},
			SlidingCounter{Limit: 200_000, Window: time.Minute},
		), []string{"calls:log60000000", "counter60000000/6003000"}},
	}
	for _, tt := range tests {
		rules, err := Rules(tt.p)
		if err != nil {
			t.Fatalf("Rules(%#v) error = %v", tt.p, err)
		}
		var ids []string
		for _, r := range rules {
			ids = append(ids, r.ID())
		}
		if !reflect.DeepEqual(ids, tt.want) {
			t.Errorf("IDs of %#v = %q, want %q", tt.p, ids, tt.want)
		}
	}
}

func TestSlidingCounterBuckets(t *testing.T) {
	tests := []struct{ buckets, want int }{
		{0, 10},
		{1, 1},
		{10, 10},
		{1000, 1000},
	}
	for _, tt := range tests {
		if got := (SlidingCounter{Buckets: tt.buckets}).buckets(); got != tt.want {
			t.Errorf("SlidingCounter{Buckets: %d}.buckets() = %d, want %d", tt.buckets, got, tt.want)
		}
	}
}

func TestUnit_ValidatesItsNameAndPolicy(t *testing.T) {
	log := SlidingLog{Limit: 10, Window: time.Minute}
	for _, tc := range []struct {
		p    Policy
		want string
	}{
		{Unit{Name: "Output", Policy: log}, `Unit.Name must be lower-case`},
		{Unit{Name: "output_tokens"}, "Unit.Policy is nil"},
		{Unit{Name: "a", Policy: Concurrency{Max: 1}}, "must not contain a Concurrency"},
		{Unit{Name: "a", Policy: PerCall{Policy: log}}, "must not contain a Unit or a PerCall"},
		{PerCall{Policy: Unit{Name: "a", Policy: log}}, "must not contain a Unit"},
		{Unit{Name: "a", Policy: SlidingLog{Window: time.Minute}}, `Unit "a": `},
	} {
		if _, err := Rules(tc.p); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%#v: %v, want an error saying %q", tc.p, err, tc.want)
		}
	}
	rules, err := Rules(All(log, PerKey{Policy: Unit{Name: "output_tokens", Policy: log}}))
	if err != nil {
		t.Fatal(err)
	}
	if rules[1].Unit != "output_tokens" || !rules[1].PerKey || rules[1].ID() != "output_tokens:log60000000" || rules[0].ID() != "log60000000" {
		t.Fatalf("rules %+v, ids %q %q", rules, rules[0].ID(), rules[1].ID())
	}
}

func TestKind_StringNamesEachKind(t *testing.T) {
	for k, want := range map[Kind]string{
		KindSlidingLog: "sliding log", KindSlidingCounter: "sliding counter",
		KindTokenBucket: "token bucket", KindConcurrency: "concurrency", Kind(9): "kind 9",
	} {
		if got := k.String(); got != want {
			t.Errorf("Kind(%d).String() = %q, want %q", int(k), got, want)
		}
	}
}
