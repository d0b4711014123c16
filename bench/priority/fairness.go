package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

// The fairness scenario: the heavy tenant runs heavyWorkers workers on
// replica 1; lightTenants light tenants each ask for a call every
// lightEvery, the odd ones on replica 2, the even ones on replica 3.
const (
	heavyWorkers = 40
	lightTenants = 9
	lightEvery   = 200 * time.Millisecond
	heavyTenant  = "tenant-0"
	// lightSlow is the wait past which a light tenant's call counts as
	// slow: the bound on its p99.
	lightSlow = 200 * time.Millisecond
)

// fairnessResult is what one run of the fairness scenario measured.
type fairnessResult struct {
	version string
	heavy   summary
	light   []tenantResult // tenant-1 first
	// The calls started in span, from the first second to the end, and the
	// heavy tenant's over what the light tenants left of the cap in it.
	span                   time.Duration
	heavyCalls, lightCalls int
	heavyShare             float64
	overCap                int
	// early is how many calls the heavy tenant started before the second
	// light tenant first asked (lightEvery/lightTenants after the start):
	// the room left in the first window for the light tenants that had
	// not called yet.
	early int
}

// tenantResult is what one tenant saw.
type tenantResult struct {
	name    string
	replica int // 1-based
	summary
}

// lightTenant returns the name of light tenant i (1 to lightTenants) and
// the index of its replica in a run's limiters.
func lightTenant(i int) (name string, replica int) {
	return fmt.Sprintf("tenant-%d", i), 2 - i%2
}

// runFairness runs the fairness scenario for d, with every limiter of
// version v in Block mode, on the Redis at addr.
func runFairness(ctx context.Context, addr string, v version, d time.Duration) (fairnessResult, error) {
	quota := strings.ToLower("fairness-" + v.name)
	rule := policies.SlidingLog{Limit: vendorLimit, Window: vendorWindow}
	reps, err := newReplicas(ctx, addr, quota, policies.All(rule, policies.PerKey{Policy: rule}), v.options(throttle.Block))
	if err != nil {
		return fairnessResult{}, err
	}
	defer reps.close()

	var ven vendor
	start := time.Now()
	heavy := tally{start: start}
	light := make([]tally, lightTenants)
	for i := range light {
		light[i] = tally{start: start, slowAfter: lightSlow}
	}
	end := start.Add(d)
	var wg sync.WaitGroup
	call := caller(ctx, reps.lims[0], &ven, heavyTenant, throttle.Key(heavyTenant))
	for range heavyWorkers {
		wg.Go(func() { loop(ctx, end, &heavy, call) })
	}
	for i := range lightTenants {
		name, replica := lightTenant(i + 1)
		call := caller(ctx, reps.lims[replica], &ven, name, throttle.Key(name))
		// Spread over the period, so that the tenants do not ask in step.
		first := start.Add(time.Duration(i) * lightEvery / lightTenants)
		wg.Go(func() { every(ctx, first, lightEvery, end, &light[i], call) })
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return fairnessResult{}, err
	}
	r := fairnessOf(v, &ven, &heavy, light, start.Add(time.Second), end)
	r.early = ven.started(start, start.Add(lightEvery/lightTenants), heavyTenant)
	return r, nil
}

// fairnessOf sums up a run of the fairness scenario whose calls have all
// returned, counting the calls started from from to end.
func fairnessOf(v version, ven *vendor, heavy *tally, light []tally, from, end time.Time) fairnessResult {
	r := fairnessResult{version: v.name, heavy: heavy.summary(), span: end.Sub(from), overCap: ven.overCap()}
	names := make([]string, len(light))
	for i := range light {
		name, replica := lightTenant(i + 1)
		names[i] = name
		r.light = append(r.light, tenantResult{name: name, replica: replica + 1, summary: light[i].summary()})
	}
	r.heavyCalls = ven.started(from, end, heavyTenant)
	r.lightCalls = ven.started(from, end, names...)
	r.heavyShare = float64(r.heavyCalls) / (capacity(r.span) - float64(r.lightCalls))
	return r
}
