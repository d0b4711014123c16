package throttle

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// ruleUsed returns the units the first rule of lim counts now.
func ruleUsed(t *testing.T, lim *Limiter) int {
	t.Helper()
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return u.Rules[0].Used
}

// A caller that calls through an SDK over a Transport settles the call the
// SDK made from its typed result, with the permit Track gave it: here the
// SDK is an http.Client sending a request of the tracked context, twice,
// as a client that sends a request again would.
func TestTrack_SettlesTheCallATransportSent(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Minute})
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, `{"usage":{"total_tokens":4}}`)
		}))
		defer vendor.Close()
		costs := []int{10, 30}
		tr := &Transport{Limiter: lim, Cost: func(*http.Request) int {
			c := costs[0]
			costs = costs[1:]
			return c
		}}
		client := &http.Client{Transport: tr}
		ctx, call := Track(context.Background())
		for range 2 {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, vendor.URL, strings.NewReader("{}"))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		if call.cost() != 30 {
			t.Fatalf("the tracked permit costs %d, want 30: the last request's", call.cost())
		}
		if err := call.Settle(ctx, Cost(4)); err != nil {
			t.Fatal(err)
		}
		if got := ruleUsed(t, lim); got != 10+4 {
			t.Errorf("used %d after settling the second call at 4, want 14 (the first call's 10 and 4)", got)
		}
		if call.cost() != 4 {
			t.Errorf("the tracked permit costs %d after Settle, want 4", call.cost())
		}
	})
}

func TestTrack_SettlesTheCallDoRan(t *testing.T) {
	lim := newLimiter(t, redistest.Mini(t).Client(t), policies.SlidingLog{Limit: 1000, Window: time.Minute})
	ctx, call := Track(context.Background())
	if _, err := Do(ctx, lim, func(context.Context) (int, error) { return 0, nil }, Cost(20)); err != nil {
		t.Fatal(err)
	}
	if err := call.Settle(ctx, Cost(7)); err != nil {
		t.Fatal(err)
	}
	if got := ruleUsed(t, lim); got != 7 {
		t.Errorf("used %d after settling the call at 7, want 7", got)
	}
}

// Before its call is made, a tracked permit says so: its methods that
// change the quota fail, naming Track, and the others do nothing.
func TestTrack_BeforeTheCallThePermitSaysNoneWasMade(t *testing.T) {
	ctx, call := Track(context.Background())
	checks := map[string]error{
		"Settle":  call.Settle(ctx, Cost(1)),
		"Cancel":  call.Cancel(ctx),
		"Extend":  call.Extend(ctx, time.Second),
		"refused": call.refused(ctx, time.Second),
	}
	_, _, checks["Heard"] = call.Heard(ctx, Answer{})
	for method, err := range checks {
		if !errors.Is(err, errNotSent) || !strings.Contains(err.Error(), method) || !strings.Contains(err.Error(), "Track") {
			t.Errorf("%s before any call: %v; want an error naming it and Track", method, err)
		}
	}
	call.Start()
	call.Release()
	if call.cost() != 0 || call.remaining() != -1 {
		t.Errorf("Cost %d, Remaining %d before any call; want 0 and -1", call.cost(), call.remaining())
	}
	if PermitFrom(ctx) != call {
		t.Error("PermitFrom of the tracked context is not the tracked permit")
	}
}

// Options put in the context are every try's, and their Cost wins over the
// Transport's: an SDK's caller estimates once, from its parameters.
func TestTrack_OptionsAreEveryTrysAndTheirCostWins(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1000, Window: time.Minute})
		vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
		defer vendor.Close()
		client := &http.Client{Transport: &Transport{Limiter: lim, Cost: func(*http.Request) int { return 1 }}}
		ctx, call := Track(context.Background(), Cost(70))
		for range 2 {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, vendor.URL, strings.NewReader("{}"))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
		if call.cost() != 70 || ruleUsed(t, lim) != 140 {
			t.Fatalf("the last try cost %d, the window holds %d; want 70 and 140", call.cost(), ruleUsed(t, lim))
		}
		if _, ok := optionsFrom(context.Background()); ok {
			t.Fatal("optionsFrom of a context without options says it has some")
		}
	})
}
