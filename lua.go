package throttle

// The Redis scripts that decide for every quota live in lua/, one file
// each; each documents its keys, arguments and reply at the top, and
// lib.lua, prepended to each, what they share. consts.lua, before lib.lua,
// is generated from internal/protocol: the constants both sides use, and
// the layouts of the arguments and replies.

import (
	"embed"
	"regexp"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
)

//go:generate go run ./internal/protocol/gen

//go:embed lua/*.lua
var luaFiles embed.FS

// luaFile returns the text of lua/name.
func luaFile(name string) string {
	b, err := luaFiles.ReadFile("lua/" + name)
	if err != nil {
		panic(err) // embedded at build time: a missing file does not build
	}
	return string(b)
}

// scriptSet holds the scripts. go-redis runs each with EVALSHA and falls
// back to EVAL when Redis answers NOSCRIPT (a new Redis, SCRIPT FLUSH, a
// restart or a failover). They reach Redis without their comments, which
// are most of their text: a fleet of many replicas starting on a Redis that
// lost its scripts sends each one once per replica.
type scriptSet struct {
	acquire  *redis.Script // admits, books or refuses calls against every rule of a quota
	cancel   *redis.Script // gives back the booking of a call that stopped waiting
	settle   *redis.Script // replaces a call's estimated cost by its actual cost
	release  *redis.Script // frees a call's concurrency slots or extends their lease
	feedback *redis.Script // records a vendor's pause and remaining count for the fleet
	usage    *redis.Script // reads how full each rule is, changing nothing
	handback *redis.Script // tells Redis of the Local fallback's calls, and reserves the quota
}

// scripts are the scripts every limiter runs, with the switches that
// switchOff turned off (none in a program built without the tag).
var scripts = loadScripts()

// loadScripts returns the scripts with the mechanisms switched off now.
func loadScripts() scriptSet {
	return scriptSet{
		acquire:  script("acquire.lua"),
		cancel:   script("cancel.lua"),
		settle:   script("settle.lua"),
		release:  script("release.lua"),
		feedback: script("feedback.lua"),
		usage:    script("usage.lua"),
		handback: script("handback.lua"),
	}
}

// offLine is the line of lib.lua that sets the scripts' switches.
const offLine = "local OFF = {}"

// sent maps each script's SHA1 to its lines as Redis has them.
var sent = map[string][]string{}

// script prepends consts.lua and lib.lua to the script in lua/name and
// drops the lines that hold only a comment.
func script(name string) *redis.Script {
	text := scriptText(name, switchedOff)
	s := redis.NewScript(text)
	sent[s.Hash()] = strings.Split(text, "\n")
	return s
}

// scriptText returns the text of the script in lua/name as Redis gets it,
// with the mechanisms off switched off (switches.go).
func scriptText(name string, off map[mechanism]bool) string {
	var b strings.Builder
	for _, line := range strings.Split(luaFile("consts.lua")+luaFile("lib.lua")+luaFile(name), "\n") {
		if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
			continue
		}
		if line == offLine {
			line = luaOff(off)
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	text, err := protocol.Fold(b.String())
	if err != nil {
		panic(err) // the scripts are embedded: a name the protocol lacks fails every test
	}
	return text
}

var (
	scriptLine = regexp.MustCompile(`script: ([0-9a-f]{40}), on @user_script:(\d+)`)
	redisCall  = regexp.MustCompile(`redis\.call\('([A-Z]+)'`)
)

// commandAt returns the Redis command that the line of one of these scripts
// named in a Redis error calls ("ZADD"), or "" when the error names no such
// line. Redis before 7.2 says only where in a script it refused a command
// that the user may not run.
func commandAt(msg string) string {
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
