package main

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// scriptHook is a go-redis hook that counts the script calls a client sends
// (EVALSHA, EVAL and their read-only forms; a NOSCRIPT fallback is two).
type scriptHook struct{ n *atomic.Int64 }

func (h scriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h scriptHook) count(cmd redis.Cmder) {
	switch cmd.Name() {
	case "evalsha", "eval", "evalsha_ro", "eval_ro":
		h.n.Add(1)
	}
}
