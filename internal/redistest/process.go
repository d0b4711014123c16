package redistest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// errExited marks a server that died before answering; the caller may retry
// it on another port.
var errExited = errors.New("exited")

// proc is a running child process. A single goroutine calls Wait, so the
// child is always reaped and its exit is observable without blocking.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once Wait has returned
	err  error         // Wait's result; read only after done is closed
}

// startProc runs bin with its stdout and stderr appended to logPath.
func startProc(bin string, args []string, logPath string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	// The child inherits the fd, so no copying goroutine is needed and Wait
	// never blocks on a pipe held open by a stray descendant.
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGKILL and waits for the process to be reaped.
func (p *proc) kill(timeout time.Duration) error {
	// An error here only means the process is already gone, which the wait
	// below observes anyway.
	_ = p.cmd.Process.Kill()
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("pid %d still running %v after SIGKILL", p.pid(), timeout)
	}
}

// terminate asks the process to exit with SIGTERM and falls back to SIGKILL
// after grace.
func (p *proc) terminate(grace time.Duration) error {
	if p.exited() {
		return nil
	}
	// A frozen process would not act on SIGTERM until resumed.
	if sigCont != nil {
		_ = p.cmd.Process.Signal(sigCont)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	if err := p.kill(stopTimeout); err != nil {
		return err
	}
	return fmt.Errorf("pid %d ignored SIGTERM for %v and was killed", p.pid(), grace)
}

// waitReady polls addr until the server there answers PING and reports p's
// pid, so a different server that happens to hold the port is not mistaken
// for ours.
func waitReady(p *proc, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if p.exited() {
			return fmt.Errorf("%w before answering PING (%v)", errExited, p.err)
		}
		pid, err := probe(addr, 250*time.Millisecond)
		switch {
		case err != nil:
			last = err
		case pid == p.pid():
			return nil
		default:
			// Our process will fail to bind and exit; the next round sees it.
			last = fmt.Errorf("port is answered by pid %d, not by ours (%d)", pid, p.pid())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no PING answer within %v: %v", timeout, last)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// probe sends PING and INFO server over a raw connection and returns the
// answering server's process_id. Raw RESP keeps the polling free of client
// retries, pools and log noise.
func probe(addr string, timeout time.Duration) (int, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return 0, err
	}
	if _, err := io.WriteString(c, "*1\r\n$4\r\nPING\r\n*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n"); err != nil {
		return 0, err
	}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if line != "+PONG\r\n" {
		// For example -LOADING while a dataset is being read.
		return 0, fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	line, err = r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "$")))
	if !strings.HasPrefix(line, "$") || err != nil || n < 0 {
		return 0, fmt.Errorf("INFO answered %q", strings.TrimSpace(line))
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, err
	}
	for l := range strings.Lines(string(body)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "process_id:"); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, errors.New("INFO server has no process_id")
}

// freePort finds a port that is free on 127.0.0.1 right now. With needBus,
// port+10000 (the Redis Cluster bus) must be free too. The port is released
// before returning, so it can be taken again before the server binds it;
// callers retry on bind failure.
func freePort(needBus bool) (int, error) {
	var last error
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("pick a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		if port == reservedPort {
			l.Close()
			continue
		}
		if !needBus {
			l.Close()
			return port, nil
		}
		if port+10000 > 65535 {
			l.Close()
			last = fmt.Errorf("port %d has no room for a bus port", port)
			continue
		}
		// Hold the first port while checking the second, so the kernel does
		// not hand it out to this very check.
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		l.Close()
		if err != nil {
			last = err
			continue
		}
		bus.Close()
		return port, nil
	}
	return 0, fmt.Errorf("no free port pair found: %v", last)
}

// tail returns up to the last n lines of the file at path.
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	defer f.Close()
	const maxBytes = 8 << 10
	var off int64
	if fi, err := f.Stat(); err == nil && fi.Size() > maxBytes {
		off = fi.Size() - maxBytes
	}
	b, err := io.ReadAll(io.NewSectionReader(f, off, maxBytes))
	if err != nil {
		return "(" + err.Error() + ")"
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	if len(lines) == 1 && len(lines[0]) == 0 {
		return "(empty)"
	}
	return string(bytes.Join(lines, []byte("\n")))
}
