package throttle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/internal/sim"
	"github.com/throttlekit/throttle/policies"
)

// A refund on one replica moves the call another replica booked behind
// the units refunded: the quota's window is 30 s, so without the move the
// call sleeps 30 s, and the test's bound of 15 s is far from both.
func TestMove_RefundMovesASleepingCallOfAnotherReplica(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		policy := policies.SlidingLog{Limit: 100, Window: 30 * time.Second}
		a := newLimiter(t, s.Client(t), policy)
		b := newLimiter(t, s.Client(t), policy)
		ctx := context.Background()
		first, err := a.Acquire(ctx, Cost(80)) // an estimate of 80
		if err != nil {
			t.Fatal(err)
		}
		type went struct {
			after time.Duration
			err   error
		}
		waited := make(chan went, 1)
		bctx, stop := context.WithCancel(ctx)
		defer func() { stop(); <-waited }() // the booked call ends with the test
		go func() {
			start := time.Now()
			p, err := b.Acquire(bctx, Cost(50))
			if err == nil {
				p.Release()
			}
			waited <- went{time.Since(start), err}
		}()
		waitBooked(t, a, 130)
		// The news of the refund reaches b once its subscription is up:
		// a call booked before then keeps its slot (the cap is never at
		// stake), which a busy machine made this test wait out once.
		waitSubscribed(t, s.Client(t), b, 2)                // a's and b's clients
		if err := first.Settle(ctx, Cost(30)); err != nil { // it used 30
			t.Fatal(err)
		}
		select {
		case w := <-waited:
			waited <- w // for the deferred wait
			if w.err != nil {
				t.Fatal(w.err)
			}
			t.Logf("the booked call went after %v", w.after.Round(time.Millisecond))
		case <-time.After(15 * time.Second):
			t.Fatal("the call booked 30 s ahead still waits 15 s after the refund that made room for it")
		}
		if used := ruleUsed(t, a); used != 80 {
			t.Fatalf("the window holds %d units, want 80: the refunded call's 30 and the moved call's 50", used)
		}
	})
}

// A refund wakes the processes of the calls booked first after it, not
// every process with a call booked: 16 replicas each sleep towards a slot
// 30 s ahead, a refund leaves room for one, and at most roomNames of them
// run a script to move (each of the 16 with the news told to everyone,
// THROTTLE_OFF=room_names), while the first booked still moves into it.
// On a machine so busy that the call moved wakes later than its margin
// allows, it books again (late) and gives the room back to the next: its
// move took the room all the same, and each booking again is one script
// more, of the machine's making.
func TestMove_ARefundWakesTheProcessesBookedFirstOnly(t *testing.T) {
	const replicas, roomNames = 16, 8 // roomNames: ROOM_NAMES in lua/lib.lua
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		policy := policies.SlidingLog{Limit: 20, Window: 30 * time.Second}
		a := newLimiter(t, s.Client(t), policy)
		ctx := context.Background()
		first, err := a.Acquire(ctx, Cost(20)) // an estimate of 20: the window is full
		if err != nil {
			t.Fatal(err)
		}
		var scripts, late, booked atomic.Int64
		bctx, stop := context.WithCancel(ctx)
		moved := make(chan error, 2*replicas)
		observe := func(e Event) {
			if e.Kind != EventBookedAgain {
				return
			}
			booked.Add(1)
			if e.Reason == againLate {
				late.Add(1)
				select {
				case moved <- nil: // it had moved into the room, and woke late there
				default:
				}
			}
		}
		var wg sync.WaitGroup
		defer func() { stop(); wg.Wait() }() // the booked calls end with the test
		for range replicas {
			rdb := s.Client(t)
			rdb.AddHook(countScripts{&scripts})
			// miniredis runs each script in the test's process, one at a
			// time: beside the race run, sixteen moves at once took longer
			// than the default second to answer.
			b := newLimiter(t, rdb, policy, Options{Observer: observe, RedisTimeout: 10 * time.Second})
			wg.Go(func() {
				if _, err := b.Acquire(bctx, Cost(1)); bctx.Err() == nil {
					moved <- err
				}
			})
		}
		waitBooked(t, a, 20+replicas)
		waitSubscribed(t, s.Client(t), a, 1+replicas)
		before := scriptsSettled(t, &scripts)
		lateBefore, bookedBefore := late.Load(), booked.Load()
		if err := first.Settle(ctx, Cost(19)); err != nil { // it used 19: room for one
			t.Fatal(err)
		}
		select {
		case err := <-moved:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("no call booked 30 s ahead moved into the room of the refund within 15 s")
		}
		time.Sleep(300 * time.Millisecond) // the moves of every process told
		// Each booking again is a script more, not a move: a call woken
		// late gives the room back and books again, and a move that finds
		// its own slot no longer fits books again (beside eight busy
		// loops, up to 6 in a run, each finding room a few milliseconds
		// after its slot).
		again := booked.Load() - bookedBefore
		if n := scripts.Load() - before - again; n > roomNames {
			t.Fatalf("the refund of one unit set %d of %d replicas moving (%d booked again, %d of them late), want %d at most",
				n, replicas, again, late.Load()-lateBefore, roomNames)
		}
	})
}

// scriptsSettled waits until no script call was counted in n for 300 ms (the
// bookings' replies of a busy machine may still be on their way, and the
// moves of the news they missed), and returns the count.
func scriptsSettled(t *testing.T, n *atomic.Int64) int64 {
	t.Helper()
	last := n.Load()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		time.Sleep(300 * time.Millisecond)
		if now := n.Load(); now == last {
			return now
		} else {
			last = now
		}
	}
	t.Fatal("script calls still counted 10 s after the calls were booked")
	return 0
}

// A call that hears of room while Redis failed one of its process's
// script calls lately does not move then (troubled), but once that trouble
// is over: the refund's news, told to the processes it names, does not
// come again. Here the call is booked 10 s ahead; without the retry it
// sleeps to that slot.
func TestMove_ARoomHeardWhileTroubledMovesOnceTheTroubleIsOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		t.Cleanup(r.Close)
		lim := newLimiter(t, simClient(t, r, 0), policies.SlidingLog{Limit: 2, Window: 10 * time.Second}, Options{Logger: quiet()})
		defer closeInBubble(lim)
		ctx := context.Background()
		first, err := lim.Acquire(ctx, Cost(2)) // an estimate of 2: the window is full
		if err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		started := make(chan time.Duration, 1)
		go func() {
			if _, err := lim.Acquire(ctx); err != nil { // booked 10 s ahead
				t.Error(err)
			}
			started <- time.Since(began)
		}()
		time.Sleep(100 * time.Millisecond)
		lim.batches.lastFailure.Store(time.Now().UnixNano()) // as after a Redis timeout
		if err := first.Settle(ctx, Cost(1)); err != nil {   // room for the booked call
			t.Fatal(err)
		}
		if took := <-started; took > 5*time.Second {
			t.Fatalf("the booked call started %v after asking, at its slot: the room heard while troubled never moved it", took)
		}
	})
}

// A call whose move found nothing earlier keeps its booking, and its
// deadline is reckoned from the slot it keeps: booked 10 s ahead with 12 s
// to live, it starts at its slot, though 5 s later a refund too small for
// it set it moving. Reckoned from the move, the wait it was booked with
// (10 s) would end past its deadline, and the call would fail there.
func TestMove_AKeptBookingStillMeetsItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		t.Cleanup(r.Close)
		var again, scripts atomic.Int64
		rdb := simClient(t, r, 0)
		rdb.AddHook(countScripts{&scripts})
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 10, Window: 10 * time.Second}, Options{Logger: quiet(),
			Observer: func(e Event) {
				if e.Kind == EventBookedAgain {
					again.Add(1)
				}
			}})
		defer closeInBubble(lim)
		ctx := context.Background()
		first, err := lim.Acquire(ctx, Cost(10)) // the window is full
		if err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		started := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(ctx, 12*time.Second)
			defer cancel()
			_, err := lim.Acquire(ctx, Cost(3)) // booked 10 s ahead
			started <- err
		}()
		time.Sleep(5 * time.Second)
		before := scripts.Load()
		if err := first.Settle(ctx, Cost(9)); err != nil { // room for 1 unit: not for the booked call
			t.Fatal(err)
		}
		if err := <-started; err != nil {
			t.Fatalf("the booked call failed %v after asking: %v", time.Since(began), err)
		}
		if took := time.Since(began); took < 10*time.Second {
			t.Fatalf("the booked call started %v after asking, before its slot", took)
		}
		if n := scripts.Load() - before; n < 2 {
			t.Fatalf("%d script calls after the refund's, want its own and the booked call's move: the test shows nothing", n)
		}
		if n := again.Load(); n != 0 {
			t.Fatalf("the call booked again %d times, want none", n)
		}
	})
}

// waitBooked waits until the first rule of lim counts units, admitted and
// booked: a call of another goroutine has its slot. opts name the scope
// (a key) where the quota has a per-key rule.
func waitBooked(t *testing.T, lim *Limiter, units int, opts ...CallOption) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		u, err := lim.Usage(context.Background(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		if u.Rules[0].Used+u.Rules[0].Booked >= units {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the quota holds %d units admitted and %d booked, want %d in all", u.Rules[0].Used, u.Rules[0].Booked, units)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// bookBehindOne returns a limiter of one call per 10 ms on a given clock,
// its clock, and a call booked behind the one it admitted.
func bookBehindOne(t *testing.T, s *redistest.Server) (*Limiter, *fixedClock, result) {
	t.Helper()
	clock := newClock()
	lim := newLimiter(t, s.Client(t), policies.SlidingLog{Limit: 1, Window: 10 * time.Millisecond}, Options{Clock: clock.Now})
	ctx := context.Background()
	if _, err := lim.acquire(ctx, call{cost: 1}, 0, nil); err != nil {
		t.Fatal(err)
	}
	booked, err := lim.acquire(ctx, call{cost: 1}, time.Second, nil)
	if err != nil || !booked.admitted || booked.wait <= 0 {
		t.Fatalf("booking: %+v, %v", booked, err)
	}
	return lim, clock, booked
}

// moveOnce asks, in one script call, to move the booking of the call
// booked, with a wait of a second.
func moveOnce(lim *Limiter, booked result) *request {
	c := call{cost: 1, moves: true}
	req := &request{sc: lim.scopeFor(c), c: c, maxWait: time.Second, member: lim.newMember(), late: &booked, done: make(chan struct{})}
	lim.decide(req.sc, []*request{req})
	return req
}

// A call that moves never ends later than its slot, even when its process
// reckoned a wait past it (its call waited in the lane behind another
// script call) and the only room lies later: here a pause the vendor asked
// for after the call was booked.
func TestMove_NeverLaterThanItsSlot(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim, _, booked := bookBehindOne(t, s)
		if err := lim.Pause(context.Background(), 50*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		req := moveOnce(lim, booked)
		if req.err != nil || !req.res.admitted || req.res.slot() != booked.slot() {
			t.Fatalf("the moving call: %+v, %v; want its slot %v kept", req.res, req.err, booked.slot())
		}
	})
}

// A call kept at a slot that passed while it waited for the script books
// again: measured from the script's end, its lateness would not show how
// far after its slot it starts (simulation seed 85: 28 in a window of 25).
func TestMove_KeptAtAPassedSlotBooksAgain(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim, clock, booked := bookBehindOne(t, s)
		clock.Add(booked.wait + time.Millisecond)
		req := moveOnce(lim, booked)
		if req.err != nil || !req.res.admitted || req.res.slot() != booked.slot() || req.res.wait >= 0 {
			t.Fatalf("the moving call: %+v, %v; want its slot kept, %v ago", req.res, req.err, time.Millisecond)
		}
		if why := afterMove(req.res); why != againLate {
			t.Fatalf("a call kept at a slot already past books again for %q, want %q: without it, it sleeps towards it, and would start late unseen", why, againLate)
		}
		if afterMove(booked) != "" {
			t.Fatal("a call kept at a slot ahead books again")
		}
	})
}

// The news of many refunds within roomEvery sets the sleeping calls of a
// process moving twice at most: at once, and once when roomEvery is out.
func TestMove_RefundsHeardTogetherMoveOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &Limiter{}
		l.room.work = &l.work
		closed := func(ch <-chan struct{}) bool {
			select {
			case <-ch:
				return true
			default:
				return false
			}
		}
		first := l.room.now()
		l.room.signal(0)
		if !closed(first) {
			t.Fatal("the first refund's news moved no call")
		}
		second := l.room.now()
		for range 50 {
			l.room.signal(0)
		}
		if closed(second) {
			t.Fatal("the calls moved again at once")
		}
		time.Sleep(roomEvery)
		synctest.Wait()
		third := l.room.now()
		if !closed(second) || closed(third) {
			t.Fatalf("after roomEvery: the refunds heard meanwhile moved the calls %v, and again %v; want once", closed(second), closed(third))
		}
	})
}

// waitSubscribed waits until n connections of the server rdb talks to
// are subscribed to lim's quota's channel.
func waitSubscribed(t *testing.T, rdb redis.UniversalClient, lim *Limiter, n int) {
	t.Helper()
	waitSubscribedTo(t, rdb, lim.cfg.shared[0], n)
}

// waitSubscribedTo waits until n clients subscribe to channel.
func waitSubscribedTo(t *testing.T, rdb redis.UniversalClient, channel string, n int) {
	t.Helper()
	waitFor(t, func() bool {
		subs, err := rdb.PubSubNumSub(context.Background(), channel).Result()
		return err == nil && subs[channel] >= int64(n)
	}, fmt.Sprintf("%d subscriptions to %q", n, channel))
}

// A move that Redis does not answer counts as the call's script call: the
// call fails within the Redis timeout of it (FailClosed), instead of asking
// Redis again with a timeout of its own, twice the timeout in all on a hung
// Redis.
func TestMove_AFailedMoveEndsTheCallWithinTheTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		t.Cleanup(r.Close)
		rdb := simClient(t, r, 0)
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 2, Window: time.Second}, Options{Logger: quiet()})
		defer closeInBubble(lim)
		ctx := context.Background()
		for range 2 {
			if _, err := lim.Acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		errs := make(chan error, 1)
		var ended time.Time
		go func() {
			_, err := lim.Acquire(ctx) // booked a window ahead
			ended = time.Now()
			errs <- err
		}()
		time.Sleep(100 * time.Millisecond)
		r.Freeze()
		defer r.Thaw()
		moved := time.Now()
		lim.room.signal(math.MaxInt64) // units given back after every booking
		err := <-errs
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("the call whose move Redis did not answer: %v, want ErrUnavailable", err)
		}
		if took := ended.Sub(moved); took > defaultRedisTimeout+50*time.Millisecond {
			t.Errorf("the call failed %v after its move began, want within the Redis timeout (%v)", took, defaultRedisTimeout)
		}
	})
}

// A refund whose news comes while the reply that booked a call is on its
// way, before the call sleeps, moves it all the same: the call took the
// channel of that news before it asked (roomNews.now). Here the reply is held
// until the other process's refund was heard; taken after the reply, the
// channel was a new one, and the call slept to its slot 10 s ahead.
func TestMove_ARefundHeardBeforeTheCallSleepsMovesIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		t.Cleanup(r.Close)
		policy := policies.SlidingLog{Limit: 2, Window: 10 * time.Second}
		a := newLimiter(t, simClient(t, r, 0), policy, Options{Logger: quiet()})
		defer closeInBubble(a)
		ctx := context.Background()
		first, err := a.Acquire(ctx, Cost(2)) // an estimate of 2: the window is full
		if err != nil {
			t.Fatal(err)
		}
		rdb := simClient(t, r, 1)
		var b *Limiter
		rdb.AddHook(&refundOnReply{do: func() {
			if err := first.Settle(ctx, Cost(1)); err != nil { // room for b's call
				t.Error(err)
			}
			time.Sleep(100 * time.Millisecond) // b hears the news meanwhile
		}})
		b = newLimiter(t, rdb, policy, Options{Logger: quiet()})
		defer closeInBubble(b)
		began := time.Now()
		if _, err := b.Acquire(ctx); err != nil { // booked 10 s ahead
			t.Fatal(err)
		}
		if took := time.Since(began); took > 5*time.Second {
			t.Fatalf("the booked call started %v after asking, at its slot: the refund heard before it slept never moved it", took)
		}
	})
}

// refundOnReply runs do once, after the first script call it sees that
// booked a call ahead, before its reply goes back to the caller.
type refundOnReply struct {
	do   func()
	once sync.Once
}

func (*refundOnReply) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *refundOnReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); err == nil && (name == "evalsha" || name == "eval") {
			h.once.Do(h.do)
		}
		return err
	}
}
func (h *refundOnReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			if name := cmd.Name(); err == nil && (name == "evalsha" || name == "eval") {
				h.once.Do(h.do)
			}
		}
		return err
	}
}

// News of units given back before a call was booked does not set it
// moving: the script that booked it saw that room. Taken before the
// script call (roomNews.now), the channel of such news is closed when the call
// goes to sleep; without the check, each call booked while a fleet's
// refunds come made a move for nothing (an LLM fleet whose calls settle:
// 1.5-4.4% of its calls refused for their deadlines, 0-0.5% with it).
func TestMove_RoomGivenBackBeforeABookingDoesNotMoveIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := sim.NewRedis(func(int) time.Duration { return time.Millisecond })
		t.Cleanup(r.Close)
		var scripts atomic.Int64
		rdb := simClient(t, r, 0)
		rdb.AddHook(countScripts{&scripts})
		lim := newLimiter(t, rdb, policies.SlidingLog{Limit: 1, Window: 10 * time.Second}, Options{Logger: quiet()})
		defer closeInBubble(lim)
		ctx := context.Background()
		if _, err := lim.Acquire(ctx); err != nil { // the window is full
			t.Fatal(err)
		}
		bctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { _, _ = lim.Acquire(bctx); close(done) }() // booked 10 s ahead
		defer func() { stop(); <-done }()
		time.Sleep(time.Second)
		before := scripts.Load()
		lim.room.signal(time.Duration(time.Now().Add(-time.Minute).UnixMicro()) * time.Microsecond) // before it was booked
		time.Sleep(time.Second)
		if n := scripts.Load() - before; n != 0 {
			t.Fatalf("news of room given back before the booking made %d script calls, want none", n)
		}
		lim.room.signal(time.Duration(time.Now().UnixMicro()) * time.Microsecond) // after it
		time.Sleep(time.Second)
		if n := scripts.Load() - before; n != 1 {
			t.Fatalf("news of room given back after the booking made %d script calls, want the one move", n)
		}
	})
}

// A move that finds nothing earlier keeps its slot, whose units its own
// booking gave back at the script's start: no call of the same script
// call takes them first. Here a call that also moves, but whose booking is
// of a lost epoch (so nothing is given back, and it books as a new call),
// comes first in the batch, its old slot being earlier (simulation seed
// 304023: 6 in a window of 5).
func TestMove_AKeptMoveKeepsItsUnitsFromTheCallsBeforeIt(t *testing.T) {
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		lim, _, booked := bookBehindOne(t, s)
		lost := booked
		lost.member, lost.epoch, lost.wait = lim.newMember(), booked.epoch-1, booked.wait-time.Millisecond
		mk := func(late *result) *request {
			c := call{cost: 1, moves: true}
			return &request{sc: lim.scopeFor(c), c: c, maxWait: time.Second, member: lim.newMember(), late: late, done: make(chan struct{})}
		}
		first, moving := mk(&lost), mk(&booked)
		lim.decide(first.sc, []*request{first, moving})
		if moving.err != nil || !moving.res.admitted || moving.res.slot() != booked.slot() {
			t.Fatalf("the moving call: %+v, %v; want its slot %v kept", moving.res, moving.err, booked.slot())
		}
		if first.err != nil {
			t.Fatalf("the call of a lost epoch's booking: %v", first.err)
		}
		if first.res.admitted && first.res.slot() < booked.slot()+10*time.Millisecond {
			t.Errorf("the call of a lost epoch's booking: admitted at %v, %v after the kept slot, in a log of 1 in 10 ms: the kept move's units taken twice",
				first.res.slot(), first.res.slot()-booked.slot())
		}
	})
}

// A broadcast's signal closes the channel every waiter took before it, and
// no other: signals from many goroutines at once never close a channel
// twice (a panic), nor leave a waiter that took its channel before the
// last signal asleep.
func TestBroadcast_WakesEveryWaiterOfItsSignals(t *testing.T) {
	var b broadcast
	first := b.wait()
	if b.wait() != first {
		t.Fatal("two waits before a signal returned two channels")
	}
	b.signal()
	select {
	case <-first:
	default:
		t.Fatal("a signal left the channel taken before it open")
	}
	next := b.wait()
	select {
	case <-next:
		t.Fatal("the channel taken after a signal is closed already")
	default:
	}
	var wg sync.WaitGroup
	taken := make(chan (<-chan struct{}), 64*100)
	for range 64 {
		wg.Go(func() {
			for range 100 {
				taken <- b.wait()
				b.signal()
			}
		})
	}
	wg.Wait()
	close(taken)
	for ch := range taken {
		select {
		case <-ch:
		default:
			t.Fatal("a channel taken before a signal is still open after it")
		}
	}
}
