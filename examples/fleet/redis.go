package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisTimeout bounds the first PING, so a wrong address fails in seconds.
const redisTimeout = 5 * time.Second

// redisOptions turns -redis into client options. A redis:// or rediss:// URL
// is one server; a comma-separated list of host:port (or URLs), or -cluster,
// is a Redis Cluster. Credentials and TLS come from the first URL.
func redisOptions(spec string, cluster bool) (*redis.UniversalOptions, error) {
	var addrs []string
	opts := &redis.UniversalOptions{}
	for i, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if !strings.Contains(part, "://") {
			if _, _, err := net.SplitHostPort(part); err != nil {
				return nil, fmt.Errorf("-redis: %q is neither a redis:// URL nor host:port", part)
			}
			addrs = append(addrs, part)
			continue
		}
		o, err := redis.ParseURL(part)
		if err != nil {
			return nil, fmt.Errorf("-redis: %w", err)
		}
		addrs = append(addrs, o.Addr)
		if i == 0 {
			opts.Username, opts.Password, opts.DB, opts.TLSConfig = o.Username, o.Password, o.DB, o.TLSConfig
		}
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("-redis: no address in %q", spec)
	}
	opts.Addrs = addrs
	opts.IsClusterMode = cluster || len(addrs) > 1
	if opts.IsClusterMode {
		opts.DB = 0 // a cluster has only database 0
	}
	return opts, nil
}

// newRedis returns a client for spec, a Client or a ClusterClient.
func newRedis(spec string, cluster bool) (redis.UniversalClient, error) {
	opts, err := redisOptions(spec, cluster)
	if err != nil {
		return nil, err
	}
	return redis.NewUniversalClient(opts), nil
}

// pingRedis checks that spec answers before any replica is started.
func pingRedis(ctx context.Context, spec string, cluster bool) error {
	rdb, err := newRedis(spec, cluster)
	if err != nil {
		return err
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, redisTimeout)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis %s: %w", spec, err)
	}
	return nil
}

// scriptCounter is a go-redis hook that counts the scripts a client runs
// (EVALSHA, and EVAL when a script is not loaded yet): the cost of the
// limiter in Redis round trips.
type scriptCounter struct {
	n atomic.Int64
}

// DialHook leaves dialing alone.
func (h *scriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook counts one command.
func (h *scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook counts each command of a pipeline.
func (h *scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *scriptCounter) count(cmd redis.Cmder) {
	switch cmd.Name() {
	case "evalsha", "eval", "evalsha_ro", "eval_ro":
		h.n.Add(1)
	}
}
