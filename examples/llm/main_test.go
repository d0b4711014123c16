package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestRun_RequestsAndTokensInOnePolicy(t *testing.T) {
	cfg := config{Replicas: 3, Workers: 6, Requests: 40, Tokens: 3000, Window: time.Second, Duration: 5 * time.Second}
	var out bytes.Buffer
	res, err := run(context.Background(), cfg, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("\n%s", out.String())
	if res.OverRequests != 0 || res.OverTokens != 0 {
		t.Errorf("past the cap: %d requests, %d tokens; want none", res.OverRequests, res.OverTokens)
	}
	// Calls admitted with the most they may use and settled after: what
	// the estimates of the calls in flight overstate is held a while.
	// About 70% with estimates of 1.5 times the tokens used on a quiet
	// machine; under -race on 2 cores 30-60% (six runs), and 25% once with
	// other test binaries on the CPU: a stalled process's calls wake too
	// late and book again, a window on, and one such second is a fifth of
	// this run. The floor catches a fleet that leaves the cap idle for good.
	if res.TokenUse < 0.15 {
		t.Errorf("%.0f%% of the tokens' cap used, want at least 15%%", 100*res.TokenUse)
	}
	if !strings.Contains(out.String(), "API: 40 requests and 3000 tokens per 1s") {
		t.Errorf("output lacks the API's caps")
	}
}

func TestRun_RejectsBadFlags(t *testing.T) {
	// A call may use 160 tokens: a cap of tokens below it admits none.
	cfg := config{Replicas: 1, Workers: 1, Requests: 10, Tokens: 100, Window: time.Second, Duration: time.Second}
	if _, err := run(context.Background(), cfg, &bytes.Buffer{}); err == nil {
		t.Error("run with a tokens' cap of 100 succeeded, want an error")
	}
	if _, err := run(context.Background(), config{}, &bytes.Buffer{}); err == nil {
		t.Error("run with zero flags succeeded, want an error")
	}
}
