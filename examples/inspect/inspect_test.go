package main

import (
	"bytes"
	"context"
	"io"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

func TestParsePolicy(t *testing.T) {
	tests := []struct {
		in   string
		want policies.Policy
	}{
		{"log:100/1s", policies.SlidingLog{Limit: 100, Window: time.Second}},
		{"log:100/s", policies.SlidingLog{Limit: 100, Window: time.Second}},
		{"log:100/1s,margin=5ms", policies.SlidingLog{Limit: 100, Window: time.Second, Margin: 5 * time.Millisecond}},
		{"counter:50000/1m", policies.SlidingCounter{Limit: 50000, Window: time.Minute}},
		{"counter:50000/1m,buckets=60", policies.SlidingCounter{Limit: 50000, Window: time.Minute, Buckets: 60}},
		{"bucket:10/1s,burst=20", policies.TokenBucket{Rate: 10, Per: time.Second, Burst: 20}},
		{"concurrency:5", policies.Concurrency{Max: 5}},
		{"concurrency:5,lease=30s", policies.Concurrency{Max: 5, Lease: 30 * time.Second}},
		{"key:log:5000/1h", policies.PerKey{Policy: policies.SlidingLog{Limit: 5000, Window: time.Hour}}},
		{" log:100/1s + key:log:10/1s ", policies.All(
			policies.SlidingLog{Limit: 100, Window: time.Second},
			policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
		)},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := parsePolicy(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			// Policies compare by the rules they flatten into, which is what
			// decides the Redis keys.
			gotRules, err := policies.Rules(got)
			if err != nil {
				t.Fatal(err)
			}
			wantRules, _ := policies.Rules(tt.want)
			if !reflect.DeepEqual(gotRules, wantRules) {
				t.Errorf("rules\n got %+v\nwant %+v", gotRules, wantRules)
			}
		})
	}
}

func TestParsePolicy_ErrorsNameTheTermAndTheField(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", "-policy is empty"},
		{"log", `term 1 "log": want KIND:SPEC`},
		{"window:100/1s", `unknown kind "window"`},
		{"log:100", `"100": want LIMIT/WINDOW`},
		{"log:x/1s", `LIMIT: "x" is not a whole number`},
		{"log:100/1sec", `WINDOW: "1sec" is not a duration`},
		{"log:100/1s+bucket:10/1s,burst=x", `term 2 "bucket:10/1s,burst=x": burst: "x" is not a whole number`},
		{"bucket:10/1s,burst", `option "burst": want name=value`},
		{"log:100/1s,burst=3", `unknown option "burst"`},
		{"log:100/1s,margin=1ms,margin=2ms", "option margin given twice"},
		{"log:0/1s", "SlidingLog.Limit must be > 0"},
		{"log:10/1s+concurrency:0", `term 2 "concurrency:0": policies: Concurrency.Max must be`},
		{"key:key:log:1/1s", `unknown kind "key"`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			_, err := parsePolicy(tt.in)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestParseFlags_TakesAKeyOnlyForPerKeyTerms(t *testing.T) {
	base := []string{"-redis", "127.0.0.1:6400", "-quota", "q"}
	tests := []struct {
		args    []string
		wantErr string
	}{
		{[]string{"-policy", "log:10/1s"}, ""},
		{[]string{"-policy", "log:10/1s+key:log:1/1s", "-key", "t1"}, ""},
		{[]string{"-policy", "log:10/1s+key:log:1/1s"}, ""},
		{[]string{"-policy", "log:10/1s", "-key", "t1"}, "no key: term"},
		{[]string{"-policy", "log:10/1s", "-every", "0s"}, "-every must be positive"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			_, err := parseFlags(append(base, tt.args...), io.Discard)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatal(err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("err = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	if _, err := parseFlags([]string{"-quota", "q", "-policy", "log:1/1s"}, io.Discard); err == nil {
		t.Error("no -redis and no -demo: accepted")
	}
	if _, err := parseFlags([]string{"-demo", "-redis", "127.0.0.1:6400"}, io.Discard); err == nil {
		t.Error("-demo with -redis: accepted")
	}
}

func TestRender(t *testing.T) {
	rules, err := policies.Rules(policies.All(
		policies.SlidingLog{Limit: 100, Window: time.Second},
		policies.Concurrency{Max: 5},
		policies.PerKey{Policy: policies.TokenBucket{Rate: 10, Per: time.Second, Burst: 20}},
		policies.SlidingCounter{Limit: 50000, Window: time.Minute},
	))
	if err != nil {
		t.Fatal(err)
	}
	u := throttle.Usage{Paused: 1500 * time.Millisecond, PausedBy: throttle.PausedByVendor, Rules: []throttle.RuleUsage{
		{Rule: rules[0], Used: 63, Booked: 4, Remaining: 37},
		{Rule: rules[1], Used: 5, NextFree: 59 * time.Second},
		{Rule: rules[2], Used: 12, Remaining: 8, NextFree: 0},
		{Rule: rules[3], Used: 25000, Booked: 100, Remaining: 24900, NextFree: 412345 * time.Microsecond},
	}}
	var b bytes.Buffer
	render(&b, frame{
		Quota: "sms", Prefix: "throttle", Redis: "127.0.0.1:6379", Key: "tenant-42", HasKey: true,
		At: time.Date(2025, 1, 2, 12, 4, 5, 0, time.UTC), Rules: rules, Usage: u,
	})
	want := `quota "sms", key "tenant-42", on 127.0.0.1:6379  12:04:05
paused: for 1.5s, at the vendor's request   remaining under every rule: 0

#  scope   kind         limit  window                used   booked  remaining  next free   full
0  shared  log          100    1s +30ms              63     4       37         now         63%
1  shared  concurrency  5      in flight, lease 1m   5      -       0          on release  100%
2  key     bucket       20     1 per 100ms           12     0       8          now         60%
3  shared  counter      50000  1m +30ms, 10 buckets  25000  100     24900      412ms       50%

redis keys: throttle:{sms}:log1000000, throttle:{sms}:concurrency, throttle:{sms}:key:bucket100000:<key hash>, throttle:{sms}:counter60000000/6003000
`
	if got := b.String(); got != want {
		t.Errorf("render:\n%s\nwant:\n%s", got, want)
	}
}

func TestRender_ShowsTheError(t *testing.T) {
	var b bytes.Buffer
	render(&b, frame{Quota: "q", Redis: "r:1", Err: throttle.ErrUnavailable})
	if !strings.Contains(b.String(), "error: throttle: redis unavailable") {
		t.Errorf("render of a failed read:\n%s", b.String())
	}
}

func TestRun_ShowsTheCallsMade(t *testing.T) {
	mr := miniredis.RunT(t)
	makeCalls(t, mr.Addr())

	args := []string{"-redis", "redis://" + mr.Addr(), "-quota", "vendor", "-policy", "log:10/1m+key:log:5/1m", "-key", "a"}
	out := inspect(t, append(args, "-n", "2", "-every", "10ms"), false)
	if n := strings.Count(out, "redis keys:"); n != 2 {
		t.Errorf("got %d frames, want 2:\n%s", n, out)
	}
	if strings.Contains(out, clearScreen) {
		t.Error("cleared the screen of a stdout that is not a terminal")
	}
	// 4 calls in all, 3 of them for key a.
	shared := regexp.MustCompile(`(?m)^0\s+shared\s+log\s+10\s+1m \+30ms\s+4\s+0\s+6\s+now\s+40%$`)
	perKey := regexp.MustCompile(`(?m)^1\s+key\s+log\s+5\s+1m \+30ms\s+3\s+0\s+2\s+now\s+60%$`)
	if !shared.MatchString(out) || !perKey.MatchString(out) {
		t.Errorf("want rows with 4 calls shared and 3 for key a:\n%s", out)
	}

	// Without -policy, the quota is read under the one it describes: the
	// same rows; without -key, its per-key row shows no figures.
	own := inspect(t, []string{"-redis", mr.Addr(), "-quota", "vendor", "-key", "a", "-n", "1"}, false)
	if !shared.MatchString(own) || !perKey.MatchString(own) {
		t.Errorf("read under its own description, want the same rows:\n%s", own)
	}
	own = inspect(t, []string{"-redis", mr.Addr(), "-quota", "vendor", "-n", "1"}, false)
	if !regexp.MustCompile(`(?m)^1\s+key\s+log\s+5\s+1m \+30ms\s+-\s+-\s+-\s+-\s+-$`).MatchString(own) {
		t.Errorf("without -key, want the per-key row without figures:\n%s", own)
	}

	if tty := inspect(t, append(args, "-n", "1"), true); !strings.HasPrefix(tty, clearScreen) {
		t.Error("did not clear the screen of a terminal")
	}
}

// makeCalls makes 4 calls of quota vendor on the Redis at addr, 3 of them
// for key a.
func makeCalls(t *testing.T, addr string) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	policy := policies.All(policies.SlidingLog{Limit: 10, Window: time.Minute}, policies.PerKey{Policy: policies.SlidingLog{Limit: 5, Window: time.Minute}})
	lim, err := throttle.New(rdb, "vendor", policy, throttle.Options{Mode: throttle.FailFast})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"a", "a", "a", "b"} {
		if _, err := lim.Acquire(context.Background(), throttle.Key(key)); err != nil {
			t.Fatal(err)
		}
	}
}

// inspect runs the tool with args, to a terminal when tty, and returns
// what it wrote.
func inspect(t *testing.T, args []string, tty bool) string {
	t.Helper()
	cfg, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run(context.Background(), cfg, &out, tty); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

func TestRun_FailsWhenTheFirstReadFails(t *testing.T) {
	mr := miniredis.RunT(t)
	addr := mr.Addr()
	mr.Close()
	cfg, err := parseFlags([]string{"-redis", addr, "-quota", "q", "-policy", "log:1/1s", "-n", "1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), cfg, io.Discard, false); err == nil {
		t.Error("run against a closed Redis returned no error")
	}
}

func TestRun_Demo(t *testing.T) {
	cfg, err := parseFlags([]string{"-demo", "-n", "3", "-every", "300ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run(context.Background(), cfg, &out, false); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", out.String())
	if n := strings.Count(out.String(), "redis keys:"); n != 3 {
		t.Fatalf("got %d frames, want 3", n)
	}
	// After a second of traffic that asks for more than the quota, the
	// shared log holds calls.
	if regexp.MustCompile(`(?m)^0\s+shared\s+log\s+20\s+1s \+30ms\s+0\s`).MatchString(out.String()[strings.LastIndex(out.String(), "quota "):]) {
		t.Errorf("the last frame shows no traffic:\n%s", out.String())
	}
}

// With only -redis, inspect lists the quotas the Redis holds, a Shared
// group's with their group, found by their meta keys.
func TestList_NamesEveryQuota(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	for name, p := range map[string]policies.Policy{
		"alpha:api": policies.SlidingLog{Limit: 10, Window: time.Second},
		"beta": policies.All(policies.SlidingLog{Limit: 10, Window: time.Second},
			policies.Shared{Name: "token-a", Policy: policies.Concurrency{Max: 2}}),
	} {
		lim, err := throttle.New(rdb, name, p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := lim.Allow(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Another prefix's quota is not this one's.
	other, err := throttle.New(rdb, "gamma", policies.SlidingLog{Limit: 1, Window: time.Second}, throttle.Options{Prefix: "elsewhere"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Allow(ctx); err != nil {
		t.Fatal(err)
	}
	cfg, err := parseFlags([]string{"-redis", mr.Addr(), "-n", "1"}, io.Discard)
	if err != nil || !cfg.List {
		t.Fatalf("parseFlags with -redis alone: list %v, %v", cfg.List, err)
	}
	var out bytes.Buffer
	if err := run(ctx, cfg, &out, false); err != nil {
		t.Fatal(err)
	}
	want := "2 quotas of prefix \"throttle\":\n  alpha:api\n  beta (group token-a)\n\nshowing \"alpha:api\" (-quota NAME shows another)\n\nquota \"alpha:api\" on "
	if !strings.HasPrefix(out.String(), want) {
		t.Errorf("listed\n%s\nwant it to begin with\n%s", out.String(), want)
	}
	// The first quota is shown under the policy it describes: 1 call of 10.
	if !regexp.MustCompile(`(?m)^0\s+shared\s+log\s+10\s+1s \+30ms\s+1\s+0\s+9\s`).MatchString(out.String()) {
		t.Errorf("the first quota's row is missing:\n%s", out.String())
	}
	// A group's quota is found by its name alone, and shown with its
	// group's keys.
	beta, err := parseFlags([]string{"-redis", mr.Addr(), "-quota", "beta", "-n", "1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run(ctx, beta, &out, false); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "throttle:{token-a}/beta:log1000000") || !strings.Contains(out.String(), "throttle:{token-a}//concurrency") {
		t.Errorf("beta shown without its group's keys:\n%s", out.String())
	}
	if _, err := parseFlags([]string{"-redis", mr.Addr(), "-policy", "log:1/1s"}, io.Discard); err == nil || !strings.Contains(err.Error(), "-quota") {
		t.Errorf("-policy without -quota: %v, want an error naming -quota", err)
	}
}
