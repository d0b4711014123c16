package protocol

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// The generated files are what the generator writes now: run
// `go generate` in the module's root when this fails.
func TestGeneratedFilesAreCurrent(t *testing.T) {
	for _, f := range []struct {
		path string
		make func() ([]byte, error)
	}{{LuaFile, Lua}, {GoFile, Go}} {
		want, err := f.make()
		if err != nil {
			t.Fatalf("%s: %v", f.path, err)
		}
		got, err := os.ReadFile(filepath.Join("..", "..", f.path))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from what internal/protocol generates: run go generate in the module's root", f.path)
		}
	}
}
