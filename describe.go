package throttle

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/policies"
)

// description is what a limiter stores of its policy with its quota's
// meta (the policy field), so that a tool reads any quota without being
// told its policy (see Open). It stays as small as the policy, and goes
// with the meta key when the quota expires.
type description struct {
	// Version is descriptionVersion; a reader refuses another.
	Version int `json:"v"`
	// Name is the quota's name, as given to New.
	Name string `json:"name"`
	// Rules are the rules as policies.Rules gives them, in their order.
	Rules []policies.Rule `json:"rules"`
	// Keys are each rule's Redis key; a per-key rule's is followed by
	// ":" and the key's hash (see scopeFor).
	Keys []string `json:"keys"`
}

const descriptionVersion = 1

// describe returns the limiter's description, as JSON.
func (l *Limiter) describe() string {
	b, err := json.Marshal(description{Version: descriptionVersion, Name: l.name, Rules: l.cfg.rules, Keys: l.cfg.shared[2:]})
	if err != nil {
		// A Rule is numbers and strings: Marshal cannot fail on one.
		panic("throttle: describing the policy: " + err.Error())
	}
	return string(b)
}

// describing returns the limiter's age in µs and the description for the
// next acquire script to store, or "" when the quota's meta holds it
// already in the epoch this limiter knows (the meta is new after a loss,
// and only then can lack it), or the limiter describes nothing. The
// script keeps the description of the limiter made last: ages tell an old
// version's limiter from a new one, whichever describes last.
func (l *Limiter) describing() (int64, string) {
	if e := l.view.epoch.Load(); l.cfg.description == "" || e != 0 && l.view.described.Load() == e {
		return 0, ""
	}
	return time.Since(l.born).Microseconds(), l.cfg.description
}

// A QuotaName names a quota a Redis holds, as Quotas finds it.
type QuotaName struct {
	// Name is the quota's name, as given to New.
	Name string
	// Group is the Name of the quota's policies.Shared rules, or "".
	Group string
}

// Quotas lists the quotas of prefix ("" for the default, "throttle") that
// rdb holds, sorted by name, found by their meta keys with SCAN (never
// KEYS: a production Redis is not held up), on every master of a Cluster.
// Open reads each one.
func Quotas(ctx context.Context, rdb redis.UniversalClient, prefix string) ([]QuotaName, error) {
	if rdb == nil {
		return nil, errors.New("throttle: Quotas: redis client is nil")
	}
	if prefix == "" {
		prefix = defaultPrefix
	}
	pattern := globEscape(prefix) + ":{*:meta"
	var (
		mu    sync.Mutex // a Cluster's masters are scanned at once
		found []QuotaName
	)
	scan := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			if q, ok := quotaOfMeta(prefix, iter.Val()); ok {
				mu.Lock()
				found = append(found, q)
				mu.Unlock()
			}
		}
		return iter.Err()
	}
	var err error
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, scan)
	} else if c, ok := rdb.(*redis.Client); ok {
		err = scan(ctx, c)
	} else {
		return nil, fmt.Errorf("throttle: Quotas: a %T cannot be scanned; pass a *redis.Client or *redis.ClusterClient", rdb)
	}
	if err != nil {
		return nil, fmt.Errorf("throttle: Quotas: %w", err)
	}
	slices.SortFunc(found, func(a, b QuotaName) int { return strings.Compare(a.Group+"/"+a.Name, b.Group+"/"+b.Name) })
	return slices.Compact(found), nil
}

// quotaOfMeta returns the quota whose meta key is key: prefix:{NAME}:meta,
// or prefix:{GROUP}/NAME:meta for a quota with policies.Shared rules.
func quotaOfMeta(prefix, key string) (QuotaName, bool) {
	rest, ok := strings.CutPrefix(key, prefix+":{")
	if !ok {
		return QuotaName{}, false
	}
	if rest, ok = strings.CutSuffix(rest, ":meta"); !ok {
		return QuotaName{}, false
	}
	if group, name, shared := strings.Cut(rest, "}/"); shared && name != "" && !strings.HasPrefix(name, "/") {
		return QuotaName{Name: name, Group: group}, true
	}
	if name, plain := strings.CutSuffix(rest, "}"); plain && name != "" && !strings.Contains(name, "}") {
		return QuotaName{Name: name}, true
	}
	return QuotaName{}, false
}

// globEscape escapes the characters SCAN's MATCH reads as a pattern.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// ErrNotDescribed is returned by Open for a quota whose meta holds no
// description of its policy: no process has run its acquire script since
// the quota's data began (or the quota's fleet runs a version that did not
// describe it). Build a Limiter with New and the fleet's policy instead.
var ErrNotDescribed = errors.New("throttle: the quota holds no description of its policy")

// Open returns a Limiter for quota q on rdb under the policy its fleet
// stored with the quota's data, for tools that read a quota without being
// told its policy: Usage reads it as its fleet sees it. opts are as for New
// (Prefix names where the quota lives); q is as Quotas lists it, or
// QuotaName{Name: name} for a quota without policies.Shared rules. The
// quota must exist: Open fails
// with ErrNotDescribed when its meta holds no description, and with
// ErrUnavailable when Redis cannot be read.
//
// The Limiter is a full one: its calls count against the quota as the
// fleet's do. It leaves the quota's description to the fleet's limiters.
func Open(ctx context.Context, rdb redis.UniversalClient, q QuotaName, opts ...Options) (*Limiter, error) {
	name, group := q.Name, q.Group
	if rdb == nil {
		return nil, errors.New("throttle: Open: redis client is nil")
	}
	if err := validName("name", name); err != nil {
		return nil, err
	}
	s, err := newSettings(name, opts)
	if err != nil {
		return nil, err
	}
	meta := quotaBase(s.keyPrefix(), name, group) + "meta"
	text, err := rdb.HGet(ctx, meta, "policy").Result()
	switch {
	case errors.Is(err, redis.Nil):
		return nil, fmt.Errorf("%w: %s (no field policy in %s)", ErrNotDescribed, name, meta)
	case err != nil:
		return nil, fmt.Errorf("%w: reading %s: %w", ErrUnavailable, meta, err)
	}
	var d description
	if err := json.Unmarshal([]byte(text), &d); err != nil || d.Version != descriptionVersion {
		return nil, fmt.Errorf("throttle: Open: quota %q: the description in %s is not one this version reads (version %d): %v", name, meta, d.Version, err)
	}
	l, err := New(rdb, name, policies.FromRules(d.Rules), opts...)
	if err != nil {
		return nil, err
	}
	// Made after the fleet's limiters, it would pass for the newest: a
	// description read before a newer one came would replace that one.
	l.cfg.description = ""
	return l, nil
}
