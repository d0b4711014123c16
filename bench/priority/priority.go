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

// The priority scenario: replicas 1 and 2 run batchWorkers workers each at
// batchPriority; replica 3 asks for an interactive call at
// interactivePriority every interactiveEvery.
const (
	batchWorkers        = 30
	batchPriority       = 0
	interactivePriority = 10
	interactiveEvery    = 100 * time.Millisecond
	// interactiveSlow is the wait past which an interactive call counts as
	// slow: the bound on its p99.
	interactiveSlow = 50 * time.Millisecond
)

// priorityModes are the modes the priority scenario runs in, in order.
var priorityModes = []throttle.Mode{throttle.Block, throttle.Queue}

// priorityResult is what one run of the priority scenario measured.
type priorityResult struct {
	version     string
	mode        throttle.Mode
	interactive summary
	batch       summary
	use         float64 // calls started from the first second on, over the cap in that time
	overCap     int
}

// runPriority runs the priority scenario for d, with every limiter of
// version v in mode, on the Redis at addr.
func runPriority(ctx context.Context, addr string, v version, mode throttle.Mode, d time.Duration) (priorityResult, error) {
	quota := strings.ToLower(fmt.Sprintf("priority-%s-%s", v.name, mode))
	policy := policies.SlidingLog{Limit: vendorLimit, Window: vendorWindow}
	reps, err := newReplicas(ctx, addr, quota, policy, v.options(mode))
	if err != nil {
		return priorityResult{}, err
	}
	defer reps.close()

	var ven vendor
	start := time.Now()
	batch, interactive := tally{start: start}, tally{start: start, slowAfter: interactiveSlow}
	end := start.Add(d)
	var wg sync.WaitGroup
	for _, lim := range reps.lims[:2] {
		call := caller(ctx, lim, &ven, "batch", throttle.Priority(batchPriority))
		for range batchWorkers {
			wg.Go(func() { loop(ctx, end, &batch, call) })
		}
	}
	urgent := caller(ctx, reps.lims[2], &ven, "interactive", throttle.Priority(interactivePriority))
	wg.Go(func() { every(ctx, start, interactiveEvery, end, &interactive, urgent) })
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return priorityResult{}, err
	}

	return priorityResult{
		version:     v.name,
		mode:        mode,
		interactive: interactive.summary(),
		batch:       batch.summary(),
		use:         float64(ven.started(start.Add(time.Second), end)) / capacity(d-time.Second),
		overCap:     ven.overCap(),
	}, nil
}

// capacity is how many calls the vendor takes in d.
func capacity(d time.Duration) float64 {
	return vendorLimit * d.Seconds() / vendorWindow.Seconds()
}
