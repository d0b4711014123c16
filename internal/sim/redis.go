// Package sim is the world of the deterministic simulation the root
// package's tests run the real code in: a Redis (miniredis) behind a
// simulated network of pipes, with the faults a real one meets. Everything
// in it blocks on channels and timers only, so that inside a
// testing/synctest bubble the clock moves only when every goroutine waits,
// a run of minutes takes the CPU time of its work, and one seed gives one
// run.
//
// A Redis is reached through Dialer, one per process of the fleet, which
// go-redis takes as its Options.Dialer: each connection is a link whose
// bytes arrive after the process's latency (and jitter), in order. The
// faults:
//
//   - Kill closes every connection and refuses new ones; Restart brings
//     the server back empty, scripts included (a restart without
//     persistence).
//   - Flush and FlushScripts are FLUSHALL and SCRIPT FLUSH.
//   - Snapshot and Failover: the server is replaced by a copy of what it
//     held at the snapshot (a failover to a replica that lagged, a
//     restart from an old snapshot); the connections are closed.
//   - Step moves the server's clock by an offset (NTP, a failover to a
//     host whose clock differs).
//   - Freeze holds every request until Thaw (a stalled or paused server:
//     connections stay open, nothing is answered).
//   - Cut holds one process's requests and answers, and makes its new
//     connections wait (a partition), until Mend.
//
// Every method is safe for concurrent use.
package sim

import (
	"context"
	"errors"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
)

// Redis is a simulated Redis server and the network in front of it.
type Redis struct {
	mu      sync.Mutex
	m       *miniredis.Miniredis
	down    bool
	offset  time.Duration // added to the server's clock
	frozen  chan struct{} // closed while the server answers; nil never
	procs   map[int]*proc
	links   map[*link]struct{}
	snap    *snapshot
	latency func(proc int) time.Duration // one way, per chunk
}

// proc is what the network knows of one process of the fleet.
type proc struct {
	open chan struct{} // closed while the process reaches the server
}

// NewRedis starts a simulated Redis. latency gives the one-way delay of a
// chunk of bytes between process proc and the server, drawn anew for each
// chunk (jitter); nil for none. Close it at the end of the run, inside the
// bubble that made it.
func NewRedis(latency func(proc int) time.Duration) *Redis {
	if latency == nil {
		latency = func(int) time.Duration { return 0 }
	}
	r := &Redis{procs: map[int]*proc{}, links: map[*link]struct{}{}, latency: latency, frozen: closed()}
	r.m = newServer()
	return r
}

func newServer() *miniredis.Miniredis {
	m := miniredis.NewMiniRedis()
	m.ClockTTL(true)
	return m
}

func closed() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// Server returns the miniredis in service now, for a test's own reads.
func (r *Redis) Server() *miniredis.Miniredis {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.m
}

func (r *Redis) procLocked(i int) *proc {
	p := r.procs[i]
	if p == nil {
		p = &proc{open: closed()}
		r.procs[i] = p
	}
	return p
}

// Dialer returns the dialer of process i, for go-redis's Options.Dialer.
func (r *Redis) Dialer(i int) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, _, _ string) (net.Conn, error) {
		for {
			r.mu.Lock()
			p := r.procLocked(i)
			open := p.open
			r.mu.Unlock()
			// A cut process's dial gets no answer, as across a partition.
			select {
			case <-open:
			case <-ctx.Done():
				return nil, &net.OpError{Op: "dial", Net: "tcp", Err: ctx.Err()}
			}
			r.mu.Lock()
			if p.open != open {
				r.mu.Unlock()
				continue // cut again meanwhile
			}
			if r.down {
				r.mu.Unlock()
				return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
			}
			m := r.m
			r.mu.Unlock()
			// Not under r.mu: Dial takes the server's lock, which a script
			// holds while it publishes to a subscriber whose link waits for
			// r.mu to carry the message (a cycle that stops the bubble).
			srv, err := m.Dial()
			if err != nil {
				return nil, err
			}
			r.mu.Lock()
			if r.m != m || r.down || p.open != open {
				r.mu.Unlock()
				_ = srv.Close()
				continue // killed, failed over or cut meanwhile
			}
			l := r.newLinkLocked(i, srv)
			r.mu.Unlock()
			return clientConn{l.client}, nil
		}
	}
}

// Kill crashes the server: every connection closes, and new ones are
// refused until Restart.
func (r *Redis) Kill() {
	r.mu.Lock()
	r.down = true
	links := r.takeLinksLocked()
	old := r.m
	r.mu.Unlock()
	closeLinks(links)
	old.Close()
}

// Restart brings a killed server back, empty (scripts too), and lets new
// connections in. Restarting a server that is up kills it first.
func (r *Redis) Restart() {
	r.mu.Lock()
	up := !r.down
	r.mu.Unlock()
	if up {
		r.Kill()
	}
	r.mu.Lock()
	r.m = newServer()
	r.down = false
	r.mu.Unlock()
}

// Flush is FLUSHALL.
func (r *Redis) Flush() { r.Server().FlushAll() }

// FlushScripts is SCRIPT FLUSH: the scripts are run by EVAL next, as after
// a failover.
func (r *Redis) FlushScripts() {
	m := r.Server()
	c, err := m.Dial()
	if err != nil {
		return
	}
	defer c.Close()
	_, _ = c.Write([]byte("*2\r\n$6\r\nSCRIPT\r\n$5\r\nFLUSH\r\n"))
	_, _ = c.Read(make([]byte, 64))
}

// Step moves the server's clock by d more (forward when positive).
func (r *Redis) Step(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.offset += d
	r.tickLocked()
}

// tickLocked sets the server's clock to the bubble's, moved by the offset.
func (r *Redis) tickLocked() {
	if r.offset == 0 {
		r.m.SetTime(time.Time{})
		return
	}
	r.m.SetTime(time.Now().Add(r.offset))
}

// tick is called before each chunk reaches the server.
func (r *Redis) tick() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.offset != 0 {
		r.tickLocked()
	}
}

// Freeze holds every request on its way to the server until Thaw.
func (r *Redis) Freeze() {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.frozen:
		r.frozen = make(chan struct{})
	default:
	}
}

// Thaw lets the held requests through.
func (r *Redis) Thaw() {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.frozen:
	default:
		close(r.frozen)
	}
}

// answering returns a channel closed while the server answers.
func (r *Redis) answering() chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.frozen
}

// Cut partitions process i from the server: its bytes in flight and to
// come are held, and its new connections wait, until Mend.
func (r *Redis) Cut(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.procLocked(i)
	select {
	case <-p.open:
		p.open = make(chan struct{})
	default:
	}
}

// Mend ends process i's partition.
func (r *Redis) Mend(i int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.procLocked(i)
	select {
	case <-p.open:
	default:
		close(p.open)
	}
}

// reaches returns a channel closed while process i reaches the server.
func (r *Redis) reaches(i int) chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.procLocked(i).open
}

// Close ends every connection and stops the server, as Kill does.
func (r *Redis) Close() { r.Kill() }

func (r *Redis) takeLinksLocked() []*link {
	var links []*link
	for l := range r.links {
		links = append(links, l)
	}
	r.links = map[*link]struct{}{}
	return links
}

func closeLinks(links []*link) {
	for _, l := range links {
		l.close()
	}
}

// ErrNoSnapshot is Failover's error when no Snapshot was taken.
var ErrNoSnapshot = errors.New("sim: failover without a snapshot")
