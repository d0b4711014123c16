package throttle

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/throttlekit/throttle/internal/redistest"
)

func TestSwitches_THROTTLE_OFFNamesKnownMechanisms(t *testing.T) {
	off, err := readOff(" hint, spares ")
	if err != nil || !off["hint"] || !off[offSpares] || len(off) != 2 {
		t.Errorf("readOff(hint, spares) = %v, %v; want both off", off, err)
	}
	if off, err := readOff(""); err != nil || off != nil {
		t.Errorf("readOff(\"\") = %v, %v; want nothing off", off, err)
	}
	_, err = readOff("hint,nope")
	if err == nil || !strings.Contains(err.Error(), "THROTTLE_OFF") || !strings.Contains(err.Error(), `"nope"`) || !strings.Contains(err.Error(), "segment") {
		t.Errorf("readOff(hint,nope) error = %v; want one naming THROTTLE_OFF, the value and the mechanisms it knows", err)
	}
}

// TestSwitches_EachIsReadWhereItsMechanismLives checks that every switch
// reaches its mechanism: each of the scripts' is read as OFF.<name> in
// lua/, and each of Go's is passed to isOff outside the tests.
func TestSwitches_EachIsReadWhereItsMechanismLives(t *testing.T) {
	var lua strings.Builder
	for _, f := range []string{"lib.lua", "acquire.lua", "feedback.lua"} {
		lua.WriteString(luaFile(f))
	}
	for _, m := range luaMechanisms {
		if !regexp.MustCompile(`\bOFF\.` + string(m) + `\b`).MatchString(lua.String()) {
			t.Errorf("no script reads OFF.%s", m)
		}
	}
	var src strings.Builder
	files, _ := os.ReadDir(".")
	for _, f := range files {
		if n := f.Name(); strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") && n != "switches.go" {
			b, err := os.ReadFile(n)
			if err != nil {
				t.Fatal(err)
			}
			src.Write(b)
		}
	}
	for _, m := range goMechanisms {
		name := goSwitchName(t, m)
		if !strings.Contains(src.String(), "isOff("+name+")") {
			t.Errorf("no isOff(%s) in the package's code: switch %q reaches nothing", name, m)
		}
	}
}

// goSwitchName returns the name of the Go constant of mechanism m.
func goSwitchName(t *testing.T, m mechanism) string {
	t.Helper()
	b, err := os.ReadFile("switches.go")
	if err != nil {
		t.Fatal(err)
	}
	c := regexp.MustCompile(`(?m)^\t(off\w+)\s+mechanism = "` + string(m) + `"`).FindStringSubmatch(string(b))
	if c == nil {
		t.Fatalf("switches.go: no constant for %q", m)
	}
	return c[1]
}

// TestSwitches_ScriptsLoadWithEachOff loads every script with each of the
// scripts' switches off, on miniredis and a real Redis: a switch that
// breaks a script's syntax measures nothing.
func TestSwitches_ScriptsLoadWithEachOff(t *testing.T) {
	t.Parallel() // loads scripts only
	redistest.Each(t, func(t *testing.T, s *redistest.Server) {
		rdb := s.Client(t)
		ctx := context.Background()
		for _, m := range luaMechanisms {
			for _, name := range []string{"acquire.lua", "cancel.lua", "settle.lua", "release.lua", "feedback.lua", "usage.lua", "handback.lua"} {
				text := scriptText(name, map[mechanism]bool{m: true})
				if !strings.Contains(text, "local OFF = {"+string(m)+" = true}") {
					t.Fatalf("%s with %s off: no OFF table naming it", name, m)
				}
				if err := rdb.ScriptLoad(ctx, text).Err(); err != nil {
					t.Errorf("%s with %s off: %v", name, m, err)
				}
			}
		}
	})
}

// TestSwitches_TheLedgerNamesEachOnce checks that docs/PROTOCOL.md's
// ledger gives every switch a row, and names no switch that does not
// exist.
func TestSwitches_TheLedgerNamesEachOnce(t *testing.T) {
	b, err := os.ReadFile("docs/PROTOCOL.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "## 7. Ledger of mechanisms")
	end := strings.Index(doc, "## 8.")
	if start < 0 || end < start {
		t.Fatal("docs/PROTOCOL.md: no section 7 before section 8")
	}
	seen := map[mechanism]int{}
	for _, line := range strings.Split(doc[start:end], "\n") {
		cells := strings.Split(line, " | ")
		if !strings.HasPrefix(line, "| ") || len(cells) < 6 || strings.HasPrefix(line, "| mechanism") || strings.HasPrefix(line, "| ---") {
			continue
		}
		last := strings.TrimSuffix(cells[len(cells)-1], " |")
		for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(last, -1) {
			seen[mechanism(m[1])]++
		}
	}
	known := append(slices.Clone(goMechanisms), luaMechanisms...)
	for _, m := range known {
		if seen[m] != 1 {
			t.Errorf("the ledger names switch %q in %d rows, want 1", m, seen[m])
		}
	}
	for m := range seen {
		if !slices.Contains(known, m) {
			t.Errorf("the ledger names switch %q, which switches.go does not know", m)
		}
	}
}

// switchBreaks names, for each switch, a test of the default run that
// fails with the switch off (its -test.run pattern, and any other flag):
// the test that shows what the mechanism does. A switch missing here has
// no such test; the ledger says what measures it instead.
var switchBreaks = map[mechanism][]string{
	offSleepToSlot:     {"^TestGuard_SlowReplyStillStartsOnItsSlot$"},
	offGuard:           {"^TestGuard_BooksAgainABoundedNumberOfTimes$"},
	offDoubt:           {"^TestTiming_UnsureAfterAStepWhileRepliesAreSlow$"},
	offLeads:           {"^TestGuard_LateReplyWaitsForASlotAhead$"},
	offSpares:          {"^TestSpare_TermsFollowTheMarginAndTheRoomLeft$"},
	offNews:            {"^TestSim_Regressions$/^(701|10462)$"},
	offHiddenSteps:     {"^TestSim_Regressions$/^720739$"},
	offBreaker:         {"^TestBreaker_StopsAskingADeadRedisAndComesBack$"},
	offBatches:         {"^TestSim_Schedules$/^142$", "-sim.n=143"},
	offQueuedFailures:  {"^TestQueue_ACallQueuedBehindFailuresFailsAtItsTurn$"},
	offHandBack:        {"^TestLocal_HandsBackTheCallsThatBeganNotThoseBookedAhead$"},
	offClockSteps:      {"^TestClockStep_(Forward|Backward)StepCountsAsALoss$"},
	offStepEpoch:       {"^TestClockStep_AReplyAnsweredAfterAnotherShowedTheStepIsStale$"},
	offLoweredEpoch:    {"^TestLowered_ALimitLoweredBeforeAClockStepBackOvertakesNoLaterBooking$"},
	offMoves:           {"^TestMove_RefundMovesASleepingCallOfAnotherReplica$"},
	offRebookLowered:   {"^TestBookedAhead$/^TestLowered_CallsBookedBeforeADropBookAgain$"},
	offSpreadParts:     {"^TestSpread_ABurstTakesAPartsShare$"},
	offUnsent:          {"^TestTransport_ARequestNeverSentGivesItsUnitsBack$"},
	offDeadlineGuard:   {"^TestDeadline_NoSlotWithinHalfAMarginOfTheDeadline$"},
	offKeepTurn:        {"^TestPlace_ALateCallTakesTheSlotOfACallThatAskedAfterIt$"},
	offConcRefusals:    {"^TestTransport_AConcurrencyRefusalGoesToTheConcurrencyRule$"},
	offLearnMeasures:   {"^TestOthers_ACountThatTeachesMeasuresThemToo$"},
	offLoweredMeasures: {"^TestOthers_EveryProcessMeasuresOnceALimitDrops$"},
	"spread_margins":   {"^TestMargin_FollowsTheFleetsSpread$"},
	"bucket_margin":    {"^TestGuard_TokenBucketLateReplyBooksAgain$"},
	"holds":            {"^TestMargin_NarrowsWhileTheFleetBooksAhead$"},
	"warm_up":          {"^TestWarmUp_HoldsTheFirstCallsOfAColdQuota$"},
	"warm_pacing":      {"^TestPacing_SpreadsTheLoneCallsOfManyReplicasWhileWarm$"},
	"pacing":           {"^TestPacing_SpreadsTheCallsOfALateFleet$"},
	"hint":             {"^TestScript_HintHoldsAfterACallThatBooksAhead$"},
	"read_budget":      {"^TestScript_LongLogSettlesForItsTail$"},
	"epochs":           {"^TestDataLoss_CountsTheQuotaFullForOneWindow$"},
	"group_clock":      {"^TestShared_AClockStepKeepsWhatTheFirstQuotaBooked$"},
	"moves_first":      {"^TestMove_AKeptMoveKeepsItsUnitsFromTheCallsBeforeIt$"},
	"keep_place":       {"^TestLowered_TheCallsAheadKeepTheirPlacesWhereTheLowerLimitLeavesRoom$"},
	"policy_ids":       {"^TestDeploy_ChangedPolicyTakesOverCleanly$"},
	"blind_rules":      {"^TestDeploy_ANewRuleStartsBlindAlone$"},
	"rebuild":          {"^TestBlind_AVendorsCountRebuildsALostQuotaInOneRoundTrip$"},
	"learned_caps":     {"^TestRefused_DropsByHalfAtMost$"},
	"first_cap":        {"^TestRefused_ARefusalTheFleetsOwnRecordExplainsTeachesNoCap$"},
	"charges":          {"^TestSetRemaining_AnswersOfCallsInFlightChargeTheGapOnce$", "+off=others"},
	"charge_refunds":   {"^TestOthers_ACountTakenAtArrivalChargesNoRefund$"},
	"others":           {"^TestOthers_RefusedCallsAreNotTheFleets$"},
	"about":            {"^TestOthers_ACountIsAboutTheRuleOfItsLimit$"},
	"others_grow":      {"^TestOthers_AShareGrowsWhileTheOthersSpendAllItLeaves$"},
	"others_pacing":    {"^TestOthers_AFleetStartingBesideTheOtherConsumerLeavesItsShare$"},
	"others_steady":    {"^TestOthers_AShareThatScalesWithTheFleetHoldsThroughALull$", "^TestOthers_AShareWithinItsStepLowersNothing$"},
	"lag":              {"^TestOthers_ALateAnswerFindsTheRecordOfItsWindow$"},
	"reserve":          {"^TestLocal_BackOnRedisReservesTheOthersShare$"},
	"classes":          {"^TestClasses_AHigherPriorityFindsItsShareAtOnce$"},
	"class_news":       {"^TestBookedAhead$/^TestClasses_ANewKeyIsHeardByTheCallsBookedAhead$"},
	"class_give_back":  {"^TestClasses_ABookingGivenBackLeavesItsClass$"},
	"class_logs":       {"^TestClasses_AClassThatCallsMidWindowFindsItsShareInIt$"},
	"class_backlog":    {"^TestClasses_ABacklogServedLeavesItsClassesDemand$"},
	"groups":           {"^TestShared_ACapLearnedHoldsInEveryQuota$"},
	"room_names":       {"^TestMove_ARefundWakesTheProcessesBookedFirstOnly$"},
}

// TestSwitches_EachBreaksItsTest runs, for each switch of switchBreaks,
// this test binary again with the switch off and the test named for it,
// which must fail, and, when that run turns another mechanism off or sets
// a flag of its own, with every mechanism on, where it must pass (the
// default run passes it otherwise); with THROTTLE_LONG=1 and without -race
// only (.ci/run runs it so).
func TestSwitches_EachBreaksItsTest(t *testing.T) {
	if os.Getenv("THROTTLE_LONG") == "" {
		t.Skip("runs this test binary twice per switch; set THROTTLE_LONG=1")
	}
	if os.Getenv("THROTTLE_OFF") != "" {
		t.Skip("already run with a switch off")
	}
	if raceEnabled {
		// Each run builds nothing, but the race detector makes the 56
		// runs take minutes: .ci/run runs this test without it.
		t.Skip("runs without -race (see .ci/run)")
	}
	for m, args := range switchBreaks {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			// A "+off=" argument names a mechanism that both runs turn
			// off: one that would otherwise do the switch's work.
			var also []string
			args = slices.DeleteFunc(slices.Clone(args), func(a string) bool {
				if v, ok := strings.CutPrefix(a, "+off="); ok {
					also = append(also, v)
					return true
				}
				return false
			})
			run := func(off string) (string, error) {
				cmd := exec.Command(os.Args[0], append([]string{"-test.count=1", "-test.run", args[0]}, args[1:]...)...)
				offs := slices.DeleteFunc(append(slices.Clone(also), off), func(s string) bool { return s == "" })
				cmd.Env = append(os.Environ(), "THROTTLE_OFF="+strings.Join(offs, ","))
				out, err := cmd.CombinedOutput()
				return string(out), err
			}
			out, err := run(string(m))
			switch {
			case err == nil:
				t.Errorf("THROTTLE_OFF=%s -test.run %s passed; want the test to fail without its mechanism", m, args[0])
			case !strings.Contains(out, "--- FAIL"):
				t.Errorf("THROTTLE_OFF=%s -test.run %s: %v, with no failing test:\n%s", m, args[0], err, out)
			case strings.Contains(out, "no tests to run"):
				t.Errorf("-test.run %s runs no test", args[0])
			}
			// With every mechanism on, the test ran and passed in the
			// default run: it runs again here only when this run differs
			// from that one (another mechanism off, or a flag of its own).
			if len(also) == 0 && len(args) == 1 {
				return
			}
			if out, err := run(""); err != nil || strings.Contains(out, "no tests to run") {
				t.Errorf("-test.run %s with every mechanism on: %v\n%s", args[0], err, out)
			}
		})
	}
}

// TestSwitches_AProgramBuiltWithoutTheTagIgnoresThem builds a program that
// uses a Limiter (testdata/switchprobe) with and without the tag
// throttle_switches, and runs both with THROTTLE_OFF=breaker,epochs. Only
// the tagged build turns them off; the other keeps both, and warns once
// that THROTTLE_OFF has no effect: what reads it is not even linked in.
func TestSwitches_AProgramBuiltWithoutTheTagIgnoresThem(t *testing.T) {
	redistest.Heavy(t, "it compiles the package twice")
	t.Parallel() // builds and runs another program
	for _, tagged := range []bool{false, true} {
		t.Run(fmt.Sprintf("tagged=%v", tagged), func(t *testing.T) {
			t.Parallel()
			p := runSwitchProbe(t, tagged, "breaker,epochs")
			if p.linked != tagged {
				t.Errorf("readOff linked into the program: %v, want %v", p.linked, tagged)
			}
			table, warnings := "local OFF = {}", 1
			if tagged {
				table, warnings = "local OFF = {epochs = true}", 0
			}
			if p.table != table {
				t.Errorf("the scripts' table: %q, want %q", p.table, table)
			}
			if held := p.calls <= 10; held == tagged {
				t.Errorf("%d script calls of 20 decisions reached a dead Redis; breaker on: %v, want %v", p.calls, held, !tagged)
			}
			if n := strings.Count(p.stderr, "THROTTLE_OFF has no effect"); n != warnings {
				t.Errorf("%d warnings that THROTTLE_OFF has no effect, want %d:\n%s", n, warnings, p.stderr)
			}
		})
	}
}

// switchProbe is what testdata/switchprobe showed of one build.
type switchProbe struct {
	linked bool   // whether readOff is in the program at all
	table  string // the OFF table the scripts were sent with
	calls  int    // the script calls that reached a dead Redis
	stderr string
}

// runSwitchProbe builds testdata/switchprobe, with the tag throttle_switches
// if tagged, and runs it with THROTTLE_OFF=off.
func runSwitchProbe(t *testing.T, tagged bool, off string) switchProbe {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "switchprobe")
	args := []string{"build", "-o", bin}
	if tagged {
		args = append(args, "-tags", "throttle_switches")
	}
	if out, err := exec.Command("go", append(args, "./testdata/switchprobe")...).CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	syms, err := exec.Command("go", "tool", "nm", bin).Output()
	if err != nil {
		t.Fatalf("go tool nm: %v", err)
	}
	var stderr strings.Builder
	run := exec.Command(bin)
	run.Env = append(os.Environ(), "THROTTLE_OFF="+off)
	run.Stderr = &stderr
	out, err := run.Output()
	if err != nil {
		t.Fatalf("switchprobe: %v\n%s%s", err, out, stderr.String())
	}
	// readOff, too large to be inlined, stands for what reads the switches.
	p := switchProbe{linked: strings.Contains(string(syms), "throttle.readOff"), calls: -1, stderr: stderr.String()}
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, "OFF table: "); ok {
			p.table = v
		}
		if v, ok := strings.CutPrefix(line, "script calls to a dead Redis: "); ok {
			p.calls, _ = strconv.Atoi(v)
		}
	}
	if p.calls < 0 {
		t.Fatalf("switchprobe printed no count of script calls:\n%s", out)
	}
	return p
}
