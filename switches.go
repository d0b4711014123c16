package throttle

// Switches turn one mechanism of the protocol off, so that what it buys
// can be measured again (docs/PROTOCOL.md, section 7, the ledger: each row
// names its switch). They are for measurement only: a fleet with a
// mechanism off may break the promise that mechanism serves, and no
// release keeps a switch's name.
//
// Two kinds of program read them: one built with the tag throttle_switches
// (switches_tag.go), and this package's tests (switches_env_test.go). Each
// reads the environment variable THROTTLE_OFF once, when it starts: a
// comma-separated list of names; New fails while one names no mechanism.
// Any other program keeps every mechanism on, whatever its environment:
// its first New logs that THROTTLE_OFF has no effect, when it is set.
// The scripts read the Lua side's switches from a table, OFF, empty unless
// a switch is read.

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
)

// mechanism names a mechanism that a switch turns off.
type mechanism string

// The mechanisms decided in Go.
const (
	offSleepToSlot     mechanism = "sleep_to_slot"    // waiter.go sleepToSlot: sleep the wait from the reply instead
	offGuard           mechanism = "guard"            // waiter.go late: no call is too late
	offDoubt           mechanism = "doubt"            // timing.go unsure: no doubt after a clock step
	offLeads           mechanism = "leads"            // waiter.go wait: a late reply books from now, not ahead
	offSpares          mechanism = "spares"           // spare.go mayPool: no spare admissions
	offBatches         mechanism = "batches"          // batch.go take, abandon, askDeadline: one call per script call, a caller that left gives back at once (holding the lane), Redis's timeout runs from each call's own script call
	offNews            mechanism = "news"             // news.go listen: no subscription to the quota's channel
	offBreaker         mechanism = "breaker"          // breaker.go allow: every call asks Redis
	offQueuedFailures  mechanism = "queued_failures"  // batch.go failedWhileQueued: a queued call waits its own timeout
	offHandBack        mechanism = "hand_back"        // decide.go handBack: Redis is not told of the fallback's calls
	offClockSteps      mechanism = "clock_steps"      // one of luaMechanisms, read in Go too: batch.go newStep, a forward step is not told to the script
	offStepEpoch       mechanism = "step_epoch"       // batch.go stepUntold: only the reply that shows a step is stale
	offHiddenSteps     mechanism = "hidden_steps"     // timing.go hiddenStep: a step forward after a step back, both after a process's last reply, is not counted
	offLoweredEpoch    mechanism = "lowered_epoch"    // view.go noteEpoch: a limit lowered before a new epoch stays in force for its bookings
	offMoves           mechanism = "moves"            // move.go movable: room given back moves no sleeping call
	offRebookLowered   mechanism = "rebook_lowered"   // view.go overtaken: a call booked before a limit dropped keeps its slot
	offKeepPlace       mechanism = "keep_place"       // one of luaMechanisms, read in Go too: decide.go keepPlace, keptAsBooked
	offLearnMeasures   mechanism = "learn_measures"   // feedback.go tell: an answer that teaches a cap or a pause measures no others' share
	offLoweredMeasures mechanism = "lowered_measures" // news.go news: a process whose replies never said a rule keeps a share saves its counts after a drop
	offSpreadParts     mechanism = "spread_parts"     // throttle.go New: a policies.Spread's parts are dropped
	offUnsent          mechanism = "unsent"           // transport.go failed: a request given no connection keeps its units
	offDeadlineGuard   mechanism = "deadline_guard"   // waiter.go untilDeadline, endedAtSlot: a slot may lie up to the context's deadline, and a call whose context ended as it woke keeps its slot
	offKeepTurn        mechanism = "keep_turn"        // waiter.go keepTurn: a late call books again behind the calls that asked after it

	// feedback.go Heard: a refusal about calls in flight pauses, as any other.
	offConcRefusals mechanism = "concurrency_refusals"
)

// luaMechanisms are the mechanisms decided in the scripts, by the names
// the scripts' OFF table uses.
var luaMechanisms = []mechanism{
	"spread_margins",  // lib.lua margins: the configured margin, whatever the fleet's spread
	"bucket_margin",   // lib.lua margins: a token bucket's calls are not held to its margin
	"holds",           // lib.lua hold_spread, held_spread: no spread is held for the calls booked with it, nor a second level by which a hold narrows
	"warm_up",         // acquire.lua read_fleet: a quota never warms up
	"warm_pacing",     // acquire.lua pace_warm_start: the lone calls of a warming quota are not paced
	"pacing",          // lib.lua margins: a late fleet's calls are not paced
	"hint",            // lib.lua read_hint, write_hint: no :next key
	"segment",         // acquire.lua earliest_in_log: every log is searched by rank
	"fits",            // acquire.lua earliest_in_log: the rounds of one call search again
	"read_budget",     // acquire.lua SCAN: a search reads the whole log
	"lazy_done",       // acquire.lua: every script reads the clock again when it ends
	"epochs",          // lib.lua check_loss, acquire.lua count_own: no loss is found by counts (a missing meta key is a new quota, a Redis gone back in time is not found)
	"clock_steps",     // lib.lua clock_back, batch.go newStep: no clock step is found, back or forward
	"moves_first",     // acquire.lua moves.order: the calls are decided as they came, moves among them
	"keep_place",      // acquire.lua fits_behind, decide.go keepPlace: a move keeps its slot unchecked, and a call booked before a limit dropped books again behind
	"group_clock",     // acquire.lua check_meta: every quota of a group that meets a clock gone back drops what its shared rules hold ahead
	"policy_ids",      // lib.lua check_policy: a changed policy starts at once
	"blind_rules",     // lib.lua blind.read, blind.lost, check_policy: a loss or a new rule pauses the whole quota for its longest window
	"rebuild",         // acquire.lua blind.floor, feedback.lua rebuild: no scout goes out, and no vendor's count ends a rule's blindness
	"learned_caps",    // feedback.lua: a vendor's refusal teaches no cap
	"first_cap",       // lib.lua learn_cap: a first refusal halves the limit though the fleet had admitted more than it, the call with them
	"charges",         // feedback.lua charged_after: every answer charges its whole gap
	"charge_refunds",  // feedback.lua: a charge reads units settled back since the call's arrival as gone, though the vendor's count may hold them
	"reserve",         // acquire.lua reserve: back from Local, Redis admits the whole limit
	"others",          // feedback.lua note_others: no share is left to other consumers of the key
	"others_steady",   // lib.lua others_share, others_reserve: a measure leaves the share a window and a half after it, though no measure since saw the fleet as busy, and the share is left to the unit, not in steps
	"others_grow",     // feedback.lua note_others: a measure that reaches the whole reserve (the others' share and spare all spent) counts what they spent, not twice that
	"others_pacing",   // lib.lua apply_limits, acquire.lua paced_all: a log that leaves others a share does not pace the calls that may wait once half its limit in force is in the window
	"about",           // feedback.lua about_rules: a vendor's count is about every rule that takes its kind of count
	"lag",             // lib.lua note_lag, lag_of: the record is kept for its widest window alone, and a late answer measures what is left of it
	"classes",         // acquire.lua class_rules: no share is held for higher priorities and lighter keys
	"class_news",      // acquire.lua announce_class: the calls booked ahead do not hear of a new class
	"class_give_back", // lib.lua change_classes: a booking given back or settled stays in its class's log and demand
	"class_logs",      // acquire.lua class_rules, fill_default: a class's calls are logged only while a share is held against them
	"class_backlog",   // acquire.lua demand: a backlog served counts in its class's demand until its period leaves the demand's runs
	"room_names",      // lib.lua movers: room given back is told to every process, not to those of the calls booked first after it
	"groups",          // lib.lua GROUP: a quota of a group keeps the state of what it shares on its own meta, and tells its own channel
}

// goMechanisms are the mechanisms decided in Go.
var goMechanisms = []mechanism{
	offSleepToSlot, offGuard, offDoubt, offLeads, offSpares, offBatches,
	offNews, offBreaker, offQueuedFailures, offHandBack, offStepEpoch, offHiddenSteps, offLoweredEpoch, offMoves, offRebookLowered, offLearnMeasures, offLoweredMeasures,
	offConcRefusals, offSpreadParts, offUnsent, offDeadlineGuard, offKeepTurn,
}

// switchedOff holds the mechanisms THROTTLE_OFF turns off, offErr what is
// wrong with it, and switchesRead whether this program reads it at all.
var (
	switchedOff  map[mechanism]bool
	offErr       error
	switchesRead bool
)

// switchOff turns off the mechanisms that v names, as THROTTLE_OFF does.
// Only the programs that read switches call it, when they start.
func switchOff(v string) {
	switchedOff, offErr = readOff(v)
	switchesRead = true
	if len(switchedOff) > 0 {
		scripts = loadScripts() // their OFF table changes their text
	}
}

// ignoredOnce makes warnIgnoredSwitches log once per process.
var ignoredOnce sync.Once

// warnIgnoredSwitches logs to logger, once per process, that THROTTLE_OFF
// is set but not read. A warning, not an error: the environment must not
// change what a production program does, nor be ignored unseen.
func warnIgnoredSwitches(logger *slog.Logger) {
	v := os.Getenv("THROTTLE_OFF")
	if switchesRead || v == "" {
		return
	}
	ignoredOnce.Do(func() {
		logger.Warn("throttle: THROTTLE_OFF has no effect: every mechanism stays on in a program built without the tag throttle_switches",
			"THROTTLE_OFF", v)
	})
}

// readOff reads a list of mechanisms to turn off.
func readOff(v string) (map[mechanism]bool, error) {
	if strings.TrimSpace(v) == "" {
		return nil, nil
	}
	known := append(slices.Clone(goMechanisms), luaMechanisms...)
	off := map[mechanism]bool{}
	for _, name := range strings.Split(v, ",") {
		m := mechanism(strings.TrimSpace(name))
		if !slices.Contains(known, m) {
			names := make([]string, len(known))
			for i, k := range known {
				names[i] = string(k)
			}
			slices.Sort(names)
			return nil, fmt.Errorf("throttle: THROTTLE_OFF names no mechanism %q (it turns off, for measurement only: %s)", m, strings.Join(names, ", "))
		}
		off[m] = true
	}
	return off, nil
}

// isOff reports whether the mechanism m is switched off.
func isOff(m mechanism) bool { return switchedOff[m] }

// luaOff returns the scripts' OFF table as Lua: the mechanisms of the
// scripts in off.
func luaOff(off map[mechanism]bool) string {
	var on []string
	for _, m := range luaMechanisms {
		if off[m] {
			on = append(on, string(m)+" = true")
		}
	}
	return "local OFF = {" + strings.Join(on, ", ") + "}"
}
