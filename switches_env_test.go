//go:build !throttle_switches

package throttle

import "os"

// This package's tests read THROTTLE_OFF without the tag, as a program built
// with it does (switches_tag.go): TestSwitches_EachBreaksItsTest sets it.
func init() { switchOff(os.Getenv("THROTTLE_OFF")) }
