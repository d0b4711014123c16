#!/usr/bin/env bash
# ledger.sh measures what each mechanism of docs/PROTOCOL.md's ledger buys:
# it runs one measurement with every mechanism on, then once with each
# named switch off (THROTTLE_OFF, see switches.go), all in one run, and
# prints one line per run. It builds every program it runs with the tag
# throttle_switches: a program built without it keeps every mechanism on.
#
# Usage, from the repository's root:
#
#	bench/ledger.sh cost   [switch ...]  Redis's work: BenchmarkFleetSaturated,
#	                                     BenchmarkDecisions (throttle alone) and
#	                                     BenchmarkAcquireUncontended
#	bench/ledger.sh worst  [switch ...]  Redis's time per decision at each
#	                                     policy's bounds: BenchmarkWorstCase
#	bench/ledger.sh fleet  [switch ...]  real fleets: go run ./conditions, the
#	                                     scenarios in $SCENARIOS
#	bench/ledger.sh faults [switch ...]  the simulation's schedules 1..$SCHEDULES:
#	                                     how many break the promise
#
# Each needs redis-server on PATH. The runs of one call share the machine's
# state of the moment: compare lines of one call, not of two.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: bench/ledger.sh cost|worst|fleet|faults [switch ...]}
shift
runs=(none "$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# off runs its arguments with the switch $1 off ("none": every mechanism on).
off() {
	local m=$1
	shift
	if [ "$m" = none ]; then
		env -u THROTTLE_OFF "$@"
	else
		THROTTLE_OFF=$m "$@"
	fi
}

case $what in
cost)
	(cd bench && go test -tags throttle_switches -c -o "$tmp/bench.test" .)
	for m in "${runs[@]}"; do
		out=$(cd bench && off "$m" "$tmp/bench.test" -test.run '^$' -test.bench 'FleetSaturated/throttle$|Decisions/throttle$|AcquireUncontended$' -test.benchtime "${BENCHTIME:-2s}" 2>&1)
		fleet=$(echo "$out" | grep 'FleetSaturated/throttle' | grep -o '[0-9.]* redis-commands/admitted\|[0-9.]* redis-µs/admitted\|[0-9.]* utilization' | tr '\n' ' ')
		dec=$(echo "$out" | grep 'Decisions/throttle' | grep -o '[0-9.]* decisions/s\|[0-9.]* redis-cpu-µs/decision' | tr '\n' ' ')
		one=$(echo "$out" | grep 'AcquireUncontended' | grep -o '[0-9.]* p50/ping-p50\|[0-9.]* scripts/call' | tr '\n' ' ')
		echo "off=$m | saturated fleet: $fleet | 64 goroutines: $dec | one caller: $one"
	done
	;;
worst)
	(cd bench && go test -tags throttle_switches -c -o "$tmp/bench.test" .)
	for m in "${runs[@]}"; do
		echo "== off=$m"
		(cd bench && off "$m" "$tmp/bench.test" -test.run '^$' -test.bench 'WorstCase' -test.benchtime 1x 2>&1 | grep '^|' || true)
	done
	;;
fleet)
	(cd bench && go build -tags throttle_switches -o "$tmp/conditions" ./conditions)
	for m in "${runs[@]}"; do
		echo "== off=$m"
		off "$m" "$tmp/conditions" -only "${SCENARIOS:-fleet-d25,busy,replicas-1000}" 2>&1 | sed -n '/^| scenario/,/^$/p'
	done
	;;
faults)
	go test -tags throttle_switches -c -o "$tmp/throttle.test" .
	for m in "${runs[@]}"; do
		n=$(off "$m" env GOGC=400 "$tmp/throttle.test" -test.run 'TestSim_Schedules' -sim.n "${SCHEDULES:-500}" -test.timeout 30m 2>&1 | grep -c -- '--- FAIL: TestSim_Schedules/' || true)
		echo "off=$m | schedules 1..${SCHEDULES:-500} | $n broke the promise"
	done
	;;
*)
	echo "usage: bench/ledger.sh cost|worst|fleet|faults [switch ...]" >&2
	exit 2
	;;
esac
