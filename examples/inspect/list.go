package main

import (
	"context"
	"fmt"
	"io"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
)

// listQuotas prints the name of every quota of prefix that rdb holds (see
// throttle.Quotas), one per line, sorted; a quota of a policies.Shared group
// is shown as "name (group G)". It prints a line saying so when there is
// none, and returns the quotas.
func listQuotas(ctx context.Context, rdb *redis.Client, prefix string, stdout io.Writer) ([]throttle.QuotaName, error) {
	names, err := throttle.Quotas(ctx, rdb, prefix)
	if err != nil {
		return nil, fmt.Errorf("listing the quotas: %w", err)
	}
	if len(names) == 0 {
		fmt.Fprintf(stdout, "no quota of prefix %q in this Redis\n", prefix)
		return nil, nil
	}
	fmt.Fprintf(stdout, "%d quotas of prefix %q:\n", len(names), prefix)
	for _, n := range names {
		if n.Group != "" {
			fmt.Fprintf(stdout, "  %s (group %s)\n", n.Name, n.Group)
		} else {
			fmt.Fprintln(stdout, "  "+n.Name)
		}
	}
	return names, nil
}
