// Package lua holds the Redis scripts that decide for every throttle quota.
// Each script documents its keys, arguments and reply at the top; lib.lua,
// prepended to each, describes what they share.
package lua

import (
	_ "embed"
	"strings"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed lib.lua
	lib string
	//go:embed acquire.lua
	acquire string
	//go:embed cancel.lua
	cancel string
	//go:embed settle.lua
	settle string
	//go:embed release.lua
	release string
	//go:embed feedback.lua
	feedback string
	//go:embed usage.lua
	usage string
)

// The scripts. go-redis runs each with EVALSHA and falls back to EVAL when
// Redis answers NOSCRIPT (a new Redis, SCRIPT FLUSH, a restart or a
// failover). They reach Redis without their comments, which are most of
// their text: a fleet of many replicas starting on a Redis that lost its
// scripts sends each one once per replica.
var (
	// Acquire admits, books or refuses one call against every rule of a quota.
	Acquire = script(acquire)
	// Cancel gives back the booking of a call that stopped waiting.
	Cancel = script(cancel)
	// Settle replaces a call's estimated cost by its actual cost.
	Settle = script(settle)
	// Release frees a call's concurrency slots or extends their lease.
	Release = script(release)
	// Feedback records a vendor's pause and remaining count for the fleet.
	Feedback = script(feedback)
	// Usage reads how full each rule is, changing nothing.
	Usage = script(usage)
)

// script prepends lib.lua to a script and drops the lines that hold only a
// comment.
func script(src string) *redis.Script {
	var b strings.Builder
	for _, line := range strings.Split(lib+src, "\n") {
		if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
			continue
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	return redis.NewScript(b.String())
}
