package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"
)

// listQuotas prints the name of every quota of prefix that rdb holds,
// found by its meta key with SCAN (never KEYS: a production Redis is not
// held up), one per line, sorted; a quota of a policies.Shared group is
// shown as "name (group G)". It prints a line saying so when there is none.
func listQuotas(ctx context.Context, rdb *redis.Client, prefix string, stdout io.Writer) error {
	pattern := globEscape(prefix) + ":{*:meta"
	var names []string
	iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		if name, ok := quotaOfMeta(prefix, iter.Val()); ok {
			names = append(names, name)
		}
	}
	if err := iter.Err(); err != nil {
		return fmt.Errorf("listing the quotas: %w", err)
	}
	slices.Sort(names)
	names = slices.Compact(names)
	if len(names) == 0 {
		fmt.Fprintf(stdout, "no quota of prefix %q in this Redis\n", prefix)
		return nil
	}
	fmt.Fprintf(stdout, "%d quotas of prefix %q (show one with -quota NAME -policy P):\n", len(names), prefix)
	for _, n := range names {
		fmt.Fprintln(stdout, "  "+n)
	}
	return nil
}

// quotaOfMeta returns the quota whose meta key is key: prefix:{NAME}:meta,
// or prefix:{GROUP}/NAME:meta for a quota with a policies.Shared rule.
func quotaOfMeta(prefix, key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, prefix+":{")
	if !ok {
		return "", false
	}
	if rest, ok = strings.CutSuffix(rest, ":meta"); !ok {
		return "", false
	}
	if group, name, shared := strings.Cut(rest, "}/"); shared && name != "" {
		return name + " (group " + group + ")", true
	}
	if name, plain := strings.CutSuffix(rest, "}"); plain && name != "" {
		return name, true
	}
	return "", false
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
