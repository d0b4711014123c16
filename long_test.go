package throttle

import (
	"os"
	"strconv"
	"testing"
)

// longEnv names the environment variable that runs the long tests: fleets,
// faults, outages, caps learned over many windows and clamps that converge,
// which run on the wall clock for seconds each. The default run leaves them
// out and checks fewer random histories against the model; .ci/run sets it.
const longEnv = "THROTTLE_LONG"

// longRun reports whether the long tests run (THROTTLE_LONG=1).
func longRun() bool {
	on, _ := strconv.ParseBool(os.Getenv(longEnv))
	return on
}

// long skips a test that runs for seconds on the wall clock unless
// THROTTLE_LONG=1. It comes first in the test, before any server starts.
func long(t testing.TB) {
	t.Helper()
	if !longRun() {
		t.Skip("long test: run it with THROTTLE_LONG=1 go test -race ./... (as .ci/run does)")
	}
}

// figureWithoutRace skips a long test under -race: its figures (a margin
// or a cap over many windows of a given clock) take the race detector half
// a minute of CPU each to replay, and the paths it runs are raced by the
// shorter tests. .ci/run runs it without -race.
func figureWithoutRace(t testing.TB) {
	t.Helper()
	if raceEnabled {
		t.Skip("a long figure: .ci/run runs it without -race")
	}
}
