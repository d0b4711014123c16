package main

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// policySyntax is what -policy accepts, for error messages and -help.
const policySyntax = `terms joined by '+', each one of:
  log:LIMIT/WINDOW[,margin=D]                  policies.SlidingLog
  counter:LIMIT/WINDOW[,buckets=N][,margin=D]  policies.SlidingCounter
  bucket:RATE/PER[,burst=N]                    policies.TokenBucket
  concurrency:MAX[,lease=D]                    policies.Concurrency
prefixed with 'key:' for a per-key limit (policies.PerKey).
WINDOW, PER and D are Go durations (100ms, 1s, 1m); a bare unit means one of it: 100/s is 100/1s.
Example: log:100/1s+key:log:10/1s`

// parsePolicy reads the -policy syntax into the policy it names. Its terms
// keep their order, which is the order of the quota's rules and so of its
// Redis keys.
func parsePolicy(s string) (policies.Policy, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("-policy is empty; want " + policySyntax)
	}
	var ps []policies.Policy
	for i, term := range strings.Split(s, "+") {
		p, err := parseTerm(strings.TrimSpace(term))
		if err != nil {
			return nil, fmt.Errorf("-policy term %d %q: %w", i+1, term, err)
		}
		// Check each term alone, so that the error names it.
		if _, err := policies.Rules(p); err != nil {
			return nil, fmt.Errorf("-policy term %d %q: %w", i+1, term, err)
		}
		ps = append(ps, p)
	}
	if len(ps) == 1 {
		return ps[0], nil
	}
	return policies.All(ps...), nil
}

// parseTerm reads one term of -policy: a kind, its first field, its
// options, and key: before them for a per-key limit.
func parseTerm(term string) (policies.Policy, error) {
	perKey := false
	if rest, ok := strings.CutPrefix(term, "key:"); ok {
		perKey, term = true, rest
	}
	kind, spec, ok := strings.Cut(term, ":")
	if !ok {
		return nil, errors.New("want KIND:SPEC, as in log:100/1s; KIND is log, counter, bucket or concurrency")
	}
	fields := strings.Split(spec, ",")
	opts, err := parseOptions(fields[1:])
	if err != nil {
		return nil, err
	}
	parse, ok := termKinds[kind]
	if !ok {
		return nil, fmt.Errorf("unknown kind %q; want log, counter, bucket or concurrency", kind)
	}
	p, err := parse(fields[0], opts)
	if err != nil {
		return nil, err
	}
	if err := opts.unused(); err != nil {
		return nil, err
	}
	if perKey {
		p = policies.PerKey{Policy: p}
	}
	return p, nil
}

// termKinds reads a term of each kind from its first field and its options.
// Each takes the options it knows from opts, so that unused finds the others.
var termKinds = map[string]func(first string, opts options) (policies.Policy, error){
	"log":         parseLog,
	"counter":     parseCounter,
	"bucket":      parseBucket,
	"concurrency": parseConcurrency,
}

// parseLog reads log:LIMIT/WINDOW[,margin=D].
func parseLog(first string, opts options) (policies.Policy, error) {
	limit, window, err := perWindow(first, "LIMIT/WINDOW")
	if err != nil {
		return nil, err
	}
	sl := policies.SlidingLog{Limit: limit, Window: window}
	if sl.Margin, err = opts.duration("margin"); err != nil {
		return nil, err
	}
	return sl, nil
}

// parseCounter reads counter:LIMIT/WINDOW[,buckets=N][,margin=D].
func parseCounter(first string, opts options) (policies.Policy, error) {
	limit, window, err := perWindow(first, "LIMIT/WINDOW")
	if err != nil {
		return nil, err
	}
	sc := policies.SlidingCounter{Limit: limit, Window: window}
	if sc.Margin, err = opts.duration("margin"); err != nil {
		return nil, err
	}
	if sc.Buckets, err = opts.int("buckets"); err != nil {
		return nil, err
	}
	return sc, nil
}

// parseBucket reads bucket:RATE/PER[,burst=N].
func parseBucket(first string, opts options) (policies.Policy, error) {
	rate, per, err := perWindow(first, "RATE/PER")
	if err != nil {
		return nil, err
	}
	tb := policies.TokenBucket{Rate: rate, Per: per}
	if tb.Burst, err = opts.int("burst"); err != nil {
		return nil, err
	}
	return tb, nil
}

// parseConcurrency reads concurrency:MAX[,lease=D].
func parseConcurrency(first string, opts options) (policies.Policy, error) {
	n, err := wholeNumber("MAX", first)
	if err != nil {
		return nil, err
	}
	c := policies.Concurrency{Max: n}
	if c.Lease, err = opts.duration("lease"); err != nil {
		return nil, err
	}
	return c, nil
}

// perWindow reads "100/1s", and "100/s" as one of the unit.
func perWindow(s, form string) (int, time.Duration, error) {
	n, w, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, fmt.Errorf("%q: want %s, as in 100/1s", s, form)
	}
	names := strings.Split(form, "/")
	count, err := wholeNumber(names[0], n)
	if err != nil {
		return 0, 0, err
	}
	d, err := duration(names[1], w)
	return count, d, err
}

func wholeNumber(name, s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("%s: %q is not a whole number", name, s)
	}
	return n, nil
}

func duration(name, s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if s != "" && (s[0] < '0' || s[0] > '9') && s[0] != '.' {
		s = "1" + s
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%s: %q is not a duration such as 500ms, 1s or 1m", name, s)
	}
	return d, nil
}

// options are a term's name=value fields; each must be used by its kind.
type options map[string]string

func parseOptions(fields []string) (options, error) {
	opts := options{}
	for _, f := range fields {
		name, value, ok := strings.Cut(f, "=")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return nil, fmt.Errorf("option %q: want name=value, as in burst=20", f)
		}
		if _, dup := opts[name]; dup {
			return nil, fmt.Errorf("option %s given twice", name)
		}
		opts[name] = value
	}
	return opts, nil
}

func (o options) int(name string) (int, error) {
	v, ok := o[name]
	if !ok {
		return 0, nil
	}
	delete(o, name)
	return wholeNumber(name, v)
}

func (o options) duration(name string) (time.Duration, error) {
	v, ok := o[name]
	if !ok {
		return 0, nil
	}
	delete(o, name)
	return duration(name, v)
}

// unused reports an option that the term's kind does not take.
func (o options) unused() error {
	if len(o) == 0 {
		return nil
	}
	return fmt.Errorf("unknown option %q for this kind", slices.Sorted(maps.Keys(o))[0])
}
