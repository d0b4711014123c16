//go:build race

package throttle

// raceEnabled reports a build with the race detector, under which the
// simulation runs about twenty times slower: the default corpus is empty.
const raceEnabled = true
