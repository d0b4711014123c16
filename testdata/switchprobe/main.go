// Command switchprobe runs a Limiter as any program using the library
// does, for TestSwitches_AProgramBuiltWithoutTheTagIgnoresThem: it prints
// the scripts' OFF table and how many script calls 20 decisions sent to
// a Redis that is down, which the breaker keeps to a few.
//
// Run it with THROTTLE_OFF=breaker,epochs: built without the tag
// throttle_switches, it must print an empty table and a few calls.
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/policies"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "switchprobe:", err)
		os.Exit(1)
	}
}

func run() error {
	redis.SetLogger(quiet{}) // a dial refused at each decision is the point, not news
	mr, err := miniredis.Run()
	if err != nil {
		return err
	}
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	h := &hook{}
	rdb.AddHook(h)
	lim, err := throttle.New(rdb, "probe", policies.SlidingLog{Limit: 100_000, Window: time.Second},
		throttle.Options{OnRedisError: throttle.FailOpen, RedisTimeout: 200 * time.Millisecond})
	if err != nil {
		return err
	}
	ctx := context.Background()
	if d, err := lim.Allow(ctx); err != nil || !d.OK {
		return fmt.Errorf("first call: %+v, %v", d, err)
	}
	mr.Close()
	h.scripts.Store(0)
	for range decisions {
		if d, err := lim.Allow(ctx); err != nil || !d.OK {
			return fmt.Errorf("a call with FailOpen while Redis is down: %+v, %v", d, err)
		}
	}
	fmt.Printf("OFF table: %s\nscript calls to a dead Redis: %d\n", h.offTable(), h.scripts.Load())
	return nil
}

// decisions is how many calls the probe makes while Redis is down.
const decisions = 20

// quiet drops go-redis's log lines.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// hook counts script calls and keeps the OFF table of the scripts sent.
type hook struct {
	scripts atomic.Int64
	mu      sync.Mutex
	off     string
}

func (h *hook) offTable() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.off
}

func (*hook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch cmd.Name() {
		case "evalsha":
			h.scripts.Add(1)
		case "eval":
			h.scripts.Add(1)
			text, _ := cmd.Args()[1].(string)
			for _, line := range strings.Split(text, "\n") {
				if strings.HasPrefix(line, "local OFF = ") {
					h.mu.Lock()
					h.off = line
					h.mu.Unlock()
				}
			}
		}
		return next(ctx, cmd)
	}
}

func (*hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
