package throttle

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// A call is given no slot closer to its context's deadline than half the
// smallest margin: a call may start that late in its slot, and one woken
// after its deadline cannot leave while its units hold the slot. Each
// quota here admits a call, and a second one asks with a deadline a few
// milliseconds past the slot the same call gets without one (virtual time:
// the same each time): refused at once; with the deadline past the slot by
// more than half the margin, admitted with that much left.
func TestDeadline_NoSlotWithinHalfAMarginOfTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		defer r.Close()
		rdb := simClient(t, r, 0)
		policy := policies.SlidingLog{Limit: 1, Window: time.Second}
		// second admits a call, then asks for a second one with a deadline
		// past (0: none) from when it asks, and returns how long it waited
		// and what it had left of its context when admitted.
		second := func(quota string, past time.Duration) (time.Duration, time.Duration, error) {
			lim, err := New(rdb, quota, policy, Options{Logger: quiet()})
			if err != nil {
				t.Fatal(err)
			}
			defer closeInBubble(lim)
			first, err := lim.Acquire(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			first.Release()
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if past > 0 {
				ctx, cancel = context.WithTimeout(ctx, past)
			}
			defer cancel()
			start := time.Now()
			p, err := lim.Acquire(ctx)
			if err != nil {
				return time.Since(start), 0, err
			}
			defer p.Release()
			deadline, _ := ctx.Deadline()
			return time.Since(start), time.Until(deadline), nil
		}
		wait, _, err := second("no-deadline", 0)
		if err != nil || wait < time.Second/2 {
			t.Fatalf("without a deadline: waited %v, err %v; want about a window", wait, err)
		}
		half := policies.DefaultMargin / 2
		took, left, err := second("close", wait+5*time.Millisecond)
		if err == nil {
			t.Errorf("a slot 5 ms before the deadline: admitted with %v left, want refused (half the margin is %v)", left, half)
		} else if !errors.Is(err, ErrLimited) || !strings.Contains(err.Error(), "deadline") || took > 100*time.Millisecond {
			t.Errorf("a slot 5 ms before the deadline: %v after %v, want ErrLimited for the deadline at once", err, took)
		}
		_, left, err = second("far", wait+half+5*time.Millisecond)
		if err != nil {
			t.Fatalf("a slot %v before the deadline: %v, want admitted", half+5*time.Millisecond, err)
		}
		if left < half {
			t.Errorf("admitted with %v left of its context, want at least %v", left, half)
		}
	})
}

// endsAt is a context whose Err reports it canceled from at on, while its
// Done channel never closes: a context that ends the moment its call wakes
// at its slot, where the two would otherwise race.
type endsAt struct {
	context.Context
	at time.Time
}

func (c endsAt) Err() error {
	if time.Now().Before(c.at) {
		return nil
	}
	return context.Canceled
}

// A call whose context ended as it woke at its slot does not leave, and
// gives its slot back: a call asking next is admitted at once, where the
// slot would otherwise hold units no call used for a window.
func TestDeadline_ACallWhoseContextEndedAsItWokeGivesItsSlotBack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		defer r.Close()
		lim := newLimiter(t, simClient(t, r, 0), policies.SlidingLog{Limit: 1, Window: time.Second}, Options{Logger: quiet()})
		defer closeInBubble(lim)
		first, err := lim.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first.Release()
		p, err := lim.Acquire(endsAt{context.Background(), time.Now().Add(500 * time.Millisecond)})
		if err == nil {
			p.Release()
			t.Fatal("a call whose context ended as it woke was admitted, want its context's error")
		}
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("a call whose context ended as it woke: %v, want context.Canceled", err)
		}
		start := time.Now()
		next, err := lim.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		next.Release()
		if wait := time.Since(start); wait > 100*time.Millisecond {
			t.Errorf("the next call waited %v, want admitted at once in the slot given back", wait)
		}
	})
}

// A request the Transport's *http.Transport never got a connection for
// (the vendor's port refused the dial) was never sent, and gives its units
// back; one that got a connection may have been written whatever became of
// it, and keeps them, as the vendor may have counted it.
func TestTransport_ARequestNeverSentGivesItsUnitsBack(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		closed := redistest.ClosedAddr(t)
		hangUp := hangingUpServer(t)
		srv := newVendorServer(t, answer(http.StatusOK, "ok"))
		for _, tt := range []struct {
			name, url string
			kept      bool // the units stay counted
		}{
			{"no connection", "http://" + closed + "/", false},
			{"a connection, closed unanswered", "http://" + hangUp + "/", true},
		} {
			t.Run(tt.name, func(t *testing.T) {
				lim := replicaLimiter(t, s, "unsent-"+strings.ReplaceAll(tt.name, " ", "-"), policies.SlidingLog{Limit: 1, Window: time.Minute}, Options{Mode: FailFast})
				client := &http.Client{Transport: &Transport{Limiter: lim, Base: &http.Transport{}}}
				if resp, err := client.Get(tt.url); err == nil {
					resp.Body.Close()
					t.Fatalf("GET %s: %s, want an error", tt.url, resp.Status)
				}
				resp, err := client.Get(srv.URL)
				switch {
				case tt.kept && err == nil:
					resp.Body.Close()
					t.Errorf("after a request that got a connection: the next admitted, want its units kept (refused)")
				case tt.kept && !errors.Is(err, ErrLimited):
					t.Errorf("after a request that got a connection: %v, want ErrLimited", err)
				case !tt.kept && err != nil:
					t.Errorf("after a request never sent: %v, want its units given back and the next admitted", err)
				case !tt.kept:
					resp.Body.Close()
				}
			})
		}
	})
}

// hangingUpServer returns the address of a server that reads each
// request and closes the connection without an answer.
func hangingUpServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			buf := make([]byte, 4096)
			_, _ = c.Read(buf)
			c.Close()
		}
	}()
	return ln.Addr().String()
}
