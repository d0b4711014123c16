//go:build !mutation

package throttle

import (
	"flag"
	"os"
	"testing"
)

// TestMain runs six of the package's parallel tests at a time, without
// -race and unless -parallel says otherwise: most of their time is windows
// waited out on the wall clock, not CPU (the package takes 0.9 of 2 cores),
// and at the default of one per core the README's test command waited for
// them two by two (12-05: 76 s at four, 67-71 s at six). Under -race, whose
// checks take the CPU those tests need to keep their timing, the default
// stays.
func TestMain(m *testing.M) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set && !raceEnabled {
		_ = flag.Set("test.parallel", "6")
	}
	os.Exit(m.Run())
}
