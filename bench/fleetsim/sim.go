package main

import (
	"container/heap"
	"math/rand/v2"
	"slices"
)

// Fleet is what one simulated run puts on the quota: processes of limiters
// of workers, as a conditions scenario does, and the quota's policy.
type Fleet struct {
	Name      string // the row's name: a scenario's, or the number of limiters
	Processes int    // processes; the limiters of one share its timing
	Limiters  int    // limiters per process, each with its own Redis client
	Workers   int    // workers per limiter, each calling Do in a loop
	Limit     int    // the quota's limit per window
	Window    int64  // µs
	Margin    int64  // µs, the configured margin
	Duration  int64  // µs the workers run
}

// replicas returns how many limiters the fleet has in all.
func (f Fleet) replicas() int { return f.Processes * f.Limiters }

// Costs are the times the model is driven by, in microseconds. See the
// package comment for where each value comes from.
type Costs struct {
	NetOneWay      int64   // loopback, one way
	ScriptFixed    float64 // Redis's work per script call, whatever it decides
	ScriptPerCall  float64 // and per call it decides
	ScriptPerEntry float64 // and per log entry its searches read
	Cores          float64 // the machine's cores, shared by Redis and the client
	ClientScript   float64 // client CPU to send a script call and to read its reply, half each
	ClientSend     float64 // CPU from fn's start to the request's arrival at the vendor
	ClientReturn   float64 // CPU for the vendor's answer to reach the worker again
	ClientWake     float64 // CPU for a sleeping worker to wake
	ClientConnect  float64 // CPU for a limiter to open its subscription's connection
	RedisConnect   float64 // Redis's work to accept it, answer HELLO and SUBSCRIBE
	VendorWork     int64   // the vendor's time to answer an accepted call
	FailurePause   int64   // a worker whose call failed pauses this long
	Jitter         float64 // each CPU cost varies uniformly by ± this fraction
}

const (
	// maxBatch is batch.go's: the most calls one script call decides.
	maxBatch = 32
	// maxRebooks is waiter.go's.
	maxRebooks = 3
	// minGuardedMargin is waiter.go's: under it, no late-start guard.
	minGuardedMargin = 2000
)

// Result is what one simulated run measured, as the conditions program
// measures it.
type Result struct {
	Fleet       Fleet   // what ran
	Admitted    int     // calls the limiters let through
	Utilization float64 // the vendor's window count over its cap, averaged
	Scripts     int     // script calls, cancels included
	WaitP50     int64   // µs from asking Do to fn's start
	WaitP99     int64   // µs, likewise
	LateFails   int     // calls that failed for starting too late, three times
	MaxInWindow int     // the most calls the vendor saw in one window

	RoundTripP50, RoundTripP99 int64   // of script calls, as the limiters see them
	WayP50, WayP99             int64   // from fn's start to the vendor
	RedisMicros                float64 // Redis's mean time per script
	RedisBusy                  float64 // the share of the run Redis spent running scripts
	InRedisP50, InRedisP99     int64   // from a script call's arrival at Redis to its reply leaving
	BiggestTurn                int     // the most requests Redis served in one turn of its loop
	Paced                      bool    // the log was paced at the end

	// Timeline counts, for each timeSlice of the run, the calls that
	// arrived at the vendor, the script calls, and the calls booked again
	// for starting late.
	Timeline []Slice
}

// timeSlice is the width of a Slice of the timeline, in µs.
const timeSlice = 250_000

// Slice is a quarter second of a run.
type Slice struct {
	Arrivals, Scripts, Rebooks int   // calls at the vendor, script calls, calls booked again
	Margin                     int64 // the margin a script of the slice last gave its calls
	Paced                      bool  // the slice's last script paced the log
}

// ScriptsPerAdmitted is the script calls per admitted call.
func (r Result) ScriptsPerAdmitted() float64 {
	if r.Admitted == 0 {
		return 0
	}
	return float64(r.Scripts) / float64(r.Admitted)
}

// event is something that happens at a time; seq orders events of one
// time by when they were scheduled, so that a run depends on its seed alone.
type event struct {
	at  int64
	seq int64
	fn  func()
}

type events []event

func (e events) Len() int { return len(e) }
func (e events) Less(i, j int) bool {
	return e[i].at < e[j].at || e[i].at == e[j].at && e[i].seq < e[j].seq
}
func (e events) Swap(i, j int) { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)   { *e = append(*e, x.(event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

type process struct {
	fast     int64 // the least recvd - done of the replies so far
	haveFast bool
}

type limiter struct {
	id        int // its member prefix in the log (the limiter's id)
	proc      *process
	listening bool   // it has subscribed to the quota's news
	inFlight  bool   // a script call of it is on its way
	lane      []*ask // calls waiting for the next script call
	lates     [lateBuckets]int
}

type worker struct {
	lim     *limiter
	asked   int64 // when the current Do began
	rebooks int
	lead    int64
	give    *booking
}

// ask is one call waiting for a decision.
type ask struct {
	w       *worker
	id      int64
	maxWait int64
	lead    int64
	give    *booking
}

// request is one script call.
type request struct {
	lim     *limiter // nil for a cancel
	asks    []*ask
	report  [lateBuckets]int
	gives   []booking
	sent    int64 // local time the limiter began sending it
	rep     scriptReply
	done    int64 // Redis time the script ended
	arrived int64 // local time it reached Redis

	// then, for a limiter's subscription (news.go's listen), is what the
	// limiter does once Redis has answered: send its first script call.
	then func()
}

type sim struct {
	f     Fleet
	c     Costs
	rng   *rand.Rand
	now   int64
	queue events
	seq   int64
	q     *quota
	ids   int64
	// offset is Redis's clock minus the local one: the run starts at an
	// arbitrary phase of the timing period.
	offset int64

	inbox     []*request
	redisBusy bool
	cpuBusy   bool   // the client's CPU runs a task
	tasks     []task // the client's work waiting for it

	// What the run measured.
	admitted, scripts, lateFails int
	waits, trips, ways, inRedis  []int64
	arrivals                     []int64
	redisWork                    float64
	biggestTurn                  int
	timeline                     []Slice
}

// slice returns the timeline's slice of now.
func (s *sim) slice() *Slice {
	i := int(s.now / timeSlice)
	for len(s.timeline) <= i {
		s.timeline = append(s.timeline, Slice{})
	}
	return &s.timeline[i]
}

// Simulate runs fleet f with costs c, deterministically for seed.
func Simulate(f Fleet, c Costs, seed uint64) Result {
	s := &sim{f: f, c: c, rng: rand.New(rand.NewPCG(seed, 0x5eed)), q: newQuota(f.Limit, f.Window, f.Margin)}
	s.offset = 1_700_000_000_000_000 + s.rng.Int64N(timingPeriod)
	var workers []*worker
	nlim := 0
	for range f.Processes {
		p := &process{}
		for range f.Limiters {
			nlim++
			l := &limiter{id: nlim, proc: p}
			for range f.Workers {
				workers = append(workers, &worker{lim: l})
			}
		}
	}
	// Every worker asks at once, in an order the scheduler picks.
	s.rng.Shuffle(len(workers), func(i, j int) { workers[i], workers[j] = workers[j], workers[i] })
	for _, w := range workers {
		s.do(w)
	}
	for s.queue.Len() > 0 {
		e := heap.Pop(&s.queue).(event)
		s.now = e.at
		e.fn()
	}
	return s.result()
}

func (s *sim) at(t int64, fn func()) {
	s.seq++
	heap.Push(&s.queue, event{at: t, seq: s.seq, fn: fn})
}

// cpu runs work of cost µs on the client's share of the machine, first
// come first served, and then fn. While Redis runs scripts it holds a core,
// and the client has the others.
func (s *sim) cpu(cost float64, fn func()) {
	cost *= 1 + s.c.Jitter*(2*s.rng.Float64()-1)
	s.tasks = append(s.tasks, task{cost, fn})
	if !s.cpuBusy {
		s.nextTask()
	}
}

// task is work waiting for the client's CPU.
type task struct {
	cost float64
	fn   func()
}

// nextTask runs the next task, if any, at the rate the cores left to the
// client allow as it starts.
func (s *sim) nextTask() {
	if len(s.tasks) == 0 {
		s.cpuBusy = false
		return
	}
	t := s.tasks[0]
	s.tasks = s.tasks[1:]
	s.cpuBusy = true
	rate := s.c.Cores
	if s.redisBusy {
		rate--
	}
	s.at(s.now+int64(t.cost/rate), func() {
		t.fn()
		s.nextTask()
	})
}

// redisNow is Redis's clock.
func (s *sim) redisNow(local int64) int64 { return local + s.offset }

// do begins a call of Do.
func (s *sim) do(w *worker) {
	if s.now >= s.f.Duration {
		return
	}
	w.asked, w.rebooks, w.lead, w.give = s.now, 0, 0, nil
	s.ask(w)
}

// ask asks Redis for a decision, through the worker's limiter.
func (s *sim) ask(w *worker) {
	if s.now >= s.f.Duration {
		return // the run's context ended: not an error
	}
	s.ids++
	a := &ask{w: w, id: s.ids, maxWait: s.f.Duration - s.now, lead: w.lead, give: w.give}
	w.give = nil
	l := w.lim
	if l.inFlight {
		l.lane = append(l.lane, a)
		return
	}
	l.inFlight = true
	s.send(l, []*ask{a})
}

// send sends one script call for batch.
func (s *sim) send(l *limiter, batch []*ask) {
	if !l.listening {
		// A limiter's first call subscribes it to the quota's news, on a
		// connection of its own, before it asks (news.go's listen).
		l.listening = true
		r := &request{then: func() { s.send(l, batch) }}
		s.cpu(s.c.ClientConnect, func() { s.arrive(r) })
		return
	}
	r := &request{lim: l, asks: batch, report: l.lates, sent: s.now}
	l.lates = [lateBuckets]int{}
	for _, a := range batch {
		if a.give != nil {
			r.gives = append(r.gives, *a.give)
		}
	}
	s.post(r)
}

// cancel gives a booking back in a script call of its own.
func (s *sim) cancel(b booking) {
	s.post(&request{gives: []booking{b}, sent: s.now})
}

// post sends r to Redis.
func (s *sim) post(r *request) {
	s.scripts++
	s.slice().Scripts++
	s.cpu(s.c.ClientScript/2, func() { s.arrive(r) })
}

// arrive sends r on its way to Redis.
func (s *sim) arrive(r *request) {
	s.at(s.now+s.c.NetOneWay, func() {
		r.arrived = s.now
		s.inbox = append(s.inbox, r)
		if !s.redisBusy {
			s.turn()
		}
	})
}

// turn is one turn of Redis's event loop: it runs every script that has
// arrived, one after the other, and writes their replies at the end.
func (s *sim) turn() {
	batch := s.inbox
	s.inbox = nil
	s.redisBusy = true
	s.biggestTurn = max(s.biggestTurn, len(batch))
	t := s.now
	for _, r := range batch {
		if r.then != nil {
			work := s.c.RedisConnect
			s.redisWork += work
			t += int64(work)
			continue
		}
		var calls []scriptCall
		for _, a := range r.asks {
			calls = append(calls, scriptCall{id: a.id, lim: a.w.lim.id, maxWait: a.maxWait, lead: a.lead})
		}
		r.rep = s.q.acquire(s.redisNow(t), &r.report, r.gives, calls)
		work := s.c.ScriptFixed + s.c.ScriptPerCall*float64(len(calls)) + s.c.ScriptPerEntry*float64(r.rep.read)
		s.redisWork += work
		t += int64(work)
		r.done = s.redisNow(t)
		sl := s.slice()
		sl.Margin, sl.Paced = r.rep.margin, r.rep.paced
	}
	s.at(t, func() {
		for _, r := range batch {
			if r.then != nil {
				s.at(s.now+s.c.NetOneWay, r.then)
				continue
			}
			s.inRedis = append(s.inRedis, s.now-r.arrived)
			s.at(s.now+s.c.NetOneWay, func() {
				s.cpu(s.c.ClientScript/2, func() { s.reply(r) })
			})
		}
		s.redisBusy = false
		if len(s.inbox) > 0 {
			s.turn()
		}
	})
}

// reply hands a script's decisions to its calls, and sends the calls that
// queued meanwhile.
func (s *sim) reply(r *request) {
	l := r.lim
	if l == nil {
		return // a cancel
	}
	s.trips = append(s.trips, s.now-r.sent)
	p := l.proc
	if off := s.now - r.done; !p.haveFast || off < p.fast {
		p.fast, p.haveFast = off, true
	}
	for i, a := range r.asks {
		s.decided(a, r, r.rep.calls[i])
	}
	l.inFlight = false
	if len(l.lane) > 0 {
		n := min(len(l.lane), maxBatch)
		batch := l.lane[:n:n]
		l.lane = l.lane[n:]
		l.inFlight = true
		s.send(l, batch)
	}
}

// admission is a call's slot, as waiter.go holds it.
type admission struct {
	id     int64
	slot   int64 // Redis time
	starts int64 // its slot, or the end of the script if later (result.startsAt)
	margin int64
}

// decided is waiter.go's wait once a decision is in.
func (s *sim) decided(a *ask, r *request, d decision) {
	w := a.w
	if !d.admitted {
		return // the slot lies past the run's end: the worker stops
	}
	slot := r.rep.now + d.wait
	adm := admission{id: a.id, slot: slot, starts: max(slot, r.done), margin: r.rep.margin}
	late, tooLate := s.late(w, adm)
	if !tooLate && d.wait > 0 {
		if s.now+d.wait > s.f.Duration {
			// Past the context's deadline: given back, and the worker stops.
			s.cancel(booking{adm.id, adm.slot})
			return
		}
		// Until the slot by the fastest reply's clock (timing.wakeIn), no
		// longer than the whole wait from the reply's arrival.
		wake := s.now + d.wait
		if p := w.lim.proc; p.haveFast {
			wake = max(s.now, min(wake, adm.starts+p.fast))
		}
		wakeUp := func() {
			s.cpu(s.c.ClientWake, func() {
				late, tooLate := s.late(w, adm)
				s.settle(w, adm, late, tooLate, false)
			})
		}
		if lead := min((wake-s.now)/2, 100_000); w.lim.proc.haveFast && lead > 0 {
			// Most of the way, then to the slot by the fastest reply seen
			// by then (waiter.go's sleepToSlot).
			s.at(wake-lead, func() {
				p := w.lim.proc
				s.at(max(s.now, min(wake, adm.starts+p.fast)), wakeUp)
			})
			return
		}
		s.at(wake, wakeUp)
		return
	}
	s.settle(w, adm, late, tooLate, tooLate)
}

// settle starts a call that is on time, and books again one that is not.
func (s *sim) settle(w *worker, adm admission, late int64, tooLate, replyLate bool) {
	if !tooLate {
		s.start(w, adm)
		return
	}
	if w.rebooks++; w.rebooks > maxRebooks {
		s.cancel(booking{adm.id, adm.slot})
		s.lateFails++
		s.at(s.now+s.c.FailurePause, func() { s.do(w) })
		return
	}
	s.slice().Rebooks++
	if replyLate {
		w.lead += late
	}
	w.give = &booking{adm.id, adm.slot}
	s.ask(w)
}

// late is waiter.go's late: how late after its slot the call would start
// now, beyond the usual delay of Redis's replies, and whether that is more
// than half the margin.
func (s *sim) late(w *worker, adm admission) (int64, bool) {
	if adm.margin < minGuardedMargin || !w.lim.proc.haveFast {
		return 0, false
	}
	late := s.now - adm.starts - w.lim.proc.fast
	if late <= adm.margin/2 {
		return late, false
	}
	w.lim.lates[lateBucket(late)]++
	return late, true
}

// start runs fn: the call goes to the vendor, and the worker calls Do again
// once it is answered.
func (s *sim) start(w *worker, adm admission) {
	if w.lim.proc.haveFast {
		late := s.now - adm.starts - w.lim.proc.fast
		w.lim.lates[lateBucket(late)]++
	}
	s.admitted++
	s.waits = append(s.waits, s.now-w.asked)
	started := s.now
	s.cpu(s.c.ClientSend, func() {
		s.arrivals = append(s.arrivals, s.now)
		s.slice().Arrivals++
		s.ways = append(s.ways, s.now-started)
		s.at(s.now+s.c.VendorWork, func() {
			s.cpu(s.c.ClientReturn, func() { s.do(w) })
		})
	})
}

func (s *sim) result() Result {
	res := Result{
		Fleet: s.f, Admitted: s.admitted, Scripts: s.scripts, LateFails: s.lateFails,
		BiggestTurn: s.biggestTurn, Timeline: s.timeline,
	}
	slices.Sort(s.arrivals)
	res.Utilization = utilization(s.arrivals, s.f.Limit, s.f.Window)
	res.MaxInWindow = maxInWindow(s.arrivals, s.f.Window)
	res.WaitP50, res.WaitP99 = percentiles(s.waits)
	res.RoundTripP50, res.RoundTripP99 = percentiles(s.trips)
	res.WayP50, res.WayP99 = percentiles(s.ways)
	res.InRedisP50, res.InRedisP99 = percentiles(s.inRedis)
	if s.scripts > 0 {
		res.RedisMicros = s.redisWork / float64(s.scripts)
	}
	res.RedisBusy = s.redisWork / float64(s.now)
	end := s.redisNow(s.now)
	res.Paced = s.q.margins(s.q.fleetSpread(end), s.q.heldSpread(end), s.q.wh > end).pace > 0
	return res
}

// utilization is the conditions program's: the vendor's window count,
// averaged over every millisecond from the end of its first window to its
// last arrival, against its cap. at is sorted.
func utilization(at []int64, limit int, window int64) float64 {
	if len(at) < 2 {
		return 0
	}
	var sum, n float64
	lo, hi := 0, 0
	for t := at[0] + window; t <= at[len(at)-1]; t += 1000 {
		for hi < len(at) && at[hi] <= t {
			hi++
		}
		for lo < hi && at[lo] <= t-window {
			lo++
		}
		sum += float64(hi - lo)
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / n / float64(limit)
}

// maxInWindow is the most arrivals in one half-open window (t-window, t].
func maxInWindow(at []int64, window int64) int {
	most, lo := 0, 0
	for hi, t := range at {
		for at[lo] <= t-window {
			lo++
		}
		most = max(most, hi-lo+1)
	}
	return most
}

// percentiles returns the nearest-rank p50 and p99 of xs, which it sorts.
func percentiles(xs []int64) (int64, int64) {
	if len(xs) == 0 {
		return 0, 0
	}
	slices.Sort(xs)
	at := func(q float64) int64 {
		i := int(q*float64(len(xs))+0.999999) - 1
		return xs[min(max(i, 0), len(xs)-1)]
	}
	return at(0.50), at(0.99)
}
