package fakeapi

import "time"

// window is an exact sliding-window log: the arrivals of the last length of
// time, oldest first, each with the units it counts for. An arrival at s is
// in the window (now-length, now] and leaves it at s+length exactly.
type window struct {
	length time.Duration
	log    []arrival
	sum    int // units in log
}

type arrival struct {
	at    time.Time
	units int
}

// trim drops the arrivals that have left the window ending at now. now must
// not be before the time of an earlier trim or add.
func (w *window) trim(now time.Time) {
	i := 0
	for i < len(w.log) && now.Sub(w.log[i].at) >= w.length {
		w.sum -= w.log[i].units
		i++
	}
	w.log = w.log[i:]
}

// add records an arrival at t, which must not be before the last one.
func (w *window) add(t time.Time, units int) {
	w.log = append(w.log, arrival{t, units})
	w.sum += units
}

// count returns the units in the window ending at now without trimming, so
// that an arrival still on its way, timed before now, sees every arrival
// that was in its own window.
func (w *window) count(now time.Time) int {
	n := w.sum
	for _, a := range w.log {
		if now.Sub(a.at) < w.length {
			break
		}
		n -= a.units
	}
	return n
}

// freeIn returns how long after now it takes for at least need units to
// leave the window, or 0 when it does not hold that many. The window must
// have been trimmed at now.
func (w *window) freeIn(now time.Time, need int) time.Duration {
	left := 0
	for _, a := range w.log {
		if left += a.units; left >= need {
			return a.at.Add(w.length).Sub(now)
		}
	}
	return 0
}
