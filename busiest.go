package throttle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/policies"
)

// KeyLoad is how full one key of a quota's per-key rules is, as
// BusiestKeys reads it: under the fullest of its per-key rules.
type KeyLoad struct {
	// Hash names the key as its Redis keys do: the key itself never
	// reaches Redis, only the base64url of the first 16 bytes of its
	// SHA-256.
	Hash string
	// Used is the units the rule counts for the key now: admitted in the
	// window ending now and booked for later by waiting calls (for a
	// TokenBucket, the units still to drain; for a Concurrency rule, the
	// calls in flight).
	Used int
	// Limit is the rule's limit as configured (a cap the vendor taught the
	// key is not read: Usage with the key reads it).
	Limit int
}

// The bounds of BusiestKeys' search: SCAN's COUNT, and the keys it looks
// at in all before it stops.
const (
	busiestScanCount = 1000
	busiestScanMax   = 10_000
)

// BusiestKeys returns the n keys of the quota's per-key rules that are the
// fullest now, by Used/Limit, fullest first, for a dashboard to show where
// a quota's load comes from. It is read-only, and bounded: it finds the
// keys with SCAN (never KEYS), looks at about 10,000 of the Redis's keys at
// most (in a larger Redis the keys it finds are a sample, not all of them),
// and reads their counts in one pipeline of plain read commands. Keys with
// nothing counted now are left out. On Redis Cluster every key of the
// quota shares one hash tag, so it reads one node.
//
// It fails for a quota without per-key rules, and for n <= 0.
func (l *Limiter) BusiestKeys(ctx context.Context, n int) ([]KeyLoad, error) {
	if err := l.made(); err != nil {
		return nil, err
	}
	if n <= 0 {
		return nil, fmt.Errorf("throttle: quota %q: BusiestKeys: n must be > 0, got %d", l.name, n)
	}
	first := slices.IndexFunc(l.cfg.rules, func(r policies.Rule) bool { return r.PerKey })
	if first < 0 {
		return nil, fmt.Errorf("throttle: quota %q: BusiestKeys: the quota has no per-key rules", l.name)
	}
	node, err := l.nodeOf(ctx, l.cfg.shared[2+first])
	if err != nil {
		return nil, l.unavailable(err)
	}
	hashes, err := l.scanKeys(ctx, node, l.cfg.shared[2+first]+":")
	if err != nil {
		return nil, l.unavailable(err)
	}
	if len(hashes) == 0 {
		return nil, nil
	}
	loads, err := l.readLoads(ctx, node, hashes)
	if err != nil {
		return nil, l.unavailable(err)
	}
	slices.SortFunc(loads, func(a, b KeyLoad) int {
		return cmp.Or(cmp.Compare(b.fill(), a.fill()), cmp.Compare(b.Used, a.Used), strings.Compare(a.Hash, b.Hash))
	})
	return loads[:min(n, len(loads))], nil
}

// fill is how full the key is, Used/Limit.
func (k KeyLoad) fill() float64 { return float64(k.Used) / float64(max(k.Limit, 1)) }

// nodeOf returns the client of the server that holds key: on a Cluster,
// the master of its slot.
func (l *Limiter) nodeOf(ctx context.Context, key string) (*redis.Client, error) {
	switch c := l.rdb.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	case *redis.Client:
		return c, nil
	}
	return nil, fmt.Errorf("a %T cannot be scanned; use a *redis.Client or *redis.ClusterClient", l.rdb)
}

// scanKeys returns the hashes of the keys named prefix + hash on node,
// from at most busiestScanMax keys scanned. The keys a rule's key derives
// (":next", ":cap", a class's ":c:...") are not a key's hash, and are left.
func (l *Limiter) scanKeys(ctx context.Context, node *redis.Client, prefix string) ([]string, error) {
	seen := map[string]bool{}
	var hashes []string
	var cursor uint64
	for scanned := 0; scanned < busiestScanMax; scanned += busiestScanCount {
		keys, next, err := l.scanOnce(ctx, node, cursor, globEscape(prefix)+"*")
		if err != nil {
			return nil, err
		}
		for _, k := range keys {
			h := strings.TrimPrefix(k, prefix)
			if isKeyHash(h) && !seen[h] {
				seen[h] = true
				hashes = append(hashes, h)
			}
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	return hashes, nil
}

// scanOnce runs one SCAN, within the limiter's RedisTimeout.
func (l *Limiter) scanOnce(ctx context.Context, node *redis.Client, cursor uint64, match string) ([]string, uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, l.s.redisTimeout)
	defer cancel()
	return node.Scan(ctx, cursor, match, busiestScanCount).Result()
}

// isKeyHash reports whether s is a key's hash as scopeFor writes it: 16
// bytes in unpadded base64url.
func isKeyHash(s string) bool {
	if len(s) != 22 {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// readLoads reads the load of each key hashed under every per-key rule, in
// one pipeline, at node's time (or the limiter's Clock), and returns each
// key's fullest rule; keys with nothing counted are left out.
func (l *Limiter) readLoads(ctx context.Context, node *redis.Client, hashes []string) ([]KeyLoad, error) {
	ctx, cancel := context.WithTimeout(ctx, l.s.redisTimeout)
	defer cancel()
	now, err := l.redisNow(ctx, node)
	if err != nil {
		return nil, err
	}
	type read struct {
		rule int
		cmd  redis.Cmder
	}
	reads := make([][]read, len(hashes))
	// Each command's error is read below: Pipelined returns the first.
	_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, h := range hashes {
			for j, r := range l.cfg.rules {
				if r.PerKey {
					reads[i] = append(reads[i], read{j, loadCmd(ctx, p, r, l.cfg.shared[2+j]+":"+h, now)})
				}
			}
		}
		return nil
	})
	loads := make([]KeyLoad, 0, len(hashes))
	for i, h := range hashes {
		load := KeyLoad{Hash: h}
		for _, rd := range reads[i] {
			// A missing key (redis.Nil) holds nothing.
			if err := rd.cmd.Err(); err != nil && !errors.Is(err, redis.Nil) {
				return nil, err
			}
			r := l.cfg.rules[rd.rule]
			k := KeyLoad{Hash: h, Used: loadOf(r, rd.cmd, now), Limit: r.Limit}
			if load.Limit == 0 || k.fill() > load.fill() {
				load = k
			}
		}
		if load.Used > 0 {
			loads = append(loads, load)
		}
	}
	return loads, nil
}

// redisNow returns the time the scripts would decide at, in microseconds:
// the limiter's Clock, or node's TIME.
func (l *Limiter) redisNow(ctx context.Context, node *redis.Client) (int64, error) {
	if l.s.clock != nil {
		return l.s.clock().UnixMicro(), nil
	}
	t, err := node.Time(ctx).Result()
	return t.UnixMicro(), err
}

// loadCmd queues on p the read of rule r's count in key at now, as
// usage.lua reads it (see lua/lib.lua for each kind's layout): a log's
// entries in its window and after (booked), scored in microseconds; a
// counter's buckets (a hash of bucket index -> units); a token bucket's
// theoretical arrival time (field t); a concurrency rule's leases, scored
// by when they run out.
func loadCmd(ctx context.Context, p redis.Pipeliner, r policies.Rule, key string, now int64) redis.Cmder {
	switch r.Kind {
	case policies.KindSlidingLog:
		return p.ZCount(ctx, key, "("+strconv.FormatInt(now-r.Window.Microseconds(), 10), "+inf")
	case policies.KindSlidingCounter:
		return p.HGetAll(ctx, key)
	case policies.KindTokenBucket:
		return p.HGet(ctx, key, "t")
	}
	return p.ZCount(ctx, key, "("+strconv.FormatInt(now, 10), "+inf")
}

// loadOf returns the units rule r counts now, read by cmd (see loadCmd):
// what usage.lua's used and booked add up to.
func loadOf(r policies.Rule, cmd redis.Cmder, now int64) int {
	switch c := cmd.(type) {
	case *redis.IntCmd:
		return int(c.Val())
	case *redis.MapStringStringCmd:
		// The buckets a window ending now touches, and those booked after.
		width := max(r.Bucket.Microseconds(), 1)
		oldest := now/width - (r.Window.Microseconds()+width-1)/width
		used := 0
		for b, units := range c.Val() {
			bucket, err1 := strconv.ParseInt(b, 10, 64)
			n, err2 := strconv.Atoi(units)
			if err1 == nil && err2 == nil && bucket >= oldest {
				used += n
			}
		}
		return used
	case *redis.StringCmd:
		tat, err := strconv.ParseInt(c.Val(), 10, 64)
		if err != nil || tat <= now {
			return 0
		}
		return int(math.Ceil(float64(tat-now) / float64(max(r.Every.Microseconds(), 1))))
	}
	return 0
}
