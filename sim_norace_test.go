//go:build !race

package throttle

// raceEnabled reports a build with the race detector.
const raceEnabled = false
