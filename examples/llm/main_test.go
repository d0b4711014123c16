package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestRun_RequestsAndTokensInOnePolicy(t *testing.T) {
	cfg := config{Replicas: 3, Workers: 6, Requests: 40, Tokens: 3000, Window: time.Second, Duration: 4 * time.Second}
	var out bytes.Buffer
	res, err := run(context.Background(), cfg, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("\n%s", out.String())
	if res.OverRequests != 0 || res.OverTokens != 0 {
		t.Errorf("past the cap: %d requests, %d tokens; want none", res.OverRequests, res.OverTokens)
	}
	// Calls admitted with an estimate and settled after: the estimates of
	// the calls in flight hold some of the cap for a while.
	if res.TokenUse < 0.7 {
		t.Errorf("%.0f%% of the tokens' cap used, want at least 70%%", 100*res.TokenUse)
	}
	if !strings.Contains(out.String(), "API: 40 requests and 3000 tokens per 1s") {
		t.Errorf("output lacks the API's caps")
	}
}
