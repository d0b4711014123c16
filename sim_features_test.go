package throttle

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// The features a schedule draws beside its policy, mode and faults (see
// drawFeatures for how often each is drawn): priority classes, keys of
// uneven demand under a rule they share (the fair shares), first come,
// first served, costs that are estimates settled after the call, calls
// given back, named units, a rule shared by two quotas, and a replica that
// closes its limiter and drains it.

// drawFeatures draws s's features from a stream of their own, so that the
// rest of a seed's schedule stays what it was. It runs before the faults
// are drawn, since a shared rule or units change the policy's kind.
//
// How often each is drawn, per schedule:
//   - Classes: 1, 2 or 3 priority classes, a third each (2: as before);
//     first come, first served (ArrivalOrder) in one in four.
//   - Keys under a rule every key shares (log, counter, bucket, all): one
//     schedule in four of those, two or three keys; in half of the keyed
//     schedules (perkey too), the first key asks for three calls in four.
//   - Units (a quota of calls, input and output units): one in ten;
//     Shared (two quotas with one shared rule): one in ten.
//   - Settle: one in three of the schedules of a log, counter, all,
//     perkey, units or shared policy, their costs raised to up to a fifth
//     of the limit: every call's cost an estimate, settled lower, higher,
//     or either way (a third each) once the vendor answered.
//   - Cancel: one in four: a call in five is given back before it leaves.
//   - Close: one in four (drawClose): a replica closes its limiter mid-run
//     and drains it.
//   - A per-key rule over five windows (simPolicy.Long): half the perkey
//     schedules.
//   - Spread (policies.Spread, no tenth of a window takes more than a
//     sixth of its limit): one in eight of the log and counter schedules,
//     their costs at most a sixth of the limit.
//   - The script that finds a flush or a restart without its data
//     (FoundBy): in a sixth each, Pause (feedback.lua) and Usage
//     (usage.lua) right after it, and the Settle (settle.lua) or Cancel
//     (cancel.lua) of a call acquired before it; else the next call's
//     acquire.
func drawFeatures(seed uint64, s *schedule) {
	rng := rand.New(rand.NewPCG(seed, 0x6665617475726573))
	s.Classes = 1 + rng.IntN(3)
	s.ArrivalOrder = rng.IntN(4) == 0
	switch rng.IntN(10) {
	case 0:
		if s.Policy.Kind != "concurrency" {
			s.Policy.Kind = "units"
		}
	case 1:
		// Local cannot divide a rule other quotas share (New says so).
		if s.Policy.Kind != "concurrency" && s.OnError != Local {
			s.Policy.Kind = "shared"
		}
	}
	switch s.Policy.Kind {
	case "log", "counter", "bucket", "all":
		if rng.IntN(4) == 0 {
			s.Keys, s.Policy.Keyed = 2+rng.IntN(2), true
		}
	}
	if s.Keys > 0 {
		s.Skew = rng.IntN(2) == 0
		s.Policy.Keyed = s.Policy.Kind != "perkey"
	}
	switch s.Policy.Kind {
	case "log", "counter", "all", "perkey", "units", "shared":
		if rng.IntN(3) == 0 {
			s.Settle = []string{"lower", "higher", "both"}[rng.IntN(3)]
			s.MaxCost = max(s.MaxCost, 2, s.Policy.Limit/5)
		}
	}
	s.Cancel = rng.IntN(4) == 0
	if s.Policy.Kind == "perkey" && rng.IntN(2) == 0 {
		s.Policy.Long = true
	}
	s.FoundBy = []string{"", "", "pause", "usage", "settle", "cancel"}[rng.IntN(6)]
	// Under Local, each replica keeps its share of a part (New says so).
	local := s.OnError == Local && s.Policy.Limit/6 < s.Replicas
	if (s.Policy.Kind == "log" || s.Policy.Kind == "counter") && rng.IntN(8) == 0 && !local {
		// A call may cost up to what a part admits.
		s.Policy.Spread = true
		s.MaxCost = min(s.MaxCost, s.Policy.smallest())
	}
}

// holdAcross returns, when s's losses are found by settle or cancel and e
// is a flush or a kill, a permit replica r acquired in the two windows
// before e and holds across it (its call never reaches the vendor), or nil
// when none was admitted in that time.
func (s schedule) holdAcross(ctx context.Context, e event, r *simReplica, start time.Time) *Permit {
	if s.FoundBy != "settle" && s.FoundBy != "cancel" || e.Kind != "flush" && e.Kind != "kill" {
		return nil
	}
	if !sleepUntil(ctx, e.At-2*s.Policy.longest()-time.Since(start)) {
		return nil
	}
	c, cancel := context.WithDeadline(ctx, start.Add(e.At-5*time.Millisecond))
	defer cancel()
	for c.Err() == nil {
		if p, err := r.lim.Load().Acquire(c, s.lossCall(1)...); err == nil {
			return p
		}
		_ = sleep(c, 10*time.Millisecond)
	}
	return nil
}

// lossCost returns the cost of n units of a call holdAcross makes: in the
// units kind, of its output.
func (s schedule) lossCost(n int) []CallOption {
	if s.Policy.Kind == "units" {
		return []CallOption{CostIn("in", 1), CostIn("out", n)}
	}
	return []CallOption{Cost(n)}
}

// lossCall returns the options of a call of n units holdAcross makes, for
// the first key when the calls name keys.
func (s schedule) lossCall(n int) []CallOption {
	opts := s.lossCost(n)
	if s.Keys > 0 {
		opts = append(opts, Key("k0"))
	}
	return opts
}

// findLoss runs, on replica r's limiter, the script s.FoundBy names as
// the first after a flush or a restart: Pause (the feedback script, given
// only the rules a vendor's answer is about), Usage (the usage script), or
// held's Settle, two units higher, or Cancel (held from before the loss).
// Otherwise the next call's acquire finds it.
func (s schedule) findLoss(ctx context.Context, r *simReplica, held *Permit) {
	lim := r.lim.Load()
	switch s.FoundBy {
	case "pause":
		_ = lim.Pause(ctx, time.Millisecond)
	case "usage":
		_, _ = lim.Usage(ctx)
	case "settle":
		if held != nil {
			_ = held.Settle(ctx, s.lossCost(3)...)
			held.Release()
		}
	case "cancel":
		if held != nil {
			_ = held.Cancel(ctx)
		}
	}
}

// drawClose returns, for one schedule in four, a replica that closes its
// limiter after the other events, with calls still waiting or queued:
// Close must give each its turn or an error, and return.
func drawClose(seed uint64, s schedule) []event {
	rng := rand.New(rand.NewPCG(seed, 0x636c6f7365))
	if rng.IntN(4) != 0 {
		return nil
	}
	at := max(s.Length/5, slices.Max(s.Join)+20*slices.Max(s.Latency)+100*time.Millisecond)
	if n := len(s.Events); n > 0 {
		at = max(at, s.Events[n-1].end())
	}
	if at >= s.Length*3/4 {
		return nil
	}
	return []event{{At: at + time.Duration(rng.Int64N(int64(s.Length/5))), Kind: "close", Replica: rng.IntN(s.Replicas)}}
}

// classes returns how many priority classes the workers' calls fall in:
// schedules kept from before the field had two.
func (s schedule) classes() int {
	if s.Classes == 0 {
		return 2
	}
	return s.Classes
}

// simPlan is what one call of a worker is: its options, what the vendor
// counts of it, and whether it is given back instead of made.
type simPlan struct {
	opts   []CallOption
	a      simArrival // what the vendor records when the call arrives
	cancel bool
}

// plan draws worker k's next call.
func (s schedule) plan(rng *rand.Rand, k uint64) simPlan {
	cost := s.MinCost + 1 + rng.IntN(s.MaxCost-s.MinCost)
	p := simPlan{a: simArrival{cost: cost, actual: cost}}
	if s.Keys > 0 {
		n := rng.IntN(s.Keys)
		if s.Skew && rng.IntN(4) != 0 {
			n = 0
		}
		p.a.key = "k" + strconv.Itoa(n)
	}
	switch s.Settle {
	case "lower":
		p.a.actual = rng.IntN(cost + 1)
	case "higher":
		p.a.actual = cost + rng.IntN(cost+1)
	case "both":
		p.a.actual = rng.IntN(2*cost + 1)
	}
	p.a.actual = min(p.a.actual, s.Policy.smallest())
	switch s.Policy.Kind {
	case "units":
		p.a.in = 1 + rng.IntN(2*s.MaxCost)
		p.opts = append(p.opts, CostIn("in", p.a.in), CostIn("out", cost))
	default:
		p.opts = append(p.opts, Cost(cost))
	}
	if s.Policy.Kind == "shared" {
		p.a.quota = int(k % 2)
	}
	p.opts = append(p.opts, Priority(int(k)%s.classes()))
	if p.a.key != "" {
		p.opts = append(p.opts, Key(p.a.key))
	}
	p.cancel = s.Cancel && rng.IntN(5) == 0
	return p
}

// settle tells the limiter what the vendor counted of call p, as a user
// settles an estimate once the answer says what it cost.
func (s schedule) settle(ctx context.Context, p simPlan) int {
	if s.Settle == "" {
		return p.a.cost
	}
	cost := Cost(p.a.actual)
	if s.Policy.Kind == "units" {
		cost = CostIn("out", p.a.actual)
	}
	if PermitFrom(ctx).Settle(ctx, cost) != nil {
		return p.a.cost
	}
	return p.a.actual
}

// unitsPolicy is the units kind's: a limit of calls, and one of each of
// two named units, input at twice the output's limit.
func unitsPolicy(limit int, w time.Duration) policies.Policy {
	return policies.All(
		policies.PerCall{Policy: policies.SlidingLog{Limit: limit, Window: w}},
		policies.Unit{Name: "in", Policy: policies.SlidingLog{Limit: 4 * limit, Window: w}},
		policies.Unit{Name: "out", Policy: policies.SlidingLog{Limit: 2 * limit, Window: w}},
	)
}

// sharedPolicy is quota q's policy of the shared kind: a limit of its own
// and one, half as large again, that both quotas share.
func sharedPolicy(limit int, w time.Duration) policies.Policy {
	return policies.All(
		policies.SlidingLog{Limit: limit, Window: w},
		policies.Shared{Name: "simshared", Policy: policies.SlidingLog{Limit: limit * 3 / 2, Window: w}},
	)
}

// smallest returns the smallest limit a call's cost counts under, which a
// settled cost cannot pass.
func (p simPolicy) smallest() int {
	switch {
	case p.Spread:
		return max(p.Limit/6, 1)
	case p.Kind == "perkey":
		return max(p.Limit/2, 1)
	}
	return p.Limit
}
