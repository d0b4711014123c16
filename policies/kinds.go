package policies

import (
	"fmt"
	"time"
)

// Defaults of the policies whose fields may be left zero.
const (
	// DefaultBuckets is the Buckets of a SlidingCounter left zero.
	DefaultBuckets = 10
	// MaxBuckets bounds Buckets, and so the work of every decision.
	MaxBuckets = 1000
	// DefaultLease is the Lease of a Concurrency left zero.
	DefaultLease = time.Minute
)

// SlidingCounter admits at most Limit units in any window of length Window,
// keeping one counter per bucket of Window/Buckets: O(1) memory per key, the
// counter approach of ClassDojo's write-up, whatever the limit.
//
// It is conservative: the bucket that is partly out of the window is counted
// in full, so that no window ever holds more than Limit, at the price of at
// most 1/Buckets of the quota (a steady flow runs at Limit per Window plus one
// bucket). Waiting calls book whole buckets. Choose it over SlidingLog when
// the limit is very large (50,000 tokens per minute), where a log would keep
// an entry per unit.
type SlidingCounter struct {
	// Limit is the number of units admitted in any window. It must be > 0.
	Limit int
	// Window is the length of the sliding window, at least MinWindow.
	Window time.Duration
	// Buckets is how many counters a window is cut into; zero means
	// DefaultBuckets. More buckets waste less of the quota and cost more
	// work per call.
	Buckets int
	// Margin widens the window as for SlidingLog. Zero means DefaultMargin.
	// Unlike a log's, it does not grow with the fleet's spread: the counter
	// counts whole buckets, far coarser than the spread, and one more
	// bucket would cost a share of the quota. Calls that start later than
	// half of it after their slots book again, as for SlidingLog.
	Margin time.Duration
}

// Validate reports whether the fields are usable.
func (p SlidingCounter) Validate() error {
	switch {
	case p.Limit <= 0:
		return fmt.Errorf("policies: SlidingCounter.Limit must be > 0, got %d", p.Limit)
	case p.Window < MinWindow || p.Window > MaxWindow:
		return fmt.Errorf("policies: SlidingCounter.Window must be between %v and %v, got %v", MinWindow, MaxWindow, p.Window)
	case int64(p.Limit) > 1<<40:
		return fmt.Errorf("policies: SlidingCounter.Limit must be at most %d, got %d", int64(1)<<40, p.Limit)
	case p.Buckets < 0 || p.Buckets > MaxBuckets:
		return fmt.Errorf("policies: SlidingCounter.Buckets must be between 0 and %d, got %d", MaxBuckets, p.Buckets)
	case p.Margin < 0 || p.Margin > p.Window:
		return fmt.Errorf("policies: SlidingCounter.Margin must be between 0 and the Window %v, got %v", p.Window, p.Margin)
	case p.Window/time.Duration(p.buckets()) < time.Microsecond:
		return fmt.Errorf("policies: SlidingCounter.Window %v is too short for %d buckets", p.Window, p.buckets())
	}
	return nil
}

func (p SlidingCounter) buckets() int {
	if p.Buckets == 0 {
		return DefaultBuckets
	}
	return p.Buckets
}

func (p SlidingCounter) rules(perKey bool) []Rule {
	w := SlidingLog{Window: p.Window, Margin: p.Margin}.EffectiveWindow()
	n := p.buckets()
	// Round the bucket up to a whole microsecond, as Redis counts them.
	bucket := (w/time.Duration(n) + time.Microsecond - 1).Truncate(time.Microsecond)
	return []Rule{{Kind: KindSlidingCounter, PerKey: perKey, Limit: p.Limit, Window: w, Bucket: bucket, Margin: w - p.Window}}
}

// TokenBucket admits Rate units per Per, with bursts of up to Burst units,
// by the generic cell rate algorithm on one Redis key (as go-redis/redis_rate
// does). Waiting calls book their place, one emission interval (Per/Rate)
// apart.
//
// With Burst 1 (the default) it paces calls evenly: a minimum gap of
// Per/Rate between calls, which vendors that also cap short bursts need, and
// which combines safely with a SlidingLog in All. Against a vendor's
// sliding window, set Rate some percent below the vendor's limit: the slack
// absorbs the jitter that a SlidingLog's Margin would. Beware a burst as large as
// the rate: a bucket with Rate 100 per second and Burst 100 lets 200 calls
// through in one sliding second (a full burst, then a second's refill).
type TokenBucket struct {
	// Rate is the number of units per Per. It must be > 0.
	Rate int
	// Per is the period of Rate, at least MinWindow.
	Per time.Duration
	// Burst is the most units admitted at once; zero means 1.
	Burst int
}

// Validate reports whether the fields are usable.
func (p TokenBucket) Validate() error {
	switch {
	case p.Rate <= 0:
		return fmt.Errorf("policies: TokenBucket.Rate must be > 0, got %d", p.Rate)
	case p.Per < MinWindow || p.Per > MaxWindow:
		return fmt.Errorf("policies: TokenBucket.Per must be between %v and %v, got %v", MinWindow, MaxWindow, p.Per)
	case p.Burst < 0 || p.Burst > 1<<30:
		return fmt.Errorf("policies: TokenBucket.Burst must be between 0 and %d, got %d", 1<<30, p.Burst)
	case p.Per/time.Duration(p.Rate) < time.Microsecond:
		return fmt.Errorf("policies: TokenBucket.Rate %d per %v is more than one unit per microsecond", p.Rate, p.Per)
	case float64(max(p.Burst, 1))*float64(p.Per)/float64(p.Rate) > float64(MaxWindow):
		return fmt.Errorf("policies: TokenBucket.Burst %d takes longer than %v to refill at %d per %v; lower Burst or raise Rate", p.Burst, MaxWindow, p.Rate, p.Per)
	}
	return nil
}

func (p TokenBucket) rules(perKey bool) []Rule {
	burst := max(p.Burst, 1)
	// Round the interval up: a slower emission never breaks the rate.
	every := (p.Per/time.Duration(p.Rate) + time.Microsecond - 1).Truncate(time.Microsecond)
	return []Rule{{Kind: KindTokenBucket, PerKey: perKey, Limit: burst, Every: every, Margin: DefaultMargin}}
}

// Concurrency admits at most Max calls in flight across the fleet. A call
// holds its slot until its Permit is released (Do releases it when the call
// returns); a holder that crashed frees it after Lease, and a long call can
// extend its lease with Permit.Extend.
//
// No one knows when a running call will finish, so a call that finds every
// slot taken cannot book one: in Block mode it retries after a short, growing,
// jittered pause, and at once when a call of the same process releases its
// slot.
type Concurrency struct {
	// Max is the number of calls in flight. It must be > 0.
	Max int
	// Lease is how long a slot stays taken when its holder never releases it;
	// zero means DefaultLease. It must be at least MinWindow.
	Lease time.Duration
}

// Validate reports whether the fields are usable.
func (p Concurrency) Validate() error {
	switch {
	case p.Max <= 0 || p.Max > MaxLogLimit:
		return fmt.Errorf("policies: Concurrency.Max must be between 1 and %d, got %d", MaxLogLimit, p.Max)
	case p.Lease != 0 && (p.Lease < MinWindow || p.Lease > MaxWindow):
		return fmt.Errorf("policies: Concurrency.Lease must be zero or between %v and %v, got %v", MinWindow, MaxWindow, p.Lease)
	}
	return nil
}

func (p Concurrency) rules(perKey bool) []Rule {
	lease := p.Lease
	if lease == 0 {
		lease = DefaultLease
	}
	return []Rule{{Kind: KindConcurrency, PerKey: perKey, Limit: p.Max, Lease: lease}}
}
