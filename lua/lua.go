// Package lua holds the Redis scripts that decide for every throttle quota.
// Each script documents its keys, arguments and reply at the top; lib.lua,
// prepended to each, describes what they share.
package lua

import (
	_ "embed"

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
// Redis answers NOSCRIPT (after SCRIPT FLUSH, a restart or a failover).
var (
	// Acquire admits, books or refuses one call against every rule of a quota.
	Acquire = redis.NewScript(lib + acquire)
	// Cancel gives back the booking of a call that stopped waiting.
	Cancel = redis.NewScript(lib + cancel)
	// Settle replaces a call's estimated cost by its actual cost.
	Settle = redis.NewScript(lib + settle)
	// Release frees a call's concurrency slots or extends their lease.
	Release = redis.NewScript(lib + release)
	// Feedback records a vendor's pause and remaining count for the fleet.
	Feedback = redis.NewScript(lib + feedback)
	// Usage reads how full each rule is, changing nothing.
	Usage = redis.NewScript(lib + usage)
)
