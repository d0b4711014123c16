package main

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"github.com/throttlekit/throttle/bench/internal/mdtable"
)

// summary is the mean of a fleet's simulated runs, one per seed.
type summary struct {
	Fleet                      Fleet
	Runs                       []Result
	Admitted                   float64
	Utilization                float64
	UtilizationMin             float64
	UtilizationMax             float64
	ScriptsPerAdmitted         float64
	WaitP50, WaitP99           float64 // ms
	LateFails                  float64
	RedisMicros, RedisBusy     float64
	InRedisP50, InRedisP99     float64 // ms
	MaxInWindow                int     // the most calls in one vendor window, over every run
	RoundTripP50, RoundTripP99 float64 // ms
	WayP50, WayP99             float64 // ms
	BiggestTurn                float64
	Paced                      int // runs paced at the end
}

// simulate runs f once per seed 1..seeds and sums the runs up.
func simulate(f Fleet, c Costs, seeds int) summary {
	s := summary{Fleet: f, UtilizationMin: math.Inf(1), UtilizationMax: math.Inf(-1)}
	n := float64(seeds)
	ms := func(us int64) float64 { return float64(us) / 1000 / n }
	for seed := range seeds {
		r := Simulate(f, c, uint64(seed+1))
		s.Runs = append(s.Runs, r)
		s.Admitted += float64(r.Admitted) / n
		s.Utilization += r.Utilization / n
		s.UtilizationMin = min(s.UtilizationMin, r.Utilization)
		s.UtilizationMax = max(s.UtilizationMax, r.Utilization)
		s.ScriptsPerAdmitted += r.ScriptsPerAdmitted() / n
		s.WaitP50 += ms(r.WaitP50)
		s.WaitP99 += ms(r.WaitP99)
		s.LateFails += float64(r.LateFails) / n
		s.RedisMicros += r.RedisMicros / n
		s.RedisBusy += r.RedisBusy / n
		s.InRedisP50 += ms(r.InRedisP50)
		s.InRedisP99 += ms(r.InRedisP99)
		s.MaxInWindow = max(s.MaxInWindow, r.MaxInWindow)
		s.RoundTripP50 += ms(r.RoundTripP50)
		s.RoundTripP99 += ms(r.RoundTripP99)
		s.WayP50 += ms(r.WayP50)
		s.WayP99 += ms(r.WayP99)
		s.BiggestTurn += float64(r.BiggestTurn) / n
		if r.Paced {
			s.Paced++
		}
	}
	return s
}

// check is a measured scenario, the mean of its runs, and its simulation.
type check struct {
	m    Measured
	runs []Measured
	sim  summary
}

// spread formats the range of a figure over the runs, when there are more
// than one.
func (c check) spread(figure func(Measured) float64) string {
	if len(c.runs) < 2 {
		return ""
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range c.runs {
		lo, hi = min(lo, figure(r)), max(hi, figure(r))
	}
	return fmt.Sprintf(" (%s-%s)", f3(lo), f3(hi))
}

// diff formats the simulation's difference from the measured figure.
func diff(measured, simulated float64) string {
	if measured == 0 {
		return "-"
	}
	return fmt.Sprintf("%+.1f%%", 100*(simulated/measured-1))
}

func f3(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }

// ms formats milliseconds as the conditions program does: one decimal
// under 100.
func ms(v float64) string {
	if v < 100 {
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func writeAccuracy(w io.Writer, checks []check) {
	rows := [][]string{{
		"scenario", "utilization m / s", "diff", "scripts/admitted m / s", "diff",
		"wait p50 m / s (ms)", "diff", "wait p99 m / s (ms)", "diff",
		"script round trip p99 m / s (ms)", "EVALSHA µs m / s", "fn start to vendor p99 m / s (ms)",
	}}
	for _, c := range checks {
		m, s := c.m, c.sim
		rows = append(rows, []string{
			m.Name,
			f3(m.Utilization) + c.spread(func(r Measured) float64 { return r.Utilization }) + " / " + f3(s.Utilization),
			diff(m.Utilization, s.Utilization),
			f3(m.ScriptsPerAdmitted) + c.spread(func(r Measured) float64 { return r.ScriptsPerAdmitted }) + " / " + f3(s.ScriptsPerAdmitted),
			diff(m.ScriptsPerAdmitted, s.ScriptsPerAdmitted),
			ms(m.WaitP50) + " / " + ms(s.WaitP50), diff(m.WaitP50, s.WaitP50),
			ms(m.WaitP99) + " / " + ms(s.WaitP99), diff(m.WaitP99, s.WaitP99),
			ms(m.RoundTripP99) + " / " + ms(s.RoundTripP99),
			fmt.Sprintf("%.0f / %.0f", m.RedisMicros, s.RedisMicros),
			ms(m.WayP99) + " / " + ms(s.WayP99),
		})
	}
	mdtable.Write(w, rows)
}

func writeSeries(w io.Writer, series []summary) {
	rows := [][]string{{
		"replicas", "admitted", "max/cap", "utilization (runs' range)", "scripts/admitted", "wait p50 / p99 (ms)",
		"late-start failures", "Redis µs per script", "Redis busy", "time in Redis p50 / p99 (ms)",
		"script round trip p50 / p99 (ms)", "largest turn (requests)", "paced at the end",
	}}
	for _, s := range series {
		rows = append(rows, []string{
			strconv.Itoa(s.Fleet.replicas()),
			fmt.Sprintf("%.0f", s.Admitted),
			fmt.Sprintf("%d/%d", s.MaxInWindow, s.Fleet.Limit),
			fmt.Sprintf("%s (%s-%s)", f3(s.Utilization), f3(s.UtilizationMin), f3(s.UtilizationMax)),
			f3(s.ScriptsPerAdmitted),
			ms(s.WaitP50) + " / " + ms(s.WaitP99),
			fmt.Sprintf("%.0f", s.LateFails),
			fmt.Sprintf("%.0f", s.RedisMicros),
			fmt.Sprintf("%.2f", s.RedisBusy),
			ms(s.InRedisP50) + " / " + ms(s.InRedisP99),
			ms(s.RoundTripP50) + " / " + ms(s.RoundTripP99),
			fmt.Sprintf("%.0f", s.BiggestTurn),
			fmt.Sprintf("%d of %d", s.Paced, len(s.Runs)),
		})
	}
	mdtable.Write(w, rows)
}

// chartWidth is the width of the chart's bars, in characters.
const chartWidth = 50

// writeChart draws the utilization and the script calls per admitted call
// of each simulated fleet as bars, with the measured figures of the fleets
// of as many one-worker replicas marked on them.
func writeChart(w io.Writer, series []summary, checks []check) {
	bars := func(title string, top float64, value func(summary) float64, measured func(Measured) float64) {
		fmt.Fprintf(w, "%s (# simulated, | measured; the axis runs from 0 to %g)\n", title, top)
		for _, s := range series {
			v := value(s)
			n := min(int(math.Round(v/top*chartWidth)), chartWidth)
			bar := []rune(strings.Repeat("#", n) + strings.Repeat(" ", chartWidth-n))
			var marks []string
			for _, c := range checks {
				f := c.sim.Fleet
				if f.Workers != 1 || f.replicas() != s.Fleet.replicas() || f.Limit != s.Fleet.Limit {
					continue
				}
				mv := measured(c.m)
				if i := min(int(math.Round(mv/top*chartWidth)), chartWidth) - 1; i >= 0 {
					bar[i] = '|'
				}
				marks = append(marks, fmt.Sprintf("%s %.3f", c.m.Name, mv))
			}
			line := fmt.Sprintf("%7d %s %.3f", s.Fleet.replicas(), string(bar), v)
			if len(marks) > 0 {
				line += "  measured: " + strings.Join(marks, ", ")
			}
			fmt.Fprintln(w, line)
		}
		fmt.Fprintln(w)
	}
	bars("Utilization of the cap", 1, func(s summary) float64 { return s.Utilization }, func(m Measured) float64 { return m.Utilization })
	bars("Script calls per admitted call", 2, func(s summary) float64 { return s.ScriptsPerAdmitted }, func(m Measured) float64 { return m.ScriptsPerAdmitted })
	writeSparklines(w, series)
}

// sparks are the levels of a sparkline, from none to the cap's rate.
var sparks = []rune(" ▁▂▃▄▅▆▇█")

// writeSparklines draws, for each fleet's first run, the calls that
// reached the vendor in each quarter second, against the cap's rate.
func writeSparklines(w io.Writer, series []summary) {
	fmt.Fprintln(w, "Calls at the vendor per quarter second, first seed (█ = the cap's rate or more)")
	for _, s := range series {
		full := float64(s.Fleet.Limit) * timeSlice / float64(s.Fleet.Window)
		var b strings.Builder
		for _, sl := range s.Runs[0].Timeline {
			level := int(math.Round(float64(sl.Arrivals) / full * float64(len(sparks)-1)))
			b.WriteRune(sparks[min(level, len(sparks)-1)])
		}
		fmt.Fprintf(w, "%7d |%s|\n", s.Fleet.replicas(), b.String())
	}
}

// writeTimelines prints each fleet's first run by quarter second.
func writeTimelines(w io.Writer, series []summary) {
	for _, s := range series {
		fmt.Fprintf(w, "%d replicas, seed 1, by quarter second:\n", s.Fleet.replicas())
		rows := [][]string{{"from (s)", "calls at the vendor", "script calls", "booked again late", "margin (ms)", "paced"}}
		for i, sl := range s.Runs[0].Timeline {
			rows = append(rows, []string{
				strconv.FormatFloat(float64(i)*timeSlice/1e6, 'f', 2, 64),
				strconv.Itoa(sl.Arrivals), strconv.Itoa(sl.Scripts), strconv.Itoa(sl.Rebooks),
				strconv.FormatInt(sl.Margin/1000, 10), strconv.FormatBool(sl.Paced),
			})
		}
		mdtable.Write(w, rows)
		fmt.Fprintln(w)
	}
}
