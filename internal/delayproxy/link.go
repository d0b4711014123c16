package delayproxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// chunkSize is the most bytes read, and so delayed, as one chunk.
	chunkSize = 32 << 10
	// queueLen is how many chunks a direction holds in flight before it
	// stops reading and lets TCP push back on the sender.
	queueLen = 1024
)

// chunk is what one read returned, stamped with when it may be delivered.
type chunk struct {
	data []byte
	due  time.Time
	eof  bool // the sender closed its side; pass that on once due
}

// link is one client connection and its connection to the target. Each
// direction has a reader goroutine, which stamps chunks and queues them, and
// a writer goroutine, which delivers them in order once due.
type link struct {
	p      *Proxy
	client net.Conn
	ctx    context.Context // done once the link is closed
	cancel context.CancelFunc
	open   atomic.Int32 // directions that have not yet delivered their EOF

	mu     sync.Mutex
	server net.Conn // nil until dialled

	closeOnce sync.Once
}

// setServer records the connection to the target, or closes it and reports
// false if the link was closed while dialling.
func (l *link) setServer(server net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx.Err() != nil {
		server.Close()
		return false
	}
	l.server = server
	return true
}

// close closes both connections, stops the link's goroutines and removes it
// from the proxy's open connections. It may be called any number of times.
func (l *link) close() {
	l.closeOnce.Do(func() {
		// Cancel before taking mu, so that setServer either sees the
		// cancellation or leaves a server for us to close.
		l.cancel()
		l.client.Close()
		l.mu.Lock()
		if l.server != nil {
			l.server.Close()
		}
		l.mu.Unlock()
		l.p.forget(l)
	})
}

// pipe starts forwarding, with delay, what src sends to dst.
func (l *link) pipe(dst, src net.Conn) {
	chunks := make(chan chunk, queueLen)
	l.p.wg.Go(func() { l.read(src, chunks) })
	l.p.wg.Go(func() { l.write(dst, chunks) })
}

// read queues what src sends, stamped on arrival, ending with an EOF chunk
// when src closes its side. Any other read error closes the link.
func (l *link) read(src net.Conn, out chan<- chunk) {
	buf := make([]byte, chunkSize)
	for {
		n, err := src.Read(buf)
		if n > 0 && !l.send(out, chunk{data: bytes.Clone(buf[:n]), due: l.stamp()}) {
			return
		}
		if errors.Is(err, io.EOF) {
			l.send(out, chunk{eof: true, due: l.stamp()})
			return
		}
		if err != nil {
			l.close()
			return
		}
	}
}

// stamp is when a chunk arriving now may be delivered.
func (l *link) stamp() time.Time {
	return time.Now().Add(l.p.delay())
}

// send queues c, or reports false if the link is closed first.
func (l *link) send(out chan<- chunk, c chunk) bool {
	select {
	case out <- c:
		return true
	case <-l.ctx.Done():
		return false
	}
}

// write delivers chunks to dst in the order they were read, each no earlier
// than its due time and never while the proxy is frozen. Since it delivers
// one chunk at a time, no chunk overtakes the one before it.
func (l *link) write(dst net.Conn, in <-chan chunk) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		var c chunk
		select {
		case c = <-in:
		case <-l.ctx.Done():
			return
		}
		timer.Reset(time.Until(c.due))
		select {
		case <-timer.C:
		case <-l.ctx.Done():
			return
		}
		if !l.p.waitThawed(l.ctx) {
			return
		}
		if c.eof {
			l.closeWrite(dst)
			return
		}
		if _, err := dst.Write(c.data); err != nil {
			l.close()
			return
		}
	}
}

// closeWrite passes a half-close on to dst, and closes the link once both
// directions have been closed.
func (l *link) closeWrite(dst net.Conn) {
	if err := dst.(*net.TCPConn).CloseWrite(); err != nil || l.open.Add(-1) == 0 {
		l.close()
	}
}
