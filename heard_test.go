package throttle

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Permit.Heard is what the Transport does with each of a vendor's answers;
// these tests drive it as a wrapper of another client (a vendor SDK, gRPC)
// would, through the public API alone.
func TestHeard_MakesTheVendorsAnswerKnown(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, c := range heardAnswers {
			t.Run(c.name, func(t *testing.T) { c.run(context.Background(), t, s) })
		}
	})
}

// perMinute is the quota of heardAnswers: 10 calls a minute.
var perMinute = policies.SlidingLog{Limit: 10, Window: time.Minute}

// heardAnswers are the answers TestHeard_MakesTheVendorsAnswerKnown gives
// Permit.Heard, each with what it must do to the quota.
var heardAnswers = []struct {
	name string
	run  func(ctx context.Context, t *testing.T, s *redistest.Server)
}{
	{"a 429 about the rate pauses every replica and teaches the cap", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		var rec recorder
		lim := replicaLimiter(t, s, "heard-429", perMinute, Options{Observer: rec.Observe})
		other := replicaLimiter(t, s, "heard-429", perMinute)
		for range 3 {
			acquire(t, lim)
		}
		p := acquire(t, lim)
		pause, refused, err := p.Heard(ctx, Answer{Status: http.StatusTooManyRequests, RetryAfter: 2 * time.Second, HasRetryAfter: true, AboutRate: true})
		if err != nil || !refused || pause != 2*time.Second {
			t.Fatalf("Heard(429, Retry-After 2s) = %v, %v, %v; want 2s, true, nil", pause, refused, err)
		}
		if d := lim.paused(); d <= time.Second || d > 2*time.Second {
			t.Errorf("paused() = %v after a 2s pause, want (1s, 2s]", d)
		}
		if d, err := other.Allow(ctx); err != nil || d.OK || d.RetryAfter < time.Second {
			t.Errorf("another replica during the pause: %+v, %v; want refused for over a second", d, err)
		}
		if n, _ := rec.count(EventVendorLimited, false); n != 1 {
			t.Errorf("%d EventVendorLimited, want 1", n)
		}
		if n, _ := rec.count(EventCapLearned, false); n != 1 {
			t.Errorf("%d EventCapLearned, want 1", n)
		}
		if got := learned(t, other); got != 5 {
			// Half the limit at most: 3 admitted before the call is fewer.
			t.Errorf("limit in force %d after a refusal, want 5", got)
		}
	}},
	{"a 429 that names no time pauses for DefaultPause", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		for _, tt := range []struct {
			set, low, high time.Duration
		}{
			{0, time.Second, 1250 * time.Millisecond},
			{4 * time.Second, 4 * time.Second, 5 * time.Second},
		} {
			lim := replicaLimiter(t, s, "heard-default-"+tt.set.String(), perMinute, Options{WithoutLearning: true})
			pause, refused, err := acquire(t, lim).Heard(ctx, Answer{Status: http.StatusTooManyRequests, DefaultPause: tt.set})
			if err != nil || !refused || pause < tt.low || pause > tt.high {
				t.Errorf("DefaultPause %v: Heard = %v, %v, %v; want [%v, %v], true, nil", tt.set, pause, refused, err, tt.low, tt.high)
			}
		}
	}},
	{"a 503 pauses and teaches nothing", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		var rec recorder
		lim := replicaLimiter(t, s, "heard-503", perMinute, Options{Observer: rec.Observe})
		acquire(t, lim)
		pause, refused, err := acquire(t, lim).Heard(ctx, Answer{Status: http.StatusServiceUnavailable, RetryAfter: 3 * time.Second, HasRetryAfter: true})
		if err != nil || !refused || pause != 3*time.Second {
			t.Fatalf("Heard(503, Retry-After 3s) = %v, %v, %v", pause, refused, err)
		}
		if n, _ := rec.count(EventCapLearned, false); n != 0 || learned(t, lim) != 10 {
			t.Errorf("an overloaded vendor taught a cap: %d events, limit in force %d", n, learned(t, lim))
		}
		if lim.paused() <= 2*time.Second {
			t.Errorf("Paused() = %v after a 3s pause", lim.paused())
		}
	}},
	{"a count lowers the quota's only when it says fewer are left", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		var scripts atomic.Int64
		rdb := s.Client(t)
		rdb.AddHook(countScripts{&scripts})
		lim, err := New(rdb, "heard-count", perMinute)
		if err != nil {
			t.Fatal(err)
		}
		other := replicaLimiter(t, s, "heard-count", perMinute)
		p := acquire(t, lim)
		if p.remaining() != 9 {
			t.Errorf("Remaining() = %d after the first call of 10, want 9", p.remaining())
		}
		// A limiter's first count of an epoch is passed on, once: it tells
		// the quota that the vendor states its counts (firstCount).
		before := scripts.Load()
		if _, refused, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 50}}); err != nil || refused {
			t.Fatalf("Heard(200, 50 left) = %v, %v", refused, err)
		}
		if n := scripts.Load() - before; n != 1 {
			t.Errorf("the limiter's first count ran %d scripts, want 1", n)
		}
		before = scripts.Load()
		if _, refused, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 50}}); err != nil || refused {
			t.Fatalf("Heard(200, 50 left) = %v, %v", refused, err)
		}
		if _, _, err := p.Heard(ctx, Answer{Status: http.StatusOK}); err != nil {
			t.Fatal(err)
		}
		if n := scripts.Load() - before; n != 0 {
			t.Errorf("answers that tell the quota nothing new ran %d scripts", n)
		}
		if _, _, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 2, Reset: time.Minute}}); err != nil {
			t.Fatal(err)
		}
		if n := scripts.Load() - before; n != 1 {
			t.Errorf("a count of fewer left ran %d scripts, want 1", n)
		}
		// The others spent 7 of the 10: the fleet leaves them that, and
		// a unit more for the jitter of their calls (Usage.Others).
		if free, want := allowed(t, other, 20), leftAfter(10, 1, 2); free != want {
			t.Errorf("after the vendor said 2 are left, another replica made %d calls, want %d", free, want)
		}
	}},
	{"a call with a Cost follows the vendor's tokens", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		tokens := policies.SlidingLog{Limit: 1000, Window: time.Minute}
		lim := replicaLimiter(t, s, "heard-tokens", tokens)
		other := replicaLimiter(t, s, "heard-tokens", tokens)
		p := acquire(t, lim, Cost(100))
		a := Answer{Status: http.StatusOK, Requests: &Count{Remaining: 50}, Tokens: &Count{Remaining: 300}}
		if _, _, err := p.Heard(ctx, a); err != nil {
			t.Fatal(err)
		}
		if d, _ := other.Allow(ctx, Cost(leftAfter(1000, 100, 300))); !d.OK {
			t.Errorf("the 300 tokens the vendor said are left, less what the others need more, were refused: %+v", d)
		}
		if d, _ := other.Allow(ctx, Cost(1)); d.OK {
			t.Errorf("a token more than the vendor said are left was admitted")
		}
		// Without a Cost the units are requests: their count stands.
		plain := replicaLimiter(t, s, "heard-requests", tokens)
		if _, _, err := acquire(t, plain).Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 5}, Tokens: &Count{Remaining: 300}}); err != nil {
			t.Fatal(err)
		}
		if free, want := allowed(t, plain, 20), leftAfter(1000, 1, 5); free != want {
			t.Errorf("a call without a Cost: %d calls left after the vendor said 5 requests, want %d", free, want)
		}
	}},
	{"a bad answer is an error that names the field", func(ctx context.Context, t *testing.T, s *redistest.Server) {
		lim := replicaLimiter(t, s, "heard-bad", perMinute)
		p := acquire(t, lim)
		for _, tt := range []struct {
			a    Answer
			want string
		}{
			{Answer{Requests: &Count{Remaining: -1}}, "Answer.Requests.Remaining must not be negative, got -1"},
			{Answer{Tokens: &Count{Reset: -time.Second}}, "Answer.Tokens.Reset must not be negative, got -1s"},
			{Answer{Requests: &Count{Limit: -2}}, "Answer.Requests.Limit must not be negative, got -2"},
			{Answer{Status: 429, RetryAfter: -time.Second, HasRetryAfter: true}, "Answer.RetryAfter and Answer.DefaultPause must not be negative, got -1s and 0s"},
		} {
			pause, refused, err := p.Heard(ctx, tt.a)
			if err == nil || !strings.Contains(err.Error(), tt.want) || pause != 0 || refused {
				t.Errorf("Heard(%+v) = %v, %v, %v; want an error with %q", tt.a, pause, refused, err, tt.want)
			}
		}
		if lim.paused() != 0 {
			t.Errorf("a bad answer paused the quota for %v", lim.paused())
		}
		var nilPermit *Permit
		if _, _, err := nilPermit.Heard(ctx, Answer{Status: 429}); err == nil {
			t.Error("Heard on a nil permit: no error")
		}
	}},
}

// acquire is lim.Acquire that fails the test on an error.
func acquire(t *testing.T, lim *Limiter, opts ...CallOption) *Permit {
	t.Helper()
	p, err := lim.Acquire(context.Background(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// learned returns the limit in force of lim's first rule.
func learned(t *testing.T, lim *Limiter) int {
	t.Helper()
	u, err := lim.Usage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return u.Rules[0].Limit
}

// allowed counts the calls lim admits now, up to n.
func allowed(t *testing.T, lim *Limiter, n int) int {
	t.Helper()
	free := 0
	for late := 0; free < n; {
		// Allow's path, which tells why it refused: a busy machine may
		// read a reply too late to start in (reasonLate), and such a call
		// is asked again, up to five times. Any other refusal ends the
		// count.
		c, err := lim.newCall(nil)
		if err != nil {
			t.Fatal(err)
		}
		r, err := lim.now(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		if !r.admitted && r.reason == reasonLate && late < 5 {
			late++
			continue
		}
		if !r.admitted {
			break
		}
		free++
	}
	return free
}

// The accessors a wrapper of one's own needs beside Acquire and Heard.
func TestLimiter_TellsAWrapperWhatItNeeds(t *testing.T) {
	s := redistest.Mini(t)
	ctx := context.Background()
	policy := policies.All(policies.SlidingLog{Limit: 10, Window: time.Second}, policies.Concurrency{Max: 2, Lease: time.Minute})
	lim := replicaLimiter(t, s, "accessors", policy, Options{Mode: FailFast})
	if lim.mode() != FailFast {
		t.Errorf("Mode() = %v", lim.mode())
	}
	rules := lim.Rules()
	if len(rules) != 2 || rules[1].Kind != policies.KindConcurrency {
		t.Fatalf("Rules() = %+v", rules)
	}
	rules[0].Limit = 1
	if lim.Rules()[0].Limit != 10 {
		t.Error("changing the slice Rules returned changed the limiter's rules")
	}
	if lim.logger() != slog.Default() {
		t.Error("Logger() is not slog.Default() when Options.Logger is nil")
	}
	logger := slog.New(slog.DiscardHandler)
	if replicaLimiter(t, s, "accessors-logger", policy, Options{Logger: logger}).logger() != logger {
		t.Error("Logger() is not Options.Logger")
	}
	var none *Limiter
	if none.mode() != Block || none.Rules() != nil || none.logger() != slog.Default() || none.paused() != 0 {
		t.Error("a nil Limiter's accessors do not give their zero answers")
	}
	p, err := lim.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	if PermitFrom(withPermit(ctx, p)) != p || PermitFrom(ctx) != nil {
		t.Error("PermitFrom does not find what withPermit put in a context, or finds a permit in one without")
	}
	keyed := replicaLimiter(t, s, "accessors-keyed", policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}})
	if err := keyed.Pause(ctx, time.Minute, Key("a")); err != nil {
		t.Fatal(err)
	}
	if d := keyed.paused(Key("a")); d <= 50*time.Second || d > time.Minute {
		t.Errorf("Paused(Key(a)) = %v after a pause of a minute", d)
	}
	if d := keyed.paused(Key("b")); d != 0 {
		t.Errorf("Paused(Key(b)) = %v: another key's pause", d)
	}
}

// refused tells the quota that the vendor refused the permit's call for
// being over its rate limit (a 429): every replica pauses for retryAfter
// (none when it is 0; at most an hour), and, unless the limiter's
// Options say WithoutLearning, the quota learns the vendor's cap from the
// refusal: each rule counting calls over time takes as its limit what the fleet admitted
// in the window before the call, which the vendor accepted (one refusal
// lowers a limit by half at most; see policies.SlidingLog.Limit). The cap
// holds for eight windows without a refusal, then rises back towards the
// configured limit, step by step, while the fleet fills it.
// It is the tests' shorthand for what Heard does with a 429 the vendor
// says is about its rate (Answer.AboutRate).
func (p *Permit) refused(ctx context.Context, retryAfter time.Duration) error {
	p, err := p.acting("refused")
	if err != nil {
		return err
	}
	said := vendorSaid{pause: min(max(retryAfter, 0), maxPause), units: unknownCount, calls: unknownCount, learn: !p.l.s.noLearning, refused: true}
	return p.l.feedback(ctx, said, p.r, p.opts())
}
