package throttle

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/throttlekit/throttle/policies"
)

// ErrUnavailable is matched, through errors.Is, by the error of a call that
// could not be decided because Redis failed, answered too late, or could not
// be reached. The call was not made. The error wraps what went wrong, so
// that errors.As finds a redis.Error when Redis answered with one; when
// Redis refused a right the scripts need, its message names the right.
var ErrUnavailable = errors.New("throttle: redis unavailable")

// unavailableError is the error of a call that Redis could not decide.
type unavailableError struct {
	Quota string // the limiter's name
	Err   error  // what went wrong

	prefix string // the quota's key prefix, for the rights a refusal names
}

// Error describes the failure. When Redis refused the user a right the
// scripts need, it names the right to grant, in ACL SETUSER's words, and
// the command the script calls where it was refused (Redis before 7.2
// does not name it).
func (e *unavailableError) Error() string {
	msg := fmt.Sprintf("throttle: quota %q: redis unavailable: %v", e.Quota, e.Err)
	called := commandAt(e.Err.Error())
	right := missingRight(e.Err.Error(), e.prefix)
	switch {
	case called != "" && !strings.Contains(right, called):
		msg += " (the script calls " + called + " there"
		if right != "" {
			msg += "; " + right
		}
		msg += ")"
	case right != "":
		msg += " (" + right + ")"
	}
	return msg
}

// The words engines refuse a right with: Redis 7.0 ("this user has no
// permissions to run the 'evalsha' command", "... to access one of the
// keys used as arguments", "The user executing the script can't run this
// command", "... can't access at least one of the keys ...", "... can't
// publish to the channel ..."), Redis 7.2 and later and Valkey ("ACL
// failure in script: User ... has no permissions to run the 'zadd'
// command", "No permissions to access a key", "... a channel"). They only
// name the right in the error: whether a reply is a refusal at all does
// not hang on them (see refusedByConfiguration).
var (
	refusedCommand = regexp.MustCompile(`(?i)no permissions to run the '([a-z|]+)' command`)
	refusedInLua   = regexp.MustCompile(`(?i)can't run this command`)
	refusedKey     = regexp.MustCompile(`(?i)(no permissions to access (a|one of the) key|can't access at least one of the keys)`)
	refusedChannel = regexp.MustCompile(`(?i)(no permissions to access (a|one of the) channel|can't publish to the channel)`)
)

// missingRight names the right an ACL refusal msg says the user lacks, as
// ACL SETUSER grants it, or returns "" when msg is no such refusal.
func missingRight(msg, prefix string) string {
	if prefix == "" {
		prefix = "throttle"
	}
	switch {
	case refusedCommand.MatchString(msg):
		c := strings.ToLower(refusedCommand.FindStringSubmatch(msg)[1])
		return "the user may not run " + strings.ToUpper(c) + ": grant it +" + c
	case refusedInLua.MatchString(msg):
		if c := commandAt(msg); c != "" {
			return "the user may not run " + c + ": grant it +" + strings.ToLower(c)
		}
		return "the user may not run a command the script calls: see ACL LOG"
	case refusedKey.MatchString(msg):
		return "the user may not access the quota's keys: grant it ~" + prefix + ":*"
	case refusedChannel.MatchString(msg):
		return "the user may not publish to the quota's channel: grant it &" + prefix + ":*"
	}
	return ""
}

// Unwrap returns ErrUnavailable, which the error matches, and what went
// wrong.
func (e *unavailableError) Unwrap() []error { return []error{ErrUnavailable, e.Err} }

// ErrLimited is matched, through errors.Is, by every error that refuses a
// call because the quota is full. The error is a *LimitedError, which says
// when to retry.
var ErrLimited = errors.New("throttle: rate limited")

// LimitedError is returned when a call does not fit the quota now (FailFast),
// or could not get a slot within its context deadline or MaxWait (Block).
type LimitedError struct {
	// Quota is the limiter's name.
	Quota string
	// RetryAfter is how long until the call would fit, as Redis saw it;
	// never negative.
	RetryAfter time.Duration
	// Reason says why the call was refused, when the quota being full now
	// is not the whole story: the slot lay beyond MaxWait or the context's
	// deadline, or every slot came too late to start in, and why the quota
	// is paused. Empty otherwise.
	Reason string
	// PausedBy says why the quota was paused when it refused the call:
	// PausedByVendor, PausedByLoss, PausedByPolicy or PausedByClock; "" when
	// no pause kept the call out.
	PausedBy string
}

// Error describes the refusal.
func (e *LimitedError) Error() string {
	if e.Reason != "" {
		return fmt.Sprintf("throttle: quota %q: rate limited (%s), retry after %v", e.Quota, e.Reason, e.RetryAfter)
	}
	return fmt.Sprintf("throttle: quota %q: rate limited, retry after %v", e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrLimited.
func (e *LimitedError) Is(target error) bool { return target == ErrLimited }

// shareReason is why a call larger than a replica's share of a limit is
// refused while replicas may decide without Redis (Options.OnRedisError
// Local): each keeps to its share, and only Redis, once every replica has
// told it of its calls, may admit more at once.
const shareReason = "the call is larger than one replica's share of a limit (Limit / ExpectedReplicas), the most a replica admits while replicas may decide without Redis"

func (l *Limiter) limited(retryAfter time.Duration, reason string) error {
	return &LimitedError{Quota: l.name, RetryAfter: max(retryAfter, 0), Reason: reason}
}

// refused returns the error of a call that Redis did not admit now, which
// by asks only for now: FailFast mode, Allow, or shadow mode.
func (l *Limiter) refused(r result, by string) error {
	switch {
	case r.reason == reasonLate:
		return l.limited(r.wait, lateReason)
	case r.reason == reasonBusy:
		return l.busyError(r)
	case r.reason == reasonShare:
		return l.limited(r.wait, shareReason)
	case r.pausedBy != "":
		return l.pausedError(r, "the quota is paused")
	}
	return l.limited(r.wait, "the quota is full now, and "+by+" does not wait")
}

// busyError returns the error of the call r, refused because a
// concurrency rule is full, or counts as full (PausedBy says why).
func (l *Limiter) busyError(r result) error {
	if r.pausedBy != "" {
		return l.pausedError(r, "every concurrency slot counts as taken")
	}
	return l.limited(r.wait, "every concurrency slot is taken")
}

// pauseCauses say, by Usage.PausedBy's names, why a quota is paused.
var pauseCauses = map[string]string{
	PausedByVendor: "the vendor asked the fleet to pause",
	PausedByLoss:   "Redis lost the quota's data, and every limit counts as full for its window, whose calls the vendor still counts",
	PausedByPolicy: "a deploy changed the policy, and a rule it added counts as full for its window: the calls before it are not in its data",
	PausedByClock:  "Redis's clock stepped, and the calls admitted before the step count as full for a window",
}

// pausedError returns the error of the call r, refused while its quota was
// paused: reason, then the pause's cause.
func (l *Limiter) pausedError(r result, reason string) error {
	cause := pauseCauses[r.pausedBy]
	if cause == "" {
		cause = "for a reason this version does not know"
	}
	return &LimitedError{Quota: l.name, RetryAfter: max(r.wait, 0), Reason: reason + ": " + cause, PausedBy: r.pausedBy}
}

// limitName names the field a rule's limit comes from, with its value.
func limitName(r policies.Rule) string {
	if r.Paces {
		return fmt.Sprintf("the %d a part of a window admits (Spread.Most of the limit)", r.Limit)
	}
	switch r.Kind {
	case policies.KindTokenBucket:
		return fmt.Sprintf("TokenBucket.Burst %d (1 when not set)", r.Limit)
	case policies.KindConcurrency:
		return fmt.Sprintf("Concurrency.Max %d", r.Limit)
	case policies.KindSlidingCounter:
		return fmt.Sprintf("SlidingCounter.Limit %d", r.Limit)
	}
	return fmt.Sprintf("SlidingLog.Limit %d", r.Limit)
}

// ruleName names a rule as the policy that made it: its limit's field and
// value, inside the PerKey, PerCall, Unit or Shared that holds it.
func ruleName(r policies.Rule) string {
	name := limitName(r)
	if r.PerCall {
		name = "PerCall{" + name + "}"
	}
	if r.PerKey {
		name = "PerKey{" + name + "}"
	}
	if r.Unit != "" {
		name = fmt.Sprintf("Unit{%q, %s}", r.Unit, name)
	}
	if r.Shared != "" {
		name = fmt.Sprintf("Shared{%q, %s}", r.Shared, name)
	}
	return name
}

// ErrQueueFull is matched, through errors.Is, by the error of a call that a
// full queue turned away (Queue mode).
var ErrQueueFull = errors.New("throttle: queue full")

// ErrClosed is matched by the error of a call made after Close, or still
// queued when Close gave up draining.
var ErrClosed = errors.New("throttle: limiter closed")

// quotaErr is an error of quota that matches sentinel through errors.Is,
// and says msg once: "throttle: quota "sms": queue full (...)".
func quotaErr(quota string, sentinel error, msg string) error {
	return &sentinelError{msg: fmt.Sprintf("throttle: quota %q: %s", quota, msg), err: sentinel}
}

type sentinelError struct {
	msg string
	err error
}

func (e *sentinelError) Error() string { return e.msg }

func (e *sentinelError) Unwrap() error { return e.err }
