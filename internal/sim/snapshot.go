package sim

import "time"

// snapshot is what a server held at a moment: the strings, hashes and
// sorted sets the scripts write, with their TTLs. Scripts are not kept: a
// replica has none until they are run by EVAL.
type snapshot struct {
	at      time.Time
	strings map[string]string
	hashes  map[string]map[string]string
	zsets   map[string]map[string]float64
	ttls    map[string]time.Duration
}

// Snapshot remembers what the server holds now, for Failover: a replica
// whose replication stopped here.
func (r *Redis) Snapshot() {
	m := r.Server()
	s := &snapshot{at: time.Now(), strings: map[string]string{}, hashes: map[string]map[string]string{},
		zsets: map[string]map[string]float64{}, ttls: map[string]time.Duration{}}
	for _, k := range m.Keys() {
		switch m.Type(k) {
		case "string":
			s.strings[k], _ = m.Get(k)
		case "hash":
			fields, _ := m.HKeys(k)
			h := map[string]string{}
			for _, f := range fields {
				h[f] = m.HGet(k, f)
			}
			s.hashes[k] = h
		case "zset":
			// Member by member: SortedSet returns the server's own map,
			// which its scripts go on writing.
			members, _ := m.ZMembers(k)
			z := map[string]float64{}
			for _, member := range members {
				z[member], _ = m.ZScore(k, member)
			}
			s.zsets[k] = z
		default:
			continue
		}
		if ttl := m.TTL(k); ttl > 0 {
			s.ttls[k] = ttl
		}
	}
	r.mu.Lock()
	r.snap = s
	r.mu.Unlock()
}

// Failover replaces the server with one that holds what the last Snapshot
// saw, and no scripts: every connection closes, as when a replica is
// promoted. The TTLs run from the failover, as a replica's do.
func (r *Redis) Failover() error {
	r.mu.Lock()
	s := r.snap
	r.mu.Unlock()
	if s == nil {
		return ErrNoSnapshot
	}
	m := newServer()
	for k, v := range s.strings {
		_ = m.Set(k, v)
	}
	for k, h := range s.hashes {
		var fv []string
		for f, v := range h {
			fv = append(fv, f, v)
		}
		m.HSet(k, fv...)
	}
	for k, z := range s.zsets {
		for member, score := range z {
			_, _ = m.ZAdd(k, score, member)
		}
	}
	for k, ttl := range s.ttls {
		m.SetTTL(k, ttl)
	}
	r.mu.Lock()
	links := r.takeLinksLocked()
	old := r.m
	r.m = m
	r.down = false
	if r.offset != 0 {
		r.tickLocked()
	}
	r.mu.Unlock()
	closeLinks(links)
	old.Close()
	return nil
}
