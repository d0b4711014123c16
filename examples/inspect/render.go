package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// Terminal control: move the cursor home and clear the screen, as top does
// before each refresh.
const clearScreen = "\x1b[H\x1b[2J"

// frame is one refresh of the display.
type frame struct {
	Quota  string
	Group  string // the quota's policies.Shared group, or ""
	Prefix string
	Redis  string // where the quota lives, as the user named it
	Key    string
	HasKey bool
	At     time.Time
	Rules  []policies.Rule
	Usage  throttle.Usage
	Err    error // why Usage could not be read; the rest is then unset
}

// render writes f as a header and a table with one row per rule.
func render(w io.Writer, f frame) {
	title := fmt.Sprintf("quota %q", f.Quota)
	if f.HasKey {
		title += fmt.Sprintf(", key %q,", f.Key)
	}
	fmt.Fprintf(w, "%s on %s  %s\n", title, f.Redis, f.At.Format("15:04:05"))
	if f.Err != nil {
		fmt.Fprintf(w, "error: %v\n", f.Err)
		return
	}
	fmt.Fprintf(w, "paused: %s   remaining under every rule: %s\n", paused(f.Usage), figure(f.Usage.Remaining, f.HasKey || !perKey(f.Rules)))
	if !f.Usage.Since.IsZero() {
		fmt.Fprintf(w, "data since %s", f.Usage.Since.UTC().Format(time.DateTime))
		if !f.Usage.LastLoss.IsZero() {
			fmt.Fprintf(w, "   last lost %s", f.Usage.LastLoss.UTC().Format(time.DateTime))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "#\tscope\tkind\tlimit\twindow\tused\tbooked\tremaining\tnext free\tfull")
	for i, u := range f.Usage.Rules {
		r := u.Rule
		booked := strconv.Itoa(u.Booked)
		if r.Kind == policies.KindConcurrency {
			booked = "-" // a slot in flight cannot be booked ahead
		}
		next := "now"
		switch {
		case u.NextFree > 0 && r.Kind == policies.KindConcurrency:
			// Usage gives the end of the oldest lease, but a slot is freed
			// as soon as its call ends.
			next = "on release"
		case u.NextFree > 0:
			next = until(u.NextFree)
		}
		if r.PerKey && !f.HasKey {
			// Read for no key: -key names whose figures to show.
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t-\t-\t-\t-\t-\n", i, scope(r), kindName(r.Kind), limit(u), window(r))
			continue
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\t%s\n",
			i, scope(r), kindName(r.Kind), limit(u), window(r), u.Used, booked, u.Remaining, next, full(u))
	}
	tw.Flush()
	fmt.Fprintf(w, "\nredis keys: %s\n", strings.Join(keys(f), ", "))
}

// paused says whether the quota is paused, for how long, and why.
func paused(u throttle.Usage) string {
	if u.Paused <= 0 {
		return "no"
	}
	why := map[string]string{
		throttle.PausedByVendor: "at the vendor's request",
		throttle.PausedByLoss:   "after Redis lost the quota's data",
		throttle.PausedByPolicy: "for a new policy",
		throttle.PausedByClock:  "after Redis's clock went back",
	}[u.PausedBy]
	if why == "" {
		why = "(cause not recorded)"
	}
	return "for " + until(u.Paused) + ", " + why
}

// figure prints n, or "-" when it was not read (a per-key rule without a key).
func figure(n int, read bool) string {
	if !read {
		return "-"
	}
	return strconv.Itoa(n)
}

// limit prints the rule's limit, and the limit in force when a cap
// learned from the vendor or others' share lowers it.
func limit(u throttle.RuleUsage) string {
	if u.Limit > 0 && u.Limit < u.Rule.Limit {
		return fmt.Sprintf("%d (%d now)", u.Rule.Limit, u.Limit)
	}
	return strconv.Itoa(u.Rule.Limit)
}

func scope(r policies.Rule) string {
	if r.PerKey {
		return "key"
	}
	return "shared"
}

// kindName names a rule's kind as -policy spells it ("log", "counter",
// "bucket", "concurrency"), so that the table reads as the flag is typed.
func kindName(k policies.Kind) string {
	switch k {
	case policies.KindSlidingLog:
		return "log"
	case policies.KindSlidingCounter:
		return "counter"
	case policies.KindTokenBucket:
		return "bucket"
	case policies.KindConcurrency:
		return "concurrency"
	}
	return "kind " + strconv.Itoa(int(k))
}

// window says what the rule's limit is per: the window and its margin for a
// log or a counter, the emission interval of a bucket (whose limit is its
// burst), the lease of a concurrency limit (whose limit is calls in flight).
func window(r policies.Rule) string {
	switch r.Kind {
	case policies.KindSlidingLog:
		return short(r.Window-r.Margin) + " +" + short(r.Margin)
	case policies.KindSlidingCounter:
		n := 0
		if r.Bucket > 0 {
			n = int((r.Window + r.Bucket - 1) / r.Bucket)
		}
		return fmt.Sprintf("%s +%s, %d buckets", short(r.Window-r.Margin), short(r.Margin), n)
	case policies.KindTokenBucket:
		return "1 per " + short(r.Every)
	case policies.KindConcurrency:
		return "in flight, lease " + short(r.Lease)
	}
	return ""
}

// full is the share of the limit used now; bookings lie in the future, and
// are not counted.
func full(u throttle.RuleUsage) string {
	if u.Rule.Limit <= 0 {
		return "-"
	}
	return strconv.Itoa(100*u.Used/u.Rule.Limit) + "%"
}

// keys lists the Redis keys the rules live in: prefix:{quota}:<rule id>
// (see policies.Rule.ID), after "key:" and with a hash of the key after it
// for per-key rules.
func keys(f frame) []string {
	var ks []string
	seen := map[string]int{}
	for _, r := range f.Rules {
		id := r.ID()
		if r.PerKey {
			id = "key:" + id
		}
		if seen[id]++; seen[id] > 1 {
			id += "#" + strconv.Itoa(seen[id])
		}
		k := fmt.Sprintf("%s:{%s}:%s", f.Prefix, f.Quota, id)
		switch {
		case r.Shared != "":
			k = fmt.Sprintf("%s:{%s}//%s", f.Prefix, r.Shared, id)
		case f.Group != "":
			k = fmt.Sprintf("%s:{%s}/%s:%s", f.Prefix, f.Group, f.Quota, id)
		}
		if r.PerKey {
			k += ":<key hash>"
		}
		ks = append(ks, k)
	}
	return ks
}

// until prints a time to wait, to the millisecond.
func until(d time.Duration) string {
	if d = d.Round(time.Millisecond); d == 0 {
		return "<1ms"
	}
	return short(d)
}

// short prints a duration the way a person reads it: 1s, 30ms, 1m, 1.25s.
func short(d time.Duration) string {
	switch {
	case d == 0:
		return "0"
	case d%time.Hour == 0:
		return strconv.FormatInt(int64(d/time.Hour), 10) + "h"
	case d%time.Minute == 0:
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	case d >= time.Second:
		return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
	case d >= time.Millisecond:
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', -1, 64) + "ms"
	}
	return d.String()
}
