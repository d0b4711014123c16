package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/internal/redistest"
)

// TestMain lets the test binary stand in for the program: the scenarios
// start their replicas and spinners from os.Executable(), which here is
// this binary, with replicaFlag or spinFlag first.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case replicaFlag:
			os.Exit(replicaMain(os.Args[2:]))
		case spinFlag:
			spin()
		}
	}
	os.Exit(m.Run())
}

// steady returns n arrivals spaced evenly, every gap apart, from t0.
func steady(t0 time.Time, n int, gap time.Duration) []time.Time {
	at := make([]time.Time, n)
	for i := range at {
		at[i] = t0.Add(time.Duration(i) * gap)
	}
	return at
}

func TestUtilization_AveragesTheWindowCountAfterTheFirstWindow(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		at   []time.Time
		want float64
	}{
		{"at the cap", steady(t0, 500, 10*time.Millisecond), 1},
		{"at half the cap", steady(t0, 250, 20*time.Millisecond), 0.5},
		// 100 calls at once, then nothing until one more 2 s later: from
		// the end of the first window on, the window holds the 100 calls
		// at no moment (they left exactly at t0+1s) and then the last one.
		{"a burst, then silence", append(steady(t0, 100, 0), t0.Add(2*time.Second)), 1.0 / 1001 / 100},
		{"one arrival", steady(t0, 1, 0), 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := &arrivalLog{at: tt.at}
			if got := a.utilization(100, time.Second); math.Abs(got-tt.want) > 1e-9 {
				t.Errorf("utilization = %.4f, want %.4f", got, tt.want)
			}
		})
	}
}

func TestMaxInWindow_CountsAHalfOpenWindow(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	// 10 calls 100 ms apart: one that arrives exactly a window after the
	// first no longer shares a window with it.
	if got := maxInWindow(steady(t0, 11, 100*time.Millisecond), time.Second); got != 10 {
		t.Errorf("maxInWindow = %d, want 10", got)
	}
	if got := maxInWindow(steady(t0, 5, 0), time.Second); got != 5 {
		t.Errorf("maxInWindow of 5 calls at once = %d, want 5", got)
	}
	if got := maxInWindow(nil, time.Second); got != 0 {
		t.Errorf("maxInWindow of nothing = %d, want 0", got)
	}
}

func TestPercentile_IsTheNearestRank(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	for _, tt := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 50 * time.Millisecond}, {0.99, 99 * time.Millisecond}, {1, 100 * time.Millisecond}} {
		if got := durations.Percentile(d, tt.q); got != tt.want {
			t.Errorf("durations.Percentile(%v) = %v, want %v", tt.q, got, tt.want)
		}
	}
	if got := durations.Percentile(nil, 0.5); got != 0 {
		t.Errorf("percentile of nothing = %v, want 0", got)
	}
}

func TestClassify_TellsTheRunsEndFromErrors(t *testing.T) {
	now := time.Now()
	end := now.Add(time.Second)
	live, cancelLive := context.WithDeadline(context.Background(), end)
	defer cancelLive()
	over, cancelOver := context.WithDeadline(context.Background(), now.Add(-time.Millisecond))
	defer cancelOver()

	limited := func(after time.Duration) error {
		return &throttle.LimitedError{Quota: "q", RetryAfter: after}
	}
	redisErr := func(err error) error {
		return fmt.Errorf("throttle: quota \"q\": %w: %w", throttle.ErrUnavailable, err)
	}
	tests := []struct {
		name string
		ctx  context.Context
		err  error
		want outcome
	}{
		{"admitted", live, nil, succeeded},
		{"slot past the end", live, limited(2 * time.Second), endLimited},
		{"late start refused before the end", live, limited(40 * time.Millisecond), limitedEarly},
		{"the end came while waiting", over, context.DeadlineExceeded, endContext},
		{"the end came during a round trip", over, redisErr(context.DeadlineExceeded), endUnavailable},
		{"Redis answered too late", live, redisErr(context.DeadlineExceeded), unavailable},
		{"Redis refused", live, redisErr(errors.New("LOADING")), unavailable},
		{"anything else", live, errors.New("connection reset"), failed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := classify(tt.ctx, tt.err, now); got != tt.want {
				t.Errorf("classify(%v) = %d, want %d", tt.err, got, tt.want)
			}
		})
	}
}

func TestWriteTable_AlignsEveryColumn(t *testing.T) {
	results := []result{
		{
			Name: "fleet-d0", Admitted: 1000, Cap: 100, MaxInWindow: 100, Utilization: 0.99712,
			ScriptCalls: 250, WaitP50: 1500 * time.Microsecond, WaitP99: 1031 * time.Millisecond,
			Errors: 2, Late: 1, Unavailable: 3, TimedOut: 1, Spread: 8 * time.Millisecond, Margin: 30 * time.Millisecond,
		},
		{Name: "replicas-100x10", Admitted: 9000, OverCap: 12, Cap: 1000, MaxInWindow: 1012, Utilization: 0.9},
	}
	var b bytes.Buffer
	writeTable(&b, results)
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != 4 {
		t.Fatalf("got %d lines, want a header, a rule and 2 rows:\n%s", len(lines), b.String())
	}
	for i, l := range lines {
		if len([]rune(l)) != len([]rune(lines[0])) || strings.Count(l, "|") != len(tableHeader)+1 {
			t.Errorf("line %d is not aligned with the header:\n%s\n%s", i, lines[0], l)
		}
	}
	for _, want := range []string{
		"| fleet-d0 ", " 1000 ", " 100/100 ", " 0.997 ", " 0.250 ", " 1.5 / 1031 ", " 2 (1) ", " 3 (1) ", " 8.0 / 30.0 ",
		"| replicas-100x10 ", " 12 ", " 1012/1000 ", " 0.900 ",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestParseFlags_RejectsAnUnknownScenario(t *testing.T) {
	if _, err := parseFlags([]string{"-only", "fleet-d7"}, io.Discard); err == nil || !strings.Contains(err.Error(), "fleet-d25") {
		t.Errorf("parseFlags(-only fleet-d7) = %v, want an error listing the scenarios", err)
	}
	if _, err := parseFlags([]string{"-margin", "1s"}, io.Discard); err == nil || !strings.Contains(err.Error(), "-margin") {
		t.Errorf("parseFlags(-margin 1s) = %v, want an error naming -margin", err)
	}
	opts, err := parseFlags([]string{"-only", "busy, fleet-d0", "-duration", "2s"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(opts.only) != "[busy fleet-d0]" || opts.duration != 2*time.Second {
		t.Errorf("parseFlags = %+v, want busy and fleet-d0 for 2s", opts)
	}
}

func TestReplicaConfig_ArgsRoundTrip(t *testing.T) {
	rc := replicaConfig{ID: 2, Redis: "127.0.0.1:1", Vendor: "http://127.0.0.1:2/call", Quota: "q",
		Limit: 100, Window: time.Second, Limiters: 3, Workers: 20, Pool: 20, Margin: 5 * time.Millisecond}
	args := rc.args()
	got, err := parseReplicaArgs(args[1:])
	if err != nil {
		t.Fatal(err)
	}
	if got != rc {
		t.Errorf("parseReplicaArgs(args()) = %+v, want %+v", got, rc)
	}
}

// A short run of one scenario, end to end: a real redis-server, the proxy,
// three replica processes and the vendor.
func TestRun_FleetScenarioEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a fleet of processes for a few seconds")
	}
	if !redistest.Available() {
		if redistest.RequireReal() {
			t.Fatal("redis-server is not on PATH, and CI=true requires it")
		}
		t.Skip("redis-server is not on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	results, err := run(ctx, options{only: []string{"fleet-d1"}, duration: 2 * time.Second}, &out, io.Discard)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("\n%s", out.String())
	if len(results) != 1 || results[0].Name != "fleet-d1" {
		t.Fatalf("got results %+v, want one for fleet-d1", results)
	}
	r := results[0]
	if r.Admitted == 0 || r.ScriptCalls == 0 || r.Margin == 0 {
		t.Errorf("admitted %d calls with %d script calls, margin %v; want all three above zero", r.Admitted, r.ScriptCalls, r.Margin)
	}
	if r.EndOfRun == 0 {
		t.Error("no call failed at the run's end, yet 60 workers were waiting for slots")
	}
	if !strings.Contains(out.String(), "| fleet-d1 ") {
		t.Errorf("the table has no fleet-d1 row:\n%s", out.String())
	}
}

func TestDistinctLines_CountsRepeatsWithoutTheirLogTimes(t *testing.T) {
	s := "2026/11/22 22:35:47 WARN a\n2026/11/22 22:35:48 WARN a\nplain\n\n2026/11/22 22:35:49 WARN a\n"
	got := distinctLines(s)
	want := []counted{{"WARN a", 3}, {"plain", 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("distinctLines = %v, want %v", got, want)
	}
}

func TestTailBuffer_KeepsWholeLinesOfTheEnd(t *testing.T) {
	b := &tailBuffer{max: 10}
	fmt.Fprint(b, "first line\nsecond\nthird\n")
	if got := b.String(); got != "third\n" {
		t.Errorf("String = %q, want %q", got, "third\n")
	}
}
