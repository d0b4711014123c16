package throttle

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
)

// The master behind Redis Sentinel crashes and the sentinels promote its
// replica, while a fleet of limiters on FailoverClients calls a strict
// vendor. The fleet fails closed while there is no master, then follows
// the client to the promoted replica, under the cap all along. Replication
// is asynchronous, so the replica may lack the last bookings; when it lacks
// the quota's meta key the epoch counts the window as full, as after a
// restart. The window (500 ms) is shorter than the failover (2 s or more),
// so what the replica missed no longer counts at the vendor.
func TestFault_SentinelFailover(t *testing.T) {
	long(t)
	// From the kill to the first call admitted by the promoted replica: the
	// sentinels take SentinelDownAfter to see the master down and a second
	// or two to promote the replica, and the limiters' breakers probe
	// Redis again with a growing backoff.
	const recoverWithin = 20 * time.Second
	s := redistest.StartSentinel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	before := runtime.NumGoroutine()
	logs, logger := faultLogger()
	lims, closeClients := faultLimiters(t, "fault-sentinel", func(int) redis.UniversalClient {
		return redis.NewFailoverClient(s.FailoverOptions())
	}, Options{Logger: logger})
	f := startFaultFleet(t, lims, faultWindow)

	time.Sleep(2 * faultWindow)
	master, err := s.KillMaster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	killed := f.enter(phaseFault)
	promoted, err := s.WaitFailover(ctx, master)
	if err != nil {
		t.Fatal(err)
	}
	failedOver := f.enter(phaseRecovery)
	var recovered [faultReplicas]time.Time
	for r := range faultReplicas {
		recovered[r] = f.firstSuccess(killed, r, time.Until(killed.Add(recoverWithin)))
	}
	time.Sleep(2 * faultWindow)
	sum := f.finish(false)
	closeClients()
	checkGoroutines(t, before)

	failing := sum.lastAfter(killed, func(c faultCall) bool { return errors.Is(c.err, ErrUnavailable) })
	for r := range faultReplicas {
		t.Logf("replica %d: first call after the kill ran %v after it (%v after the promotion)", r,
			recovered[r].Sub(killed).Round(time.Millisecond), recovered[r].Sub(failedOver).Round(time.Millisecond))
	}
	t.Logf("master %s killed, replica %s promoted %v later; calls failed until %v after the kill; lost data noticed: %v",
		master.Addr, promoted.Addr, failedOver.Sub(killed).Round(time.Millisecond), failing.Round(time.Millisecond),
		strings.Contains(logs.String(), "Redis lost the quota's data"))
	if promoted != s.Nodes[1] {
		t.Errorf("the sentinels promoted %s, want the replica %s", promoted.Addr, s.Nodes[1].Addr)
	}
	checkClosedUntilPromoted(t, sum, killed)
	if !strings.Contains(logs.String(), "Redis answers again") {
		t.Errorf("the breaker did not close after the failover:\n%s", logs.String())
	}
}

// checkClosedUntilPromoted checks a fleet's calls over a Sentinel failover
// whose master was killed at killed: none failed before, some failed while
// there was no master, and none ran before a replica could be promoted.
func checkClosedUntilPromoted(t *testing.T, sum faultTally, killed time.Time) {
	t.Helper()
	for _, c := range sum.calls {
		if c.err != nil && c.end.Before(killed) {
			t.Errorf("a call failed before the kill: %v", c.err)
			break
		}
	}
	if sum.byPhase[phaseFault][1] == 0 {
		t.Error("no call failed while there was no master")
	}
	// No replica can be promoted before the sentinels take the master for
	// down, so a call that began after the kill and ran before then ran
	// without Redis.
	for _, c := range sum.calls {
		if c.err == nil && c.began.After(killed) && c.arrived.Before(killed.Add(redistest.SentinelDownAfter)) {
			t.Errorf("a call that began %v after the kill ran %v after it, before any replica could be promoted",
				c.began.Sub(killed), c.arrived.Sub(killed))
			break
		}
	}
}
