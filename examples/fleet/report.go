package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/throttlekit/throttle/examples/fakeapi"
)

// Result is one fleet run as the vendor and the replicas saw it.
type Result struct {
	Variant variant       // how the replicas limited themselves
	Title   string        // the run's name in its table and on the chart
	Short   string        // the title in the side-by-side table
	Limit   int           // the vendor's cap: calls per window
	Window  time.Duration // the vendor's window
	// Ran is the time from the start signal to the stop signal.
	Ran      time.Duration
	Replicas []Row // a row per replica, in order
	Fleet    Row   // the replicas' rows added up
	// OverCap is the calls the vendor answered 429, fleet-wide. The
	// promise of throttle is that it stays 0.
	OverCap int
	// MaxInWindow is the most calls, 429s included, the vendor saw in any
	// window: at most Limit when the fleet kept under the cap.
	MaxInWindow int
	// Seconds holds the vendor's answers in each second since the start.
	Seconds []second
	// TenantLimit and TenantMaxInWindow, with tenants, are each tenant's
	// limit and the most calls the vendor accepted for one tenant in any
	// window.
	TenantLimit       int
	TenantMaxInWindow int // see TenantLimit
}

// second is what the vendor answered in one second of a run.
type second struct {
	Accepted, Rejected int
}

// Row is one line of a results table: a replica or the whole fleet.
type Row struct {
	Name string // the replica's number, or "fleet"
	// Admitted is the calls the limiter let go to the vendor.
	Admitted int
	// Accepted and OverCap are the vendor's answers: 200 and 429.
	Accepted, OverCap int
	// Failed is the calls lost to Redis or network errors; Unfinished the
	// calls still waiting for a slot when the run ended.
	Failed, Unfinished int
	// Utilization is the share of the vendor's cap these calls used; see
	// summarize.
	Utilization float64
	// P50 and P99 are percentiles of the wait for a slot.
	P50, P99 time.Duration
	// ScriptCalls is the Redis scripts run (EVALSHA, EVAL); 0 without
	// Redis. The calls still waiting at the end ran some of them too.
	ScriptCalls int64
	// FirstError is the first failure, if any.
	FirstError string
}

// ScriptsPerCall is the Redis scripts run per admitted call.
func (r Row) ScriptsPerCall() float64 {
	if r.Admitted == 0 {
		return 0
	}
	return float64(r.ScriptCalls) / float64(r.Admitted)
}

// summarize puts together what the vendor and the replicas saw.
//
// Utilization counts the calls the vendor accepted in the whole windows
// since the start, against what those windows allow. An exact sliding log
// admits a window's worth in a burst at each window's start, so a count over
// a span that ends just after such a burst, or just before it, would be off
// by a whole burst; whole windows from the start hold a whole number of them.
func summarize(cfg config, v variant, ran time.Duration, st fakeapi.Stats, arrivals []arrival, reports []replicaReport) Result {
	res := Result{
		Variant:     v,
		Title:       v.title(cfg),
		Short:       v.short(cfg),
		Limit:       cfg.Limit,
		Window:      cfg.Window,
		Ran:         ran,
		OverCap:     st.OverCap,
		MaxInWindow: st.MaxInWindow,
		Seconds:     perSecond(arrivals),
	}
	windows := max(1, int(ran/cfg.Window))
	counted := time.Duration(windows) * cfg.Window
	allowance := float64(windows * cfg.Limit)

	rows, allWaits := replicaRows(reports)
	inWindows, tenantTimes := tallyArrivals(rows, arrivals, counted)
	for i := range rows {
		rows[i].Utilization = float64(inWindows[i]) / allowance
	}
	res.Replicas, res.Fleet = rows, fleetRow(rows, inWindows, allowance, allWaits)

	if cfg.Tenants > 0 && v == shared {
		res.TenantLimit = cfg.TenantLimit
		for _, ts := range tenantTimes {
			res.TenantMaxInWindow = max(res.TenantMaxInWindow, maxInWindow(ts, cfg.Window))
		}
	}
	return res
}

// replicaRows returns a row for each replica's report, and the waits of
// them all.
func replicaRows(reports []replicaReport) ([]Row, []int64) {
	rows := make([]Row, len(reports))
	var allWaits []int64
	for i, rep := range reports {
		rows[i] = Row{
			Name:        strconv.Itoa(i),
			Admitted:    rep.Admitted,
			Failed:      rep.Failed,
			Unfinished:  rep.Unfinished,
			ScriptCalls: rep.ScriptCalls,
			FirstError:  rep.FirstError,
		}
		rows[i].P50, rows[i].P99 = percentiles(rep.WaitsMicros)
		allWaits = append(allWaits, rep.WaitsMicros...)
	}
	return rows, allWaits
}

// perSecond returns the vendor's answers in each second since the start.
func perSecond(arrivals []arrival) []second {
	var seconds []second
	for _, a := range arrivals {
		if a.at < 0 {
			continue
		}
		s := int(a.at / time.Second)
		if s >= len(seconds) {
			seconds = append(seconds, make([]second, s+1-len(seconds))...)
		}
		if a.ok {
			seconds[s].Accepted++
		} else {
			seconds[s].Rejected++
		}
	}
	return seconds
}

// tallyArrivals adds the vendor's answers to each replica's row. It returns
// the calls each replica had accepted before counted, and when the vendor
// accepted each tenant's calls.
func tallyArrivals(rows []Row, arrivals []arrival, counted time.Duration) ([]int, map[int][]time.Duration) {
	inWindows := make([]int, len(rows))
	tenantTimes := map[int][]time.Duration{}
	for _, a := range arrivals {
		if a.replica < 0 || a.replica >= len(rows) {
			continue
		}
		r := &rows[a.replica]
		if !a.ok {
			r.OverCap++
			continue
		}
		r.Accepted++
		if a.at >= 0 && a.at < counted {
			inWindows[a.replica]++
		}
		if a.tenant >= 0 {
			tenantTimes[a.tenant] = append(tenantTimes[a.tenant], a.at)
		}
	}
	return inWindows, tenantTimes
}

// fleetRow adds up the replicas' rows.
func fleetRow(rows []Row, inWindows []int, allowance float64, allWaits []int64) Row {
	fleet := Row{Name: "fleet"}
	fleetInWindows := 0
	for i, r := range rows {
		fleetInWindows += inWindows[i]
		fleet.Admitted += r.Admitted
		fleet.Accepted += r.Accepted
		fleet.OverCap += r.OverCap
		fleet.Failed += r.Failed
		fleet.Unfinished += r.Unfinished
		fleet.ScriptCalls += r.ScriptCalls
		if fleet.FirstError == "" {
			fleet.FirstError = r.FirstError
		}
	}
	fleet.Utilization = float64(fleetInWindows) / allowance
	fleet.P50, fleet.P99 = percentiles(allWaits)
	return fleet
}

// percentiles returns the median and the 99th percentile, by nearest rank.
func percentiles(micros []int64) (p50, p99 time.Duration) {
	if len(micros) == 0 {
		return 0, 0
	}
	s := slices.Clone(micros)
	slices.Sort(s)
	rank := func(p float64) time.Duration {
		i := max(0, int(math.Ceil(p*float64(len(s))))-1)
		return time.Duration(s[i]) * time.Microsecond
	}
	return rank(0.50), rank(0.99)
}

// maxInWindow returns the most times in any half-open window (t-w, t], as
// the vendor counts.
func maxInWindow(ts []time.Duration, w time.Duration) int {
	s := slices.Clone(ts)
	slices.Sort(s)
	most, lo := 0, 0
	for hi, t := range s {
		for s[lo] <= t-w {
			lo++
		}
		most = max(most, hi-lo+1)
	}
	return most
}

func printHeader(w io.Writer, cfg config, redisAt string) {
	fmt.Fprintf(w, "fleet:   %d replica processes × %d workers, %s mode\n", cfg.Procs, cfg.Workers, cfg.Mode)
	fmt.Fprintf(w, "vendor:  strict sliding window, cap %d calls per %v; a call past it gets 429\n", cfg.Limit, cfg.Window)
	fmt.Fprintf(w, "redis:   %s\n", redisAt)
	if cfg.Demand > 0 {
		fmt.Fprintf(w, "load:    the fleet asks for %.3g× the cap", cfg.Demand)
		if cfg.Procs > 1 {
			fmt.Fprintf(w, ", %.0f%% of it on replica 0", 100*cfg.Skew)
		}
		fmt.Fprintln(w)
	} else {
		fmt.Fprintln(w, "load:    every worker calls as fast as it is admitted")
	}
	if cfg.Tenants > 0 {
		fmt.Fprintf(w, "tenants: %d, each at most %d calls per %v (shared quota only)\n", cfg.Tenants, cfg.TenantLimit, cfg.Window)
	}
	fmt.Fprintf(w, "cap used: calls the vendor accepted in the whole %v windows of a run, over what those windows allow\n\n", cfg.Window)
}

func printResult(w io.Writer, res Result) {
	fmt.Fprintf(w, "%s — %.1fs\n", res.Title, res.Ran.Seconds())
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "replica\tadmitted\tvendor 429s\tcap used\tp50 wait\tp99 wait\tscript calls/call\t")
	for _, r := range append(slices.Clone(res.Replicas), res.Fleet) {
		// Padded here, since tabwriter aligns every column alike.
		fmt.Fprintf(tw, "%-7s\t%d\t%d\t%s\t%s\t%s\t%s\t\n",
			r.Name, r.Admitted, r.OverCap, percent(r.Utilization), wait(r.P50), wait(r.P99), scriptsPerCall(res, r))
	}
	tw.Flush()
	fmt.Fprintf(w, "fleet 429s counted by the vendor: %d; busiest %v window: %d of %d calls\n",
		res.OverCap, res.Window, res.MaxInWindow, res.Limit)
	if f := res.Fleet; f.Unfinished > 0 {
		fmt.Fprintf(w, "%d calls were still waiting for a slot when the run stopped", f.Unfinished)
		if res.Variant == shared {
			// Their scripts count in the table, with no admitted call to show for them.
			fmt.Fprintf(w, "; their Redis scripts count in script calls/call")
		}
		fmt.Fprintln(w)
	}
	if res.TenantLimit > 0 {
		fmt.Fprintf(w, "busiest %v window of one tenant: %d of %d calls\n", res.Window, res.TenantMaxInWindow, res.TenantLimit)
	}
	for _, r := range res.Replicas {
		if r.Failed > 0 {
			fmt.Fprintf(w, "replica %s: %d calls failed, first: %s\n", r.Name, r.Failed, r.FirstError)
		}
	}
	fmt.Fprintln(w)
}

// printComparison prints the runs side by side.
func printComparison(w io.Writer, runs []Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(Result) string) {
		cells := []string{fmt.Sprintf("%-17s", name)}
		for _, r := range runs {
			cells = append(cells, cell(r))
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	row("", func(r Result) string { return r.Short })
	row("calls admitted", func(r Result) string { return strconv.Itoa(r.Fleet.Admitted) })
	row("vendor accepted", func(r Result) string { return strconv.Itoa(r.Fleet.Accepted) })
	row("vendor 429s", func(r Result) string { return strconv.Itoa(r.OverCap) })
	row("cap used", func(r Result) string { return percent(r.Fleet.Utilization) })
	row("busiest window", func(r Result) string { return fmt.Sprintf("%d/%d", r.MaxInWindow, r.Limit) })
	row("p50 wait", func(r Result) string { return wait(r.Fleet.P50) })
	row("p99 wait", func(r Result) string { return wait(r.Fleet.P99) })
	row("script calls/call", func(r Result) string { return scriptsPerCall(r, r.Fleet) })
	fmt.Fprintln(w, "side by side:")
	tw.Flush()
}

func percent(f float64) string { return strconv.FormatFloat(100*f, 'f', 1, 64) + "%" }

func scriptsPerCall(res Result, r Row) string {
	if res.Variant != shared {
		return "-"
	}
	return strconv.FormatFloat(r.ScriptsPerCall(), 'f', 2, 64)
}

func wait(d time.Duration) string {
	switch {
	case d < 10*time.Millisecond:
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64) + "ms"
	case d < time.Second:
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 0, 64) + "ms"
	}
	return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) + "s"
}
