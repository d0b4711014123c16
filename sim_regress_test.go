package throttle

import (
	"encoding/json"
	"strconv"
	"testing"
)

// simRegressions are schedules that found a bug, each kept whole (not as
// its seed, whose schedule changes with drawSchedule) and run by every
// test run, with the bug it found. Add the schedule a failure prints
// (schedule.String) when you fix what it found.
var simRegressions = []struct {
	why      string
	schedule string
}{
	{"a call decided in its own goroutine waited a Redis timeout past its 500 ms deadline (Redis frozen)",
		`{"Seed":12,"Replicas":1,"Workers":1,"Policy":{"Kind":"all","Limit":10,"Window":500000000},"Mode":"Queue","OnError":"FailClosed","Latency":[2000000],"Jitter":0,"Vendor":1000000,"Deadline":500000000,"MaxCost":2,"Keys":0,"Join":[0],"Length":5000000000,"Events":[{"At":1824730162,"Kind":"freeze","Replica":0,"For":1662000000}]}`},
	{"Redis's clock stepped an hour back: the calls before the step lay ahead of the clock, and a second full window was admitted",
		`{"Seed":46,"Replicas":5,"Workers":2,"Policy":{"Kind":"log","Limit":20,"Window":1000000000},"Mode":"Block","OnError":"FailClosed","Latency":[2000000,0,0,1000000,1000000],"Jitter":0,"Vendor":0,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[500000000,1000000000,0,0,1000000000],"Length":10000000000,"Events":[{"At":3259626259,"Kind":"step","Replica":2,"For":-3600000000000}]}`},
	{"Local: calls the fallback admitted while its calls were handed back to Redis never reached Redis (21 in a window of 20)",
		`{"Seed":78,"Replicas":3,"Workers":8,"Policy":{"Kind":"log","Limit":20,"Window":1000000000},"Mode":"Queue","OnError":"Local","Latency":[1000000,1000000,1000000],"Jitter":0,"Vendor":1000000,"Deadline":0,"MaxCost":2,"Keys":0,"Join":[0,0,500000000],"Length":10000000000,"Events":[{"At":2447112032,"Kind":"kill","Replica":2,"For":1032000000},{"At":6460040208,"Kind":"kill","Replica":1,"For":1106000000}]}`},
	{"moves: a call kept at its slot, which passed while it waited in the lane behind a script call 50 ms away, slept towards it and started late unseen (28 in a window of 25)",
		`{"Seed":85,"Replicas":3,"Workers":4,"Policy":{"Kind":"perkey","Limit":50,"Window":100000000},"Mode":"Block","OnError":"FailClosed","Latency":[50000000,52000000,52000000],"Jitter":0,"Vendor":1000000,"Deadline":500000000,"MaxCost":6,"Keys":2,"Join":[100000000,100000000,0],"Length":3000000000,"Events":[{"At":1473450126,"Kind":"stall","Replica":1,"For":388000000}]}`},
	{"FailOpen: Do waited for a concurrency slot's release on a dead Redis, a second past its deadline",
		`{"Seed":109,"Replicas":4,"Workers":4,"Policy":{"Kind":"concurrency","Limit":5,"Window":100000000},"Mode":"Block","OnError":"FailOpen","Latency":[1000000,1000000,3000000,2000000],"Jitter":2000000,"Vendor":1000000,"Deadline":200000000,"MaxCost":1,"Keys":0,"Join":[0,100000000,0,0],"Length":3000000000,"Events":[{"At":954980683,"Kind":"kill","Replica":2,"For":2078000000}]}`},
	{"Local: the hand-back to a Redis back from a kill held its caller past its deadline",
		`{"Seed":137,"Replicas":5,"Workers":1,"Policy":{"Kind":"log","Limit":10,"Window":200000000},"Mode":"Block","OnError":"Local","Latency":[27000000,27000000,27000000,25000000,27000000],"Jitter":1000000,"Vendor":0,"Deadline":500000000,"MaxCost":1,"Keys":0,"Join":[100000000,0,200000000,100000000,0],"Length":3000000000,"Events":[{"At":847601091,"Kind":"kill","Replica":1,"For":1086000000},{"At":2328448282,"Kind":"leave","Replica":1,"For":0}]}`},
	{"Local: the hand-back held its caller a second past its 200 ms deadline",
		`{"Seed":149,"Replicas":3,"Workers":4,"Policy":{"Kind":"log","Limit":10,"Window":500000000},"Mode":"Block","OnError":"Local","Latency":[1000000,1000000,2000000],"Jitter":1000000,"Vendor":0,"Deadline":200000000,"MaxCost":1,"Keys":0,"Join":[250000000,0,500000000],"Length":5000000000,"Events":[{"At":1533348392,"Kind":"kill","Replica":2,"For":1127000000},{"At":3719460411,"Kind":"cut","Replica":0,"For":1352000000}]}`},
	{"a booking given back, on a Redis 50 ms away, held its caller past its 200 ms deadline",
		`{"Seed":159,"Replicas":2,"Workers":4,"Policy":{"Kind":"log","Limit":20,"Window":1000000000},"Mode":"Queue","OnError":"Local","Latency":[50000000,51000000],"Jitter":0,"Vendor":0,"Deadline":200000000,"MaxCost":5,"Keys":0,"Join":[0,0],"Length":10000000000,"Events":null}`},
	{"FailOpen, a replica cut off: a booking given back held its caller a Redis timeout past its deadline",
		`{"Seed":217,"Replicas":5,"Workers":8,"Policy":{"Kind":"log","Limit":10,"Window":1000000000},"Mode":"Block","OnError":"FailOpen","Latency":[5000000,5000000,7000000,5000000,5000000],"Jitter":2000000,"Vendor":10000000,"Deadline":500000000,"MaxCost":1,"Keys":0,"Join":[0,0,0,500000000,0],"Length":10000000000,"Events":[{"At":3739566518,"Kind":"cut","Replica":2,"For":1638000000},{"At":7554486559,"Kind":"failover","Replica":1,"For":19000000}]}`},
	{"FailClosed, after a kill and a stall: a booking given back held its caller past its deadline",
		`{"Seed":251,"Replicas":1,"Workers":8,"Policy":{"Kind":"perkey","Limit":10,"Window":1000000000},"Mode":"Queue","OnError":"FailClosed","Latency":[25000000],"Jitter":0,"Vendor":10000000,"Deadline":500000000,"MaxCost":1,"Keys":2,"Join":[1000000000],"Length":10000000000,"Events":[{"At":3198571481,"Kind":"kill","Replica":0,"For":1449000000},{"At":5687917133,"Kind":"stall","Replica":0,"For":324000000}]}`},
	{"token bucket on Local: the share left to replicas still deciding without Redis kept the whole burst (86 units where 85 fit)",
		`{"Seed":333,"Replicas":3,"Workers":1,"Policy":{"Kind":"bucket","Limit":10,"Window":1000000000},"Mode":"Block","OnError":"Local","Latency":[2000000,2000000,2000000],"Jitter":2000000,"Vendor":10000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[500000000,0,500000000],"Length":10000000000,"Events":[{"At":2950524451,"Kind":"leave","Replica":1,"For":0},{"At":5340254832,"Kind":"failover","Replica":0,"For":280000000},{"At":6724864573,"Kind":"flush","Replica":1,"For":0}]}`},
	{"Local: calls the fallback booked ahead were handed back at Redis's now, and left Redis's windows before the vendor's (55 in a window of 50)",
		`{"Seed":378,"Replicas":3,"Workers":8,"Policy":{"Kind":"perkey","Limit":50,"Window":500000000},"Mode":"Block","OnError":"Local","Latency":[2000000,3000000,2000000],"Jitter":0,"Vendor":0,"Deadline":0,"MaxCost":6,"Keys":3,"Join":[0,250000000,0],"Length":5000000000,"Events":[{"At":1360946246,"Kind":"kill","Replica":0,"For":562000000}]}`},
	{"FailClosed, Redis 25 ms away: after a kill the news subscription never came back (its ping, 100 ms, could not cover a new connection's handshake), so sleeping calls never heard of the loss found after a FLUSHALL (21 in a window of 20)",
		`{"Seed":701,"Replicas":5,"Workers":8,"Policy":{"Kind":"log","Limit":20,"Window":1000000000},"Mode":"Block","OnError":"FailClosed","Latency":[25000000,25000000,27000000,26000000,27000000],"Jitter":2000000,"Vendor":10000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[500000000,1000000000,0,0,0],"Length":6000000000,"Events":[{"At":1797575666,"Kind":"kill","Replica":2,"For":725000000},{"At":4088656287,"Kind":"flush","Replica":1,"For":0}]}`},
	{"Redis's clock stepped an hour forward: the calls booked ahead by the old clock ran beside the slots the emptied token bucket handed out again (two calls every 100 ms of a bucket of 10 a second)",
		`{"Seed":10462,"Replicas":4,"Workers":8,"Policy":{"Kind":"bucket","Limit":10,"Window":1000000000},"Mode":"Block","OnError":"FailClosed","Latency":[1000000,1000000,1000000,1000000],"Jitter":0,"Vendor":10000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[1000000000,500000000,1000000000,0],"Length":6000000000,"Events":[{"At":1685612815,"Kind":"step","Replica":3,"For":3600000000000},{"At":3173770559,"Kind":"flush","Replica":1,"For":0}]}`},
	{"Local: back on Redis, a call larger than the reserved share was booked at the reserve's end unchecked, over calls handed back at their times ahead (13 in a key's window of 10)",
		`{"Seed":10833,"Replicas":5,"Workers":4,"Policy":{"Kind":"perkey","Limit":20,"Window":1000000000},"Mode":"Block","OnError":"Local","Latency":[5000000,5000000,7000000,6000000,6000000],"Jitter":0,"Vendor":10000000,"Deadline":0,"MaxCost":5,"Keys":2,"Join":[1000000000,500000000,1000000000,500000000,1000000000],"Length":6000000000,"Events":[{"At":1266601681,"Kind":"freeze","Replica":2,"For":2020000000}]}`},
	{"a caller that left while Redis decided its call had its booking given back in the lane, a round trip each ahead of the calls waiting: on a Redis 51 ms away they missed their deadlines in turn, and the replica admitted nothing for seconds",
		`{"Seed":11210,"Replicas":1,"Workers":8,"Policy":{"Kind":"bucket","Limit":5,"Window":100000000},"Mode":"Block","OnError":"FailOpen","Latency":[51000000],"Jitter":0,"Vendor":1000000,"Deadline":500000000,"MaxCost":1,"Keys":0,"Join":[0],"Length":3000000000,"Events":[{"At":629937153,"Kind":"scriptflush","Replica":0,"For":0}]}`},
	{"Local: a process whose calls all slept towards slots its fallback booked ahead told Redis of them only as they ran, while the other replica, back on Redis, filled their window (6 in a window of 5)",
		`{"Seed":14604,"Replicas":2,"Workers":8,"Policy":{"Kind":"log","Limit":5,"Window":1000000000},"Mode":"Queue","OnError":"Local","Latency":[52000000,50000000],"Jitter":0,"Vendor":0,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[1000000000,0],"Length":6000000000,"Events":[{"At":1797484174,"Kind":"freeze","Replica":0,"For":1929000000}]}`},
	{"a deploy changed the rule's kind: the new rule's key started empty while the vendor still counted the old rule's calls (found with check_policy's pause taken out: 11 in a window of 10)",
		`{"Seed":29,"Replicas":3,"Workers":2,"Policy":{"Kind":"log","Limit":10,"Window":500000000},"Mode":"Block","OnError":"Local","Latency":[1000000,3000000,3000000],"Jitter":0,"Vendor":10000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[0,500000000,250000000],"Length":3000000000,"Events":[{"At":1124378737,"Kind":"deploy","Replica":0,"For":0}]}`},
	{"Redis's clock stepped a second back, then an hour back: the pause of the first loss, set by the old clock, and the log's entries lay an hour ahead of the new one, and a replica was refused for the hour",
		`{"Seed":41089,"Replicas":3,"Workers":4,"Policy":{"Kind":"log","Limit":6,"Window":100000000},"Mode":"Block","OnError":"Local","Latency":[2000000,0,2000000],"Jitter":0,"Vendor":0,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[0,100000000,0],"Length":3000000000,"Events":[{"At":869014162,"Kind":"step","Replica":2,"For":-1000000000},{"At":1051944996,"Kind":"step","Replica":1,"For":-3600000000000}]}`},
	{"Redis's clock stepped an hour back, and the readings of a replica began anew with its replies half a second slow: once they were fast again, a call woke by the slow readings half a second after its slot, unseen (11 in a window of 10)",
		`{"Seed":65003,"Replicas":50,"Workers":1,"Policy":{"Kind":"log","Limit":10,"Window":100000000},"Mode":"Block","OnError":"FailClosed","Latency":[6000000,6000000,5000000,6000000,5000000,5000000,6000000,6000000,5000000,7000000,6000000,7000000,7000000,5000000,6000000,7000000,7000000,7000000,7000000,7000000,5000000,7000000,6000000,7000000,7000000,7000000,6000000,5000000,6000000,6000000,7000000,7000000,7000000,6000000,5000000,5000000,5000000,7000000,6000000,6000000,6000000,6000000,6000000,5000000,5000000,7000000,6000000,5000000,6000000,7000000],"Jitter":0,"Vendor":1000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[100000000,0,50000000,50000000,100000000,0,50000000,100000000,0,100000000,100000000,50000000,0,0,100000000,0,100000000,50000000,100000000,50000000,100000000,0,0,100000000,50000000,0,0,0,100000000,0,100000000,100000000,0,0,0,0,0,0,0,50000000,50000000,0,100000000,0,50000000,0,100000000,0,50000000,100000000],"Length":3000000000,"Events":[{"At":796208497,"Kind":"step","Replica":42,"For":-3600000000000},{"At":1028420399,"Kind":"stall","Replica":2,"For":488000000}]}`},
	{"the simulation's own: a replica that left twice waited for the first close on a sync.Once, which stops the bubble's clock, and the first close waited for ever for its timers (the run hung)",
		`{"Seed":971,"Replicas":2,"Workers":8,"Policy":{"Kind":"log","Limit":5,"Window":100000000},"Mode":"Block","OnError":"Local","Latency":[25000000,26000000],"Jitter":0,"Vendor":0,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[50000000,100000000],"Length":3000000000,"Events":[{"At":732828098,"Kind":"leave","Replica":1,"For":0},{"At":851255176,"Kind":"leave","Replica":1,"For":0},{"At":994639441,"Kind":"deploy","Replica":0,"For":0}]}`},
	{"two quotas with a policies.Shared rule, calls given back: the group's freed-slot signal was one per process and name, and a call given back in one run closed a channel made in another run's bubble (a fatal error)",
		`{"Seed":92,"Replicas":2,"Workers":8,"Policy":{"Kind":"shared","Limit":20,"Window":500000000,"Keyed":true},"Mode":"Queue","OnError":"FailClosed","Latency":[51000000,52000000],"Jitter":1000000,"Vendor":1000000,"Deadline":50000000,"MaxCost":1,"Keys":2,"Join":[500000000,250000000],"Length":3000000000,"Events":[{"At":2094000515,"Kind":"stall","Replica":0,"For":163000000}],"Classes":3,"Cancel":true}`},
	{"the simulation's own: a script published to a subscriber whose link was held, the link's reader stopped at 256 chunks, and the publish blocked holding the server's lock, on which every other client then waited; the bubble's clock stopped (the run hung)",
		`{"Seed":344,"Replicas":5,"Workers":4,"Policy":{"Kind":"log","Limit":50,"Window":100000000},"Mode":"Queue","OnError":"FailClosed","Latency":[2000000,0,0,1000000,0],"Jitter":0,"Vendor":1000000,"Deadline":0,"MaxCost":10,"Keys":0,"Join":[0,50000000,0,50000000,100000000],"Length":3000000000,"Events":[{"At":824167043,"Kind":"cut","Replica":0,"For":2212000000}],"Classes":2,"Settle":"lower","Cancel":true}`},
	{"a loss found by Pause (feedback.lua, given only the rule every key shares) paused the quota for that rule's window alone, and each key's rule over five windows then admitted 6 in a window of 5 for key k0 (issue 46's first point; found again with feedback.go's Span at 0 and THROTTLE_OFF=blind_rules, each of which closes it alone)",
		`{"Seed":251,"Replicas":1,"Workers":8,"Policy":{"Kind":"perkey","Limit":10,"Window":1000000000,"Long":true},"Mode":"Queue","OnError":"FailClosed","Latency":[25000000],"Jitter":0,"Vendor":10000000,"Deadline":200000000,"MaxCost":1,"Keys":2,"Join":[1000000000],"Length":6000000000,"Events":[{"At":2319142888,"Kind":"kill","Replica":0,"For":1449000000}],"Classes":2,"Skew":true,"Cancel":true,"FoundBy":"pause"}`},
	{"the checker's own: a rule rebuilt after a flush from a vendor that counts fixed windows counts as the vendor does, and a window of the rule around the flush held the vendor's last window's calls and the new one's (6 in a window of 5 where the vendor counted 5); such windows are judged as the vendor counts (TestSimCheck_ARebuiltRuleIsJudgedAsTheVendorCounts)",
		`{"Seed":100023,"Replicas":1,"Workers":1,"Policy":{"Kind":"counter","Limit":5,"Window":200000000},"Mode":"Queue","OnError":"FailClosed","Latency":[6000000],"Jitter":2000000,"Vendor":1000000,"Deadline":0,"MaxCost":1,"Keys":0,"Join":[0],"Length":3000000000,"Events":[{"At":654101130,"Kind":"flush","Replica":0,"For":0}],"Classes":3,"ArrivalOrder":true,"Model":{"Counts":"fixed","At":"arrival","Report":"response","RetryAfter":true,"Lock":0,"Other":0,"Lower":0,"Raise":0}}`},
}

// TestSim_Regressions runs the schedules that found bugs.
func TestSim_Regressions(t *testing.T) {
	for i, r := range simRegressions {
		var s schedule
		if err := json.Unmarshal([]byte(r.schedule), &s); err != nil {
			t.Fatalf("regression %d: %v", i, err)
		}
		t.Run(strconv.FormatUint(s.Seed, 10), func(t *testing.T) {
			t.Parallel()
			if broken, summary := violations(t, s); len(broken) > 0 {
				t.Errorf("%s\nfound again: %s\n%s\n%s", r.why, broken[0], s.describe(), summary)
			}
		})
	}
}
