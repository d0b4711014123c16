package main

import (
	"context"
	"io"
	"testing"
	"time"
)

func TestRun_SendsEveryJobUnderTheCap(t *testing.T) {
	rep, err := run(context.Background(), config{Jobs: 60, Workers: 3, Tenants: 3, Limit: 30, TenantLimit: 12, Window: 500 * time.Millisecond}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Sent+rep.Failed != rep.Submitted || rep.Submitted != 60 {
		t.Errorf("submitted %d, sent %d, failed %d: a job went missing", rep.Submitted, rep.Sent, rep.Failed)
	}
	if rep.Failed != 0 || rep.OverCap != 0 {
		t.Errorf("%d jobs failed and the provider saw %d over its cap", rep.Failed, rep.OverCap)
	}
}

// A signal (the context's end) stops the submitting; the jobs queued by
// then drain: each is sent, none fails for the signal.
func TestRun_StopsOnSignalAndDrainsEveryJobQueued(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	rep, err := run(ctx, config{Jobs: 60, Workers: 2, Tenants: 2, Limit: 20, TenantLimit: 10, Window: 500 * time.Millisecond}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Sent+rep.Failed != rep.Submitted || rep.Submitted == 0 {
		t.Errorf("submitted %d, sent %d, failed %d: a job went missing", rep.Submitted, rep.Sent, rep.Failed)
	}
	if rep.Failed != 0 {
		t.Errorf("%d of %d jobs queued before the signal failed, want every one drained", rep.Failed, rep.Submitted)
	}
	if rep.OverCap != 0 {
		t.Errorf("provider saw %d over its cap", rep.OverCap)
	}
}
