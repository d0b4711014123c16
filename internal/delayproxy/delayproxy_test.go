package delayproxy_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/delayproxy"
	"github.com/throttlekit/throttle/internal/redistest"
)

// slack is how much longer than the configured delays a round trip may take
// on a loaded machine running the race detector.
const slack = 200 * time.Millisecond

// listen starts a TCP server on 127.0.0.1 that runs handle on each
// connection it accepts, then closes it. It is stopped at cleanup.
func listen(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				handle(conn)
			}()
		}
	}()
	return ln.Addr().String()
}

// echoServer starts a server that sends back whatever it receives.
func echoServer(t *testing.T) string {
	t.Helper()
	return listen(t, func(c net.Conn) { io.Copy(c, c) })
}

// heldServer starts a server that hands each accepted connection to the test
// and keeps it open until the test ends.
func heldServer(t *testing.T) (string, <-chan net.Conn) {
	t.Helper()
	conns := make(chan net.Conn, 1)
	testDone := make(chan struct{})
	t.Cleanup(func() { close(testDone) })
	addr := listen(t, func(c net.Conn) {
		conns <- c
		<-testDone
	})
	return addr, conns
}

// dial connects to addr, closing the connection at cleanup.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip sends msg on c, reads as many bytes back and returns how long
// that took.
func roundTrip(t *testing.T, c net.Conn, msg string) time.Duration {
	t.Helper()
	start := time.Now()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != msg {
		t.Fatalf("echo = %q, want %q", got, msg)
	}
	return time.Since(start)
}

// expectHeld checks that nothing arrives on c for a while.
func expectHeld(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(150 * time.Millisecond))
	defer c.SetReadDeadline(time.Time{})
	n, err := c.Read(make([]byte, 1))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read while frozen = %d bytes, %v; want a timeout", n, err)
	}
}

// eventually fails the test unless cond becomes true within a few seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestLatency_RoundTripTakesTwiceTheLatency(t *testing.T) {
	const latency = 25 * time.Millisecond
	p := delayproxy.Start(t, echoServer(t), delayproxy.WithLatency(latency))
	c := dial(t, p.Addr())

	for range 3 {
		rtt := roundTrip(t, c, "ping")
		if rtt < 2*latency || rtt >= 2*latency+slack {
			t.Errorf("round trip = %v, want within [%v, %v)", rtt, 2*latency, 2*latency+slack)
		}
	}
}

func TestSetLatency_AppliesToLaterChunks(t *testing.T) {
	p := delayproxy.Start(t, echoServer(t))
	c := dial(t, p.Addr())
	if rtt := roundTrip(t, c, "fast"); rtt >= slack {
		t.Errorf("round trip without latency = %v, want < %v", rtt, slack)
	}

	const latency = 40 * time.Millisecond
	p.SetLatency(latency, 0)
	if rtt := roundTrip(t, c, "slow"); rtt < 2*latency || rtt >= 2*latency+slack {
		t.Errorf("round trip after SetLatency = %v, want within [%v, %v)", rtt, 2*latency, 2*latency+slack)
	}
}

func TestJitter_KeepsOrder(t *testing.T) {
	const n = 1000
	p := delayproxy.Start(t, echoServer(t), delayproxy.WithJitter(5*time.Millisecond))
	c := dial(t, p.Addr())

	// Separate writes, sent while the echoes are read, so that the proxy
	// sees many chunks whose random delays would reorder them if it let
	// them overtake one another.
	writeErr := make(chan error, 1)
	go func() {
		var msg [4]byte
		for i := range uint32(n) {
			binary.BigEndian.PutUint32(msg[:], i)
			if _, err := c.Write(msg[:]); err != nil {
				writeErr <- err
				return
			}
		}
		writeErr <- nil
	}()

	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, 4*n)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if err := <-writeErr; err != nil {
		t.Fatal(err)
	}
	for i := range uint32(n) {
		if v := binary.BigEndian.Uint32(got[4*i:]); v != i {
			t.Fatalf("message %d = %d; the stream was reordered", i, v)
		}
	}
}

// pipeline sends that many one-byte requests on c, a millisecond apart so
// that each is a chunk of its own, while reading the echoes. It returns how
// long all of them took and the mean round trip of a request.
func pipeline(t *testing.T, c net.Conn, requests int) (elapsed, meanRTT time.Duration) {
	t.Helper()
	sent := make(chan time.Time, requests)
	writeErr := make(chan error, 1)
	start := time.Now()
	go func() {
		for i := range requests {
			sent <- time.Now()
			if _, err := c.Write([]byte{byte(i)}); err != nil {
				writeErr <- err
				return
			}
			time.Sleep(time.Millisecond)
		}
		writeErr <- nil
	}()

	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	var total time.Duration
	b := make([]byte, 1)
	for i := range requests {
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		total += time.Since(<-sent)
		if b[0] != byte(i) {
			t.Fatalf("response %d = %d, want %d", i, b[0], i)
		}
	}
	elapsed = time.Since(start)
	if err := <-writeErr; err != nil {
		t.Fatal(err)
	}
	return elapsed, total / time.Duration(requests)
}

func TestLatency_DoesNotLimitPipelining(t *testing.T) {
	const (
		latency  = 20 * time.Millisecond
		requests = 100
		// Delivering one request per round trip would take 100 × 40 ms.
		limit = requests * 2 * latency / 4
	)
	p := delayproxy.Start(t, echoServer(t), delayproxy.WithLatency(latency))
	c := dial(t, p.Addr())
	roundTrip(t, c, "warm") // let the proxy connect to the target

	if elapsed, _ := pipeline(t, c, requests); elapsed >= limit {
		t.Errorf("%d pipelined requests took %v, want < %v", requests, elapsed, limit)
	}
}

func TestLatency_PipelinedRequestsPayOneRoundTripEach(t *testing.T) {
	const (
		latency = 100 * time.Millisecond
		// A proxy that sleeps between reads makes each request wait, on
		// average, half a latency more on the way there: it would miss
		// this by as much as a delivered request may be late.
		limit = 2*latency + latency/4
	)
	p := delayproxy.Start(t, echoServer(t), delayproxy.WithLatency(latency))
	c := dial(t, p.Addr())
	roundTrip(t, c, "warm")

	if _, mean := pipeline(t, c, 100); mean < 2*latency || mean >= limit {
		t.Errorf("mean round trip of pipelined requests = %v, want within [%v, %v)", mean, 2*latency, limit)
	}
}

func TestFreeze_HoldsBytesUntilThaw(t *testing.T) {
	tests := []struct {
		name     string
		toServer bool
	}{
		{"client to server", true},
		{"server to client", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			addr, serverConns := heldServer(t)
			p := delayproxy.Start(t, addr)
			client := dial(t, p.Addr())
			server := <-serverConns

			from, to := server, client
			if tt.toServer {
				from, to = client, server
			}
			p.Freeze()
			if _, err := from.Write([]byte("held")); err != nil {
				t.Fatal(err)
			}
			expectHeld(t, to)
			if got := p.Conns(); got != 1 {
				t.Errorf("Conns while frozen = %d, want 1", got)
			}

			p.Thaw()
			to.SetReadDeadline(time.Now().Add(5 * time.Second))
			got := make([]byte, 4)
			if _, err := io.ReadFull(to, got); err != nil {
				t.Fatal(err)
			}
			if string(got) != "held" {
				t.Errorf("after Thaw read %q, want %q", got, "held")
			}
		})
	}
}

func TestCutAll_ClientSeesConnectionEnd(t *testing.T) {
	p := delayproxy.Start(t, echoServer(t))
	c := dial(t, p.Addr())
	roundTrip(t, c, "before")

	p.CutAll()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.Read(make([]byte, 1))
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read after CutAll = %v, want EOF or a reset", err)
	}
	if got := p.Conns(); got != 0 {
		t.Errorf("Conns after CutAll = %d, want 0", got)
	}

	roundTrip(t, dial(t, p.Addr()), "after")
	if got := p.Stats().Accepted; got != 2 {
		t.Errorf("Stats().Accepted = %d, want 2", got)
	}
}

func TestConns_CountsOpenConnections(t *testing.T) {
	p := delayproxy.Start(t, echoServer(t))
	var conns []net.Conn
	for range 3 {
		c := dial(t, p.Addr())
		roundTrip(t, c, "hi")
		conns = append(conns, c)
	}
	if got := p.Conns(); got != 3 {
		t.Errorf("Conns = %d, want 3", got)
	}

	conns[0].Close()
	eventually(t, "Conns to drop to 2", func() bool { return p.Conns() == 2 })
	if got := p.Stats().Accepted; got != 3 {
		t.Errorf("Stats().Accepted = %d, want 3", got)
	}
}

func TestHalfClose_DeliversDataBeforeEOF(t *testing.T) {
	p := delayproxy.Start(t, echoServer(t),
		delayproxy.WithLatency(10*time.Millisecond), delayproxy.WithJitter(5*time.Millisecond))
	c := dial(t, p.Addr())

	if _, err := c.Write([]byte("last words")); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "last words" {
		t.Errorf("read %q before EOF, want %q", got, "last words")
	}
	eventually(t, "the connection to close", func() bool { return p.Conns() == 0 })
}

func TestNew_UnreachableTargetClosesClient(t *testing.T) {
	target := redistest.ClosedAddr(t)
	p := delayproxy.Start(t, target)
	c := dial(t, p.Addr())
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read = %v, want EOF or a reset", err)
	}
	if got := p.Stats().Accepted; got != 1 {
		t.Errorf("Stats().Accepted = %d, want 1", got)
	}
}

func TestClose_LeavesNoGoroutines(t *testing.T) {
	target := echoServer(t)
	before := runtime.NumGoroutine()

	p, err := delayproxy.New(target, delayproxy.WithLatency(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	for range 5 {
		c := dial(t, p.Addr())
		roundTrip(t, c, "hi")
		conns = append(conns, c)
	}
	// Leave writers waiting on a freeze, and bytes in flight.
	p.Freeze()
	for _, c := range conns {
		if _, err := c.Write([]byte("stuck")); err != nil {
			t.Fatal(err)
		}
	}

	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read after Close timed out; want the connection closed")
		}
		if bytes.Contains(b, []byte("stuck")) {
			t.Errorf("read %q after Close, want the frozen bytes dropped", b)
		}
		c.Close()
	}
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		c.Close()
		t.Error("dial after Close succeeded, want it refused")
	}

	eventually(t, "goroutines to exit", func() bool { return runtime.NumGoroutine() <= before })
}
