package throttle

import (
	"bufio"
	"bytes"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// transportFiles hold the Transport: it uses nothing of the package but its
// public API and what they declare themselves, so that a transport of one's
// own (another HTTP client, gRPC, a vendor SDK) can be written outside the
// package with the same parts.
var transportFiles = []string{"transport.go", "keypool.go", "headers.go"}

// TestTransport_UsesThePublicAPIOnly type-checks the package and fails on
// every unexported name of it that the Transport's files use without
// declaring it.
func TestTransport_UsesThePublicAPIOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("type-checks the package")
	}
	if raceEnabled {
		// go list -export builds every dependency without -race: a minute
		// of a cold run, for a check the race detector adds nothing to.
		t.Skip("a static check: .ci/run runs it without -race")
	}
	fset := token.NewFileSet()
	var files []*ast.File
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: exportImporter(t, fset)}
	pkg, err := conf.Check("github.com/throttlekit/throttle", fset, files, info)
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for id, obj := range info.Uses {
		pos := fset.Position(id.Pos())
		if !slices.Contains(transportFiles, pos.Filename) || obj.Pkg() != pkg || obj.Exported() {
			continue
		}
		if decl := fset.Position(obj.Pos()).Filename; !slices.Contains(transportFiles, decl) {
			found = append(found, pos.String()+": "+id.Name+" (declared in "+decl+")")
		}
	}
	slices.Sort(found)
	for _, f := range found {
		t.Errorf("the Transport uses an unexported name of the package: %s", f)
	}
	if len(info.Uses) == 0 {
		t.Fatal("type-checking recorded no use at all")
	}
}

// exportImporter imports the package's dependencies from their export data,
// as go list builds it.
func exportImporter(t *testing.T, fset *token.FileSet) types.Importer {
	t.Helper()
	out, err := exec.Command("go", "list", "-export", "-deps", "-f", "{{.ImportPath}}\t{{.Export}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -export: %v", err)
	}
	exports := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if path, file, ok := strings.Cut(sc.Text(), "\t"); ok && file != "" {
			exports[path] = file
		}
	}
	return importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		return os.Open(exports[path])
	})
}
