package dashboard

import (
	"strings"
	"time"
)

// human formats d for the page: milliseconds below a second, whole
// seconds above, without the zero units Duration.String writes ("1m", not
// "1m0s").
func human(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	}
	s := d.Round(time.Second).String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// ago says how long before now t was.
func ago(t, now time.Time) string {
	return human(now.Sub(t)) + " ago"
}

// percent returns n in percent of of, from 0 to 100.
func percent(n, of int) int {
	if of <= 0 {
		return 0
	}
	return min(max(100*n/of, 0), 100)
}

// joinDot joins the parts of a description.
func joinDot(parts []string) string { return strings.Join(parts, " · ") }
