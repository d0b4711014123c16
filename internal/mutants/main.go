// Command mutants measures the mutation efficacy of the root package on a
// random sample of the mutants that gremlins finds, where running every
// mutant would take hours: each sampled mutant is applied through an
// overlay (the tree is never written) and the package's tests run against
// it; a mutant that makes a test fail is killed, one that passes them all
// lived, one that does not compile is not viable.
//
//	CI=true gremlins unleash --dry-run --tags mutation . > dry.txt
//	CI=true go run ./internal/mutants -n 80 dry.txt
//
// The mutation build tag leaves the slowest tests out (mutation_test.go),
// so the efficacy it prints is a floor.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

type mutant struct {
	kind string
	file string
	line int
	col  int
}

func (m mutant) String() string { return fmt.Sprintf("%s at %s:%d:%d", m.kind, m.file, m.line, m.col) }

// swaps gives, for each kind of mutant gremlins makes, the operator each
// operator becomes.
var swaps = map[string]map[string]string{
	"CONDITIONALS_BOUNDARY": {"<": "<=", "<=": "<", ">": ">=", ">=": ">"},
	"CONDITIONALS_NEGATION": {"==": "!=", "!=": "==", "<": ">=", "<=": ">", ">": "<=", ">=": "<"},
	"ARITHMETIC_BASE":       {"+": "-", "-": "+", "*": "/", "/": "*", "%": "*", "+=": "-=", "-=": "+=", "*=": "/=", "/=": "*="},
	"INCREMENT_DECREMENT":   {"++": "--", "--": "++"},
	"INVERT_NEGATIVES":      {"-": "+"},
}

var operators = []string{"<=", ">=", "==", "!=", "++", "--", "+=", "-=", "*=", "/=", "<", ">", "+", "-", "*", "/", "%"}

func main() {
	n := flag.Int("n", 80, "mutants to sample")
	seed := flag.Uint64("seed", 1, "seed of the sample")
	timeout := flag.Duration("timeout", 5*time.Minute, "longest test run of one mutant")
	from := flag.Int("from", 1, "the first of the sampled mutants to run, to go on with a run cut short")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: mutants [-n 80] [-seed 1] gremlins-dry-run.txt")
		os.Exit(2)
	}
	all, err := readMutants(flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	rng := rand.New(rand.NewPCG(*seed, 0))
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	all = all[:min(*n, len(all))]
	tmp, err := os.MkdirTemp("", "mutants")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer os.RemoveAll(tmp)
	var killed, lived, notViable int
	for i, m := range all {
		if i+1 < *from {
			continue
		}
		status, err := try(m, tmp, *timeout)
		if err != nil {
			fmt.Fprintln(os.Stderr, m, err)
			os.Exit(1)
		}
		switch status {
		case "KILLED", "TIMED OUT":
			killed++
		case "LIVED":
			lived++
		default:
			notViable++
		}
		fmt.Printf("%3d/%d %-10s %s\n", i+1, len(all), status, m)
	}
	fmt.Printf("killed %d, lived %d, not viable %d: efficacy %.1f%% of %d sampled mutants\n",
		killed, lived, notViable, 100*float64(killed)/float64(max(killed+lived, 1)), len(all))
}

// readMutants reads the runnable mutants of the root package's files from
// gremlins' dry run.
func readMutants(path string) ([]mutant, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var ms []mutant
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 4 || fields[0] != "RUNNABLE" {
			continue
		}
		parts := strings.Split(fields[3], ":")
		if len(parts) != 3 || strings.Contains(parts[0], "/") {
			continue
		}
		line, err1 := strconv.Atoi(parts[1])
		col, err2 := strconv.Atoi(parts[2])
		if err1 != nil || err2 != nil {
			continue
		}
		ms = append(ms, mutant{kind: fields[1], file: parts[0], line: line, col: col})
	}
	return ms, sc.Err()
}

// try applies m through an overlay and runs the tests.
func try(m mutant, tmp string, timeout time.Duration) (string, error) {
	src, err := os.ReadFile(m.file)
	if err != nil {
		return "", err
	}
	off, err := offset(src, m.line, m.col)
	if err != nil {
		return "", err
	}
	var op string
	for _, o := range operators {
		if strings.HasPrefix(string(src[off:]), o) {
			op = o
			break
		}
	}
	to, ok := swaps[m.kind][op]
	if !ok {
		return "NOT VIABLE", nil
	}
	mutated := string(src[:off]) + to + string(src[off+len(op):])
	file := filepath.Join(tmp, m.file)
	if err := os.WriteFile(file, []byte(mutated), 0o644); err != nil {
		return "", err
	}
	abs, err := filepath.Abs(m.file)
	if err != nil {
		return "", err
	}
	overlay, err := json.Marshal(map[string]map[string]string{"Replace": {abs: file}})
	if err != nil {
		return "", err
	}
	ov := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(ov, overlay, 0o644); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "test", "-tags", "mutation", "-vet=off", "-overlay", ov, "-count=1", "-failfast", ".")
	out, err := cmd.CombinedOutput()
	switch {
	case ctx.Err() != nil:
		return "TIMED OUT", nil
	case err != nil && strings.Contains(string(out), "[build failed]"):
		return "NOT VIABLE", nil
	case err != nil:
		return "KILLED", nil
	}
	return "LIVED", nil
}

// offset returns the byte offset of a 1-based line and column.
func offset(src []byte, line, col int) (int, error) {
	l := 1
	for i, b := range src {
		if l == line {
			if i+col-1 > len(src) {
				break
			}
			return i + col - 1, nil
		}
		if b == '\n' {
			l++
		}
	}
	return 0, fmt.Errorf("no line %d column %d", line, col)
}
