package dashboard

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/throttlekit/throttle"
)

// A sparkline shows one figure of a quota over the last History: the Used
// of its first rule shared by every key, or, for a quota whose rules are
// all per key, the Used of its busiest key. The Handler samples it on each
// read it makes, and keeps the samples of each quota in a ring.

// sample is one reading of a quota's sparkline; at is zero for none.
type sample struct {
	at    time.Time
	used  int
	limit int // the scale: the limit the figure is of
}

// history is the last samples of a quota, in a ring of fixed size.
type history struct {
	buf  []sample
	head int // the oldest sample
	n    int
}

func newHistory(size int) *history { return &history{buf: make([]sample, size)} }

// add adds s, in place of the oldest sample when the ring is full.
func (h *history) add(s sample) {
	if h.n < len(h.buf) {
		h.buf[(h.head+h.n)%len(h.buf)] = s
		h.n++
		return
	}
	h.buf[h.head] = s
	h.head = (h.head + 1) % len(h.buf)
}

// since returns the samples taken after t, oldest first.
func (h *history) since(t time.Time) []sample {
	var out []sample
	for i := range h.n {
		if s := h.buf[(h.head+i)%len(h.buf)]; s.at.After(t) {
			out = append(out, s)
		}
	}
	return out
}

// ringLength is how many samples cover History: reads come at most twice
// per Refresh (see refresh).
func (h *Handler) ringLength() int {
	return min(max(int(2*h.opts.History/h.opts.Refresh)+2, 8), maxRingLength)
}

// sample adds the samples of a read, one per quota of names, and sets each
// quota's sparkline; it forgets the quotas no longer listed, and their
// limiters.
func (h *Handler) sample(names []throttle.QuotaName, samples []sample, views []quotaView, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	listed := make(map[throttle.QuotaName]bool, len(names))
	for i, q := range names {
		listed[q] = true
		hist := h.histories[q]
		if hist == nil {
			hist = newHistory(h.ringLength())
			h.histories[q] = hist
		}
		if !samples[i].at.IsZero() {
			hist.add(samples[i])
		}
		views[i].Spark = spark(hist.since(now.Add(-h.opts.History)), now, h.opts.History, views[i].Spark.Label)
	}
	for q := range h.histories {
		if !listed[q] {
			delete(h.histories, q)
			delete(h.limiters, q)
		}
	}
}

// sparkSample returns the sample of quota v's sparkline, and names it in
// v.Spark.Label.
func sparkSample(v *quotaView, now time.Time) sample {
	for _, r := range v.Rules {
		if !r.PerKey {
			v.Spark.Label = fmt.Sprintf("rule %d used", r.Index)
			return sample{at: now, used: r.Used, limit: r.Configured}
		}
	}
	v.Spark.Label = "busiest key's used"
	if len(v.Keys) == 0 {
		return sample{at: now}
	}
	return sample{at: now, used: v.Keys[0].Used, limit: v.Keys[0].Limit}
}

// sparkView is a sparkline as the page draws it: an SVG polyline in a box
// of sparkWidth by sparkHeight.
type sparkView struct {
	Label   string `json:"label"`
	Points  string `json:"points"` // the polyline's points, "x,y x,y ..."
	LastX   string `json:"last_x"` // where the last sample is drawn, as a dot
	LastY   string `json:"last_y"`
	Last    int    `json:"last"`
	Max     int    `json:"max"` // the top of the scale
	Samples int    `json:"samples"`
}

const sparkWidth, sparkHeight = 240, 40

// spark draws samples taken over the span up to now, scaled to the
// largest of their limits and values.
func spark(samples []sample, now time.Time, span time.Duration, label string) sparkView {
	v := sparkView{Label: label, Samples: len(samples), Max: 1}
	for _, s := range samples {
		v.Max = max(v.Max, s.used, s.limit)
	}
	var pts []string
	for _, s := range samples {
		// A dot's radius in from the edges, so that it shows whole.
		x := 2 + float64(sparkWidth-4)*(1-float64(now.Sub(s.at))/float64(span))
		y := 2 + float64(sparkHeight-4)*(1-float64(s.used)/float64(v.Max))
		v.LastX, v.LastY = strconv.FormatFloat(x, 'f', 1, 64), strconv.FormatFloat(y, 'f', 1, 64)
		v.Last = s.used
		pts = append(pts, v.LastX+","+v.LastY)
	}
	v.Points = strings.Join(pts, " ")
	return v
}
