package throttle

import (
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"
)

// newKeyPool returns the pool of a Transport's Keys, set on requests by
// set, or an error saying what is wrong with them.
func newKeyPool(keys []string, set func(r *http.Request, key string)) (*keyPool, error) {
	if set == nil {
		return nil, errors.New("needs SetKey, to set the key picked on the request")
	}
	if len(keys) == 0 {
		return nil, errors.New("empty, while SetKey is set")
	}
	p := &keyPool{set: set, keys: make([]poolKey, len(keys))}
	for i, k := range keys {
		if k == "" {
			return nil, fmt.Errorf("key %d is empty", i)
		}
		p.keys[i] = poolKey{key: k, room: -1}
	}
	return p, nil
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
		if k.quiet.After(now) || lim.paused(Key(k.key)) > 0 {
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
