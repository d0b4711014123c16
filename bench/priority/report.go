package main

import (
	"fmt"
	"io"
	"strconv"

	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/bench/internal/mdtable"
)

// writeVersions says what each measured version does.
func writeVersions(w io.Writer, vs []version) {
	for _, v := range vs {
		fmt.Fprintf(w, "%s: %s.\n", v.name, v.about)
	}
	fmt.Fprintln(w)
}

// priorityHeader heads the priority scenario's table.
var priorityHeader = []string{
	"version", "mode", "interactive admitted / asked", "interactive wait p50 / p99 / max (ms)",
	"interactive over 50 ms", "batch wait p50 (ms)", "use of the cap", "calls over the cap", "failed calls",
}

// writePriority prints the priority scenario's table.
func writePriority(w io.Writer, results []priorityResult) {
	fmt.Fprintf(w, "Priority: SlidingLog{Limit: %d, Window: %v}; replicas 1 and 2: %d batch workers each, closed loop, Priority(%d); "+
		"replica 3: an interactive call every %v, Priority(%d).\n\n",
		vendorLimit, vendorWindow, batchWorkers, batchPriority, interactiveEvery, interactivePriority)
	rows := [][]string{priorityHeader}
	for _, r := range results {
		rows = append(rows, []string{
			r.version, string(r.mode),
			ratio(r.interactive.admitted, r.interactive.asked),
			durations.FormatMs(r.interactive.p50) + " / " + durations.FormatMs(r.interactive.p99) + " / " + durations.FormatMs(r.interactive.max),
			r.interactive.slowCalls(),
			durations.FormatMs(r.batch.p50),
			strconv.FormatFloat(r.use, 'f', 3, 64),
			strconv.Itoa(r.overCap),
			strconv.Itoa(r.interactive.failed + r.batch.failed),
		})
	}
	mdtable.Write(w, rows)
	fmt.Fprintln(w)
}

// tenantHeader heads the table of the fairness scenario's tenants.
var tenantHeader = []string{"version", "tenant", "replica", "admitted / demanded", "wait p50 / p99 (ms)", "over 200 ms"}

// fairnessHeader heads the table of the fairness scenario's fleet.
var fairnessHeader = []string{
	"version", "light tenants' calls/s", "heavy tenant's calls/s", "heavy / what the light left",
	"calls over the cap", "failed calls", "heavy calls started before tenant-2 first asked",
}

// writeFairness prints the fairness scenario's tables: each tenant's, then
// the fleet's.
func writeFairness(w io.Writer, results []fairnessResult) {
	fmt.Fprintf(w, "Fairness: All(SlidingLog{Limit: %d, Window: %v}, PerKey{the same}), Block mode; %s: %d workers, closed loop, on replica 1; "+
		"tenant-1 to tenant-%d: a call every %v each, odd ones on replica 2, even ones on replica 3.\n\n",
		vendorLimit, vendorWindow, heavyTenant, heavyWorkers, lightTenants, lightEvery)
	rows := [][]string{tenantHeader}
	for _, r := range results {
		rows = append(rows, tenantCells(r.version, tenantResult{name: heavyTenant + " (heavy)", replica: 1, summary: r.heavy}))
		for _, t := range r.light {
			rows = append(rows, tenantCells(r.version, t))
		}
	}
	mdtable.Write(w, rows)
	fmt.Fprintln(w)

	rows = [][]string{fairnessHeader}
	for _, r := range results {
		failed := r.heavy.failed
		for _, t := range r.light {
			failed += t.failed
		}
		rows = append(rows, []string{
			r.version,
			strconv.FormatFloat(float64(r.lightCalls)/r.span.Seconds(), 'f', 1, 64),
			strconv.FormatFloat(float64(r.heavyCalls)/r.span.Seconds(), 'f', 1, 64),
			strconv.FormatFloat(r.heavyShare, 'f', 3, 64),
			strconv.Itoa(r.overCap),
			strconv.Itoa(failed),
			strconv.Itoa(r.early),
		})
	}
	mdtable.Write(w, rows)
}

// tenantCells is a row of the tenants' table.
func tenantCells(version string, t tenantResult) []string {
	return []string{
		version, t.name, strconv.Itoa(t.replica), ratio(t.admitted, t.asked),
		durations.FormatMs(t.p50) + " / " + durations.FormatMs(t.p99), t.slowCalls(),
	}
}

// writeErrors prints the first failure of each class of calls that had any.
func writeErrors(w io.Writer, res results) {
	note := func(what string, s summary) {
		if s.first != nil {
			fmt.Fprintf(w, "%s: %d failed, the first: %v\n", what, s.failed, s.first)
		}
	}
	for _, r := range res.priority {
		note(fmt.Sprintf("priority %s %s, interactive", r.version, r.mode), r.interactive)
		note(fmt.Sprintf("priority %s %s, batch", r.version, r.mode), r.batch)
	}
	for _, r := range res.fairness {
		note(fmt.Sprintf("fairness %s, %s", r.version, heavyTenant), r.heavy)
		for _, t := range r.light {
			note(fmt.Sprintf("fairness %s, %s", r.version, t.name), t.summary)
		}
	}
}

// ratio formats n of of, and their quotient.
func ratio(n, of int) string {
	if of == 0 {
		return "0/0"
	}
	return fmt.Sprintf("%d/%d (%.3f)", n, of, float64(n)/float64(of))
}
