package throttle

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// stackHook records, at each script call, the files of the package that the
// call came down through, from the entry point to Redis.
type stackHook struct {
	mu    sync.Mutex
	paths [][]string
}

func (*stackHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*stackHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *stackHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.record()
		}
		return next(ctx, cmd)
	}
}

func (h *stackHook) record() {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(3, pcs)])
	var files []string // innermost first
	for {
		f, more := frames.Next()
		// The package's own files: not its tests, not internal/ nor go-redis.
		if strings.HasPrefix(f.Function, "github.com/throttlekit/throttle.") && !strings.HasSuffix(f.File, "_test.go") {
			file := filepath.Base(f.File)
			if len(files) == 0 || files[len(files)-1] != file {
				files = append(files, file)
			}
		}
		if !more {
			break
		}
	}
	slices.Reverse(files)
	h.mu.Lock()
	h.paths = append(h.paths, files)
	h.mu.Unlock()
}

// TestPath_ACallGoesDownThroughEachFileOnce follows each entry point down to
// the script call it makes: the files on the way are each entered once, so
// that a reader follows one call downward, one idea per file.
func TestPath_ACallGoesDownThroughEachFileOnce(t *testing.T) {
	s := redistest.Mini(t)
	ctx := context.Background()
	policy := policies.SlidingLog{Limit: 1000, Window: time.Second}
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer vendor.Close()
	for _, tt := range []struct {
		name string
		mode Mode
		call func(lim *Limiter) error
	}{
		{"Acquire in Block mode", Block, func(lim *Limiter) error { _, err := lim.Acquire(ctx); return err }},
		{"Acquire in FailFast mode", FailFast, func(lim *Limiter) error { _, err := lim.Acquire(ctx); return err }},
		{"Acquire in Queue mode", Queue, func(lim *Limiter) error { _, err := lim.Acquire(ctx); return err }},
		{"Allow", Block, func(lim *Limiter) error { _, err := lim.Allow(ctx); return err }},
		{"Do", Block, func(lim *Limiter) error {
			_, err := Do(ctx, lim, func(context.Context) (int, error) { return 0, nil })
			return err
		}},
		{"Go", Queue, func(lim *Limiter) error {
			_, err := Go(ctx, lim, func(context.Context) (int, error) { return 0, nil }).Wait()
			return err
		}},
		{"Transport", Block, func(lim *Limiter) error {
			resp, err := (&http.Client{Transport: &Transport{Limiter: lim}}).Get(vendor.URL)
			if err == nil {
				resp.Body.Close()
			}
			return err
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var h stackHook
			rdb := s.Client(t)
			rdb.AddHook(&h)
			lim, err := New(rdb, "path-"+strings.ReplaceAll(tt.name, " ", "-"), policy, Options{Mode: tt.mode})
			if err != nil {
				t.Fatal(err)
			}
			if err := tt.call(lim); err != nil {
				t.Fatal(err)
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			if len(h.paths) == 0 {
				t.Fatal("no script call was seen")
			}
			for _, path := range h.paths {
				seen := map[string]bool{}
				for _, f := range path {
					if seen[f] {
						t.Errorf("the call enters %s twice on its way down: %s", f, strings.Join(path, " → "))
						break
					}
					seen[f] = true
				}
				t.Logf("%s", strings.Join(path, " → "))
			}
		})
	}
}
