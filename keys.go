package throttle

import (
	"crypto/sha256"
	"encoding/base64"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/policies"
)

// scope is the set of Redis keys one call touches: the pause keys and the
// key of every rule, per-key rules resolved for the call's key.
type scope struct {
	id   string   // the hashed key, or "" for a call that touches shared rules only
	keys []string // pause of the quota, pause of the key (or the quota's again), rules
}

// scopeFor resolves the keys of every rule for key k. The key is hashed so
// that tokens and tenant names never reach Redis in the clear, and every
// key of the quota carries the hash tag {name}, so one script can touch them
// all on Redis Cluster.
func (l *Limiter) scopeFor(c call) scope {
	if !l.cfg.perKey {
		return scope{keys: l.cfg.shared}
	}
	sum := sha256.Sum256([]byte(c.key))
	hashed := base64.RawURLEncoding.EncodeToString(sum[:16])
	keys := make([]string, len(l.cfg.shared))
	copy(keys, l.cfg.shared)
	if !l.cfg.hasShared {
		keys[1] = l.cfg.base + "pause:" + hashed
	}
	for i, r := range l.cfg.rules {
		if r.PerKey {
			keys[2+i] += ":" + hashed
		}
	}
	return scope{id: hashed, keys: keys}
}

func (l *Limiter) newMember() string {
	return l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
}

// Every key a script touches is declared in its KEYS, as Redis asks of a
// script (engines that check it, as Dragonfly does, refuse others): the
// keys the script reads by place (the meta, the pause, the rules), then
// those it reaches by name (see lib.lua's header), built from a rule's
// key: a log's hint (:next), a learned cap and the others' share (:cap),
// the charges to match the vendor's count (:ch), the refunds (:rf), the
// refused calls (:rj), the classes (:cl), and when a vendor's count last
// rebuilt a blind rule (:rb). A class's own log
// (:c:<class>) is declared by the acquire script's caller, which knows the
// calls' classes (declareClasses). Each script declares only what it may
// touch, by the rule's kind: every key declared costs the call's bytes,
// and, while a Cluster slot migrates, a declared key absent from the source
// makes Redis answer TRYAGAIN. The scripts that read the meta's state of
// a group (readsGroup) declare the group's key too, and acquire the key of
// each limiter's own count of scripts (countsOwn). TestScripts_TouchOnlyDeclaredKeys
// holds these lists to what the scripts touch.
var (
	logOrCounter = []policies.Kind{policies.KindSlidingLog, policies.KindSlidingCounter}
	suffixes     = map[*redis.Script]map[policies.Kind][]string{
		scripts.acquire: {
			policies.KindSlidingLog:     {":next", ":cap", ":cl", ":rb"},
			policies.KindSlidingCounter: {":cap", ":cl", ":rb"},
			policies.KindTokenBucket:    {":cap", ":rb"},
		},
		scripts.cancel:   {policies.KindSlidingLog: {":next"}},
		scripts.handback: {policies.KindSlidingLog: {":next"}},
		scripts.settle: {
			policies.KindSlidingLog:     {":next", ":rf"},
			policies.KindSlidingCounter: {":rf"},
		},
		scripts.usage: {
			policies.KindSlidingLog:     {":cap", ":rb"},
			policies.KindSlidingCounter: {":cap", ":rb"},
			policies.KindTokenBucket:    {":cap", ":rb"},
		},
		scripts.feedback: {
			policies.KindSlidingLog:     {":next", ":cap", ":ch", ":rf", ":rj", ":rb"},
			policies.KindSlidingCounter: {":cap", ":ch", ":rf", ":rj", ":rb"},
			policies.KindTokenBucket:    {":cap", ":rb"},
		},
	}
	readsGroup = map[*redis.Script]bool{scripts.acquire: true, scripts.feedback: true, scripts.usage: true}
	// countsOwn are the scripts that count each limiter's own scripts, in
	// the quota's key "ran" (count_own in lua/acquire.lua).
	countsOwn = map[*redis.Script]bool{scripts.acquire: true}
)

// declared returns keys, the KEYS script s reads by place for rules (the
// meta, the pause, then rule i's at 2+i), followed by the keys it may
// build from them, and the key of the quota's group, if any (lib.lua's
// Groups), for a script that reads it.
func declared(s *redis.Script, keys []string, rules []policies.Rule, group string) []string {
	by := suffixes[s]
	n := len(keys)
	for _, r := range rules {
		n += len(by[r.Kind])
	}
	if group != "" && readsGroup[s] {
		n++
	} else {
		group = ""
	}
	if countsOwn[s] {
		n++
	}
	if n == len(keys) {
		return keys
	}
	out := make([]string, len(keys), n)
	copy(out, keys)
	for i, r := range rules {
		for _, suffix := range by[r.Kind] {
			out = append(out, keys[2+i]+suffix)
		}
	}
	if group != "" {
		out = append(out, group)
	}
	if countsOwn[s] {
		out = append(out, strings.TrimSuffix(keys[0], "meta")+"ran")
	}
	return out
}

// declaredFor returns what declared does for script s on scope sc: for
// the scope of the shared rules, as compile made it once.
func (l *Limiter) declaredFor(s *redis.Script, sc scope) []string {
	if sc.id == "" {
		if keys, ok := l.cfg.sharedAll[s]; ok {
			return keys
		}
	}
	return declared(s, sc.keys, l.cfg.rules, l.cfg.groupKey)
}

// declareClasses appends to keys the class logs the acquire script may
// book the calls of class in, under the rules of sc (see class_rules in
// acquire.lua): under each log and counter, the class's log, and a log's
// hint of it; a per-key rule's classes are priorities alone. A class
// other than the default one may be the first to call under a rule: the
// script then fills the default class's log (fill_default), declared too.
func (l *Limiter) declareClasses(keys []string, sc scope, class string) []string {
	if class == "" {
		return keys
	}
	for i, r := range l.cfg.rules {
		if slices.Contains(logOrCounter, r.Kind) {
			keys = appendClassLog(keys, sc.keys[2+i], r, class)
			if className(r, class) != defaultClass {
				keys = appendClassLog(keys, sc.keys[2+i], r, defaultClass)
			}
		}
	}
	return keys
}

// defaultClass is the class of a call of priority 0 with no key.
const defaultClass = "0"

// className is the name of class under rule r, as class_name in
// lua/lib.lua has it: a per-key rule's classes are priorities alone.
func className(r policies.Rule, class string) string {
	if r.PerKey {
		name, _, _ := strings.Cut(class, "/")
		return name
	}
	return class
}

// appendClassLog appends to keys the log of class under rule r, of key
// ruleKey, and a log's hint of it; a per-key rule's classes are
// priorities alone.
func appendClassLog(keys []string, ruleKey string, r policies.Rule, class string) []string {
	k := ruleKey + ":c:" + className(r, class)
	keys = append(keys, k)
	if r.Kind == policies.KindSlidingLog {
		keys = append(keys, k+":next")
	}
	return keys
}

// bookingKeys returns the keys script s may touch to give back or settle
// booking r: those of its scope (see declared) and, under the rules where
// r counts in its class, the rule's classes (:cl) and, where the class's
// own log holds r, that log and a log's hint of it (see change_classes in
// lua/lib.lua).
func (l *Limiter) bookingKeys(s *redis.Script, r result) []string {
	keys := l.declaredFor(s, r.scope)
	if r.noted == 0 {
		return keys
	}
	keys = slices.Clone(keys)
	for i, rule := range l.cfg.rules {
		bit := int64(1) << i
		if r.noted&bit == 0 {
			continue
		}
		k := r.scope.keys[2+i]
		keys = append(keys, k+":cl")
		if r.logged&bit != 0 {
			keys = appendClassLog(keys, k, rule, r.class)
		}
	}
	return keys
}
