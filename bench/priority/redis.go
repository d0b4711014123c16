package main

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

// internal/redistest starts servers for tests only (it needs a testing.TB),
// so the program starts its own, as bench/conditions does.
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

// redisServer is a throwaway redis-server on a free 127.0.0.1 port, with no
// persistence, in a temp dir of its own.
type redisServer struct {
	addr    string
	version string
	dir     string
	cmd     *exec.Cmd
	exited  chan struct{} // closed once the process has been reaped
}

// startRedis starts redis-server and waits until it answers.
func startRedis() (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("this program needs redis-server on PATH: %w", err)
	}
	dir, err := os.MkdirTemp("", "throttle-priority-")
	if err != nil {
		return nil, err
	}
	for range redisStartAttempts {
		var port int
		if port, err = freePort(); err != nil {
			break
		}
		var s *redisServer
		if s, err = launchRedis(bin, dir, port); err == nil {
			return s, nil
		}
	}
	os.RemoveAll(dir)
	return nil, err
}

// launchRedis starts the server on port, its log in dir, and waits until
// it answers.
func launchRedis(bin, dir string, port int) (*redisServer, error) {
	log, err := os.OpenFile(filepath.Join(dir, "redis.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	s := &redisServer{
		addr:   net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
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
		return nil, fmt.Errorf("redis-server on %s: %w", s.addr, err)
	}
	return s, nil
}

// awaitReady polls the server until it answers INFO as our process, so that
// another server holding the port is not mistaken for ours.
func (s *redisServer) awaitReady() error {
	rdb := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1, DialTimeout: 250 * time.Millisecond})
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
		if pid := infoField(info, "process_id"); pid != strconv.Itoa(s.cmd.Process.Pid) {
			return fmt.Errorf("the port is answered by pid %s, not by ours", pid)
		}
		s.version = infoField(info, "redis_version")
		return nil
	}
	return fmt.Errorf("no answer within %v: %v", redisStartTimeout, last)
}

// stop kills the server and removes its dir.
func (s *redisServer) stop() {
	s.kill()
	os.RemoveAll(s.dir)
}

// kill kills the server and waits until it is reaped.
func (s *redisServer) kill() {
	_ = s.cmd.Process.Kill()
	<-s.exited
}

// infoField returns the value of one "field:value" line of an INFO reply.
func infoField(info, field string) string {
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
