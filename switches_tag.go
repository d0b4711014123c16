//go:build throttle_switches

package throttle

import "os"

// A program built with the tag throttle_switches reads THROTTLE_OFF when it
// starts (switches.go); bench/ledger.sh builds its measurements so.
func init() { switchOff(os.Getenv("THROTTLE_OFF")) }
