package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/bench/internal/durations"
	"github.com/throttlekit/throttle/bench/internal/mdtable"
	"github.com/throttlekit/throttle/policies"
)

// A sample is what one Usage read of the quota saw.
type sample struct {
	at             time.Time
	spread, margin time.Duration // the widest margin in force
}

// sampleUsage reads the quota's Usage every step from began to end, through
// its own limiter on the admin client (a read-only script call each), and
// returns what it saw.
func sampleUsage(ctx context.Context, rdb *redis.Client, quota string, limit int, window, margin time.Duration, began, end time.Time, step time.Duration) []sample {
	lim, err := throttle.New(rdb, quota, policies.SlidingLog{Limit: limit, Window: window, Margin: margin}, throttle.Options{})
	if err != nil {
		return nil
	}
	defer lim.Close(context.Background())
	var out []sample
	for t := began.Add(step); !t.After(end); t = t.Add(step) {
		select {
		case <-ctx.Done():
			return out
		case <-time.After(time.Until(t)):
		}
		u, err := lim.Usage(ctx)
		if err != nil {
			continue
		}
		s := sample{at: t, spread: u.Spread}
		for _, r := range u.Rules {
			s.margin = max(s.margin, r.Margin)
		}
		out = append(out, s)
	}
	return out
}

// A slice is one step of a scenario's run.
type slice struct {
	From     time.Duration // since the workers were told to start
	Arrived  int           // calls that reached the vendor in the slice
	InWindow int           // the vendor's window count at the slice's end
	Spread   time.Duration // as the sample at the slice's end saw them
	Margin   time.Duration
}

// timeline cuts the run from began to end into steps.
func (a *arrivalLog) timeline(began, end time.Time, step, window time.Duration, samples []sample) []slice {
	a.mu.Lock()
	at := slices.Clone(a.at)
	a.mu.Unlock()
	slices.SortFunc(at, func(x, y time.Time) int { return x.Compare(y) })
	var out []slice
	lo, hi, si := 0, 0, 0
	for from := began; from.Before(end); from = from.Add(step) {
		to := from.Add(step)
		s := slice{From: from.Sub(began)}
		first := hi
		for hi < len(at) && at[hi].Before(to) {
			hi++
		}
		for first < hi && at[first].Before(from) {
			first++
		}
		s.Arrived = hi - first
		for lo < hi && !at[lo].After(to.Add(-window)) {
			lo++
		}
		s.InWindow = hi - lo
		for si < len(samples) && samples[si].at.Before(to) {
			si++
		}
		if si < len(samples) && !samples[si].at.After(to.Add(step/2)) {
			s.Spread, s.Margin = samples[si].spread, samples[si].margin
		}
		out = append(out, s)
	}
	return out
}

// writeTimelines prints each scenario's timeline.
func writeTimelines(w io.Writer, results []result, step time.Duration) {
	for _, r := range results {
		fmt.Fprintf(w, "\n%s, every %v:\n\n", r.Name, step)
		rows := [][]string{{"from (s)", "arrived", "window count / cap", "spread / margin (ms)"}}
		for _, s := range r.Timeline {
			rows = append(rows, []string{fmt.Sprintf("%.2f", s.From.Seconds()), fmt.Sprint(s.Arrived),
				fmt.Sprintf("%d / %d", s.InWindow, r.Cap), durations.FormatMs(s.Spread) + " / " + durations.FormatMs(s.Margin)})
		}
		mdtable.Write(w, rows)
	}
}
