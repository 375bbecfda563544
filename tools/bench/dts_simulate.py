#!/usr/bin/env python3
"""Projects the distributed task scheduler's speed-up to many ranks (docs/scheduler.md).

    tools/bench/dts_simulate.py REPORT [--ranks 2 8 64 512] [--latency_ms L] [--bandwidth_gbs B]

REPORT is the quant_report.json of a 2-rank run (tools/bench/dts.sh writes them): every task's
time on its executor (`dts:<task>:seconds`), its wave, whether the wave was parallel and the bytes
its sync sent (`:sync_bytes`), per module. The schedulers' tensor exchanges give the cost of one
collective unless --latency_ms is given: `dts:<scheduler>:settled_collective_seconds` per settled
collective (the ranks enter them together), less the time of the synced bytes they carried at
--bandwidth_gbs. A report without one (no wave synced tensors) needs --latency_ms.
tools/bench/collective_latency.py measures both figures on this host.

A local wave (every rank runs its tasks, no collective) costs the sum of its tasks on any N.
Each parallel wave of each scheduler run is replayed on N ranks:
  dynamic      the rank that is free first claims the next ceil(left / 4N) tasks in submit order
               (the scheduler's guided chunks), paying one store round trip (a tenth of a
               collective) per claim;
  round-robin  task i runs on rank i mod N;
then the wave's collectives, as the scheduler makes them: the outcomes (one all-gather of a slot
every rank knows) and, when its tasks sync tensors, those tensors (another); 1 or 2 collectives
whatever N, plus one agreement (an all-reduce) per scheduler run, i.e. per layer and scheduler,
each costing latency · log2(N) (recursive doubling's depth, as NCCL's trees and MPI; Gloo's ring
all-gather takes N - 1 steps; the measured latency is at N = 2), plus the wave's synced bytes at
the bandwidth. The outcomes' second collective, when they outgrow the last wave's slot, is not
modelled. The projected speed-up of the sub-task phase is Σ task seconds over Σ (makespan + sync).
The rest of a run (loading, the calibration forward, saving) is not part of it.
"""

import argparse
import heapq
import json
import math
from collections import defaultdict


def waves(report):
    """{(layer, scheduler, wave): (parallel, [(seconds, bytes), ...])} in the report's module order.

    A task's keys are dts:<scheduler>.<task>[#<instance>]:seconds (and :wave, :parallel,
    :sync_bytes); its scheduler run is one per layer, so (layer, scheduler, wave) names a wave."""
    out = {}
    for layer in report["layers"]:
        for module, values in layer.get("values", {}).items():
            for key, seconds in values.items():
                if not (key.startswith("dts:") and key.endswith(":seconds") and key.count(":") == 2):
                    continue
                task = key[len("dts:") : -len(":seconds")]
                if values.get(f"dts:{task}:wave") is None:
                    continue  # a scheduler's summary, not a task
                scheduler = task.split("#")[0].split(".")[0]
                wave = (layer["name"], scheduler, int(values[f"dts:{task}:wave"]))
                parallel = values.get(f"dts:{task}:parallel", 1.0) > 0
                out.setdefault(wave, (parallel, []))[1].append((seconds, values.get(f"dts:{task}:sync_bytes", 0.0)))
    return out


def measured_latency(report, groups, bandwidth):
    """Seconds per collective: the tensor exchanges, which the ranks enter together from the
    outcomes' gather (the other collectives also wait for the slowest rank), less their bytes at
    `bandwidth` B/s (they carried every parallel wave's synced bytes); None without one."""
    totals = defaultdict(float)
    for layer in report["layers"]:
        for values in layer.get("values", {}).values():
            for key, value in values.items():
                if key.startswith("dts:") and key.count(":") == 2:
                    totals[key.split(":")[2]] += value
    if not totals["settled_collectives"]:
        return None
    sent = sum(b for parallel, tasks in groups.values() if parallel for _, b in tasks)
    return max(0.0, totals["settled_collective_seconds"] - sent / bandwidth) / totals["settled_collectives"]


def makespan(costs, ranks, dynamic, take):
    if not dynamic:
        per_rank = [0.0] * ranks
        for i, c in enumerate(costs):
            per_rank[i % ranks] += c
        return max(per_rank)
    # Guided chunks, as the scheduler claims them: ceil(left / 4N) tasks per store round trip, left
    # as the claiming rank last saw the counter.
    parts, counter, n = 4 * ranks, 0, len(costs)
    free = [(0.0, r, 0) for r in range(ranks)]
    while counter < n:
        time, rank, seen = heapq.heappop(free)
        chunk = max(1, -(-(n - seen) // parts))
        time += take + sum(costs[counter : counter + chunk])
        counter += chunk
        heapq.heappush(free, (time, rank, counter))
    return max(time for time, _, _ in free)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 512])
    parser.add_argument("--latency_ms", type=float, default=None)
    parser.add_argument("--bandwidth_gbs", type=float, default=1.0)
    args = parser.parse_args()
    report = json.load(open(args.report))
    groups = waves(report)
    bandwidth = args.bandwidth_gbs * 1e9
    latency = args.latency_ms / 1000 if args.latency_ms is not None else measured_latency(report, groups, bandwidth)
    if latency is None:
        parser.error(f"{args.report} holds no settled collective (no parallel wave synced tensors): give "
                     "--latency_ms (tools/bench/collective_latency.py measures it)")
    runs = {(layer, scheduler) for (layer, scheduler, _), (parallel, _) in groups.items() if parallel}
    total = sum(c for _, tasks in groups.values() for c, _ in tasks)
    count = sum(len(tasks) for _, tasks in groups.values())
    print(f"{args.report}: {count} tasks in {len(groups)} waves, {total:.2f} s of tasks; "
          f"{latency * 1000:.3f} ms per collective, {args.bandwidth_gbs} GB/s")
    print()
    print("| ranks | assignment | projected s | speed-up | of N |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in args.ranks:
        depth = max(1.0, math.log2(n))
        for dynamic in (True, False):
            projected = len(runs) * latency * depth  # the agreements
            for parallel, tasks in groups.values():
                costs = [c for c, _ in tasks]
                if not parallel:
                    projected += sum(costs)
                    continue
                sent = sum(b for _, b in tasks)
                collectives = 2 if sent > 0 else 1
                sync = collectives * latency * depth + sent / bandwidth
                projected += makespan(costs, n, dynamic, latency / 10) + sync
            speedup = total / projected if projected else 1.0
            print(f"| {n} | {'dynamic' if dynamic else 'round-robin'} | {projected:.2f} | {speedup:.2f}x | "
                  f"{speedup / n:.2f} |")


if __name__ == "__main__":
    main()
