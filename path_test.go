package throttle

import (
	"context"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
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

// TestPath_FollowingCtxFromAnEntryPointIsATree follows the caller's
// context through the package's code, reading it: from each entry point,
// each call that passes ctx on to a function of the package (Do's acquire,
// then its release), and from there every such call. The files each one
// reaches form a tree: each is entered from one file only, and none calls
// back up into a file on its way down, so a reader who follows ctx from
// the entry point goes down through each file once and comes back up the
// same way.
func TestPath_FollowingCtxFromAnEntryPointIsATree(t *testing.T) {
	// Type-checking go-redis from source takes 9 s of a core: .ci/run's
	// switches step runs it (THROTTLE_LONG=1, without -race), the README's
	// test command leaves it out.
	long(t)
	if raceEnabled {
		// Type-checking go-redis from source takes 20 s under -race, and
		// one goroutine does it: .ci/run runs it without.
		t.Skip("runs without -race (see .ci/run)")
	}
	t.Parallel()
	fset, info, decls := typeCheckThePackage(t)
	for _, entry := range []string{"Limiter.Acquire", "Limiter.Allow", "Do", "Go"} {
		t.Run(entry, func(t *testing.T) {
			var root *ast.FuncDecl
			for _, fd := range decls {
				if funcName(fd) == entry {
					root = fd
				}
			}
			if root == nil {
				t.Fatalf("no %s", entry)
			}
			// Each call of the entry point that passes ctx on goes down
			// once: Do acquires, then releases.
			ast.Inspect(root.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok || !passesCtx(call) {
					return true
				}
				if callee := (&ctxPath{info: info, decls: decls}).callee(call); callee != nil {
					cp := ctxPath{fset: fset, info: info, decls: decls, from: map[string]string{}, seen: map[*ast.FuncDecl]bool{root: true}}
					cp.from[cp.file(callee)] = cp.file(root)
					cp.walk(t, callee)
					t.Logf("%s: %v", funcName(callee), cp.from)
				}
				return true
			})
		})
	}
}

// typeCheckThePackage parses and type-checks the package's files but its
// tests, and returns them with what the check found and each function's
// declaration by its object.
func typeCheckThePackage(t *testing.T) (*token.FileSet, *types.Info, map[types.Object]*ast.FuncDecl) {
	t.Helper()
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}, Defs: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "source", nil)}
	if _, err := conf.Check("throttle", fset, files, info); err != nil {
		t.Fatal(err)
	}
	decls := map[types.Object]*ast.FuncDecl{}
	for _, f := range files {
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok {
				decls[info.Defs[fd.Name]] = fd
			}
		}
	}
	return fset, info, decls
}

// funcName returns "Recv.Name" for a method, "Name" for a function.
func funcName(fd *ast.FuncDecl) string {
	if fd.Recv == nil {
		return fd.Name.Name
	}
	typ := fd.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if id, ok := typ.(*ast.Ident); ok {
		return id.Name + "." + fd.Name.Name
	}
	return fd.Name.Name
}

// ctxPath follows ctx down from a function; from maps each file reached to
// the file it was first entered from.
type ctxPath struct {
	fset  *token.FileSet
	info  *types.Info
	decls map[types.Object]*ast.FuncDecl
	from  map[string]string
	seen  map[*ast.FuncDecl]bool
}

func (cp *ctxPath) file(n ast.Node) string { return filepath.Base(cp.fset.Position(n.Pos()).Filename) }

// walk follows every call of fd that passes ctx on to a function of the
// package, and fails t where a file is entered from a second file or
// from below.
func (cp *ctxPath) walk(t *testing.T, fd *ast.FuncDecl) {
	if cp.seen[fd] {
		return
	}
	cp.seen[fd] = true
	ast.Inspect(fd.Body, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok || !passesCtx(call) {
			return true
		}
		callee := cp.callee(call)
		if callee == nil {
			return true
		}
		a, b := cp.file(fd), cp.file(callee)
		if a != b {
			if up := cp.ancestors(a); slices.Contains(up, b) {
				t.Errorf("%s (%s) calls %s back up in %s, on the way down %v", funcName(fd), a, funcName(callee), b, up)
			} else if f, ok := cp.from[b]; ok && f != a {
				t.Errorf("%s is entered from %s (%s calls %s) and from %s", b, a, funcName(fd), funcName(callee), f)
			}
			if _, ok := cp.from[b]; !ok {
				cp.from[b] = a
			}
		}
		cp.walk(t, callee)
		return true
	})
}

// ancestors returns the files above file on the way down, nearest first.
func (cp *ctxPath) ancestors(file string) []string {
	var up []string
	for f, ok := cp.from[file]; ok && !slices.Contains(up, f); f, ok = cp.from[f] {
		up = append(up, f)
	}
	return up
}

// passesCtx reports whether an argument of call mentions ctx.
func passesCtx(call *ast.CallExpr) bool {
	found := false
	for _, a := range call.Args {
		ast.Inspect(a, func(n ast.Node) bool {
			if id, ok := n.(*ast.Ident); ok && id.Name == "ctx" {
				found = true
			}
			return !found
		})
	}
	return found
}

// callee returns the declaration of the package's function that call
// calls, or nil.
func (cp *ctxPath) callee(call *ast.CallExpr) *ast.FuncDecl {
	var id *ast.Ident
	switch f := call.Fun.(type) {
	case *ast.Ident:
		id = f
	case *ast.SelectorExpr:
		id = f.Sel
	case *ast.IndexExpr:
		id, _ = f.X.(*ast.Ident)
	}
	if id == nil {
		return nil
	}
	obj := cp.info.Uses[id]
	if fn, ok := obj.(*types.Func); ok {
		obj = fn.Origin()
	}
	return cp.decls[obj]
}
