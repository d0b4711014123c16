package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
)

// A short run of every scenario, end to end, on a real redis-server: the
// tables come out, and no call went over the vendor's cap.
func TestRun_PrintsTheTablesAndStaysUnderTheCap(t *testing.T) {
	if testing.Short() {
		t.Skip("runs three fleets for a few seconds each")
	}
	if !redistest.Available() {
		if redistest.RequireReal() {
			t.Fatal("redis-server is not on PATH, and CI=true requires it")
		}
		t.Skip("redis-server is not on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	res, err := run(ctx, options{duration: 2 * time.Second, versions: versions}, &out, io.Discard)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("\n%s", out.String())
	for _, want := range []string{"| Block ", "| Queue ", "| tenant-9 ", "heavy / what the light left"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output lacks %q", want)
		}
	}
	for _, r := range res.priority {
		if r.overCap != 0 {
			t.Errorf("priority, %s, %s: %d calls over the cap", r.version, r.mode, r.overCap)
		}
	}
	for _, r := range res.fairness {
		if r.overCap != 0 {
			t.Errorf("fairness, %s: %d calls over the cap", r.version, r.overCap)
		}
	}
}
