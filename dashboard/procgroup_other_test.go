//go:build !unix

package dashboard

import "os/exec"

// killGroupOnCancel leaves cmd as it is: its cancellation kills the
// browser's process alone.
func killGroupOnCancel(*exec.Cmd) {}
