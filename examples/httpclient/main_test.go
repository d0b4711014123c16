package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestRun_FleetFollowsTheVendor(t *testing.T) {
	cfg := config{
		Replicas: 2, Workers: 2, Limit: 20, Lowered: 10, Window: time.Second,
		LowerAt: 1200 * time.Millisecond, Duration: 2500 * time.Millisecond, Step: 250 * time.Millisecond,
	}
	var out bytes.Buffer
	res, err := run(context.Background(), cfg, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("\n%s", out.String())
	if res.BeforeOverCap != 0 {
		t.Errorf("%d requests over the cap before the vendor lowered it, want 0", res.BeforeOverCap)
	}
	// The vendor's answers state its lowered limit: the fleet learns it
	// from the first that says none is left, so that a 429 comes only to
	// the calls already in flight (see the transport's tests).
	if most := (res.Pauses + 1) * cfg.Replicas * cfg.Workers; res.Refused > most {
		t.Errorf("%d 429s in %d pauses, want at most %d", res.Refused, res.Pauses, most)
	}
	if res.OK < cfg.Limit {
		t.Errorf("%d requests succeeded, want at least %d", res.OK, cfg.Limit)
	}
	for _, want := range []string{"vendor: 20 requests per 1s", "fleet: 2 replicas × 2 workers"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestRun_RejectsBadFlags(t *testing.T) {
	if _, err := run(context.Background(), config{}, &bytes.Buffer{}); err == nil {
		t.Error("run with zero flags succeeded, want an error")
	}
}
