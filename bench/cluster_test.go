package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// clusterQuotas is how many quotas BenchmarkCluster spreads its calls over.
const clusterQuotas = 1_000

// clusterPolicy never binds here: each quota sees about a thousandth of the
// calls, far below the most a SlidingLog takes (policies.MaxLogLimit) per
// second.
var clusterPolicy = policies.SlidingLog{Limit: policies.MaxLogLimit, Window: time.Second}

// clusterRef is the least number of calls of a one-node run that counts
// towards the cluster's x-one-node: the probe runs of a few calls do not.
const clusterRef = 10_000

// BenchmarkCluster measures 1,000 quotas (q0000 to q0999), one limiter each,
// on a 3-master Redis Cluster and on one redis-server, both started from the
// same binary in the same run. 64 goroutines split b.N; call i goes to quota
// i mod 1,000, so every quota gets the same share of the calls. Each target
// has one go-redis client (a ClusterClient for the cluster) with a pool of
// 64 connections per node, one per goroutine, so that no goroutine waits for
// a connection on either. The limiters live for the whole benchmark, and
// before each run's clock starts every one decides one call.
//
// Every key of a quota carries the hash tag {name}, so a quota lives in one
// slot and on one master. The benchmark asks the cluster for the slot of each
// quota (CLUSTER KEYSLOT) and for the owner of each slot (CLUSTER SLOTS), and
// reports the quotas per master; the cluster's per-master share of the script
// calls (INFO commandstats on each master) shows where the calls went.
//
// decisions/s is b.N over the wall time; x-one-node is the cluster's rate
// over the mean rate of the one-node runs of at least clusterRef calls made
// before it in the same process (not reported when there were none).
// script-in-redis-µs is Redis's mean time per EVALSHA and script-busy its
// total script time over the wall time, per master for the cluster.
// go-cpu-cores and redis-cpu-cores are the CPU time (user and system, from
// /proc, Linux only) of this process and of the target's redis-servers over
// the wall time, and cpu-µs/decision their sum over b.N; machine-cpu-cores
// is the busy time of the whole machine, other work included, over the wall
// time (on a 2-core machine it cannot pass 2), and steal-cores the time the
// hypervisor took from it.
func BenchmarkCluster(b *testing.B) {
	c := redistest.StartCluster(b)
	s := newServer(b)
	ctx := context.Background()

	names := make([]string, clusterQuotas)
	for i := range names {
		names[i] = fmt.Sprintf("q%04d", i)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, PoolSize: decisionWorkers})
	b.Cleanup(func() { _ = cc.Close() })
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, PoolSize: decisionWorkers})
	b.Cleanup(func() { _ = rdb.Close() })

	perMaster := quotasPerMaster(b, ctx, cc, c.Addrs, names)
	b.Logf("quotas per master (%s): %v", strings.Join(c.Addrs, ", "), perMaster)

	nodeClients := make([]*redis.Client, len(c.Nodes))
	nodePids := make([]int, len(c.Nodes))
	for i, n := range c.Nodes {
		nodeClients[i] = n.Client(b)
		nodePids[i] = n.Pid()
	}

	nodeLims, clusterLims := limitersOn(b, rdb, names), limitersOn(b, cc, names)

	var oneNode []float64 // decisions/s of the one-node runs of clusterRef calls or more
	b.Run("one-node", func(b *testing.B) {
		rate := runCluster(b, nodeLims, []*redis.Client{rdb}, []int{s.Pid()})
		if b.N >= clusterRef {
			oneNode = append(oneNode, rate)
		}
	})
	b.Run("cluster", func(b *testing.B) {
		rate := runCluster(b, clusterLims, nodeClients, nodePids)
		if len(oneNode) > 0 {
			var sum float64
			for _, r := range oneNode {
				sum += r
			}
			b.ReportMetric(rate/(sum/float64(len(oneNode))), "x-one-node")
		}
		b.ReportMetric(float64(slices.Min(perMaster)), "quotas/master-min")
		b.ReportMetric(float64(slices.Max(perMaster)), "quotas/master-max")
	})
}

// quotasPerMaster counts the quotas whose slot each master owns, masters in
// the order of addrs. The slot is the cluster's own answer for a key of the
// quota, and the owner that of CLUSTER SLOTS.
func quotasPerMaster(b *testing.B, ctx context.Context, cc *redis.ClusterClient, addrs, names []string) []int {
	//lint:ignore SA1019 CLUSTER SLOTS answers on Redis before 7.0 too, which CLUSTER SHARDS does not.
	ranges, err := cc.ClusterSlots(ctx).Result()
	if err != nil {
		b.Fatal(err)
	}
	counts := make([]int, len(addrs))
	for _, name := range names {
		slot, err := cc.ClusterKeySlot(ctx, keyPrefix+":{"+name+"}:x").Result()
		if err != nil {
			b.Fatal(err)
		}
		master := -1
		for _, r := range ranges {
			if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
				master = slices.Index(addrs, r.Nodes[0].Addr)
			}
		}
		if master < 0 {
			b.Fatalf("slot %d of quota %s: no master of %v owns it in %+v", slot, name, addrs, ranges)
		}
		counts[master]++
	}
	return counts
}

func limitersOn(b *testing.B, rdb redis.UniversalClient, names []string) []*throttle.Limiter {
	lims := make([]*throttle.Limiter, len(names))
	for i, name := range names {
		lim, err := throttle.New(rdb, name, clusterPolicy)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = lim.Close(context.Background()) })
		lims[i] = lim
	}
	return lims
}

// runCluster makes b.N decisions, call i on lims[i mod len(lims)], after one
// untimed call of every limiter, and reports the rate and what Redis and the
// CPUs did meanwhile. nodes are clients of each server of the target, pids
// their processes. It returns decisions/s.
func runCluster(b *testing.B, lims []*throttle.Limiter, nodes []*redis.Client, pids []int) float64 {
	ctx := context.Background()
	allow := func(i int64) error {
		lim := lims[int(i%int64(len(lims)))]
		d, err := lim.Allow(ctx)
		if err == nil && !d.OK {
			err = fmt.Errorf("%s refused: %+v", lim.Name(), d)
		}
		return err
	}
	callAll(b, int64(len(lims)), allow)
	for _, n := range nodes {
		if err := n.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
	}
	self := os.Getpid()
	goCPU, goOK := cpuTime(self)
	redisCPU, redisOK := cpuTimes(pids)
	busy, steal, machineOK := machineCPU()

	b.ResetTimer()
	start := time.Now()
	callAll(b, int64(b.N), func(i int64) error { return allow(i - 1) })
	elapsed := time.Since(start)
	b.StopTimer()

	goCPUEnd, goEndOK := cpuTime(self)
	redisCPUEnd, redisEndOK := cpuTimes(pids)
	busyEnd, stealEnd, machineEndOK := machineCPU()
	rate := float64(b.N) / elapsed.Seconds()
	b.ReportMetric(rate, "decisions/s")

	reportScripts(b, ctx, nodes, elapsed)
	if goOK && goEndOK && redisOK && redisEndOK {
		goUsed, redisUsed := goCPUEnd-goCPU, redisCPUEnd-redisCPU
		b.ReportMetric(goUsed.Seconds()/elapsed.Seconds(), "go-cpu-cores")
		b.ReportMetric(redisUsed.Seconds()/elapsed.Seconds(), "redis-cpu-cores")
		b.ReportMetric(us(goUsed+redisUsed)/float64(b.N), "cpu-µs/decision")
	}
	if machineOK && machineEndOK {
		b.ReportMetric((busyEnd-busy).Seconds()/elapsed.Seconds(), "machine-cpu-cores")
		b.ReportMetric((stealEnd-steal).Seconds()/elapsed.Seconds(), "steal-cores")
	}
	return rate
}

// reportScripts reports the script calls each of nodes ran, and how busy
// they kept it, over elapsed.
func reportScripts(b *testing.B, ctx context.Context, nodes []*redis.Client, elapsed time.Duration) {
	var calls int64
	stats := make([]redisScripts, len(nodes))
	for i, n := range nodes {
		stats[i] = scriptStats(b, ctx, n)
		calls += stats[i].calls
	}
	if calls > 0 {
		b.ReportMetric(float64(b.N)/float64(calls), "decisions/script-call")
	}
	for i, st := range stats {
		prefix := ""
		if len(nodes) > 1 {
			prefix = "master" + strconv.Itoa(i+1) + "-"
			if calls > 0 {
				b.ReportMetric(float64(st.calls)/float64(calls), prefix+"script-share")
			}
		}
		b.ReportMetric(st.evalshaMean, prefix+"script-in-redis-µs")
		b.ReportMetric(st.usec/us(elapsed), prefix+"script-busy")
	}
}

// machineCPU returns the CPU time every CPU of the machine spent busy (user,
// nice, system, irq, softirq: every process's, not only the benchmark's) and
// the time the hypervisor took from them (steal), from the first line of
// /proc/stat; false where there is no /proc.
func machineCPU() (busy, steal time.Duration, ok bool) {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, false
	}
	var ticks [8]int64 // user nice system idle iowait irq softirq steal
	for i := range ticks {
		if ticks[i], err = strconv.ParseInt(f[i+1], 10, 64); err != nil {
			return 0, 0, false
		}
	}
	busy = time.Duration(ticks[0]+ticks[1]+ticks[2]+ticks[5]+ticks[6]) * clockTick
	return busy, time.Duration(ticks[7]) * clockTick, true
}

// clockTick is Linux's USER_HZ, the unit of the CPU times in /proc/<pid>/stat
// (100 on every mainstream architecture).
const clockTick = 10 * time.Millisecond

// cpuTime returns the user and system CPU time of process pid, all its
// threads included, from /proc/<pid>/stat; false where there is no /proc.
func cpuTime(pid int) (time.Duration, bool) {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name, in parentheses, may hold spaces; fields 14 and 15
	// (utime, stime) are the 12th and 13th after it.
	i := strings.LastIndex(string(raw), ") ")
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(raw[i+2:]))
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * clockTick, true
}

func cpuTimes(pids []int) (time.Duration, bool) {
	var sum time.Duration
	for _, pid := range pids {
		t, ok := cpuTime(pid)
		if !ok {
			return 0, false
		}
		sum += t
	}
	return sum, true
}
