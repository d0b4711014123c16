package otel_test

import (
	"testing"
	"time"

	"github.com/throttlekit/throttle"
)

func TestObserve_AllocatesNothingOnceAQuotaIsKnown(t *testing.T) {
	obs, _ := newObserver(t)
	quota := string([]byte("sms")) // not a constant, as a limiter's name is not
	events := []throttle.Event{
		{Kind: throttle.EventAdmitted, Quota: quota, Cost: 1, Wait: time.Millisecond},
		{Kind: throttle.EventLimited, Quota: quota, Cost: 1},
		{Kind: throttle.EventRedis, Quota: quota, Duration: time.Millisecond, Calls: 3},
	}
	for _, e := range events {
		obs.Observe(e)
	}
	for _, e := range events {
		if n := testing.AllocsPerRun(100, func() { obs.Observe(e) }); n != 0 {
			t.Errorf("Observe(%v) allocates %v times", e.Kind, n)
		}
	}
}
