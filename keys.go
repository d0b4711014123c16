package throttle

import (
	"crypto/sha256"
	"encoding/base64"
	"strconv"
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
	if !l.perKey {
		return scope{keys: l.shared}
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
	return scope{id: hashed, keys: keys}
}

func (l *Limiter) newMember() string {
	return l.id + ":" + strconv.FormatUint(l.seq.Add(1), 36)
}
