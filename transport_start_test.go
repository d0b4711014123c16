package throttle

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// answerAfter is a base RoundTripper that is no *http.Transport: it reports
// no write, and answers after a delay.
type answerAfter time.Duration

func (d answerAfter) RoundTrip(req *http.Request) (*http.Response, error) {
	time.Sleep(time.Duration(d))
	return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Header: http.Header{}, Request: req}, nil
}

// The Transport measures how late a call starts when the request leaves for
// the vendor: a dial of 80 ms delays its arrival as much as a late start,
// and the fleet's spread must see it. A base RoundTripper that reports no
// write is measured as the request goes to it: its 80 ms answer is not
// lateness.
func TestTransport_MeasuresTheStartWhenTheRequestLeaves(t *testing.T) {
	const slow = 80 * time.Millisecond
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		policy := policies.SlidingLog{Limit: 100, Window: time.Second}
		get := func(t *testing.T, base http.RoundTripper) time.Duration {
			t.Helper()
			lim := newLimiter(t, s.Client(t), policy)
			c := &http.Client{Transport: &Transport{Limiter: lim, Base: base}}
			resp, err := c.Get(srv.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return lim.lates.latest()
		}
		t.Run("dial", func(t *testing.T) {
			var d net.Dialer
			base := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				time.Sleep(slow)
				return d.DialContext(ctx, network, addr)
			}}
			defer base.CloseIdleConnections()
			if late := get(t, base); late < slow*3/4 {
				t.Errorf("a call whose dial took %v noted %v late, want at least %v", slow, late, slow*3/4)
			}
		})
		t.Run("no write reported", func(t *testing.T) {
			if late := get(t, answerAfter(slow)); late >= slow/2 {
				t.Errorf("a call answered %v after it went to the base noted %v late, want under %v", slow, late, slow/2)
			}
		})
	})
}

// A caller of Acquire whose call waits before it leaves tells the limiter
// with Start; without it, the call counts as starting when Acquire returned.
// The last Start before Release counts, Release notes it once, and a Start
// after Release does nothing.
func TestPermit_StartTellsWhenTheCallLeaves(t *testing.T) {
	t.Parallel()
	const slow = 80 * time.Millisecond
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		policy := policies.SlidingLog{Limit: 100, Window: time.Second}
		ctx := context.Background()
		// run acquires a permit, then sleeps and starts the call once for
		// each of starts (false: sleeps only), releases it, and returns the
		// latest lateness noted and how many were.
		run := func(t *testing.T, starts ...bool) (time.Duration, int) {
			t.Helper()
			lim := newLimiter(t, s.Client(t), policy)
			p, err := lim.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, start := range starts {
				time.Sleep(slow)
				if start {
					p.Start()
				}
			}
			if n := notedStarts(lim); n != 0 {
				t.Errorf("%d starts noted before Release, want 0", n)
			}
			p.Release()
			p.Start()
			p.Release()
			return lim.lates.latest(), notedStarts(lim)
		}
		t.Run("started late", func(t *testing.T) {
			if late, n := run(t, true, false); late < slow*3/4 || late >= 2*slow || n != 1 {
				t.Errorf("a call started %v after Acquire noted %d starts, the latest %v late; want 1, %v to %v", slow, n, late, slow*3/4, 2*slow)
			}
		})
		t.Run("started again", func(t *testing.T) {
			if late, n := run(t, true, true); late < 2*slow*7/8 || n != 1 {
				t.Errorf("a call started %v and again %v after Acquire noted %d starts, the latest %v late; want 1, at least %v", slow, 2*slow, n, late, 2*slow*7/8)
			}
		})
		t.Run("never told", func(t *testing.T) {
			if late, n := run(t, false); late >= slow/2 || n != 1 {
				t.Errorf("a call released %v after Acquire, Start never called before, noted %d starts, the latest %v late; want 1, under %v", slow, n, late, slow/2)
			}
		})
	})
}

// notedStarts returns how many starts l noted since it last reported them.
func notedStarts(l *Limiter) int {
	n := 0
	for i := range l.lates.n {
		n += int(l.lates.n[i].Load())
	}
	return n
}
