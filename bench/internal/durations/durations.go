// Package durations summarises and prints the waits the bench programs
// measure.
package durations

import (
	"math"
	"strconv"
	"time"
)

// FormatMs formats d in milliseconds, with one decimal under 100ms.
func FormatMs(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	if ms < 100 {
		return strconv.FormatFloat(ms, 'f', 1, 64)
	}
	return strconv.FormatFloat(ms, 'f', 0, 64)
}

// Percentile returns the nearest-rank q-quantile (0 < q <= 1) of sorted.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
