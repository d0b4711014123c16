// Package delayproxy puts a TCP proxy between a test's clients and a server,
// so that the library can be tested against a Redis that is tens of
// milliseconds away, whose distance varies, and whose network stalls or
// drops connections.
//
//	p := delayproxy.Start(t, redisAddr, delayproxy.WithLatency(20*time.Millisecond))
//	client := redis.NewClient(&redis.Options{Addr: p.Addr()})
//
// Bytes cross the proxy in chunks, as they are read. Each chunk is stamped
// when it arrives and delivered once its delay has passed, the delay being
// the one-way latency plus a random jitter, but never before the chunk ahead
// of it: a connection's bytes are never reordered. Reading goes on while
// earlier chunks wait, so a pipelining client pays the latency once, not once
// per chunk, as on a real link. This is the model of toxiproxy's latency
// toxic.
//
// Freeze holds every byte in both directions, as a stopped server or a
// stalled network would, until Thaw. CutAll drops every open connection.
//
// Connecting is not delayed: a client's dial succeeds at once, and its first
// bytes pay the one-way latency like any others.
package delayproxy

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"
)

// dialTimeout bounds the dial to the target for each accepted connection.
const dialTimeout = 5 * time.Second

// Proxy forwards every connection made to Addr to its target, delaying the
// bytes in each direction and injecting faults on demand. Its methods are
// safe for concurrent use.
type Proxy struct {
	target string
	ln     net.Listener
	wg     sync.WaitGroup // the accept loop and every connection's goroutines

	mu       sync.Mutex
	latency  time.Duration
	jitter   time.Duration
	thawed   chan struct{} // nil unless frozen; closed by Thaw
	links    map[*link]struct{}
	accepted int
	closed   bool
}

// Option configures a Proxy when it is created.
type Option func(*Proxy)

// WithLatency delays every chunk by d in each direction, so a round trip
// takes at least 2*d.
func WithLatency(d time.Duration) Option {
	return func(p *Proxy) { p.latency = d }
}

// WithJitter adds to each chunk's delay a random amount drawn uniformly from
// [-j, +j]. A delay never falls below zero, and chunks still arrive in order.
func WithJitter(j time.Duration) Option {
	return func(p *Proxy) { p.jitter = j }
}

// Stats counts what a Proxy has done since it started.
type Stats struct {
	// Accepted is the number of client connections accepted, including
	// those closed since and those whose dial to the target failed.
	Accepted int
}

// Start starts a Proxy to target for the duration of a test and closes it,
// with every connection through it, at the test's cleanup. It fails the test
// if the proxy cannot listen.
func Start(tb testing.TB, target string, opts ...Option) *Proxy {
	tb.Helper()
	p, err := New(target, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := p.Close(); err != nil {
			tb.Errorf("delayproxy: close: %v", err)
		}
	})
	return p
}

// New starts a Proxy to target, a host:port, listening on a free port of
// 127.0.0.1. The caller must Close it. Tests should use Start instead.
func New(target string, opts ...Option) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("delayproxy: listen: %w", err)
	}
	p := &Proxy{target: target, ln: ln, links: make(map[*link]struct{})}
	for _, opt := range opts {
		opt(p)
	}
	p.wg.Go(p.acceptLoop)
	return p, nil
}

// Addr is the host:port clients dial to reach the target through the proxy.
func (p *Proxy) Addr() string {
	return p.ln.Addr().String()
}

// SetLatency changes the one-way latency and the jitter for chunks that
// arrive from now on. Chunks already waiting keep their delay, and later
// chunks still wait for them, so lowering the latency takes effect only once
// the chunks ahead have been delivered.
func (p *Proxy) SetLatency(latency, jitter time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.latency, p.jitter = latency, jitter
}

// Freeze holds every byte in both directions, on every connection, until
// Thaw. Connections stay open and the proxy goes on reading and accepting,
// like a network that has stalled or a server that has been stopped with
// SIGSTOP. A chunk already being written when Freeze is called may still
// arrive. Freezing a frozen proxy does nothing.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thawed == nil {
		p.thawed = make(chan struct{})
	}
}

// Thaw ends a Freeze: the bytes held are delivered, in order, as soon as
// their delay has passed, which for most of them it has. Thawing a proxy that
// is not frozen does nothing.
func (p *Proxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thawed != nil {
		close(p.thawed)
		p.thawed = nil
	}
}

// CutAll closes every open connection, on both the client's side and the
// target's, dropping the bytes still in flight. The proxy goes on accepting
// new connections.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		l.close()
	}
}

// Conns is the number of connections open through the proxy.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.links)
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{Accepted: p.accepted}
}

// Close stops accepting, closes every connection and returns once all of
// the proxy's goroutines have exited. Closing a closed proxy returns nil.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()

	err := p.ln.Close()
	p.CutAll()
	p.wg.Wait()
	if err != nil {
		return fmt.Errorf("delayproxy: close: %w", err)
	}
	return nil
}

// acceptLoop hands each client connection to its own goroutine until the
// listener is closed.
func (p *Proxy) acceptLoop() {
	var backoff time.Duration
	for {
		conn, err := p.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of file descriptors, most likely: wait for some to be
			// freed rather than spin or stop accepting for good.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		p.wg.Go(func() { p.serve(conn) })
	}
}

// serve registers the client's connection, dials the target and starts
// forwarding between them.
func (p *Proxy) serve(client net.Conn) {
	ctx, cancel := context.WithCancel(context.Background())
	l := &link{p: p, client: client, ctx: ctx, cancel: cancel}
	l.open.Store(2)

	p.mu.Lock()
	p.accepted++
	if p.closed {
		p.mu.Unlock()
		cancel()
		client.Close()
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()

	d := net.Dialer{Timeout: dialTimeout}
	server, err := d.DialContext(ctx, "tcp", p.target)
	if err != nil {
		l.close()
		return
	}
	if !l.setServer(server) {
		return
	}
	l.pipe(server, client)
	l.pipe(client, server)
}

// forget removes a closed link from the open connections.
func (p *Proxy) forget(l *link) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.links, l)
}

// delay draws the delay for a chunk arriving now.
func (p *Proxy) delay() time.Duration {
	p.mu.Lock()
	latency, jitter := p.latency, p.jitter
	p.mu.Unlock()
	if jitter > 0 {
		latency += time.Duration(rand.Int64N(int64(2*jitter)+1)) - jitter
	}
	return max(latency, 0)
}

// waitThawed returns once the proxy is not frozen, or false if ctx is done
// first.
func (p *Proxy) waitThawed(ctx context.Context) bool {
	p.mu.Lock()
	thawed := p.thawed
	p.mu.Unlock()
	if thawed == nil {
		return true
	}
	select {
	case <-thawed:
		return true
	case <-ctx.Done():
		return false
	}
}
