//go:build unix

package dashboard

import (
	"os/exec"
	"syscall"
)

// killGroupOnCancel makes cmd start a process group of its own, and its
// cancellation kill the whole group: chromium's renderers and helpers
// with it.
func killGroupOnCancel(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
}
