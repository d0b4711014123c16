package main

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"
)

func TestRun_SendsEveryJobUnderTheCap(t *testing.T) {
	var out bytes.Buffer // the run's report, each job not sent with its error
	rep, err := run(context.Background(), config{Jobs: 60, Workers: 3, Tenants: 3, Limit: 30, TenantLimit: 12, Window: 500 * time.Millisecond}, &out)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Sent+rep.Failed != rep.Submitted || rep.Submitted != 60 {
		t.Errorf("submitted %d, sent %d, failed %d: a job went missing", rep.Submitted, rep.Sent, rep.Failed)
	}
	if rep.Failed != 0 || rep.OverCap != 0 {
		t.Errorf("%d jobs failed and the provider saw %d over its cap; the run's report:\n%s", rep.Failed, rep.OverCap, out.String())
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
