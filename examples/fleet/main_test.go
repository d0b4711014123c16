package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/examples/fakeapi"
)

// TestMain lets the test binary stand in for the program: the fleet starts
// its replicas from os.Executable(), which here is this binary, and marks
// them with replicaEnv since a test binary cannot take replicaFlag.
func TestMain(m *testing.M) {
	if os.Getenv(replicaEnv) == "1" {
		args := os.Args[1:]
		if len(args) > 0 && args[0] == replicaFlag {
			args = args[1:]
		}
		os.Exit(replicaMain(args))
	}
	os.Exit(m.Run())
}

func TestFleet_SharedQuotaNeverOverCapAndUsesIt(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a fleet of processes for a few seconds")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	chart := filepath.Join(t.TempDir(), "fleet.svg")
	cfg := config{
		Procs: 2, Workers: 10, Limit: 20, Window: time.Second, Duration: 3 * time.Second,
		Mode: throttle.Block, Demand: 1.2, Skew: 0.7, Chart: chart, exe: exe,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var stdout bytes.Buffer
	rep, err := run(ctx, cfg, &stdout, io.Discard)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, stdout.String())
	}
	t.Logf("\n%s", stdout.String())

	if len(rep.Runs) != 1 {
		t.Fatalf("got %d runs, want 1", len(rep.Runs))
	}
	res := rep.Runs[0]
	if res.OverCap != 0 {
		t.Errorf("the vendor answered 429 to %d calls, want 0", res.OverCap)
	}
	if res.MaxInWindow > cfg.Limit {
		t.Errorf("the vendor saw %d calls in one window, cap %d", res.MaxInWindow, cfg.Limit)
	}
	if res.Fleet.Utilization < 0.9 {
		t.Errorf("the fleet used %.1f%% of the cap, want at least 90%%", 100*res.Fleet.Utilization)
	}
	if res.Fleet.Failed != 0 {
		t.Errorf("%d calls failed: %s", res.Fleet.Failed, res.Fleet.FirstError)
	}
	if len(res.Replicas) != 2 || res.Replicas[0].Admitted == 0 || res.Replicas[1].Admitted == 0 {
		t.Errorf("want calls admitted on both replicas, got %+v", res.Replicas)
	}
	for _, r := range res.Replicas {
		if r.ScriptCalls == 0 {
			t.Errorf("replica %s: the hook counted no Redis script", r.Name)
		}
	}

	if rep.Chart != chart {
		t.Errorf("Report.Chart = %q, want %q", rep.Chart, chart)
	}
	f, err := os.Open(chart)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if root := svgRoot(t, f); root != "svg" {
		t.Errorf("chart root element is <%s>, want <svg>", root)
	}
}

// svgRoot parses the whole document and returns its root element's name.
func svgRoot(t *testing.T, r io.Reader) string {
	t.Helper()
	dec := xml.NewDecoder(r)
	root := ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return root
		}
		if err != nil {
			t.Fatalf("chart is not well-formed XML: %v", err)
		}
		if el, ok := tok.(xml.StartElement); ok && root == "" {
			root = el.Name.Local
		}
	}
}

func TestChart_IsWellFormedWithEveryRun(t *testing.T) {
	var runs []Result
	for _, v := range []variant{shared, split, naive} {
		runs = append(runs, Result{
			Variant: v, Title: v.title(config{Limit: 50, Procs: 3}) + ` & <"quoted">`, Limit: 50, Window: time.Second,
			Ran: 2 * time.Second, Seconds: []second{{Accepted: 50}, {Accepted: 48, Rejected: 12}},
		})
	}
	var b bytes.Buffer
	renderChart(&b, runs)
	if root := svgRoot(t, bytes.NewReader(b.Bytes())); root != "svg" {
		t.Errorf("root element is <%s>, want <svg>", root)
	}
	if n := strings.Count(b.String(), "<g "); n != 3 {
		t.Errorf("got %d panels, want 3", n)
	}
}

func TestSummarize_CountsWholeWindowsFromTheStart(t *testing.T) {
	cfg := config{Limit: 10, Window: time.Second}
	var arrivals []arrival
	// A burst of 10 at the start of each of 3 windows, a 4th burst just
	// before the stop, and 2 calls answered 429.
	for w := range 4 {
		for range 10 {
			arrivals = append(arrivals, arrival{at: time.Duration(w) * 1020 * time.Millisecond, replica: w % 2, tenant: -1, ok: true})
		}
	}
	arrivals = append(arrivals, arrival{at: 500 * time.Millisecond, replica: 1, tenant: -1})
	arrivals = append(arrivals, arrival{at: 600 * time.Millisecond, replica: 1, tenant: -1})
	reports := []replicaReport{{Admitted: 20, WaitsMicros: []int64{1000, 2000}}, {Admitted: 22, WaitsMicros: []int64{3000}}}

	res := summarize(cfg, shared, 3100*time.Millisecond, fakeapi.Stats{OverCap: 2, MaxInWindow: 11}, arrivals, reports)
	if got := res.Fleet.Utilization; got != 1 {
		t.Errorf("fleet utilization = %v, want 1: the 4th burst lies past the 3 whole windows", got)
	}
	if got := res.Replicas[0].Utilization + res.Replicas[1].Utilization; math.Abs(got-res.Fleet.Utilization) > 1e-9 {
		t.Errorf("replica utilizations add up to %v, fleet has %v", got, res.Fleet.Utilization)
	}
	if res.Replicas[1].OverCap != 2 || res.Fleet.OverCap != 2 || res.OverCap != 2 {
		t.Errorf("429s: replica 1 %d, fleet %d, vendor %d; want 2 each", res.Replicas[1].OverCap, res.Fleet.OverCap, res.OverCap)
	}
	if res.Fleet.P50 != 2*time.Millisecond || res.Fleet.P99 != 3*time.Millisecond {
		t.Errorf("fleet waits p50 %v p99 %v, want 2ms and 3ms", res.Fleet.P50, res.Fleet.P99)
	}
	want := []second{{Accepted: 10, Rejected: 2}, {Accepted: 10}, {Accepted: 10}, {Accepted: 10}}
	if !reflect.DeepEqual(res.Seconds, want) {
		t.Errorf("seconds = %v, want %v", res.Seconds, want)
	}
}

func TestMaxInWindow_CountsHalfOpenWindows(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		var d []time.Duration
		for _, x := range v {
			d = append(d, time.Duration(x)*time.Millisecond)
		}
		return d
	}
	tests := []struct {
		name string
		ts   []time.Duration
		want int
	}{
		{"none", nil, 0},
		{"one window apart is two windows", ms(0, 1000), 1},
		{"just inside one window", ms(0, 999), 2},
		{"unsorted", ms(1500, 0, 700, 1600), 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := maxInWindow(tt.ts, time.Second); got != tt.want {
				t.Errorf("maxInWindow = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestBucket_AllowsBurstThenRate(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	b := newBucket(10, time.Second, t0) // 10 a second, burst 10
	for i := range 10 {
		if ok, _ := b.allow(t0); !ok {
			t.Fatalf("call %d of the burst refused", i)
		}
	}
	ok, retry := b.allow(t0)
	if ok || retry != 100*time.Millisecond {
		t.Errorf("11th call: ok=%v retry=%v, want refused, retry 100ms", ok, retry)
	}
	if d := b.reserve(t0); d != 100*time.Millisecond {
		t.Errorf("reserve waits %v, want 100ms", d)
	}
	if d := b.reserve(t0); d != 200*time.Millisecond {
		t.Errorf("second reserve waits %v, want 200ms", d)
	}
	b.unreserve()
	if d := b.reserve(t0.Add(100 * time.Millisecond)); d != 100*time.Millisecond {
		t.Errorf("reserve after a give-back waits %v, want 100ms", d)
	}
}

func TestRedisOptions(t *testing.T) {
	tests := []struct {
		spec    string
		cluster bool
		addrs   []string
		isClust bool
		pass    string
		wantErr string
	}{
		{spec: "127.0.0.1:6400", addrs: []string{"127.0.0.1:6400"}},
		{spec: "redis://:secret@db:6401/2", addrs: []string{"db:6401"}, pass: "secret"},
		{spec: "a:7000, b:7001", addrs: []string{"a:7000", "b:7001"}, isClust: true},
		{spec: "redis://a:7000", cluster: true, addrs: []string{"a:7000"}, isClust: true},
		{spec: "localhost", wantErr: "neither"},
		{spec: " , ", wantErr: "no address"},
	}
	for _, tt := range tests {
		t.Run(tt.spec, func(t *testing.T) {
			o, err := redisOptions(tt.spec, tt.cluster)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(o.Addrs, tt.addrs) || o.IsClusterMode != tt.isClust || o.Password != tt.pass {
				t.Errorf("got addrs %v cluster %v password %q, want %v %v %q", o.Addrs, o.IsClusterMode, o.Password, tt.addrs, tt.isClust, tt.pass)
			}
		})
	}
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-compare", "-tenants", "4", "-mode", "FailFast"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Duration != defaultCompareDuration || cfg.TenantLimit != 25 || cfg.Mode != throttle.FailFast {
		t.Errorf("got duration %v, tenant limit %d, mode %v; want %v, 25, FailFast", cfg.Duration, cfg.TenantLimit, cfg.Mode, defaultCompareDuration)
	}
	cfg, err = parseFlags([]string{"-compare", "-duration", "2s"}, io.Discard)
	if err != nil || cfg.Duration != 2*time.Second {
		t.Errorf("an explicit -duration with -compare: got %v, %v; want 2s", cfg.Duration, err)
	}
	for _, bad := range [][]string{{"-procs", "0"}, {"-mode", "queue"}, {"-skew", "1.5"}, {"extra"}} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) accepted it", bad)
		}
	}
}

func TestReplicaArgs_RoundTrip(t *testing.T) {
	want := replicaConfig{
		ID: 2, Gate: split, Vendor: "http://127.0.0.1:1/call", Redis: "a:1,b:2", Cluster: true, Quota: "q",
		Limit: 50, LocalLimit: 50.0 / 3, Window: time.Second, Margin: 5 * time.Millisecond, Mode: throttle.FailFast,
		Workers: 7, Tenants: 3, TenantLimit: 9, Rate: 12.5,
	}
	args := want.args()
	if args[0] != replicaFlag {
		t.Fatalf("args start with %q, want %q", args[0], replicaFlag)
	}
	got, err := parseReplicaArgs(args[1:])
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("round trip:\n got %+v\nwant %+v", got, want)
	}
}

func TestReplicaRate_SplitsDemandBySkew(t *testing.T) {
	cfg := config{Procs: 3, Limit: 50, Window: time.Second, Demand: 1.2, Skew: 0.7}
	got := []float64{cfg.replicaRate(0), cfg.replicaRate(1), cfg.replicaRate(2)}
	want := []float64{42, 9, 9}
	for i := range want {
		if d := got[i] - want[i]; d > 1e-9 || d < -1e-9 {
			t.Errorf("replica %d asks for %v calls/s, want %v", i, got[i], want[i])
		}
	}
}
