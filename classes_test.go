package throttle

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// classRun drives one limiter in FailFast mode on a given clock, a step
// at a time, so that each class's calls are decided at known times.
type classRun struct {
	t     *testing.T
	lim   *Limiter
	clock *fixedClock
}

func newClassRun(t *testing.T, s *redistest.Server, p policies.Policy, opts Options) *classRun {
	clock := newClock()
	opts.Mode, opts.Clock = FailFast, clock.Now
	return &classRun{t: t, lim: newLimiter(t, s.Client(t), p, opts), clock: clock}
}

// try asks for one call now, and reports whether it was admitted.
func (c *classRun) try(opts ...CallOption) bool {
	c.t.Helper()
	p, err := c.lim.Acquire(context.Background(), opts...)
	if errors.Is(err, ErrLimited) {
		return false
	}
	if err != nil {
		c.t.Fatal(err)
	}
	p.Release()
	return true
}

// book books one call now through the limiter's lane, as a call in Block
// mode asks for its slot, waiting up to maxWait, and returns its result;
// the test fails when the call is not booked.
func (c *classRun) book(cl call, maxWait time.Duration) result {
	c.t.Helper()
	req := &request{sc: c.lim.scopeFor(cl), c: cl, maxWait: maxWait, member: c.lim.newMember(), done: make(chan struct{})}
	c.lim.decide(req.sc, []*request{req})
	if req.err != nil || !req.res.admitted {
		c.t.Fatalf("a call (priority %d, key %q) was not booked: %v %+v", cl.priority, cl.key, req.err, req.res)
	}
	return req.res
}

// fill asks for calls now until one is refused, 500 at most, and returns
// how many were admitted.
func (c *classRun) fill(opts ...CallOption) int {
	c.t.Helper()
	n := 0
	for n < 500 && c.try(opts...) {
		n++
	}
	return n
}

// A batch class fills a quota of 100 a second at every step of 100ms; an
// interactive class of a higher priority asks for one call at each step.
// From the second window on, the quota holds the interactive calls their
// share: every one is admitted at once, and the two classes together use
// at least 0.9 of the quota. First come, first served (ArrivalOrder, or
// the classes switched off), the batch takes every unit as it frees and
// the interactive calls are refused.
func TestClasses_AHigherPriorityFindsItsShareAtOnce(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, arrival := range []bool{false, true} {
			t.Run("ArrivalOrder="+strconv.FormatBool(arrival), func(t *testing.T) {
				c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{ArrivalOrder: arrival})
				refused, used := 0, 0
				for step := range 31 {
					// The first window, its 3% margin included, ends
					// after the step at 1s.
					warm := step > 10
					if !c.try(Priority(10)) && warm {
						t.Logf("step %d: an interactive call refused", step)
						refused++
					} else if warm {
						used++
					}
					n := c.fill(Priority(0))
					if warm {
						used += n
					}
					c.clock.Add(100 * time.Millisecond)
				}
				// Two seconds, in windows of 1s and a 3% margin.
				ceiling := 200 / 1.03
				t.Logf("interactive calls refused after the first window: %d of 20; both classes: %d calls in 2s (%.3f of the window's ceiling)",
					refused, used, float64(used)/ceiling)
				if arrival {
					if refused < 15 {
						t.Errorf("first come, first served: %d interactive calls refused of 20, want most of them", refused)
					}
					return
				}
				if refused > 0 {
					t.Errorf("%d interactive calls refused after the first window, want none", refused)
				}
				if float64(used) < 0.9*ceiling {
					t.Errorf("both classes used %d calls in 2s, want at least 0.9 of %.0f", used, ceiling)
				}
			})
		}
	})
}

// A higher priority that calls for the first time, as a batch class
// fills the quota at every step, is held a tenth of the limit through its
// first window, while its own demand is too young to tell: its calls in
// that window, one every 100ms, are all admitted at once. Without the
// tenth, the quota held only what its first calls scaled to, and 4 of
// the 10 were refused.
func TestClasses_AHigherPriorityNewlyCalledFindsRoomInItsFirstWindow(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{})
		refused := 0
		for step := range 10 {
			if !c.try(Priority(10)) {
				t.Logf("step %d: the interactive call refused", step)
				refused++
			}
			c.fill(Priority(0))
			c.clock.Add(100 * time.Millisecond)
		}
		if refused > 0 {
			t.Errorf("%d of the interactive class's 10 calls in its first window refused, want none", refused)
		}
	})
}

// A class that first calls while another has taken part of the window,
// alone, finds its share in what is left of that window: the share held
// for it counts what the other took before, since every class's calls are
// logged from its first and the default class's, unlogged while it called
// alone, are copied into its log when another class first calls. Here 60
// calls of a batch class (or a heavy key) come first, then one call of an
// interactive class (a light key), then the batch fills the quota at every
// step of 100ms while the newcomer asks for one call a step (every other
// step for the light key): none of the newcomer's calls in that first
// window is refused. With THROTTLE_OFF=class_logs the batch's first 60
// calls are in no log of its class, the share held counts only its later
// ones, and the batch takes the window's every unit: 9 of 9 refused (the
// light key: 4 of 4).
func TestClasses_AClassThatCallsMidWindowFindsItsShareInIt(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	rule := policies.SlidingLog{Limit: 100, Window: time.Second}
	for _, run := range []struct {
		name            string
		policy          policies.Policy
		first, newcomer []CallOption
		every           int
	}{
		{"priority", rule, []CallOption{Priority(0)}, []CallOption{Priority(10)}, 1},
		{"keys", policies.All(rule, policies.PerKey{Policy: rule}), []CallOption{Key("heavy")}, []CallOption{Key("light")}, 2},
	} {
		t.Run(run.name, func(t *testing.T) {
			redistest.Each(t, func(t *testing.T, s *redistest.Server) {
				c := newClassRun(t, s, run.policy, Options{})
				for range 60 {
					if !c.try(run.first...) {
						t.Fatal("one of the first 60 calls refused")
					}
				}
				if !c.try(run.newcomer...) {
					t.Fatal("the newcomer's first call refused, with 40 units free")
				}
				taken, refused, asked := 60+c.fill(run.first...), 0, 0
				for step := 1; step < 10; step++ {
					c.clock.Add(100 * time.Millisecond)
					if step%run.every == 0 {
						asked++
						if !c.try(run.newcomer...) {
							t.Logf("step %d: the newcomer's call refused", step)
							refused++
						}
					}
					taken += c.fill(run.first...)
				}
				t.Logf("the first class took %d calls of the first window; the newcomer was refused %d of %d", taken, refused, asked)
				if refused > 0 {
					t.Errorf("%d of the newcomer's %d calls in its first window refused, want none", refused, asked)
				}
			})
		})
	}
}

// A backlog served is not what a class books by a window: a light key
// whose first calls all waited books them into one period, and once that
// period is the oldest the demand's runs read (a window later) its demand
// is what it books as it comes again, not that burst. Here a heavy key
// fills a global cap of 100 a second at every step of 100ms; a light key
// books 40 calls ahead at the start, which go out together when the heavy
// key's first window turns (about 1.05s), then asks for one call every
// 200ms. As the backlog leaves the window (2.05-2.15s), the heavy key
// takes the room it leaves: 42 calls from 1.9s to 2.1s. With THROTTLE_OFF=class_backlog the burst stays in
// the light key's demand until its period leaves the demand's runs
// (2.25s), the share held for the light key keeps that room, and the
// heavy key takes none of it then.
func TestClasses_ABacklogServedLeavesItsClassesDemand(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rule := policies.SlidingLog{Limit: 100, Window: time.Second}
		c := newClassRun(t, s, policies.All(rule, policies.PerKey{Policy: rule}), Options{})
		c.fill(Key("heavy"))
		for range 40 {
			c.book(call{key: "light", hasKey: true, cost: 1}, 10*time.Second)
		}
		heavy := 0
		for step := 1; step <= 21; step++ {
			c.clock.Add(100 * time.Millisecond)
			if step%2 == 0 {
				c.try(Key("light"))
			}
			n := c.fill(Key("heavy"))
			if step >= 19 {
				heavy += n
			}
		}
		t.Logf("the heavy key's calls from 1.9s to 2.1s: %d", heavy)
		if heavy < 20 {
			t.Errorf("the heavy key took %d calls as the light key's backlog left the window, want at least 20", heavy)
		}
	})
}

// A backlog served still fills the window it went out in, and the class's
// next calls need room beside it. Here the batch class fills a quota of
// 100 a second at the start and at every step of 100ms after; the
// interactive class (priority 10) asks for one call a step from 0.1s on,
// each booked at the first free slot: the first ten go out together when
// the batch's first window turns (about 1.03s). From then on every one
// starts at once (a step's call waits for nothing). When that backlog
// counted no more once its period had passed (1.25s), the batch took its
// room at the next steps while it was still in the window, and the
// interactive calls waited up to 0.7s, every window, to 4s (THROTTLE_OFF
// cannot show it: off, the backlog counts until its period leaves the
// demand's runs).
func TestClasses_ABacklogServedKeepsItsShareWhileInTheWindow(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{})
		c.fill(Priority(0))
		var waits []time.Duration
		for step := 1; step <= 40; step++ {
			c.clock.Add(100 * time.Millisecond)
			r := c.book(call{priority: 10, cost: 1}, 2*time.Second)
			if step > 10 {
				waits = append(waits, r.wait)
			}
			c.fill(Priority(0))
		}
		t.Logf("the interactive calls' waits from 1.1s on: %v", waits)
		if w := slices.Max(waits); w > 0 {
			t.Errorf("an interactive call after the backlog waited %v, want each to start at once", w)
		}
	})
}

// The default class's calls booked ahead before another class first
// called book again when they wake (announce_class): they count in the
// default class's log once, as they book again, and not a second time as
// copies of their old bookings (fill_default copies only what the rule
// admitted up to now). Here the batch fills a quota of 100 a second and
// books 30 calls ahead; an interactive call comes at 0.1s; the 30 book
// again at 1.1s, and the batch then fills the quota every 100ms beside one
// interactive call a step. It takes 67 calls by 2s; 37 when the copies of
// the 30 stayed in its log, which held it to 30 fewer for a window (in
// bench/priority with the interactive class first asking 100ms in, 0.936
// of the cap used instead of 0.98).
func TestClasses_DefaultClassBookingsAheadCountOnceWhenTheyBookAgain(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{})
		ctx := context.Background()
		batch := call{cost: 1}
		c.fill()
		var booked []result
		for range 30 {
			r, err := c.lim.acquire(ctx, batch, 2*time.Second, nil)
			if err != nil || !r.admitted || r.wait == 0 {
				t.Fatalf("a batch call was not booked ahead: %v %+v", err, r)
			}
			booked = append(booked, r)
		}
		c.clock.Add(100 * time.Millisecond)
		c.try(Priority(10))
		c.clock.Add(time.Second)
		for _, b := range booked {
			if _, err := c.lim.acquire(ctx, batch, 2*time.Second, &b); err != nil {
				t.Fatal(err)
			}
		}
		n := 0
		for range 10 {
			c.try(Priority(10))
			n += c.fill()
			c.clock.Add(100 * time.Millisecond)
		}
		t.Logf("the batch took %d calls from 1.1s to 2s", n)
		if n < 55 {
			t.Errorf("the batch took %d calls from 1.1s to 2s, want at least 55: its calls that booked again count twice", n)
		}
	})
}

// Under a global cap of 100 a second that every key shares, one heavy key
// fills the quota at every step of 100ms, and four light keys ask for one
// call every 200ms each. From the second window on, at least 0.9 of the
// light keys' calls are admitted at once (first come, first served: none),
// and the heavy key takes at least 0.9 of what they leave.
func TestClasses_LightKeysFindTheirShareUnderAGlobalCap(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rule := policies.SlidingLog{Limit: 100, Window: time.Second}
		c := newClassRun(t, s, policies.All(rule, policies.PerKey{Policy: rule}), Options{})
		refused, light, heavy := 0, 0, 0
		for step := range 31 {
			warm := step > 10
			for k := range 4 {
				if (step+k)%2 != 0 {
					continue
				}
				ok := c.try(Key("light-" + strconv.Itoa(k)))
				switch {
				case !ok && warm:
					t.Logf("step %d: a call of light-%d refused", step, k)
					refused++
				case warm:
					light++
				}
			}
			n := c.fill(Key("heavy"))
			if warm {
				heavy += n
			}
			c.clock.Add(100 * time.Millisecond)
		}
		left := 200/1.03 - float64(light)
		t.Logf("light keys: %d calls admitted, %d refused after the first window; the heavy key: %d calls (%.3f of the %.0f they left)",
			light, refused, heavy, float64(heavy)/left, left)
		// A window in force (1.03s) holds five or six calls of a light
		// key, and the share held for each is its mean, 5.15, with a spare
		// for them all: when several keys' calls line up, one is refused
		// now and then (3 of 40 here); a call that may wait (Block) books
		// the first unit to leave the window instead.
		if refused*10 > light+refused {
			t.Errorf("%d light calls refused after the first window, %d admitted, want at least 0.9 admitted", refused, light)
		}
		if float64(heavy) < 0.9*left {
			t.Errorf("the heavy key took %d calls, want at least 0.9 of the %.0f the light keys left", heavy, left)
		}
	})
}

// A higher priority that asks for more than the whole quota does not
// starve a lower one: the lower class, once it has a call in, keeps a
// tenth of the limit, so its calls, five a second, book within a window
// and a half of their asking. Without that floor its share would fall to
// one call a window, and its waits would grow with every call.
func TestClasses_ALowerPriorityKeepsATenth(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{})
		var waits []time.Duration
		for step := range 50 {
			c.fill(Priority(10))
			if step%2 == 0 {
				waits = append(waits, c.book(call{cost: 1}, 10*time.Second).wait)
			}
			c.clock.Add(100 * time.Millisecond)
		}
		last := waits[len(waits)-5:]
		t.Logf("the low calls' waits: %v", waits)
		for _, w := range last {
			if w > 1500*time.Millisecond {
				t.Errorf("the last low calls waited %v, want each within a window and a half", last)
				break
			}
		}
	})
}

// A key that calls for the first time while another key has filled the
// quota's next window with bookings made ahead tells the fleet so, on the
// quota's channel: the calls booked before it book again when they wake,
// against the share the global rule then holds for the new key, whose
// calls find room in that window instead of after it. Without the news
// (class_news off) the heavy key's bookings fill that window and every
// light call in it is refused.
func classesANewKeyIsHeardByTheCallsBookedAhead(t *testing.T) {
	// Not in parallel: on wall-clock time, its news and slots must not
	// wait behind the package's other tests on a busy machine (under
	// -race, in parallel, miniredis's replies and the news came so late
	// that the heavy key's calls ran at their slots unmoved: 0 of 7).
	eachSideBySide(t, func(t *testing.T, s *redistest.Server) {
		for try := 1; ; try++ {
			admitted, counted, first := newKeyAfterBookings(t, s, try)
			t.Logf("try %d: the light key first asked %v after the heavy key's first call; its calls admitted in the heavy key's booked window: %d of %d",
				try, first.Round(time.Millisecond), admitted, counted)
			// The light key's first call must come well before the heavy
			// key's booked slots (a second after its first call) for the
			// news to reach them: on a machine so loaded that booking the
			// heavy key's 40 calls took most of that second, the run says
			// nothing, and is made again on a quota of its own.
			if first > 500*time.Millisecond && try < 3 {
				continue
			}
			// 7 of 7 here, 4 to 7 under -race beside two busy loops; 0 off.
			// Beside CI's race run, one try in a few found 0 of 7 (the news
			// came after the heavy key's calls had started): the run is
			// made again, and fails when three tries all fall short.
			if admitted < 3 && try < 3 {
				continue
			}
			if admitted < 3 {
				t.Errorf("%d of the light key's %d calls admitted in the window the heavy key had booked before it came, want at least 3", admitted, counted)
			}
			return
		}
	})
}

// newKeyAfterBookings books a heavy key's 40 calls, 20 now and 20 for the
// next window, under a global log of 20 a second, and then has a light key
// ask every 100 ms from 0.2 s on. It returns how many of the light key's
// calls from 1.3 s on (past the heavy key's first window and its margin)
// were admitted, of how many, and when the light key first asked.
func newKeyAfterBookings(t *testing.T, s *redistest.Server, try int) (admitted, counted int, first time.Duration) {
	t.Helper()
	p := policies.All(policies.SlidingLog{Limit: 20, Window: time.Second},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 20, Window: time.Second}})
	rdb := s.Client(t)
	forgetTimingAtEnd(t, rdb)
	name := strings.NewReplacer("/", "-").Replace(t.Name()) + "-" + strconv.Itoa(try)
	heavy, err := New(rdb, name, p, Options{Mode: Block})
	if err != nil {
		t.Fatal(err)
	}
	light, err := New(s.Client(t), name, p, Options{Mode: FailFast})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	var wg sync.WaitGroup
	for range 40 {
		wg.Go(func() {
			_, _ = Do(ctx, heavy, func(context.Context) (struct{}, error) { return struct{}{}, nil }, Key("heavy"))
		})
	}
	defer wg.Wait()
	waitBooked(t, heavy, 40, Key("heavy"))
	// The news goes to subscribed processes alone: one that missed it
	// would keep its bookings, which costs room, never the cap.
	waitSubscribed(t, rdb, heavy, 1)
	for at := 200 * time.Millisecond; at < 1950*time.Millisecond; at += 100 * time.Millisecond {
		time.Sleep(time.Until(start.Add(at)))
		if first == 0 {
			first = time.Since(start)
		}
		p, err := light.Acquire(ctx, Key("light"))
		if err != nil && !errors.Is(err, ErrLimited) {
			t.Fatal(err)
		}
		if at >= 1300*time.Millisecond {
			counted++
			if err == nil {
				admitted++
			}
		}
		if err == nil {
			p.Release()
		}
	}
	return admitted, counted, first
}

// A class's bookings given back leave its class's own log as they leave
// the quota's: given back by callers that gave up (cancel), the class
// books the same slots again; given back by calls that book again in the
// same script call (as a call whose slot came too late to start in does),
// each finds its own slot free. Left in the class's log, the units given
// back would fill it for a window, and the class's calls would book the
// window after. THROTTLE_OFF=class_give_back leaves them there.
func TestClasses_ABookingGivenBackLeavesItsClass(t *testing.T) {
	t.Parallel()
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		run := newClassRun(t, s, policies.SlidingLog{Limit: 20, Window: time.Second}, Options{})
		ctx := context.Background()
		// A class above holds its share; the batch class fills the rest
		// and books the next window's.
		run.try(Priority(5))
		run.try(Priority(5))
		run.fill()
		batch := callOf(nil)
		book := func(giveBack *result) (result, bool) {
			t.Helper()
			r, err := run.lim.acquire(ctx, batch, 1500*time.Millisecond, giveBack)
			if err != nil {
				t.Fatal(err)
			}
			return r, r.admitted && r.wait > 0
		}
		var booked []result
		for r, ok := book(nil); ok; r, ok = book(nil) {
			booked = append(booked, r)
		}
		if len(booked) < 10 {
			t.Fatalf("the batch class booked %d calls in the next window, want 10 at least", len(booked))
		}
		for _, r := range booked {
			run.lim.cancel(ctx, batch, r)
		}
		again := 0
		for i := range booked {
			r, ok := book(nil)
			if ok && r.slot() <= booked[len(booked)-1].slot() {
				again++
			}
			booked[i] = r
		}
		if again != len(booked) {
			t.Errorf("after giving back %d bookings, the class booked %d of them again in the same slots", len(booked), again)
		}
		moved := 0
		for _, r := range booked {
			if n, ok := book(&r); ok && n.slot() <= r.slot() {
				moved++
			}
		}
		if moved != len(booked) {
			t.Errorf("%d of %d calls booking again, each giving its booking back, found their slot free", moved, len(booked))
		}
	})
}

// Through the Transport, a request's Priority is its class fleet-wide, as
// a call's: a batch class fills a quota of 100 a second at every step of
// 100ms, and an interactive request of a higher priority, sent through
// the Transport of the same limiter, is admitted at once at every step
// from the second window on. First come, first served (ArrivalOrder) it
// is refused.
func TestClasses_TheTransportsPriorityIsItsRequestsClass(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		for _, arrival := range []bool{false, true} {
			t.Run("ArrivalOrder="+strconv.FormatBool(arrival), func(t *testing.T) {
				c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{ArrivalOrder: arrival})
				srv := newVendorServer(t, answer(http.StatusOK, "ok"))
				client := &http.Client{Transport: &Transport{
					Limiter:  c.lim,
					Priority: func(r *http.Request) int { n, _ := strconv.Atoi(r.URL.Query().Get("p")); return n },
				}}
				refused := 0
				for step := range 31 {
					resp, err := client.Get(srv.URL + "/?p=10")
					switch {
					case errors.Is(err, ErrLimited):
						if step > 10 {
							refused++
						}
					case err != nil:
						t.Fatal(err)
					default:
						readAll(t, resp)
					}
					c.fill(Priority(0))
					c.clock.Add(100 * time.Millisecond)
				}
				t.Logf("interactive requests refused after the first window: %d of 20", refused)
				if arrival && refused < 15 {
					t.Errorf("first come, first served: %d interactive requests refused of 20, want most of them", refused)
				}
				if !arrival && refused > 0 {
					t.Errorf("%d interactive requests refused after the first window, want none", refused)
				}
			})
		}
	})
}

// Thousands of classes leaving a rule's classes in one period (each key
// its own class under a rule every key shares) are dropped in one script
// call: 9,000 keys that called in one period, two windows later, leave
// the next call admitted and the classes' hash holding its key's class
// alone. Deleted in one command, their names overflowed the stack of
// Redis's Lua ("too many results to unpack"): the call failed, whatever
// OnRedisError said, and so did every call that read the classes until
// the hash expired.
func TestClasses_ThousandsOfClassesLeaveInOneScriptCall(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		c := newClassRun(t, s, policies.All(
			policies.SlidingLog{Limit: 100, Window: time.Second},
			policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}},
			// The script that reads 9,000 classes took over the default
			// second on miniredis under -race beside CI's other steps.
		), Options{RedisTimeout: 30 * time.Second})
		if !c.try(Key("first")) {
			t.Fatal("the first call of an empty quota refused")
		}
		rdb, classes := s.Client(t), c.lim.cfg.shared[2]+":cl"
		fields, err := rdb.HGetAll(ctx, classes).Result()
		if err != nil || len(fields) != 1 {
			t.Fatalf("the shared log's classes after one call: %v, %v; want its key's class alone", fields, err)
		}
		var name, value string
		for k, v := range fields {
			name, value = k, v
		}
		// The other keys' classes, each as the first one's, of the same period.
		const keys = 9000
		for i := 0; i < keys; i += 1000 {
			args := make([]any, 0, 2000)
			for j := i; j < i+1000; j++ {
				args = append(args, name+"-"+strconv.Itoa(j), value)
			}
			if err := rdb.HSet(ctx, classes, args...).Err(); err != nil {
				t.Fatal(err)
			}
		}
		c.clock.Add(2 * time.Second)
		if !c.try(Key("later")) {
			t.Fatalf("a call two windows after %d keys called refused", keys)
		}
		if n, err := rdb.HLen(ctx, classes).Result(); err != nil || n != 1 {
			t.Errorf("the shared log's classes hold %d fields (%v), want the last call's class alone", n, err)
		}
		if !c.try(Key("later")) {
			t.Error("the call after refused")
		}
	})
}

// A vendor's count is read against the quota's own count of the rule, not
// against the room a class hold leaves the call: a batch call that takes
// the last of its class's room, while the rule holds a share for a higher
// class, leaves the rule units free. So "none left until the reset" pauses
// the quota (the next interactive call is not sent), and "3 left" is
// passed on (the rule then counts 3 free, less the others' spare). Read
// against the class's room (Remaining 0), the first dropped the pause and
// the interactive call went out to be refused; the second was not passed.
func TestClasses_AVendorsCountIsReadAgainstTheRuleNotTheClass(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		// lastOfClass fills the batch class's room beside an interactive
		// call, and returns the permit of the batch's last call admitted.
		lastOfClass := func(t *testing.T) (*classRun, *Permit) {
			c := newClassRun(t, s, policies.SlidingLog{Limit: 100, Window: time.Second}, Options{})
			if !c.try(Priority(10)) {
				t.Fatal("an interactive call of an empty quota refused")
			}
			var last *Permit
			for range 200 {
				p, err := c.lim.Acquire(ctx, Priority(0))
				if errors.Is(err, ErrLimited) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				p.Release()
				last = p
			}
			u, err := c.lim.Usage(ctx)
			if err != nil || last == nil || last.remaining() != 0 || u.Rules[0].Remaining < 5 {
				t.Fatalf("the batch's last call: Remaining %d, the rule's %+v (%v); want its class full and the rule not", last.remaining(), u, err)
			}
			return c, last
		}
		t.Run("none left until the reset pauses", func(t *testing.T) {
			c, p := lastOfClass(t)
			pause, refused, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 0, Reset: time.Second}})
			if err != nil || refused || pause != time.Second {
				t.Errorf("Heard(200, none left for 1s) = %v, %v, %v; want 1s, false, nil", pause, refused, err)
			}
			if c.try(Priority(10)) {
				t.Error("an interactive call admitted after the vendor said none are left until its reset")
			}
		})
		t.Run("fewer left than the rule counts is passed on", func(t *testing.T) {
			c, p := lastOfClass(t)
			if _, _, err := p.Heard(ctx, Answer{Status: http.StatusOK, Requests: &Count{Remaining: 3, Reset: time.Second}}); err != nil {
				t.Fatal(err)
			}
			if u, err := c.lim.Usage(ctx); err != nil || u.Rules[0].Remaining > 3 {
				t.Errorf("after the vendor said 3 are left, the rule counts %+v (%v) free, want 3 at most", u, err)
			}
		})
	})
}

// A booking given back leaves its class under a rule per key too, where
// the class is its priority alone: a call of priority 5 and key "a",
// admitted and given back, leaves the rule's ':cl' field "5" at 0 units.
// Left there, the priority's demand would hold a share for a window.
func TestClasses_ABookingGivenBackLeavesItsPriorityUnderAPerKeyRule(t *testing.T) {
	t.Parallel() // a given clock: nothing in it depends on the machine's load
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		ctx := context.Background()
		run := newClassRun(t, s, policies.PerKey{Policy: policies.SlidingLog{Limit: 10, Window: time.Second}}, Options{})
		c := callOf([]CallOption{Priority(5), Key("a")})
		units := func() string {
			t.Helper()
			v, err := s.Client(t).HGet(ctx, run.lim.scopeFor(c).keys[2]+":cl", "5").Result()
			if err != nil {
				t.Fatalf("the rule's class of priority 5: %v", err)
			}
			return strings.Split(v, ":")[1]
		}
		r, err := run.lim.acquire(ctx, c, 0, nil)
		if err != nil || !r.admitted || r.noted == 0 {
			t.Fatalf("the call: %+v, %v; want it admitted and counted in its class", r, err)
		}
		if u := units(); u != "1" {
			t.Fatalf("its class holds %s units after the call, want 1", u)
		}
		run.lim.cancel(ctx, c, r)
		if u := units(); u != "0" {
			t.Errorf("its class holds %s units after the call was given back, want 0", u)
		}
	})
}
