package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/examples/fakeapi"
)

// The examples keep to the library's dependencies, without
// github.com/prometheus/common/expfmt, so the exposition is checked here
// against the text format, version 0.0.4, by hand, and more strictly than
// Prometheus parses it: what the fleet writes must also follow the naming
// conventions (counters end in _total), keep each family's samples
// together after its # TYPE, repeat no series, and give each histogram
// increasing bounds, cumulative counts, a +Inf bucket equal to its count,
// and a sum.

var (
	metricName = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
	labelName  = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)
)

// parsedSample is one sample line.
type parsedSample struct {
	name   string
	labels map[string]string
	value  float64
}

// key names the sample's series: its name and its labels in order.
func (s parsedSample) key(skip string) string {
	names := make([]string, 0, len(s.labels))
	for n := range s.labels {
		if n != skip {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	var b strings.Builder
	b.WriteString(s.name)
	for _, n := range names {
		fmt.Fprintf(&b, ",%s=%q", n, s.labels[n])
	}
	return b.String()
}

// checkExposition checks text strictly against the Prometheus text format
// and returns its samples.
func checkExposition(text string) ([]parsedSample, error) {
	if text == "" {
		return nil, nil // nothing to report yet is valid
	}
	if !strings.HasSuffix(text, "\n") {
		return nil, fmt.Errorf("the exposition must end with a newline")
	}
	e := exposition{types: map[string]string{}, helps: map[string]bool{}, closed: map[string]bool{}, seen: map[string]bool{}}
	for i, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		var err error
		switch {
		case line == "":
			err = errors.New("empty line")
		case strings.HasPrefix(line, "#"):
			err = e.comment(line)
		default:
			err = e.sample(line)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d %q: %s", i+1, line, err)
		}
	}
	return e.samples, checkHistograms(e.samples, e.types)
}

// exposition is what checkExposition has read of a text so far.
type exposition struct {
	types   map[string]string // family -> type
	helps   map[string]bool
	closed  map[string]bool // families whose samples are over
	current string
	seen    map[string]bool
	samples []parsedSample
}

// comment reads a # HELP or # TYPE line.
func (e *exposition) comment(line string) error {
	f := strings.SplitN(line, " ", 4)
	if len(f) < 4 || f[0] != "#" || (f[1] != "HELP" && f[1] != "TYPE") {
		return errors.New("a comment must be '# HELP name text' or '# TYPE name type'")
	}
	name := f[2]
	if !metricName.MatchString(name) {
		return fmt.Errorf("bad metric name %q", name)
	}
	if name != e.current {
		e.closed[e.current] = true
		if e.closed[name] {
			return fmt.Errorf("family %s is declared again after its samples", name)
		}
		e.current = name
	}
	switch f[1] {
	case "HELP":
		if e.helps[name] {
			return fmt.Errorf("second HELP for %s", name)
		}
		if err := checkHelpEscapes(f[3]); err != nil {
			return fmt.Errorf("HELP text: %v", err)
		}
		e.helps[name] = true
	case "TYPE":
		if _, dup := e.types[name]; dup {
			return fmt.Errorf("second TYPE for %s", name)
		}
		switch f[3] {
		case "counter", "gauge", "histogram", "summary", "untyped":
		default:
			return fmt.Errorf("unknown type %q", f[3])
		}
		if f[3] == "counter" && !strings.HasSuffix(name, "_total") {
			return fmt.Errorf("counter %s does not end in _total", name)
		}
		e.types[name] = f[3]
	}
	return nil
}

// sample reads a sample line, which must belong to the family declared
// last, and keeps it.
func (e *exposition) sample(line string) error {
	s, err := parseSample(line)
	if err != nil {
		return err
	}
	types := e.types
	family := familyOf(s.name, types)
	if family == "" {
		return fmt.Errorf("sample of %s comes before its # TYPE", s.name)
	}
	if family != e.current {
		return fmt.Errorf("sample of %s outside its family's block (in %s)", family, e.current)
	}
	if types[family] == "histogram" && s.name == family {
		return errors.New("a histogram's samples are _bucket, _sum and _count")
	}
	if _, ok := s.labels["le"]; ok != (s.name == family+"_bucket" && types[family] == "histogram") {
		return errors.New("le belongs to histogram buckets, and every bucket has one")
	}
	if types[family] == "counter" && (s.value < 0 || math.IsNaN(s.value)) {
		return fmt.Errorf("counter value %v", s.value)
	}
	if k := s.key(""); e.seen[k] {
		return errors.New("series repeated")
	} else {
		e.seen[k] = true
	}
	e.samples = append(e.samples, s)
	return nil
}

// familyOf returns the family a sample belongs to, or "" when none was
// declared.
func familyOf(name string, types map[string]string) string {
	if _, ok := types[name]; ok {
		return name
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && types[base] == "histogram" {
			return base
		}
	}
	return ""
}

// parseSample reads name{label="value",...} value [timestamp].
func parseSample(line string) (parsedSample, error) {
	s := parsedSample{labels: map[string]string{}}
	end := strings.IndexAny(line, "{ ")
	if end < 0 {
		return s, fmt.Errorf("no value")
	}
	s.name = line[:end]
	if !metricName.MatchString(s.name) {
		return s, fmt.Errorf("bad metric name %q", s.name)
	}
	rest := line[end:]
	if strings.HasPrefix(rest, "{") {
		rest = rest[1:]
		for !strings.HasPrefix(rest, "}") {
			eq := strings.Index(rest, `="`)
			if eq < 0 {
				return s, fmt.Errorf("label without =\"value\"")
			}
			name := rest[:eq]
			if !labelName.MatchString(name) || strings.HasPrefix(name, "__") {
				return s, fmt.Errorf("bad label name %q", name)
			}
			if _, dup := s.labels[name]; dup {
				return s, fmt.Errorf("label %s given twice", name)
			}
			value, n, err := readLabelValue(rest[eq+2:])
			if err != nil {
				return s, fmt.Errorf("label %s: %v", name, err)
			}
			s.labels[name] = value
			rest = rest[eq+2+n:]
			if r, ok := strings.CutPrefix(rest, ","); ok {
				if strings.HasPrefix(r, "}") {
					return s, fmt.Errorf("trailing comma in labels")
				}
				rest = r
			} else if !strings.HasPrefix(rest, "}") {
				return s, fmt.Errorf("labels must be separated by commas")
			}
		}
		rest = rest[1:]
	}
	fields := strings.Split(strings.TrimPrefix(rest, " "), " ")
	if !strings.HasPrefix(rest, " ") || len(fields) < 1 || len(fields) > 2 {
		return s, fmt.Errorf("want one space, a value and an optional timestamp")
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("value %q: %v", fields[0], err)
	}
	s.value = v
	if len(fields) == 2 {
		if _, err := strconv.ParseInt(fields[1], 10, 64); err != nil {
			return s, fmt.Errorf("timestamp %q is not whole milliseconds", fields[1])
		}
	}
	return s, nil
}

// readLabelValue reads an escaped value up to its closing quote, and
// returns it unescaped with the bytes it took, the quote included.
func readLabelValue(s string) (string, int, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '"':
			return b.String(), i + 1, nil
		case '\n':
			return "", 0, fmt.Errorf("raw newline")
		case '\\':
			if i+1 == len(s) {
				return "", 0, fmt.Errorf("lone backslash")
			}
			i++
			switch s[i] {
			case '\\':
				b.WriteByte('\\')
			case '"':
				b.WriteByte('"')
			case 'n':
				b.WriteByte('\n')
			default:
				return "", 0, fmt.Errorf("unknown escape \\%c", s[i])
			}
		default:
			b.WriteByte(c)
		}
	}
	return "", 0, fmt.Errorf("unterminated value")
}

// checkHelpEscapes checks that a HELP text escapes only \\ and newlines.
func checkHelpEscapes(s string) error {
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' {
			if i+1 == len(s) || (s[i+1] != '\\' && s[i+1] != 'n') {
				return fmt.Errorf("bad escape at %d", i)
			}
			i++
		}
	}
	return nil
}

// checkHistograms checks each histogram series: increasing bounds ending
// at +Inf, cumulative counts, a count equal to the +Inf bucket, and a sum.
func checkHistograms(samples []parsedSample, types map[string]string) error {
	type series struct {
		bounds, counts []float64
		sum, count     *float64
	}
	all := map[string]*series{}
	var order []string
	get := func(k string) *series {
		if all[k] == nil {
			all[k] = &series{}
			order = append(order, k)
		}
		return all[k]
	}
	for _, s := range samples {
		family := familyOf(s.name, types)
		if types[family] != "histogram" {
			continue
		}
		base := s
		base.name = family
		h := get(base.key("le"))
		switch s.name {
		case family + "_bucket":
			le, err := strconv.ParseFloat(s.labels["le"], 64)
			if err != nil {
				return fmt.Errorf("%s: le %q: %v", base.key("le"), s.labels["le"], err)
			}
			h.bounds, h.counts = append(h.bounds, le), append(h.counts, s.value)
		case family + "_sum":
			h.sum = &s.value
		case family + "_count":
			h.count = &s.value
		}
	}
	for _, k := range order {
		h := all[k]
		switch {
		case len(h.bounds) == 0 || !math.IsInf(h.bounds[len(h.bounds)-1], 1):
			return fmt.Errorf("%s: no +Inf bucket last", k)
		case h.sum == nil || h.count == nil:
			return fmt.Errorf("%s: no _sum or _count", k)
		case *h.count != h.counts[len(h.counts)-1]:
			return fmt.Errorf("%s: _count %v differs from the +Inf bucket %v", k, *h.count, h.counts[len(h.counts)-1])
		}
		for i := 1; i < len(h.bounds); i++ {
			if h.bounds[i] <= h.bounds[i-1] {
				return fmt.Errorf("%s: bounds not increasing: %v", k, h.bounds)
			}
			if h.counts[i] < h.counts[i-1] {
				return fmt.Errorf("%s: counts not cumulative: %v", k, h.counts)
			}
		}
	}
	return nil
}

// value returns the value of the sample with exactly name and labels
// ("k=v" pairs).
func value(t *testing.T, samples []parsedSample, name string, labels ...string) float64 {
	t.Helper()
	want := map[string]string{}
	for _, l := range labels {
		k, v, _ := strings.Cut(l, "=")
		want[k] = v
	}
	for _, s := range samples {
		if s.name == name && len(s.labels) == len(want) {
			match := true
			for k, v := range want {
				match = match && s.labels[k] == v
			}
			if match {
				return s.value
			}
		}
	}
	t.Fatalf("no sample %s%v", name, labels)
	return 0
}

func TestCheckExposition_RejectsWhatPrometheusWouldNot(t *testing.T) {
	const good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n"
	if _, err := checkExposition(good); err != nil {
		t.Fatalf("a valid exposition was rejected: %v", err)
	}
	tests := []struct{ name, text string }{
		{"no final newline", strings.TrimSuffix(good, "\n")},
		{"sample before TYPE", "a_total 1\n# TYPE a_total counter\n"},
		{"counter without _total", "# TYPE a counter\na 1\n"},
		{"unknown type", "# TYPE a bogus\na 1\n"},
		{"bad comment", "# a comment\n"},
		{"bad help escape", "# HELP a A \\t.\n# TYPE a gauge\na 1\n"},
		{"bad name", "# TYPE 1a gauge\n1a 1\n"},
		{"bad label name", "# TYPE a gauge\na{1x=\"v\"} 1\n"},
		{"reserved label name", "# TYPE a gauge\na{__x=\"v\"} 1\n"},
		{"unquoted label", "# TYPE a gauge\na{x=v} 1\n"},
		{"unescaped quote", "# TYPE a gauge\na{x=\"a\"b\"} 1\n"},
		{"bad escape", "# TYPE a gauge\na{x=\"a\\tb\"} 1\n"},
		{"trailing comma", "# TYPE a gauge\na{x=\"1\",} 1\n"},
		{"two spaces", "# TYPE a gauge\na  1\n"},
		{"bad value", "# TYPE a gauge\na one\n"},
		{"repeated series", "# TYPE a gauge\na{x=\"1\"} 1\na{x=\"1\"} 2\n"},
		{"family split", "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\na{x=\"1\"} 1\n"},
		{"negative counter", "# TYPE a_total counter\na_total -1\n"},
		{"histogram without +Inf", "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n"},
		{"histogram not cumulative", "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"},
		{"histogram count off", "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 1\n"},
		{"histogram without sum", "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n"},
		{"bucket without le", "# TYPE h histogram\nh_bucket 1\nh_sum 1\nh_count 1\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := checkExposition(tt.text); err == nil {
				t.Errorf("accepted:\n%s", tt.text)
			}
		})
	}
}

func TestExpo_EscapesLabelValuesAndHelp(t *testing.T) {
	var b bytes.Buffer
	e := newExpo(&b)
	e.family("odd_total", "counter", "Help with a \\ backslash\nand a newline.")
	odd := "a \"quoted\" \\ value\nover two lines"
	e.sample("odd_total", 1, "v", odd)
	e.family("big", "gauge", "Large and special values.")
	e.sample("big", 1e6, "k", "million")
	e.sample("big", 0.25, "k", "quarter")
	e.sample("big", math.Inf(1), "k", "inf")
	if err := e.flush(); err != nil {
		t.Fatal(err)
	}
	samples, err := checkExposition(b.String())
	if err != nil {
		t.Fatalf("%v\n%s", err, b.String())
	}
	if got := samples[0].labels["v"]; got != odd {
		t.Errorf("label value read back as %q, want %q", got, odd)
	}
	for _, want := range []string{`big{k="million"} 1000000`, `big{k="quarter"} 0.25`, `big{k="inf"} +Inf`} {
		if !strings.Contains(b.String(), want+"\n") {
			t.Errorf("no line %q in:\n%s", want, b.String())
		}
	}
}

func TestWaitBucket(t *testing.T) {
	tests := []struct {
		d    time.Duration
		want int
	}{
		{0, 0},
		{time.Millisecond, 0}, // le is inclusive
		{1100 * time.Microsecond, 1},
		{time.Second, 8},
		{time.Minute, len(waitBounds) - 1},
		{2 * time.Minute, len(waitBounds)},
	}
	for _, tt := range tests {
		if got := waitBucket(tt.d); got != tt.want {
			t.Errorf("waitBucket(%v) = %d, want %d", tt.d, got, tt.want)
		}
	}
}

func TestMetrics_WritesValidTextWithTheReportedCounts(t *testing.T) {
	vendor := fakeapi.New(fakeapi.Config{Limit: 3, Window: time.Minute})
	for range 5 {
		vendor.Arrive()
	}
	waits := make([]int64, len(waitBounds)+1)
	waits[0], waits[8], waits[len(waitBounds)] = 4, 2, 1
	children := []*child{{id: 0}, {id: 1}}
	children[0].totals = totals{Admitted: 7, Limited: 3, Rejected: 1, Failed: 2, ScriptCalls: 9, Waits: waits, WaitSum: 81.5}
	children[0].waiting.Store(5)
	m := &fleetMetrics{}
	m.add(&runMetrics{gate: shared, quota: "q1", window: time.Minute, vendor: vendor, children: children})
	m.add(&runMetrics{gate: naive, quota: "q2", window: time.Minute, vendor: fakeapi.New(fakeapi.Config{Limit: 3, Window: time.Minute}), children: []*child{{id: 0}}})

	url, stop, err := serveMetrics("127.0.0.1:0", m)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	text := scrapeText(t, url)
	samples, err := checkExposition(text)
	if err != nil {
		t.Fatalf("%v\n%s", err, text)
	}
	r0 := []string{"quota=q1", "gate=shared", "replica=0"}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"throttle_calls_total", append(r0, "outcome=admitted"), 7},
		{"throttle_calls_total", append(r0, "outcome=limited"), 3},
		{"throttle_vendor_limited_total", r0, 1},
		{"fleet_calls_failed_total", r0, 2},
		{"fleet_calls_waiting", r0, 5},
		{"fleet_redis_scripts_total", r0, 9},
		{"throttle_wait_seconds_bucket", append(r0, "le=0.001"), 4},
		{"throttle_wait_seconds_bucket", append(r0, "le=1"), 6},
		{"throttle_wait_seconds_bucket", append(r0, "le=+Inf"), 7},
		{"throttle_wait_seconds_count", r0, 7},
		{"throttle_wait_seconds_sum", r0, 81.5},
		{"throttle_wait_seconds_count", []string{"quota=q1", "gate=shared", "replica=1"}, 0},
		{"fleet_vendor_requests_total", []string{"quota=q1", "gate=shared", "code=200"}, 3},
		{"fleet_vendor_requests_total", []string{"quota=q1", "gate=shared", "code=429"}, 2},
		{"fleet_vendor_limit", []string{"quota=q1", "gate=shared"}, 3},
		{"fleet_vendor_window_seconds", []string{"quota=q1", "gate=shared"}, 60},
		{"fleet_vendor_window_calls", []string{"quota=q1", "gate=shared"}, 3},
		{"fleet_vendor_cap_used_ratio", []string{"quota=q1", "gate=shared"}, 1},
		{"fleet_vendor_max_window_calls", []string{"quota=q1", "gate=shared"}, 5},
		{"fleet_vendor_requests_total", []string{"quota=q2", "gate=naive", "code=200"}, 0},
	} {
		if got := value(t, samples, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

func scrapeText(t *testing.T, url string) string {
	t.Helper()
	text, err := scrape(url)
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// scrape returns the text exposition served at url.
func scrape(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != textFormat {
		return "", fmt.Errorf("GET %s: %s, Content-Type %q", url, resp.Status, resp.Header.Get("Content-Type"))
	}
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestServeMetrics_FailsOnABadAddress(t *testing.T) {
	if _, _, err := serveMetrics("no-such-host.invalid:99999", &fleetMetrics{}); err == nil || !strings.Contains(err.Error(), "-metrics") {
		t.Errorf("err = %v, want one naming -metrics", err)
	}
}

func TestReplica_TotalsMatchItsReport(t *testing.T) {
	mr := miniredis.RunT(t)
	vendor := httptest.NewServer(fakeapi.New(fakeapi.Config{Limit: 20, Window: time.Second}))
	defer vendor.Close()
	rc := replicaConfig{
		Gate: shared, Vendor: vendor.URL, Redis: mr.Addr(), Quota: "totals", Limit: 20, Window: time.Second,
		Mode: throttle.FailFast, Workers: 4, Rate: 0,
	}
	in, feed := io.Pipe()
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- runReplica(context.Background(), rc, in, &out) }()
	if _, err := io.WriteString(feed, "go\n"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	feed.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	var last message
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		if err := json.Unmarshal(sc.Bytes(), &last); err != nil {
			t.Fatal(err)
		}
	}
	if last.Kind != "done" || last.Totals == nil || last.Report == nil {
		t.Fatalf("last message %+v, want done with totals and a report", last)
	}
	tot, rep := last.Totals, last.Report
	var waits int64
	for _, n := range tot.Waits {
		waits += n
	}
	switch {
	case tot.Admitted != int64(rep.Admitted) || waits != tot.Admitted:
		t.Errorf("admitted: totals %d, waits %d, report %d", tot.Admitted, waits, rep.Admitted)
	case tot.Rejected != int64(rep.Rejected) || tot.Failed != int64(rep.Failed) || tot.ScriptCalls != rep.ScriptCalls:
		t.Errorf("totals %+v disagree with the report %+v", tot, rep)
	case tot.Admitted < 20 || tot.Limited == 0:
		t.Errorf("admitted %d and limited %d in 1.5s at 20/s in FailFast, want at least 20 and some", tot.Admitted, tot.Limited)
	}
}

func TestFleet_ServesMetricsWhileItRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a fleet of processes for a few seconds")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cfg := config{
		Procs: 2, Workers: 4, Limit: 20, Window: time.Second, Duration: 6 * time.Second,
		Mode: throttle.Block, Demand: 1.5, Skew: 0.5, Metrics: "127.0.0.1:0", exe: exe,
	}
	stderr := &lineWatch{prefix: "metrics: ", found: make(chan string, 1)}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout bytes.Buffer
	ran := make(chan error, 1)
	go func() {
		_, err := run(ctx, cfg, &stdout, stderr)
		ran <- err
	}()
	var url string
	select {
	case url = <-stderr.found:
	case err := <-ran:
		t.Fatalf("run ended before serving metrics: %v", err)
	}
	// The replicas start as the machine lets them (beside CI's race run,
	// two replicas under -race had not called 5 s in, and the run took 14
	// s): scrape until they have called, or the run has ended.
	var text string
	var admitted, accepted float64
	var runErr error
	for ended := false; !ended; time.Sleep(100 * time.Millisecond) {
		select {
		case runErr = <-ran:
			ended = true
			continue
		default:
		}
		got, err := scrape(url)
		if err != nil {
			runErr, ended = <-ran, true // the run ended as it was asked
			continue
		}
		samples, err := checkExposition(got)
		if err != nil {
			t.Fatalf("%v\n%s", err, got)
		}
		text = got
		if admitted, accepted = countCalls(t, samples); admitted > 0 && accepted > 0 {
			runErr, ended = <-ran, true
		}
	}
	if runErr != nil {
		t.Fatalf("run: %v\n%s", runErr, stdout.String())
	}
	if admitted == 0 || accepted == 0 {
		t.Errorf("while the run ran: %v calls admitted, %v accepted; want some\n%s", admitted, accepted, text)
	}
}

// lineWatch is a stderr that hands over the rest of the first line that
// starts with prefix.
type lineWatch struct {
	prefix string
	found  chan string
	mu     sync.Mutex
	buf    []byte
	done   bool
}

func (w *lineWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return len(p), nil
	}
	w.buf = append(w.buf, p...)
	for {
		line, rest, ok := bytes.Cut(w.buf, []byte("\n"))
		if !ok {
			return len(p), nil
		}
		w.buf = rest
		if s, ok := strings.CutPrefix(string(line), w.prefix); ok {
			w.found <- s
			w.done = true
			return len(p), nil
		}
	}
}

// countCalls adds up the calls the replicas admitted and the vendor
// accepted, and fails t for any 429 the vendor answered.
func countCalls(t *testing.T, samples []parsedSample) (admitted, accepted float64) {
	t.Helper()
	for _, s := range samples {
		switch {
		case s.name == "throttle_calls_total" && s.labels["outcome"] == "admitted":
			admitted += s.value
		case s.name == "fleet_vendor_requests_total" && s.labels["code"] == "200":
			accepted += s.value
		case s.name == "fleet_vendor_requests_total" && s.labels["code"] == "429" && s.value != 0:
			t.Errorf("the vendor answered 429 %v times", s.value)
		}
	}
	return admitted, accepted
}
