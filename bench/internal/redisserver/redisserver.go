// Package redisserver starts a throwaway redis-server for the bench
// programs (internal/redistest needs a testing.TB): on a free 127.0.0.1
// port, never the machine's shared 6379, with no persistence, in a temp
// dir of its own.
package redisserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// reservedPort is the machine's shared Redis, which this program never
	// touches.
	reservedPort = 6379
	// redisStartTimeout bounds the wait for the server to answer.
	redisStartTimeout = 10 * time.Second
	// redisStartAttempts covers another program taking the free port before
	// the server binds it.
	redisStartAttempts = 5
)

// Server is a throwaway redis-server on a free 127.0.0.1 port, with no
// persistence, in a temp dir of its own.
type Server struct {
	Addr    string // host:port
	Version string // redis_version, once it answered
	dir     string
	cmd     *exec.Cmd
	exited  chan struct{} // closed once the process has been reaped
}

// Start starts redis-server and waits until it answers; its dir is a new
// temp dir whose name begins with dirPrefix.
func Start(dirPrefix string) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("this program needs redis-server on PATH: %w", err)
	}
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	for range redisStartAttempts {
		var port int
		if port, err = freePort(); err != nil {
			break
		}
		var s *Server
		if s, err = launchRedis(bin, dir, port); err == nil {
			return s, nil
		}
	}
	os.RemoveAll(dir)
	return nil, err
}

// launchRedis starts the server on port, its log in dir, and waits until
// it answers.
func launchRedis(bin, dir string, port int) (*Server, error) {
	log, err := os.OpenFile(filepath.Join(dir, "redis.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	s := &Server{
		Addr:   net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		dir:    dir,
		exited: make(chan struct{}),
	}
	s.cmd = exec.Command(bin,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--daemonize", "no")
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	if err := s.awaitReady(); err != nil {
		s.kill()
		return nil, fmt.Errorf("redis-server on %s: %w", s.Addr, err)
	}
	return s, nil
}

// awaitReady polls the server until it answers INFO as our process, so that
// another server holding the port is not mistaken for ours.
func (s *Server) awaitReady() error {
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: 250 * time.Millisecond})
	defer rdb.Close()
	var last error
	for deadline := time.Now().Add(redisStartTimeout); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		select {
		case <-s.exited:
			return errors.New("exited before answering; see " + filepath.Join(s.dir, "redis.log"))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		info, err := rdb.Info(ctx, "server").Result()
		cancel()
		if err != nil {
			last = err
			continue
		}
		if pid := InfoField(info, "process_id"); pid != strconv.Itoa(s.cmd.Process.Pid) {
			return fmt.Errorf("the port is answered by pid %s, not by ours", pid)
		}
		s.Version = InfoField(info, "redis_version")
		return nil
	}
	return fmt.Errorf("no answer within %v: %v", redisStartTimeout, last)
}

// Stop kills the server and removes its dir.
func (s *Server) Stop() {
	s.kill()
	os.RemoveAll(s.dir)
}

// kill kills the server and waits until it is reaped.
func (s *Server) kill() {
	_ = s.cmd.Process.Kill()
	<-s.exited
}

// InfoField returns the value of one "field:value" line of an INFO reply.
func InfoField(info, field string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// freePort finds a port that is free on 127.0.0.1 now, other than 6379.
func freePort() (int, error) {
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("pick a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if port != reservedPort {
			return port, nil
		}
	}
}
