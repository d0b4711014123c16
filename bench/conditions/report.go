package main

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"time"

	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/bench/internal/mdtable"
)

// result is one scenario's row, and what the notes say of it.
type result struct {
	Name     string
	Admitted int
	// What the vendor saw.
	OverCap     int // units answered 429
	MaxInWindow int // the most units in one of its windows
	Cap         int
	Utilization float64

	ScriptCalls      int64
	WaitP50, WaitP99 time.Duration

	// Calls that failed because the run ended, in all and by how.
	EndOfRun, EndLimited, EndContext, EndUnavailable int
	Unavailable                                      int // ErrUnavailable before the end
	TimedOut                                         int // of which Redis answered too late
	FirstUnavailable                                 string
	Errors                                           int // any other failure
	Late                                             int // of which ErrLimited: a late start refused
	FirstError                                       string

	Spread, Margin time.Duration // at the end, as Usage read them
	UsageError     string
	Stderr         []counted // the distinct lines the replicas wrote on stderr

	// Where the time went.
	RoundTrip   spread // of the script calls, as the limiters saw them
	WayToVendor spread // from fn's start to the arrival at the vendor
	// MaxStartedInWindow is the most calls started in one vendor window,
	// by fn's start rather than by the arrival at the vendor.
	MaxStartedInWindow int
	ScriptMicros       float64       // Redis's mean time per EVALSHA
	RedisCPU           time.Duration // the CPU time Redis used
	Load               string        // the load average at the end

	Timeline []slice // with -timeline, the run slice by slice
}

// counted is a line and how many times it came.
type counted struct {
	line string
	n    int
}

// spread sums up a set of durations.
type spread struct {
	P50, P99, Max time.Duration
}

// newSpread sums up sorted.
func newSpread(sorted []time.Duration) spread {
	if len(sorted) == 0 {
		return spread{}
	}
	return spread{durations.Percentile(sorted, 0.50), durations.Percentile(sorted, 0.99), sorted[len(sorted)-1]}
}

func (s spread) String() string {
	return durations.FormatMs(s.P50) + " / " + durations.FormatMs(s.P99) + " / " + durations.FormatMs(s.Max)
}

// scriptsPerAdmitted is the script calls per admitted call.
func (r result) scriptsPerAdmitted() float64 {
	if r.Admitted == 0 {
		return math.NaN()
	}
	return float64(r.ScriptCalls) / float64(r.Admitted)
}

var tableHeader = []string{
	"scenario", "admitted", "429s", "max/cap", "utilization", "scripts/admitted",
	"wait p50 / p99 (ms)", "errors (late starts)", "unavailable (timed out)", "spread / margin (ms)",
}

func (r result) cells() []string {
	return []string{
		r.Name,
		strconv.Itoa(r.Admitted),
		strconv.Itoa(r.OverCap),
		fmt.Sprintf("%d/%d", r.MaxInWindow, r.Cap),
		strconv.FormatFloat(r.Utilization, 'f', 3, 64),
		strconv.FormatFloat(r.scriptsPerAdmitted(), 'f', 3, 64),
		durations.FormatMs(r.WaitP50) + " / " + durations.FormatMs(r.WaitP99),
		fmt.Sprintf("%d (%d)", r.Errors, r.Late),
		fmt.Sprintf("%d (%d)", r.Unavailable, r.TimedOut),
		durations.FormatMs(r.Spread) + " / " + durations.FormatMs(r.Margin),
	}
}

var detailHeader = []string{
	"scenario", "script round trip p50 / p99 / max (ms)", "fn start to vendor p50 / p99 / max (ms)",
	"max/cap by fn start", "EVALSHA µs in Redis", "Redis CPU (s)",
	"failed at the end: slot past it / context / context in a round trip", "load",
}

func (r result) detailCells() []string {
	return []string{
		r.Name, r.RoundTrip.String(), r.WayToVendor.String(),
		fmt.Sprintf("%d/%d", r.MaxStartedInWindow, r.Cap),
		strconv.FormatFloat(r.ScriptMicros, 'f', 0, 64),
		strconv.FormatFloat(r.RedisCPU.Seconds(), 'f', 1, 64),
		fmt.Sprintf("%d / %d / %d", r.EndLimited, r.EndContext, r.EndUnavailable),
		r.Load,
	}
}

// writeTable prints the main table.
func writeTable(w io.Writer, results []result) {
	rows := [][]string{tableHeader}
	for _, r := range results {
		rows = append(rows, r.cells())
	}
	mdtable.Write(w, rows)
}

// writeDetails prints where the time went, and how calls failed at the end.
func writeDetails(w io.Writer, results []result) {
	rows := [][]string{detailHeader}
	for _, r := range results {
		rows = append(rows, r.detailCells())
	}
	mdtable.Write(w, rows)
}

// How many distinct lines of the replicas' stderr the notes show for a
// scenario, and how much of each.
const (
	stderrLines = 5
	stderrWidth = 300
)

// writeNotes prints anything that went wrong.
func writeNotes(w io.Writer, results []result) {
	for _, r := range results {
		if r.FirstError != "" {
			fmt.Fprintf(w, "%s: first error: %s\n", r.Name, r.FirstError)
		}
		if r.FirstUnavailable != "" {
			fmt.Fprintf(w, "%s: first ErrUnavailable: %s\n", r.Name, r.FirstUnavailable)
		}
		if r.UsageError != "" {
			fmt.Fprintf(w, "%s: Usage: %s\n", r.Name, r.UsageError)
		}
		for i, c := range r.Stderr {
			if i == stderrLines {
				fmt.Fprintf(w, "%s: stderr: %d more distinct lines\n", r.Name, len(r.Stderr)-i)
				break
			}
			line := c.line
			if len(line) > stderrWidth {
				line = line[:stderrWidth] + "..."
			}
			fmt.Fprintf(w, "%s: stderr, %d×: %s\n", r.Name, c.n, line)
		}
	}
}
