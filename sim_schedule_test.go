package throttle

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// A schedule is one run of the simulation (sim_test.go): the fleet, its
// quota and options, the network, and the faults, as events at times from
// the run's start. A seed gives one schedule (drawSchedule); a failing one
// is shrunk to the fewest events and replicas that still fail.
type schedule struct {
	Seed     uint64
	Replicas int
	Workers  int // per replica
	Policy   simPolicy
	Mode     Mode
	OnError  OnRedisError
	Latency  []time.Duration // each replica's one-way delay to Redis
	Jitter   time.Duration   // added at random to each way of each chunk
	Vendor   time.Duration   // the one-way delay to the vendor, jitter aside
	Deadline time.Duration   // of each call's context; 0 for none
	MaxCost  int
	MinCost  int             `json:",omitempty"` // each call costs more than this, up to MaxCost
	Keys     int             // tenants the calls are for (a perkey policy), 0 for no key
	Join     []time.Duration // when each replica starts calling
	Length   time.Duration   // the run's length
	Events   []event
	Hold     time.Duration `json:",omitempty"` // the vendor's time on each call; 0 for 0 to 4 ms at random (5 to 50 under a concurrency limit)

	// The features (sim_features_test.go); schedules kept from before them
	// have none but two classes.
	Classes      int          `json:",omitempty"` // priority classes, by worker; 0 for two
	ArrivalOrder bool         `json:",omitempty"` // Options.ArrivalOrder
	Skew         bool         `json:",omitempty"` // the first key has three calls in four
	Settle       string       `json:",omitempty"` // lower, higher or both: each cost an estimate settled after the call
	Cancel       bool         `json:",omitempty"` // a call in five given back before it leaves
	Model        *vendorModel `json:",omitempty"` // how the vendor counts and answers (sim_vendor_test.go); nil: a strict count
	FoundBy      string       `json:",omitempty"` // pause or usage: the script a replica runs right after each flush or restart, which finds the loss; "": the next call's
	// Interactive, when set, makes the last replica run no workers but
	// start a call of priority 10 every Interactive, each in a goroutine
	// of its own (bench/priority's interactive calls).
	Interactive time.Duration `json:",omitempty"`
}

// simPolicy is the quota's policy, in words a schedule can print.
type simPolicy struct {
	Kind   string // log, counter, bucket, concurrency, all, perkey, percall, units, shared
	Limit  int
	Window time.Duration
	Keyed  bool `json:",omitempty"` // a PerKey rule beside, at the whole limit: the keys' fair shares, no limit of their own
	Long   bool `json:",omitempty"` // perkey: each key's rule counts over five windows (a daily rule beside a per-minute one)
	Spread bool `json:",omitempty"` // a log or counter's windows spread (policies.Spread: no tenth takes more than a sixth)
}

// event is a fault, or a change of the fleet, at a time of the run.
type event struct {
	At      time.Duration
	Kind    string        // kill, flush, scriptflush, step, freeze, cut, failover, stall, leave, deploy, close
	Replica int           // for cut, stall, leave, close
	For     time.Duration // how long it lasts; for step, how far (negative: back); for failover, how far behind the copy is
}

func (s schedule) String() string {
	b, _ := json.Marshal(s)
	return string(b)
}

// policy returns the schedule's policy.
func (p simPolicy) policy() policies.Policy {
	if p.Spread {
		q := p
		q.Spread = false
		return policies.Spread{Policy: q.policy()}
	}
	if p.Keyed {
		// Calls may name a key only when a PerKey rule counts keys; one
		// at the whole limit limits no key, and leaves the keys' fair
		// shares (docs/PROTOCOL.md, 3.13) to the rules every key shares.
		q := p
		q.Keyed = false
		return policies.All(q.policy(), policies.PerKey{Policy: policies.SlidingLog{Limit: p.Limit, Window: p.Window}})
	}
	log := policies.SlidingLog{Limit: p.Limit, Window: p.Window}
	switch p.Kind {
	case "counter":
		return policies.SlidingCounter{Limit: p.Limit, Window: p.Window}
	case "bucket":
		return policies.TokenBucket{Rate: p.Limit, Per: p.Window, Burst: p.Limit}
	case "concurrency":
		return policies.Concurrency{Max: p.Limit, Lease: 10 * p.Window}
	case "all":
		return policies.All(log, policies.SlidingLog{Limit: 3 * p.Limit, Window: 5 * p.Window})
	case "perkey":
		return policies.All(log, policies.PerKey{Policy: policies.SlidingLog{Limit: max(p.Limit/2, 1), Window: p.keyWindow()}})
	case "percall":
		return policies.All(policies.PerCall{Policy: log}, policies.SlidingLog{Limit: 4 * p.Limit, Window: p.Window})
	case "units":
		return unitsPolicy(p.Limit, p.Window)
	case "shared":
		return sharedPolicy(p.Limit, p.Window)
	}
	return log
}

// keyWindow returns the window of the perkey kind's rule for each key.
func (p simPolicy) keyWindow() time.Duration {
	if p.Long {
		return 5 * p.Window
	}
	return p.Window
}

// longest returns the policy's longest window.
func (p simPolicy) longest() time.Duration {
	switch p.Kind {
	case "perkey":
		return p.keyWindow()
	case "all":
		return 5 * p.Window
	case "concurrency":
		return 10 * p.Window
	}
	return p.Window
}

// drawSchedule returns the schedule of seed. Most are small, since a
// run's cost is its script calls; a few are fleets of up to 200 replicas.
func drawSchedule(seed uint64) schedule {
	rng := rand.New(rand.NewPCG(seed, 0x7468726f74746c65))
	pick := func(xs ...int) int { return xs[rng.IntN(len(xs))] }
	s := schedule{Seed: seed}
	s.Replicas = pick(1, 2, 2, 3, 3, 4, 5)
	if rng.IntN(40) == 0 {
		s.Replicas = pick(20, 50, 200)
	}
	s.Workers = pick(1, 2, 4, 8)
	if s.Replicas > 10 {
		s.Workers = 1
	}
	kinds := []string{"log", "log", "log", "counter", "bucket", "concurrency", "all", "perkey", "percall"}
	s.Policy = simPolicy{Kind: kinds[rng.IntN(len(kinds))], Limit: pick(5, 10, 20, 50), Window: time.Duration(pick(100, 200, 500, 1000)) * time.Millisecond}
	s.Mode = []Mode{Block, Block, Block, FailFast, Queue}[rng.IntN(5)]
	s.OnError = []OnRedisError{FailClosed, FailClosed, Local, FailOpen}[rng.IntN(4)]
	if s.OnError == Local {
		s.Policy.Limit = max(s.Policy.Limit, 2*s.Replicas)
	}
	s.MaxCost = 1
	if s.Policy.Kind != "concurrency" && rng.IntN(3) == 0 {
		s.MaxCost = max(1, s.Policy.Limit/pick(4, 8))
	}
	if s.Policy.Kind == "perkey" {
		s.Keys = pick(2, 3)
	}
	drawFeatures(seed, &s)
	far := time.Duration(pick(0, 0, 1, 5, 25, 50)) * time.Millisecond
	for range s.Replicas {
		s.Latency = append(s.Latency, far+time.Duration(rng.IntN(3))*time.Millisecond)
		s.Join = append(s.Join, time.Duration(rng.IntN(3))*s.Policy.Window/2)
	}
	s.Jitter = time.Duration(pick(0, 0, 1, 2)) * time.Millisecond
	s.Vendor = time.Duration(pick(0, 1, 10)) * time.Millisecond
	if rng.IntN(3) == 0 {
		s.Deadline = time.Duration(pick(20, 50, 200, 500, 2000, 10000)) * time.Millisecond
	}
	s.Length = max(6*s.Policy.Window, 3*time.Second)
	drawVendor(seed, &s)
	s.Events = drawEvents(rng, s)
	s.Events = append(s.Events, drawDeploy(seed, s)...)
	s.Events = append(s.Events, drawClose(seed, s)...)
	s.Length = s.needed()
	return s
}

// needed returns how long s must run for its checks: the length drawn, cut
// to the end of its last fault and the time recovered allows after it (and
// five windows more where efficiency reads the fleet after it). A
// run without faults is at its steady state within a few windows, and a
// concurrency limit's window is only its lease: more of either is more
// script calls that teach nothing new.
func (s schedule) needed() time.Duration {
	need := max(1500*time.Millisecond, s.Deadline+500*time.Millisecond)
	if s.Policy.Kind != "concurrency" {
		need = max(need, 6*s.Policy.Window)
	}
	for _, e := range s.Events {
		need = max(need, e.end()+s.recovery())
		if s.saturates() {
			need = max(need, e.end()+s.recovery()+5*s.Policy.Window) // for efficiency
		}
	}
	if s.Model != nil && s.Model.Lower > 0 {
		need = max(need, s.Model.Raise+4*s.Policy.Window)
	}
	return min(s.Length, need)
}

// drawDeploy returns, for one schedule in four of a log or counter policy,
// a deploy that changes the rule's kind (a log to a counter, or back) over
// the same limit and windows, after the other events: a rule of another
// kind starts on a key of its own, empty, while the vendor still counts the
// calls the old one admitted. It draws from a stream of its own, so that
// the other draws of a seed stay what they were.
func drawDeploy(seed uint64, s schedule) []event {
	rng := rand.New(rand.NewPCG(seed, 0x6465706c6f79))
	if s.Policy.Kind != "log" && s.Policy.Kind != "counter" || rng.IntN(4) != 0 {
		return nil
	}
	at := max(s.Length/5, slices.Max(s.Join)+20*slices.Max(s.Latency)+100*time.Millisecond)
	if n := len(s.Events); n > 0 {
		at = s.Events[n-1].end() + s.Policy.longest()
	}
	if at >= s.Length*3/4 {
		return nil
	}
	return []event{{At: at + time.Duration(rng.Int64N(int64(s.Length/5))), Kind: "deploy"}}
}

// deployed returns the policy a deploy event changes s's to.
func (s schedule) deployed() simPolicy {
	p := s.Policy
	p.Kind = map[string]string{"log": "counter", "counter": "log"}[p.Kind]
	return p
}

// drawEvents draws up to three faults, apart from each other, after every
// replica's first script call: a replica new to the quota that meets an
// emptied Redis before the replicas that knew it call again is a case the
// README leaves open. A first call takes a few round trips more than the
// others (a dial, the handshake, the script loaded).
func drawEvents(rng *rand.Rand, s schedule) []event {
	var evs []event
	at := max(s.Length/5, slices.Max(s.Join)+20*slices.Max(s.Latency)+100*time.Millisecond)
	for n := rng.IntN(4); n > 0 && at < s.Length*3/4; n-- {
		e := event{At: at + time.Duration(rng.Int64N(int64(s.Length/5))), Replica: rng.IntN(s.Replicas)}
		switch k := rng.IntN(10); k {
		case 0, 1:
			e.Kind, e.For = "kill", time.Duration(100+rng.IntN(3000))*time.Millisecond
		case 2:
			e.Kind = "flush"
		case 3:
			e.Kind = "scriptflush"
		case 4:
			// Steps beyond the margin count as losses; those within it, a
			// few milliseconds, only shorten windows.
			e.Kind, e.For = "step", []time.Duration{-time.Hour, -time.Second, 3 * time.Millisecond, time.Second, time.Hour}[rng.IntN(5)]
		case 5:
			e.Kind, e.For = "freeze", time.Duration(100+rng.IntN(2500))*time.Millisecond
		case 6:
			e.Kind, e.For = "cut", time.Duration(100+rng.IntN(2500))*time.Millisecond
		case 7:
			e.Kind, e.For = "failover", time.Duration(rng.IntN(300))*time.Millisecond
		case 8:
			e.Kind, e.For = "stall", time.Duration(50+rng.IntN(500))*time.Millisecond
		case 9:
			if s.Replicas > 1 {
				e.Kind = "leave"
			} else {
				e.Kind = "scriptflush"
			}
		}
		evs = append(evs, e)
		at = e.end() + s.Policy.longest()
	}
	return evs
}

// shrink returns smaller versions of s: each with one event fewer, one
// replica fewer, fewer workers, or no deadline.
func (s schedule) shrink() []schedule {
	var out []schedule
	for i := range s.Events {
		c := s
		c.Events = slices.Delete(slices.Clone(s.Events), i, i+1)
		out = append(out, c)
	}
	if s.Replicas > 1 {
		c := s
		c.Replicas--
		c.Latency, c.Join = s.Latency[:c.Replicas], s.Join[:c.Replicas]
		c.Events = slices.DeleteFunc(slices.Clone(s.Events), func(e event) bool {
			return e.Replica >= c.Replicas && e.Kind != "kill" && e.Kind != "flush" && e.Kind != "deploy"
		})
		for i := range c.Events {
			// A fault of the whole server stays; the replica it names (the
			// one that holds a permit across it, holdAcross) must exist.
			c.Events[i].Replica = min(c.Events[i].Replica, c.Replicas-1)
		}
		if c.OnError != Local || c.Policy.Limit >= 2*c.Replicas {
			out = append(out, c)
		}
	}
	if s.Workers > 1 {
		c := s
		c.Workers /= 2
		out = append(out, c)
	}
	if s.Deadline > 0 {
		c := s
		c.Deadline = 0
		out = append(out, c)
	}
	return out
}

// minimal shrinks a failing schedule s while fails says a smaller one
// still fails, and returns the smallest found and how many runs it took.
func minimal(s schedule, fails func(schedule) bool) (schedule, int) {
	runs := 0
	for progress := true; progress && runs < 60; {
		progress = false
		for _, c := range s.shrink() {
			runs++
			if fails(c) {
				s, progress = c, true
				break
			}
		}
	}
	return s, runs
}

// describe returns one line per event, for a failure's report.
func (s schedule) describe() string {
	out := fmt.Sprintf("%d replicas × %d workers, %s limit %d per %v, %v, %v, Redis %v away ±%v, vendor %v away, deadline %v, cost ≤ %d, keys %d, %v long",
		s.Replicas, s.Workers, s.Policy.Kind, s.Policy.Limit, s.Policy.Window, s.Mode, s.OnError, s.Latency, s.Jitter, s.Vendor, s.Deadline, s.MaxCost, s.Keys, s.Length)
	out += fmt.Sprintf("\n  %d classes, arrival order %v, skewed keys %v, settle %q, cancel %v", s.classes(), s.ArrivalOrder, s.Skew, s.Settle, s.Cancel)
	if s.Policy.Long {
		out += fmt.Sprintf(", each key's rule over %v", s.Policy.keyWindow())
	}
	if s.FoundBy != "" {
		out += fmt.Sprintf(", a flush or restart found by %s", s.FoundBy)
	}
	if s.Model != nil {
		out += fmt.Sprintf("\n  vendor %+v", *s.Model)
	}
	for _, e := range s.Events {
		out += fmt.Sprintf("\n  at %v: %s (replica %d, %v)", e.At, e.Kind, e.Replica, e.For)
	}
	return out
}
