package throttle

// The values both sides use come from internal/protocol. These tests
// check what generation cannot: that no script hides a generated
// constant, and that functions computed on each side agree.

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// The constants both sides use come from internal/protocol, written into
// consts.lua (TestGeneratedFilesAreCurrent there): no script may define one
// again, which would hide it.
func TestProtocol_ScriptsDoNotRedefineGeneratedConstants(t *testing.T) {
	consts := map[string]int64{}
	for _, name := range []string{"acquire.lua", "cancel.lua", "settle.lua", "release.lua", "feedback.lua", "usage.lua", "handback.lua"} {
		consts = luaConstants(t, name)
	}
	for _, c := range protocol.Consts {
		if _, ok := consts[c.Lua]; !ok {
			if _, isString := c.Value.(string); !isString {
				t.Errorf("consts.lua: no integer constant %s", c.Lua)
			}
		}
	}
}

// A process files each lateness of its calls in a bucket (lates.note); the
// script takes a bucket's latenesses to reach its top (bucket_top in
// lib.lua). Just under a bucket's top, a lateness is filed in that bucket;
// just over it, in the next.
func TestProtocol_LatenessBucketsAgree(t *testing.T) {
	bucketOf := func(late time.Duration) int {
		var c lates
		c.note(late)
		for b := range c.n {
			if c.n[b].Load() > 0 {
				return b
			}
		}
		return -1
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		tops := runLib(t, s, `
local out = {}
for k = 0, LATE_BUCKETS - 1 do
  out[#out + 1] = bucket_top(k)
end
return out`, nil)
		if len(tops) != lateBuckets {
			t.Fatalf("the script has %d lateness buckets, Go %d", len(tops), lateBuckets)
		}
		// Bucket 0's top is 0: a spread under a millisecond is none.
		if tops[0] != 0 || bucketOf(time.Millisecond-time.Microsecond) != 0 || bucketOf(time.Millisecond) != 1 {
			t.Errorf("bucket 0: top %dµs in the script; Go files 999µs in bucket %d, 1ms in bucket %d, want 0 and 1",
				tops[0], bucketOf(time.Millisecond-time.Microsecond), bucketOf(time.Millisecond))
		}
		for k := 1; k < lateBuckets-1; k++ {
			top := time.Duration(tops[k]) * time.Microsecond
			if b := bucketOf(top - time.Microsecond); b != k {
				t.Errorf("bucket %d: top %v in the script; Go files %v in bucket %d", k, top, top-time.Microsecond, b)
			}
			if b := bucketOf(top + time.Microsecond); b != k+1 {
				t.Errorf("bucket %d: top %v in the script; Go files %v in bucket %d, want %d", k, top, top+time.Microsecond, b, k+1)
			}
		}
		if b := bucketOf(time.Hour); b != lateBuckets-1 {
			t.Errorf("Go files an hour's lateness in bucket %d, want the last, %d", b, lateBuckets-1)
		}
	})
}

// A guarded log's margin grows up to a ceiling: policies.MarginCeiling
// tells users where it lies, margin_ceiling in lib.lua holds the script to
// it. A margin under GUARDED never grows, and is left out.
func TestProtocol_MarginCeilingsAgree(t *testing.T) {
	logs := []policies.SlidingLog{
		{Limit: 10, Window: 100 * time.Millisecond},                     // a tenth of the window is less than the margin
		{Limit: 10, Window: time.Second},                                // a tenth of the window
		{Limit: 10, Window: time.Minute},                                // at most a second
		{Limit: 10, Window: 10 * time.Second, Margin: minGuardedMargin}, // the least guarded margin
		{Limit: 10, Window: time.Hour, Margin: 5 * time.Second},         // a margin wider than any ceiling
	}
	var rules []policies.Rule
	keys := []string{"meta", "meta"}
	for _, p := range logs {
		rs, err := policies.Rules(p)
		if err != nil {
			t.Fatal(err)
		}
		rules = append(rules, rs...)
		keys = append(keys, "rule"+strconv.Itoa(len(keys)))
	}
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		got := runLib(t, s, `
local out = {}
for _, r in ipairs(rules()) do
  out[#out + 1] = margin_ceiling(r)
end
return out`, keys, scriptArgs(nil, rules, nil)...)
		if len(got) != len(logs) {
			t.Fatalf("the script read %d rules, want %d", len(got), len(logs))
		}
		for i, p := range logs {
			want := policies.MarginCeiling(p.Window, rules[i].Margin)
			if g := time.Duration(got[i]) * time.Microsecond; g != want {
				t.Errorf("SlidingLog{Window: %v, Margin: %v}: the script's margin ceiling is %v, policies.MarginCeiling %v",
					p.Window, p.Margin, g, want)
			}
		}
	})
}

// luaConstant matches a constant of a script's top level: "local NAME = 16",
// "local A, B = 1, 2", or a product of integers ("24 * 3600 * 1000").
var luaConstant = regexp.MustCompile(`(?m)^(?:local |blind\.)([A-Z][A-Z0-9_]*(?:, *[A-Z][A-Z0-9_]*)*) *= *([^-\n]*?) *(?:--.*)?$`)

// luaConstants returns the integer constants script sees at its top level,
// its own and lib.lua's, by name. A name defined twice fails the test: one
// of the two would be hidden.
func luaConstants(t *testing.T, script string) map[string]int64 {
	t.Helper()
	consts := map[string]int64{}
	seen := map[string]string{}
	for _, file := range []string{"consts.lua", "lib.lua", script} {
		for _, m := range luaConstant.FindAllStringSubmatch(luaFile(file), -1) {
			names, values := strings.Split(m[1], ","), strings.Split(m[2], ",")
			for i, name := range names {
				name = strings.TrimSpace(name)
				if prev, ok := seen[name]; ok {
					t.Fatalf("%s is defined in %s and again in %s", name, prev, file)
				}
				seen[name] = file
				if i >= len(values) {
					continue
				}
				if v, ok := product(values[i]); ok {
					consts[name] = v
				}
			}
		}
	}
	return consts
}

// product evaluates an integer, or a product of integers.
func product(s string) (int64, bool) {
	v := int64(1)
	for _, f := range strings.Split(s, "*") {
		n, err := strconv.ParseInt(strings.TrimSpace(f), 10, 64)
		if err != nil {
			return 0, false
		}
		v *= n
	}
	return v, true
}

// runLib runs body after lib.lua, as every script runs, and returns its
// reply.
func runLib(t *testing.T, s *redistest.Server, body string, keys []string, args ...any) []int64 {
	t.Helper()
	text, err := protocol.Fold(luaFile("consts.lua") + luaFile("lib.lua") + body)
	if err != nil {
		t.Fatal(err)
	}
	v, err := redis.NewScript(text).Run(context.Background(), s.Client(t), keys, args...).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	return v
}
