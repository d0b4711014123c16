package protocol

// Every script's ARGV starts the same way: ARGV[1] is now in
// microseconds, or 0 to read Redis's clock; ARGV[2] the number of rules,
// n; then n groups of Rule. The script's own arguments follow, in its
// layout, and then its groups, each the number of times a field of its
// layout says.

// Kind is the type of one argument.
type Kind int

const (
	Int  Kind = iota // an integer (int64 in Go, a number in Lua)
	Text             // a string
	Flag             // a bool: "1" or "0"
	Cost             // a call's cost: an int, or one per rule comma-separated (read_cost in lib.lua)
)

// Field is one argument: its name in Lua, its kind and what it says.
type Field struct {
	Name string
	Kind Kind
	Doc  string
}

// Layout is a group of arguments that follow one another. A layout with
// Embed starts with Embed's fields.
type Layout struct {
	Name   string // its Go type, and its reader in Lua (ARGS.<name>)
	Doc    string
	Embed  *Layout
	Fields []Field
}

// All returns the fields of the layout, those of Embed first.
func (l Layout) All() []Field {
	if l.Embed == nil {
		return l.Fields
	}
	return append(append([]Field{}, l.Embed.All()...), l.Fields...)
}

// ruleLayout is one rule of a quota: every script takes each.
var ruleLayout = Layout{Name: "Rule", Doc: "one rule of the quota, as every script takes it", Fields: []Field{
	{"kind", Int, "its kind (policies.Kind), plus FlagPerCall, FlagPerKey and FlagShared"},
	{"limit", Int, "a log's or counter's limit, a bucket's burst, a concurrency rule's maximum"},
	{"window", Int, "a log's or counter's window in microseconds, its configured margin included"},
	{"width", Int, "a counter's bucket width in microseconds"},
	{"interval", Int, "a bucket's emission interval per unit in microseconds"},
	{"lease", Int, "a concurrency rule's lease in microseconds"},
	{"margin", Int, "a log's or counter's configured margin, a bucket's own, in microseconds"},
}}

// bookingLayout is a booking given back or settled: what acquire.lua answered
// for it.
var bookingLayout = Layout{Name: "Booking", Doc: "a booking given back or settled", Fields: []Field{
	{"id", Text, "the call's id"},
	{"cost", Cost, "the units it was booked for"},
	{"slot", Int, "its slot in microseconds"},
	{"epoch", Int, "the quota's epoch when it was booked"},
	{"noted", Int, "the rules whose class demand counts it, rule i as bit i-1, or 0"},
	{"logged", Int, "the rules whose class's own log holds it"},
	{"ahead", Flag, "booked ahead of its script's time"},
	{"class", Text, "its class's name, or \"\""},
	{"prio", Int, "its class's priority"},
}}

// cancelLayout is cancel.lua's: the booking given back.
var cancelLayout = Layout{Name: "Cancel", Doc: "the arguments of cancel.lua", Embed: &bookingLayout}

// settleLayout is settle.lua's: the booking, and its actual cost.
var settleLayout = Layout{Name: "Settle", Doc: "the arguments of settle.lua", Embed: &bookingLayout, Fields: []Field{
	{"actual", Cost, "the units the vendor counted"},
}}

// releaseLayout is release.lua's.
var releaseLayout = Layout{Name: "Release", Doc: "the arguments of release.lua", Fields: []Field{
	{"id", Text, "the call's id"},
	{"cost", Cost, "the units it holds"},
	{"lease", Int, "0 to release, else the new lease in microseconds from now"},
}}

// handbackLayout is handback.lua's; Charges groups of Charge follow.
var handbackLayout = Layout{Name: "Handback", Doc: "the arguments of handback.lua", Fields: []Field{
	{"replicas", Int, "the replicas the quota is divided among"},
	{"span", Int, "how long, in microseconds, other replicas may still decide without Redis"},
	{"charges", Int, "the number of charges that follow"},
}}

// chargeLayout is one call the Local fallback admitted.
var chargeLayout = Layout{Name: "Charge", Doc: "one call the Local fallback admitted", Fields: []Field{
	{"rule", Int, "the rule's place, from 1"},
	{"at", Int, "its time in microseconds, or, 0 or less, that many microseconds from now negated"},
	{"units", Int, "its units"},
	{"id", Text, "its id"},
}}

// acquireLayout is acquire.lua's. Then come Lates groups of Late, Scopes - 1
// scopes (each a pause key and one key per rule), Gives groups of Give
// and Calls groups of Call.
var acquireLayout = Layout{Name: "Acquire", Doc: "the arguments of acquire.lua", Fields: []Field{
	{"scout", Int, "1 when the vendor's counts reached the caller, 2 when none did yet but a Transport reads every answer of its calls, else 0: its calls may go out as scouts (with 2, once an answer stated the quota's counts)"},
	{"ran", Int, "the caller's acquire scripts Redis answered in epoch ran_in"},
	{"ran_in", Int, "the epoch of ran"},
	{"limiter", Text, "the caller's id"},
	{"seen", Int, "the quota's count of scripts run as the caller last saw it, or 0"},
	{"known", Int, "the quota's epoch as the caller last saw it, or 0"},
	{"delay", Int, "the caller's usual delay from Redis, one way, in microseconds, or -1"},
	{"policy", Text, "the id of the caller's policy"},
	{"described", Text, "the caller's policy described, or \"\" when the meta holds it already"},
	{"age", Int, "the caller's age in microseconds, when described"},
	{"stepped", Int, "the least time of a loss that counts a step forward of Redis's clock the caller saw, or 0"},
	{"lates", Int, "the number of Late groups"},
	{"scopes", Int, "the number of scopes, the one of KEYS first"},
	{"gives", Int, "the number of Give groups"},
	{"calls", Int, "the number of Call groups"},
}}

// lateLayout is a count of the caller's calls late by one bucket of lateness.
var lateLayout = Layout{Name: "Late", Doc: "a bucket of lateness", Fields: []Field{
	{"bucket", Int, "the bucket, from 0"},
	{"n", Int, "the calls in it"},
}}

// giveLayout is a booking acquire.lua gives back first.
var giveLayout = Layout{Name: "Give", Doc: "a booking acquire.lua gives back", Embed: &bookingLayout, Fields: []Field{
	{"scope", Int, "its scope, from 1"},
}}

// callLayout is one call acquire.lua decides.
var callLayout = Layout{Name: "Call", Doc: "a call acquire.lua decides", Fields: []Field{
	{"id", Text, "its id, unique across the fleet"},
	{"cost", Cost, "its cost"},
	{"maxwait", Int, "the longest wait in microseconds it accepts"},
	{"lead", Int, "the least wait in microseconds"},
	{"scope", Int, "its scope, from 1"},
	{"moves", Int, "for a call that moves its booking, the booking's place among the Give groups, else 0"},
	{"class", Text, "its class's name, or \"\""},
	{"prio", Int, "its class's priority"},
}}

// feedbackLayout is feedback.lua's; Named groups of Named follow.
var feedbackLayout = Layout{Name: "Feedback", Doc: "the arguments of feedback.lua", Fields: []Field{
	{"id", Text, "an id for the charges"},
	{"as_of", Int, "the slot of the call whose answer carried the count, in microseconds, or 0 for now"},
	{"pause", Int, "a pause in microseconds from now, or 0"},
	{"left", Int, "the units the vendor says are left, or -1"},
	{"reset", Int, "microseconds until the vendor's window resets, or 0"},
	{"known", Int, "the quota's epoch as the caller last saw it, or 0"},
	{"refused", Flag, "the vendor refused the call of as_of for being over its limit"},
	{"limit", Int, "the limit the vendor stated, or 0"},
	{"calls_left", Int, "the requests left, or -1, for the rules that count calls"},
	{"calls_reset", Int, "microseconds until the requests' reset, or 0"},
	{"calls_limit", Int, "the limit of requests stated, or 0"},
	{"late", Int, "how long after its slot the answer to the call of as_of came, in microseconds, or 0"},
	{"refused_cost", Cost, "the refused call's cost under the rules passed, or \"\""},
	{"span", Int, "the longest window of the whole policy in microseconds, its margin's ceiling included"},
	{"named", Int, "the number of Named groups"},
}}

// namedLayout is the vendor's own count of a rule that counts a named unit.
var namedLayout = Layout{Name: "Named", Doc: "the vendor's count of a rule's named unit", Fields: []Field{
	{"rule", Int, "the rule's place among the rules passed, from 1"},
	{"left", Int, "the units of it left, or -1"},
	{"reset", Int, "microseconds until their reset, or 0"},
}}

// Layouts are every layout, in the order the generated files hold them.
var Layouts = []Layout{ruleLayout, bookingLayout, cancelLayout, settleLayout, releaseLayout, handbackLayout, chargeLayout,
	acquireLayout, lateLayout, giveLayout, callLayout, feedbackLayout, namedLayout}

// Reply is the layout of a reply of integers: field i is at place i from 0
// in Go, i+1 in Lua.
type Reply struct {
	Name   string
	Fields []ReplyField
	Size   int // the Go constant of its length
}

// ReplyField is one field of a reply, and the Go constant of its place.
type ReplyField struct {
	Name string
	At   int
}

// The places of acquire.lua's reply header.
const (
	AcquireNow = iota
	AcquirePause
	AcquireEpoch
	AcquireLost
	AcquireMargin
	AcquireDone
	AcquireSeq
	AcquirePaused
	AcquirePausedBy
	AcquireSize // the header's length
)

// The places of each call's answer in acquire.lua's reply, after the
// header.
const (
	AnswerAdmitted = iota
	AnswerWait
	AnswerRemaining
	AnswerReason
	AnswerBlindBy
	AnswerPause
	AnswerNoted
	AnswerLogged
	AnswerRoom
	AnswerSize
)

// The places of usage.lua's reply header.
const (
	UsageNow = iota
	UsagePause
	UsageSpread
	UsageEpoch
	UsagePausedBy
	UsageLoss
	UsageSize
)

// The places of each rule's usage in usage.lua's reply, after the header.
const (
	RuleUsed = iota
	RuleBooked
	RuleRemaining
	RuleNext
	RuleMargin
	RuleLimit
	RuleOthers
	RuleSize
)

// The places of feedback.lua's reply.
const (
	FeedbackNow = iota
	FeedbackUntil
	FeedbackCharged
	FeedbackLowered
	FeedbackCap
	FeedbackOthers
	FeedbackMeasuring
	FeedbackDropped
	FeedbackSize
)

// Replies are the replies' layouts.
var Replies = []Reply{
	{"acquire", []ReplyField{{"now", AcquireNow}, {"pause", AcquirePause}, {"epoch", AcquireEpoch}, {"lost", AcquireLost},
		{"margin", AcquireMargin}, {"done", AcquireDone}, {"seq", AcquireSeq}, {"paused", AcquirePaused},
		{"paused_by", AcquirePausedBy}}, AcquireSize},
	{"answer", []ReplyField{{"admitted", AnswerAdmitted}, {"wait", AnswerWait}, {"remaining", AnswerRemaining},
		{"reason", AnswerReason}, {"blind_by", AnswerBlindBy}, {"pause", AnswerPause}, {"noted", AnswerNoted},
		{"logged", AnswerLogged}, {"room", AnswerRoom}}, AnswerSize},
	{"usage", []ReplyField{{"now", UsageNow}, {"pause", UsagePause}, {"spread", UsageSpread}, {"epoch", UsageEpoch},
		{"paused_by", UsagePausedBy}, {"loss", UsageLoss}}, UsageSize},
	{"rule", []ReplyField{{"used", RuleUsed}, {"booked", RuleBooked}, {"remaining", RuleRemaining}, {"next", RuleNext},
		{"margin", RuleMargin}, {"limit", RuleLimit}, {"others", RuleOthers}}, RuleSize},
	{"feedback", []ReplyField{{"now", FeedbackNow}, {"pause", FeedbackUntil}, {"charged", FeedbackCharged},
		{"lowered", FeedbackLowered}, {"cap", FeedbackCap}, {"others", FeedbackOthers}, {"measuring", FeedbackMeasuring},
		{"dropped", FeedbackDropped}}, FeedbackSize},
}
