package bench

import (
	"slices"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
)

func TestIdealWaits(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		d := make([]time.Duration, len(v))
		for i, x := range v {
			d[i] = time.Duration(x) * time.Millisecond
		}
		return d
	}
	// 2 per 100ms; five calls at once, then one late enough to go at once.
	got := idealWaits(ms(0, 0, 0, 0, 0, 500), 2, 100*time.Millisecond)
	want := ms(0, 0, 100, 100, 200, 0)
	if !slices.Equal(got, want) {
		t.Errorf("idealWaits = %v, want %v", got, want)
	}
	// A call that arrives while the window is full waits for the call
	// limit places before it to leave, not for the window to empty.
	got = idealWaits(ms(0, 50, 60), 2, 100*time.Millisecond)
	want = ms(0, 0, 40)
	if !slices.Equal(got, want) {
		t.Errorf("idealWaits = %v, want %v", got, want)
	}
}

func TestIdealGCRAWaits(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		d := make([]time.Duration, len(v))
		for i, x := range v {
			d[i] = time.Duration(x) * time.Millisecond
		}
		return d
	}
	// 10 per second (one per 100ms), burst 2.
	limit := redis_rate.Limit{Rate: 10, Burst: 2, Period: time.Second}
	got := idealGCRAWaits(ms(0, 0, 0, 0, 1000), limit)
	want := ms(0, 0, 100, 200, 0)
	if !slices.Equal(got, want) {
		t.Errorf("idealGCRAWaits = %v, want %v", got, want)
	}
}

func TestPercentile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i))
	}
	for q, want := range map[float64]time.Duration{0.5: 50, 0.99: 99, 1: 100, 0.001: 1} {
		if got := percentile(d, q); got != want {
			t.Errorf("percentile(1..100, %v) = %v, want %v", q, got, want)
		}
	}
}
