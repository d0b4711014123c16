// Package protocol is the one source of what the Go code and the Redis
// scripts in lua/ must agree on: the constants both sides use, the layout
// of each script's arguments, and the layout of each reply.
//
// `go generate` in the module's root writes lua/consts.lua from it (see
// Lua), which every script has before lib.lua, and args_gen.go here (see
// Go), the builders of the arguments. A test fails when either file is not
// what the generator would write now.
package protocol

import (
	"time"

	"github.com/throttlekit/throttle/policies"
)

// The reasons of a call's answer in acquire.lua's reply.
const (
	ReasonNone   = 0 // admitted or booked
	ReasonTooFar = 1 // the slot lies beyond the wait the call accepts
	ReasonBusy   = 2 // a concurrency rule is full
	ReasonShare  = 3 // larger than the share left while replicas decide without Redis
)

// The causes of a pause, or of a blind rule's refusal (Usage.PausedBy).
const (
	CauseNone   = 0
	CauseVendor = 1 // the vendor refused a call, or asked for a pause
	CauseLoss   = 2 // Redis lost the quota's data
	CausePolicy = 3 // a new policy
	CauseClock  = 4 // Redis's clock went back
)

// The flags added to a rule's kind in its arguments.
const (
	FlagPerCall = 16 // the rule counts each call once, whatever its cost
	FlagPerKey  = 32 // the rule applies to each key separately
	FlagShared  = 64 // the rule is the group's (policies.Shared)
)

// The kinds of message the scripts publish on a quota's channel, each
// followed by three numbers (see news.go).
const (
	NewsQuota   = "q" // epoch, pause, now: the quota's epoch and pause
	NewsKey     = "k" // key, pause, now: the pause of one key
	NewsLowered = "l" // epoch, now, now: a limit in force dropped
	NewsRoom    = "f" // epoch, until, now[, ids]: room freed up to until, for the limiters named
)

// Tuning values both sides use.
const (
	// LateBuckets is how many buckets of lateness a process reports.
	LateBuckets = 22
	// GuardedMargin is the least margin that is guarded: under it a call
	// that starts late does not book again, and the margin never grows.
	GuardedMargin = 2 * time.Millisecond
	// MaxMargin is how wide a log's margin grows at most.
	MaxMargin = policies.MaxMarginCeiling
	// WarmIdle is how long a quota goes without a script before it warms
	// up again.
	WarmIdle = 60 * time.Second
)

// Const is a constant as the scripts name it: an integer, a duration
// (in microseconds there) or a string.
type Const struct {
	Lua   string
	Value any
	Doc   string
}

// Consts are the constants the scripts take from here, in order.
var Consts = []Const{
	{"LOG", policies.KindSlidingLog, "The kinds of rule, and the flags added to a rule's kind."},
	{"COUNTER", policies.KindSlidingCounter, ""},
	{"BUCKET", policies.KindTokenBucket, ""},
	{"CONCURRENCY", policies.KindConcurrency, ""},
	{"PER_CALL", FlagPerCall, ""},
	{"PER_KEY", FlagPerKey, ""},
	{"SHARED", FlagShared, ""},
	{"PAUSED_BY_VENDOR", CauseVendor, "Why a quota is paused, or a blind rule refuses."},
	{"PAUSED_BY_LOSS", CauseLoss, ""},
	{"PAUSED_BY_POLICY", CausePolicy, ""},
	{"PAUSED_BY_CLOCK", CauseClock, ""},
	{"LATE_BUCKETS", LateBuckets, "How many buckets of lateness a process reports (note_timing)."},
	{"GUARDED", GuardedMargin, "The least margin that is guarded, in microseconds."},
	{"MAX_MARGIN", MaxMargin, "How wide a log's margin grows at most, in microseconds."},
	{"WARM_IDLE", WarmIdle, "How long a quota goes without a script before it warms up again."},
}

// Table is a Lua table of constants, by name: a script has fewer than 200
// locals, and lib.lua and acquire.lua hold most of them.
type Table struct {
	Lua     string
	Doc     string
	Entries []Const
}

// Tables are the scripts' tables of constants.
var Tables = []Table{
	{"REASON", "The reasons of a call's answer in acquire.lua's reply.", []Const{
		{"admitted", ReasonNone, ""}, {"too_far", ReasonTooFar, ""}, {"busy", ReasonBusy, ""}, {"share", ReasonShare, ""},
	}},
	{"NEWS", "The kinds of message published on a quota's channel (news.go).", []Const{
		{"quota", NewsQuota, ""}, {"key", NewsKey, ""}, {"lowered", NewsLowered, ""}, {"room", NewsRoom, ""},
	}},
}
