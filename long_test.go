package throttle

import (
	"testing"

	"github.com/throttlekit/throttle/internal/redistest"
)

// longRun reports whether the long tests run (THROTTLE_LONG=1): fleets,
// faults, outages, caps learned over many windows and clamps that converge,
// which run on the wall clock for seconds each. The default run leaves them
// out and checks fewer random histories against the model; .ci/run sets it.
func longRun() bool { return redistest.LongRun() }

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

// TestBookedAhead runs, side by side without -race, the tests that book
// calls a window of a second ahead on the wall clock and watch when they
// start: each keeps a core idle for its 3 s, and one after the other
// they held the README's go test ./... 10 s longer. Each subtest is named
// as the test it was, and runs beside the package's parallel tests (as
// one of them: run serially, the four held the package's serial tests
// 4.4 s); under -race they run one after the other.
func TestBookedAhead(t *testing.T) {
	if !raceEnabled {
		t.Parallel()
	}
	for _, c := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"TestLowered_CallsBookedBeforeADropBookAgain", loweredCallsBookedBeforeADropBookAgain},
		{"TestLowered_AKeptMoveStillBooksAgain", loweredAKeptMoveStillBooksAgain},
		{"TestShared_CallsOfEveryQuotaBookedBeforeADropBookAgain", sharedCallsOfEveryQuotaBookedBeforeADropBookAgain},
		{"TestClasses_ANewKeyIsHeardByTheCallsBookedAhead", classesANewKeyIsHeardByTheCallsBookedAhead},
	} {
		t.Run(c.name, func(t *testing.T) {
			if !raceEnabled {
				t.Parallel()
			}
			c.run(t)
		})
	}
}

// eachSideBySide runs fn once per backend, as redistest.Each does, the two
// at once without -race: a test that waits out windows on the wall clock
// keeps a core idle, and the README's go test ./... keeps to its 90 s. The
// test itself runs alone, not beside the package's parallel tests (its
// slots must not wait behind theirs); under -race the two run one after
// the other, as the detector slows every reply.
func eachSideBySide(t *testing.T, fn func(t *testing.T, s *redistest.Server)) {
	t.Helper()
	if raceEnabled {
		redistest.Each(t, fn)
		return
	}
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		fn(t, redistest.Mini(t))
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		fn(t, redistest.Real(t))
	})
}
