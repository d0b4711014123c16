package throttle

import (
	"crypto/sha256"
	"encoding/base64"
	"strconv"
	"strings"

	"github.com/throttlekit/throttle/policies"
)

// scope is the set of Redis keys one call touches: the pause keys and the
// key of every rule, per-key rules resolved for the call's key.
type scope struct {
	id   string   // the hashed key, or "" for a call that touches shared rules only
	keys []string // pause of the quota, pause of the key (or the quota's again), rules
	all  []string // keys, then every key a script may build from them (declared)
}

// scopeFor resolves the keys of every rule for key k. The key is hashed so
// that tokens and tenant names never reach Redis in the clear, and every
// key of the quota carries the hash tag {name}, so one script can touch them
// all on Redis Cluster.
func (l *Limiter) scopeFor(c call) scope {
	if !l.perKey {
		return scope{keys: l.shared, all: l.sharedAll}
	}
	sum := sha256.Sum256([]byte(c.key))
	hashed := base64.RawURLEncoding.EncodeToString(sum[:16])
	keys := make([]string, len(l.shared))
	copy(keys, l.shared)
	if !l.hasShared {
		keys[1] = l.base + "pause:" + hashed
	}
	for i, r := range l.rules {
		if r.PerKey {
			keys[2+i] += ":" + hashed
		}
	}
	return scope{id: hashed, keys: keys, all: declared(keys, l.rules)}
}

func (l *Limiter) newMember() string {
	return l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
}

// Every key a script touches is declared in its KEYS, as Redis asks of a
// script (engines that check it, as Dragonfly does, refuse others): the
// keys the script reads by place (the meta, the pause, the rules), then
// those it reaches by name (see lib.lua's header). derivedSuffixes are the
// keys a script may build from a rule's key, by the rule's kind: a log's
// hint (:next), a learned cap and the others' share (:cap), the charges to
// match the vendor's count (:ch), the refunds (:rf), the refused calls
// (:rj), and the classes (:cl). A class's own log (:c:<class>) is declared
// by the acquire script's caller, which knows the calls' classes
// (declareClasses).
var derivedSuffixes = map[policies.Kind][]string{
	policies.KindSlidingLog:     {":next", ":cap", ":ch", ":rf", ":rj", ":cl"},
	policies.KindSlidingCounter: {":cap", ":ch", ":rf", ":rj", ":cl"},
	policies.KindTokenBucket:    {":cap"},
}

// declared returns keys, the KEYS a script reads by place for rules (the
// meta, the pause, then rule i's at 2+i), followed by the keys a script
// may build from them.
func declared(keys []string, rules []policies.Rule) []string {
	n := len(keys)
	for _, r := range rules {
		n += len(derivedSuffixes[r.Kind])
	}
	out := make([]string, len(keys), n)
	copy(out, keys)
	for i, r := range rules {
		for _, suffix := range derivedSuffixes[r.Kind] {
			out = append(out, keys[2+i]+suffix)
		}
	}
	return out
}

// declareClasses appends to keys the class logs the acquire script may
// book the calls of class in, under the rules of sc (see class_rules in
// acquire.lua): under each log and counter, the class's log, and a log's
// hint of it; a per-key rule's classes are priorities alone.
func (l *Limiter) declareClasses(keys []string, sc scope, class string) []string {
	if class == "" {
		return keys
	}
	prio, _, _ := strings.Cut(class, "/")
	for i, r := range l.rules {
		if r.Kind != policies.KindSlidingLog && r.Kind != policies.KindSlidingCounter {
			continue
		}
		name := class
		if r.PerKey {
			name = prio
		}
		k := sc.keys[2+i] + ":c:" + name
		keys = append(keys, k)
		if r.Kind == policies.KindSlidingLog {
			keys = append(keys, k+":next")
		}
	}
	return keys
}
