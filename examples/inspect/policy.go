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
	read, ok := termKinds[kind]
	if !ok {
		return nil, fmt.Errorf("unknown kind %q; want log, counter, bucket or concurrency", kind)
	}
	r := &termReader{opts: opts}
	p := read(fields[0], r)
	if r.err != nil {
		return nil, r.err
	}
	if err := opts.unused(); err != nil {
		return nil, err
	}
	if perKey {
		p = policies.PerKey{Policy: p}
	}
	return p, nil
}

// termKinds reads a term of each kind from its first field and its options,
// in the order of the error messages: the first field, then each option.
var termKinds = map[string]func(first string, r *termReader) policies.Policy{
	"log": func(first string, r *termReader) policies.Policy {
		limit, window := r.perWindow(first, "LIMIT/WINDOW")
		return policies.SlidingLog{Limit: limit, Window: window, Margin: option(r, "margin", duration)}
	},
	"counter": func(first string, r *termReader) policies.Policy {
		limit, window := r.perWindow(first, "LIMIT/WINDOW")
		return policies.SlidingCounter{Limit: limit, Window: window,
			Margin: option(r, "margin", duration), Buckets: option(r, "buckets", wholeNumber)}
	},
	"bucket": func(first string, r *termReader) policies.Policy {
		rate, per := r.perWindow(first, "RATE/PER")
		return policies.TokenBucket{Rate: rate, Per: per, Burst: option(r, "burst", wholeNumber)}
	},
	"concurrency": func(first string, r *termReader) policies.Policy {
		return policies.Concurrency{Max: read(r, "MAX", first, wholeNumber), Lease: option(r, "lease", duration)}
	},
}

// termReader reads the fields of one term and keeps the first error, so
// that each kind reads as the policy it makes. Past an error it reads
// nothing more.
type termReader struct {
	opts options
	err  error
}

func (r *termReader) perWindow(s, form string) (int, time.Duration) {
	if r.err != nil {
		return 0, 0
	}
	n, d, err := perWindow(s, form)
	r.err = err
	return n, d
}

// read parses the field name of value s with parse.
func read[T any](r *termReader, name, s string, parse func(name, s string) (T, error)) T {
	var v T
	if r.err == nil {
		v, r.err = parse(name, s)
	}
	return v
}

// option reads the option name with parse, and takes it from the options
// left unused; it is T's zero when the term leaves it out.
func option[T any](r *termReader, name string, parse func(name, s string) (T, error)) T {
	s, ok := r.opts[name]
	if !ok {
		var zero T
		return zero
	}
	delete(r.opts, name)
	return read(r, name, s, parse)
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

// unused reports an option that the term's kind does not take.
func (o options) unused() error {
	if len(o) == 0 {
		return nil
	}
	return fmt.Errorf("unknown option %q for this kind", slices.Sorted(maps.Keys(o))[0])
}
