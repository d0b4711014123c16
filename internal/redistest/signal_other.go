//go:build !unix

package redistest

import "os"

// Freeze and Thaw need job-control signals, which this OS lacks.
var sigStop, sigCont os.Signal
