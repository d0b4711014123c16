// Command gen writes the files internal/protocol generates: run it from
// the module's root (go generate does, from lua.go).
package main

import (
	"fmt"
	"os"

	"github.com/throttlekit/throttle/internal/protocol"
)

func main() {
	for _, f := range []struct {
		path string
		make func() ([]byte, error)
	}{{protocol.LuaFile, protocol.Lua}, {protocol.GoFile, protocol.Go}} {
		b, err := f.make()
		if err == nil {
			err = os.WriteFile(f.path, b, 0o644)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "gen: %s: %v\n", f.path, err)
			os.Exit(1)
		}
	}
}
