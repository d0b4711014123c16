package throttle

import (
	"net/http"
	"sync"
	"time"
)

// WithKeyPool spreads requests over several API keys of one vendor (a
// GitHub App with 8 installation tokens, several OpenAI projects): for each
// request the transport picks the key with the most room, takes the request
// through the limiter as a call of that key (policies.PerKey limits each
// key), and sets it on the request it sends with set, on a clone: the
// caller's request is never changed. A key the vendor refused, or paused,
// is skipped until its reset; when every key is paused, the request waits
// for the one whose pause ends first.
//
//	pool := throttle.WithKeyPool(tokens, func(r *http.Request, token string) {
//		r.Header.Set("Authorization", "Bearer "+token)
//	})
//
// The room of each key is what the latest answers told this process: the
// shared count's remaining units after the key's latest call, and the
// vendor's remaining count; a key not used yet counts as roomiest, so that
// every key is tried. The request still runs in one script call: the pick
// costs Redis nothing, and the limiter decides the call against the key's
// own limits whatever this process believed. The keys are the limiter's
// Keys, hashed before they reach Redis. A pool overrides WithRequestKey.
// An empty pool, an empty key or a nil set is invalid: every request then
// fails with an error saying which.
func WithKeyPool(keys []string, set func(r *http.Request, key string)) TransportOption {
	if len(keys) == 0 {
		return invalid("WithKeyPool", "the pool has no key")
	}
	if set == nil {
		return invalid("WithKeyPool", "set is nil")
	}
	p := &keyPool{set: set, keys: make([]poolKey, len(keys))}
	for i, k := range keys {
		if k == "" {
			return invalid("WithKeyPool", "key %d is empty", i)
		}
		p.keys[i] = poolKey{key: k, room: -1}
	}
	return func(t *Transport) { t.pool = p }
}

// keyPool is what a transport knows of the room of each key of its pool.
type keyPool struct {
	set  func(*http.Request, string)
	mu   sync.Mutex
	keys []poolKey
	next int // where the search for the roomiest key starts, in turn
}

type poolKey struct {
	key   string
	room  int       // units left as last heard, or -1 when unknown
	quiet time.Time // local time until which the vendor refuses the key
}

// pick returns the index of the key with the most room, among those the
// vendor does not refuse now; when it refuses them all, the one it takes
// back first. Keys of equal room are taken in turn.
func (p *keyPool) pick(lim *Limiter) int {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	best, bestRoom := -1, 0
	first := -1
	n := len(p.keys)
	for j := range n {
		i := (p.next + j) % n
		k := &p.keys[i]
		if k.quiet.After(now) || lim.pausedPast(lim.scopeFor(call{key: k.key, hasKey: true}), 0) {
			if first < 0 || k.quiet.Before(p.keys[first].quiet) {
				first = i
			}
			continue
		}
		room := k.room
		if room < 0 {
			room = maxRemaining // not heard of yet: try it
		}
		if best < 0 || room > bestRoom {
			best, bestRoom = i, room
		}
	}
	if best < 0 {
		best = first
	}
	p.next = (best + 1) % n
	return best
}

// heard notes what a call of key i learned of its room: the shared
// count's units left after it (count, or -1), and the vendor's (vendor, or
// -1) with the time until its reset when the vendor has none left.
func (p *keyPool) heard(i, count, vendor int, quiet time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := &p.keys[i]
	switch {
	case count >= 0 && vendor >= 0:
		k.room = min(count, vendor)
	case count >= 0:
		k.room = count
	case vendor >= 0:
		k.room = vendor
	}
	if quiet > 0 {
		k.quiet = time.Now().Add(quiet)
	}
}
