// Package lua holds the Redis scripts that decide for every throttle quota.
// Each script documents its keys, arguments and reply at the top.
package lua

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed acquire.lua
	acquireSrc string
	//go:embed cancel.lua
	cancelSrc string
)

// Acquire admits, books or refuses one call against every limit of a quota.
var Acquire = redis.NewScript(acquireSrc)

// Cancel gives back the booking of a call that stopped waiting.
var Cancel = redis.NewScript(cancelSrc)
