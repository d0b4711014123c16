//go:build throttle_switches

package bench

import "os"

// switchedOff returns the switches that the throttle package, built with
// the tag throttle_switches, reads from THROTTLE_OFF (../switches_tag.go).
func switchedOff() string { return os.Getenv("THROTTLE_OFF") }
