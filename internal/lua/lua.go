// Package lua holds the Redis scripts that decide for every throttle quota.
// Each script documents its keys, arguments and reply at the top; lib.lua,
// prepended to each, describes what they share.
package lua

import (
	_ "embed"
	"regexp"
	"strconv"
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
	//go:embed handback.lua
	handback string
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
	// Handback tells Redis of the calls the Local fallback admitted, and
	// reserves the quota for the replicas still deciding without it.
	Handback = script(handback)
)

// sent maps each script's SHA1 to its lines as Redis has them.
var sent = map[string][]string{}

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
	s := redis.NewScript(b.String())
	sent[s.Hash()] = strings.Split(b.String(), "\n")
	return s
}

var (
	scriptLine = regexp.MustCompile(`script: ([0-9a-f]{40}), on @user_script:(\d+)`)
	redisCall  = regexp.MustCompile(`redis\.call\('([A-Z]+)'`)
)

// CommandAt returns the Redis command that the line of one of these scripts
// named in a Redis error calls ("ZADD"), or "" when the error names no such
// line. Redis before 7.2 says only where in a script it refused a command
// that the user may not run.
func CommandAt(msg string) string {
	m := scriptLine.FindStringSubmatch(msg)
	if m == nil {
		return ""
	}
	lines := sent[m[1]]
	n, err := strconv.Atoi(m[2])
	if err != nil || n < 1 || n > len(lines) {
		return ""
	}
	if c := redisCall.FindStringSubmatch(lines[n-1]); c != nil {
		return c[1]
	}
	return ""
}
