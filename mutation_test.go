//go:build mutation

package throttle

import (
	"flag"
	"os"
	"testing"
)

// slowTests take three seconds or more each under -race: fleets, faults,
// clusters, caps learned over many windows, the model on miniredis, and
// the clamps that converge over many windows.
const slowTests = "^(TestFollow_ClampConverges|TestFault_ClientKillDuringRun|TestFault_ClusterFailover|TestFault_ClusterFailoverToLaggingReplica|TestFault_ClusterFailoverWithDefaultClient|TestFault_FreezeLongerThanRedisTimeout|TestFault_KillAndRestart|TestFault_LocalFallbackStaysUnderTheCap|TestFault_ScriptFlushDuringRun|TestFault_SentinelFailover|TestFault_SlotMigration|TestFleet_BusyMachine|TestFleet_NeverOverCapAndUsesTheQuota|TestFleet_NeverOverCapOnCluster|TestFleet_RedisFarAway|TestFollow_LearnsALoweredCapAndFindsItRaised|TestKeyPool_SpreadsCallsOverTheKeysWithRoom|TestMargin_NarrowsWhileTheFleetBooksAhead|TestNews_SleepingCallsLearnWhatOtherReplicasLearned|TestOnRedisError_LocalDividesTheQuota|TestPerCall_FleetUnderRequestsAndTokens|TestRefused_CapRisesBackAfterItsHold|TestRefused_EveryCountingPolicy|TestRefused_LearnsWhatTheVendorAccepted|TestScript_LongLogSettlesForItsTail|TestScript_MatchesModelOnCluster|TestScript_MatchesModelOnLargeQuotas|TestTransport_FleetPausesWhenTheVendorLowersItsCap)$|^TestScript_MatchesModel$/^miniredis$"

// TestMain, under the mutation build tag, runs the suite without its
// slowest tests, so that a mutation tool's run of each mutant takes seconds
// (gremlins unleash --tags mutation): the efficacy it measures is a floor.
func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.skip"); f != nil && f.Value.String() == "" {
		_ = f.Value.Set(slowTests)
	}
	os.Exit(m.Run())
}
