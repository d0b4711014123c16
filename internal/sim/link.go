package sim

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// link is one connection between a process and the server: two pumps copy
// its bytes each way, each chunk arriving after the process's latency, in
// the order sent, and no sooner than the process reaches the server (Cut)
// and, towards the server, than the server answers (Freeze).
type link struct {
	r      *Redis
	proc   int
	client net.Conn // the process's end
	inner  net.Conn // the other end of the process's pipe
	srv    net.Conn // a connection the server serves
	done   chan struct{}
	once   sync.Once
}

func (r *Redis) newLinkLocked(proc int, srv net.Conn) *link {
	client, inner := net.Pipe()
	l := &link{r: r, proc: proc, client: client, inner: inner, srv: srv, done: make(chan struct{})}
	r.links[l] = struct{}{}
	go l.pump(inner, srv, true)
	go l.pump(srv, inner, false)
	return l
}

// chunk is bytes on their way, due at a time.
type chunk struct {
	b   []byte
	due time.Time
}

// pump copies src to dst until either closes, delaying each chunk. It
// reads src as fast as it writes, as a socket's buffers take what is sent
// whether or not the other end reads: a server that publishes to a client
// whose link is held (a cut, a freeze) must not block, since it would block
// holding its lock, the calls of every other client would wait on that
// lock, and the bubble's clock, which moves only when every goroutine waits
// on a channel or a timer, would never reach the end of the cut.
func (l *link) pump(src, dst net.Conn, toServer bool) {
	defer l.close()
	q := &chunks{more: make(chan struct{}, 1)}
	go q.fill(src, func() time.Duration { return l.r.latency(l.proc) })
	var last time.Time
	for {
		c, ok := q.next(l.done)
		if !ok {
			return
		}
		due := c.due
		if due.Before(last) {
			due = last // in order: a chunk never overtakes the one before
		}
		last = due
		if !l.wait(due, toServer) {
			return
		}
		if toServer {
			l.r.tick()
		}
		if _, err := dst.Write(c.b); err != nil {
			return
		}
	}
}

// chunks is the bytes a link has read and not yet delivered.
type chunks struct {
	mu    sync.Mutex
	queue []chunk
	ended bool          // the source closed
	more  chan struct{} // signalled when a chunk is added, or the source closes
}

// fill reads src into the queue until src closes, each chunk due after the
// latency drawn for it.
func (q *chunks) fill(src net.Conn, latency func() time.Duration) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		q.mu.Lock()
		if n > 0 {
			q.queue = append(q.queue, chunk{b: append([]byte(nil), buf[:n]...), due: time.Now().Add(latency())})
		}
		q.ended = err != nil
		q.mu.Unlock()
		select {
		case q.more <- struct{}{}:
		default:
		}
		if err != nil {
			return
		}
	}
}

// next returns the next chunk, waiting for one; false once the source
// closed and every chunk was taken, or when done closes.
func (q *chunks) next(done <-chan struct{}) (chunk, bool) {
	for {
		q.mu.Lock()
		if len(q.queue) > 0 {
			c := q.queue[0]
			q.queue = q.queue[1:]
			q.mu.Unlock()
			return c, true
		}
		ended := q.ended
		q.mu.Unlock()
		if ended {
			return chunk{}, false
		}
		select {
		case <-q.more:
		case <-done:
			return chunk{}, false
		}
	}
}

// wait waits until due, and then while the process is cut off or, towards
// the server, the server is frozen; false when the link closed meanwhile.
func (l *link) wait(due time.Time, toServer bool) bool {
	if d := time.Until(due); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-l.done:
			t.Stop()
			return false
		}
	}
	for {
		reaches := l.r.reaches(l.proc)
		answering := closed()
		if toServer {
			answering = l.r.answering()
		}
		select {
		case <-l.done:
			return false
		case <-reaches:
		}
		select {
		case <-l.done:
			return false
		case <-answering:
		}
		// Both held at once? Look again: either may have changed.
		if l.r.reaches(l.proc) == reaches && (!toServer || l.r.answering() == answering) {
			return true
		}
	}
}

// close ends the connection at both ends.
func (l *link) close() {
	l.once.Do(func() {
		close(l.done)
		_ = l.inner.Close()
		_ = l.srv.Close()
		l.r.mu.Lock()
		delete(l.r.links, l)
		l.r.mu.Unlock()
	})
}

// clientConn is the process's end of a link, failing as a TCP connection
// whose server closed it does: its deadlines can still be set, and a write
// fails with io.EOF, as a read does (over TCP the write would be buffered
// and the read after it find the end; a client's pool finds a closed
// connection before it writes on it, as go-redis peeks at each idle
// connection it takes). A pipe fails both at once with an error of its own.
type clientConn struct{ net.Conn }

func (c clientConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	return n, eof(err)
}

func (c clientConn) SetDeadline(t time.Time) error      { return open(c.Conn.SetDeadline(t)) }
func (c clientConn) SetReadDeadline(t time.Time) error  { return open(c.Conn.SetReadDeadline(t)) }
func (c clientConn) SetWriteDeadline(t time.Time) error { return open(c.Conn.SetWriteDeadline(t)) }

func eof(err error) error {
	if errors.Is(err, io.ErrClosedPipe) {
		return io.EOF
	}
	return err
}

func open(err error) error {
	if errors.Is(err, io.ErrClosedPipe) {
		return nil
	}
	return err
}
