//go:build !throttle_switches

package bench

// switchedOff returns no switch: without the tag throttle_switches, the
// throttle package reads none (../switches.go).
func switchedOff() string { return "" }
