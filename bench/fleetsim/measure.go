package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Measured is one scenario's row as the conditions program printed it.
type Measured struct {
	Name               string  // the scenario, as replicas-1000
	Admitted           int     // calls the limiters let through
	Utilization        float64 // the vendor's window count over its cap, averaged
	ScriptsPerAdmitted float64 // script calls per admitted call
	WaitP50, WaitP99   float64 // ms
	LateStarts         int     // calls refused because every slot came too late to start in
	RoundTripP50       float64 // ms, script calls as the limiters saw them
	RoundTripP99       float64 // ms, likewise
	WayP50, WayP99     float64 // ms, from fn's start to the vendor
	RedisMicros        float64 // Redis's mean time per EVALSHA
}

// measure builds the conditions program from benchDir/conditions, runs the
// scenarios named for duration, copies its output to out and returns it.
func measure(ctx context.Context, benchDir string, scenarios []string, duration string, out, progress io.Writer) (string, error) {
	dir, err := os.MkdirTemp("", "fleetsim")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	exe := filepath.Join(dir, "conditions")
	build := exec.CommandContext(ctx, "go", "build", "-o", exe, "./conditions")
	build.Dir, build.Stdout, build.Stderr = benchDir, progress, progress
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("build the conditions program: %w", err)
	}
	var stdout bytes.Buffer
	run := exec.CommandContext(ctx, exe, "-only", strings.Join(scenarios, ","), "-duration", duration)
	run.Dir, run.Stdout, run.Stderr = benchDir, io.MultiWriter(&stdout, out), progress
	if err := run.Run(); err != nil {
		return "", fmt.Errorf("run the conditions program: %w", err)
	}
	return stdout.String(), nil
}

// benchDir returns the bench module's directory as seen from the working
// directory: this program runs from bench, from the repository's root, or
// from its own directory.
func benchDir() string {
	for _, dir := range []string{".", "bench", ".."} {
		if st, err := os.Stat(filepath.Join(dir, "conditions", "main.go")); err == nil && !st.IsDir() {
			return dir
		}
	}
	return "."
}

// parseConditions reads the rows of the conditions program's two tables,
// for each run of it that text holds: each run prints its main table, then
// the table of where the time went.
func parseConditions(text string) ([]map[string]*Measured, error) {
	var runs []map[string]*Measured
	var rows map[string]*Measured
	var header []string
	for line := range strings.Lines(text) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "|") {
			header = nil
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		switch {
		case cells[0] == "scenario":
			// The conditions program's tables, not this program's.
			header = nil
			if slices.Contains(cells, "utilization") {
				rows = map[string]*Measured{}
				runs = append(runs, rows)
				header = cells
			} else if rows != nil && strings.HasPrefix(cells[1], "script round trip") {
				header = cells
			}
			continue
		case strings.HasPrefix(cells[0], "---") || header == nil:
			continue
		}
		m := rows[cells[0]]
		if m == nil {
			m = &Measured{Name: cells[0]}
			rows[cells[0]] = m
		}
		for i, cell := range cells {
			if i >= len(header) {
				break
			}
			if err := m.set(header[i], cell); err != nil {
				return nil, fmt.Errorf("%s: %s: %w", m.Name, header[i], err)
			}
		}
	}
	if len(runs) == 0 {
		return nil, fmt.Errorf("no table of the conditions program in the output")
	}
	return runs, nil
}

// set reads one cell of the column named column.
func (m *Measured) set(column, cell string) error {
	var err error
	switch {
	case column == "admitted":
		m.Admitted, err = strconv.Atoi(cell)
	case column == "utilization":
		m.Utilization, err = strconv.ParseFloat(cell, 64)
	case column == "scripts/admitted":
		m.ScriptsPerAdmitted, err = strconv.ParseFloat(cell, 64)
	case strings.HasPrefix(column, "wait p50"):
		err = numbers(cell, &m.WaitP50, &m.WaitP99)
	case strings.HasPrefix(column, "errors"):
		// "errors (late starts)": the late starts are in brackets.
		_, late, _ := strings.Cut(cell, "(")
		m.LateStarts, err = strconv.Atoi(strings.TrimSuffix(late, ")"))
	case strings.HasPrefix(column, "script round trip"):
		var most float64
		err = numbers(cell, &m.RoundTripP50, &m.RoundTripP99, &most)
	case strings.HasPrefix(column, "fn start to vendor"):
		var most float64
		err = numbers(cell, &m.WayP50, &m.WayP99, &most)
	case strings.HasPrefix(column, "EVALSHA"):
		m.RedisMicros, err = strconv.ParseFloat(cell, 64)
	}
	return err
}

// numbers reads "a / b / c" into to.
func numbers(cell string, to ...*float64) error {
	parts := strings.Split(cell, "/")
	if len(parts) != len(to) {
		return fmt.Errorf("want %d numbers in %q", len(to), cell)
	}
	for i, p := range parts {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil {
			return err
		}
		*to[i] = v
	}
	return nil
}

// mean returns the mean of runs of one scenario.
func mean(runs []Measured) Measured {
	m := Measured{Name: runs[0].Name}
	n := float64(len(runs))
	var admitted, late float64
	for _, r := range runs {
		admitted += float64(r.Admitted) / n
		late += float64(r.LateStarts) / n
		m.Utilization += r.Utilization / n
		m.ScriptsPerAdmitted += r.ScriptsPerAdmitted / n
		m.WaitP50 += r.WaitP50 / n
		m.WaitP99 += r.WaitP99 / n
		m.RoundTripP50 += r.RoundTripP50 / n
		m.RoundTripP99 += r.RoundTripP99 / n
		m.WayP50 += r.WayP50 / n
		m.WayP99 += r.WayP99 / n
		m.RedisMicros += r.RedisMicros / n
	}
	m.Admitted, m.LateStarts = int(math.Round(admitted)), int(math.Round(late))
	return m
}
