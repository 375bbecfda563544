#!/usr/bin/env python3
"""Projects the distributed task scheduler's speed-up to many ranks (docs/scheduler.md).

    tools/bench/dts_simulate.py REPORT [--ranks 2 8 64 512] [--latency_ms L] [--bandwidth_gbs B] [--no_setup]

REPORT is the quant_report.json of a 2-rank run (tools/bench/dts.sh writes them): every task's
time on its executor (`dts:<task>:seconds`), its wave, whether the wave was parallel and the bytes
its sync sent (`:sync_bytes`), per module. The schedulers' tensor exchanges give the cost of one
collective and the bandwidth unless --latency_ms and --bandwidth_gbs are given: the parallel waves
that synced tensors end in an exchange the ranks enter together, and each of their tasks records
its share of it (`:sync_seconds`); a least-squares line through those waves' (bytes, seconds)
gives the latency (its intercept; 0 where the bytes explain the whole time, when --latency_ms from
collective_latency.py is the better figure) and the bandwidth (its slope) where the waves carried
at least two clearly different amounts. Otherwise, or given --bandwidth_gbs (default 1 GB/s then), the
latency is `dts:<scheduler>:settled_collective_seconds` per settled collective less the synced
bytes' time at that bandwidth. Reports written before `:sync_seconds` existed take the second
way. A report without a settled exchange (no wave synced tensors) needs --latency_ms.
tools/bench/collective_latency.py measures both figures on this host.

A local wave (every rank runs its tasks, no collective) costs the sum of its tasks on any N.
Each parallel wave of each scheduler run is replayed on N ranks, its tasks in the order the
scheduler hands them out (descending `:cost` where the submitter gave one, then submit order):
  dynamic      the rank that is free first claims the next tasks in that order, as few as hold
               a 4N-th of what is left by cost (by count where a task has none: ceil(left /
               4N)); the scheduler's guided chunks, paying one store round trip (a tenth of a
               collective) per claim;
  round-robin  task i runs on rank i mod N;
then the wave's collectives, as the scheduler makes them: the outcomes (one all-gather of a slot
every rank knows) and, when its tasks sync tensors, their exchange (two over Gloo: the sizes, then
point to point; one packed all-gather elsewhere; the report's settled collectives tell which);
1 to 3 collectives whatever N, plus one agreement (an all-reduce) per scheduler run, i.e. per layer and scheduler,
each costing latency · log2(N) (recursive doubling's depth, as NCCL's trees and MPI; Gloo's ring
all-gather takes N - 1 steps; the measured latency is at N = 2), plus the wave's synced bytes at
the bandwidth. The outcomes' second collective, when they outgrow the last wave's slot, is not
modelled. The projected speed-up of the sub-task phase is Σ task seconds over Σ (makespan + sync).
The rest of a run (loading, the calibration forward, saving) is not part of it.

A search's candidates (the parallel tasks of one module in one scheduler run) can share state that
the first of them a rank runs computes and the rest reuse, such as the float product a smoothing
search's losses compare against: the report shows it in each executor's first task of the search
(its :executor_rank and :submit_index), when those took more than twice the median of the other
tasks. Such a group's setup (their mean excess over that median) is paid once per rank that runs
any of its tasks in the run, and once in the one-rank time the speed-up divides. Reports from
before executors were recorded take every task above twice its group's median as a carrier,
which also counts a task slowed by a busy host as a setup. --no_setup replays the recorded times
as they are.
"""

import argparse
import heapq
import json
import math
import statistics
from collections import defaultdict, namedtuple

# A task as the report recorded it (executor and index None where it did not; cost 0 where its
# submitter gave none).
Task = namedtuple("Task", "seconds bytes group executor index cost")


def waves(report):
    """{(layer, scheduler, wave): (parallel, [Task, ...])} in the report's module order; a Task's
    group is (layer, scheduler, module, task name), the tasks of one search, and its executor and
    submit index are None in reports from before they were recorded.

    A task's keys are dts:<scheduler>.<task>[#<instance>]:seconds (and :wave, :parallel,
    :sync_bytes, :executor_rank, :submit_index); its scheduler run is one per layer, so (layer,
    scheduler, wave) names a wave."""
    out = {}
    for layer in report["layers"]:
        for module, values in layer.get("values", {}).items():
            for key, seconds in values.items():
                if not (key.startswith("dts:") and key.endswith(":seconds") and key.count(":") == 2):
                    continue
                task = key[len("dts:") : -len(":seconds")]
                if values.get(f"dts:{task}:wave") is None:
                    continue  # a scheduler's summary, not a task
                name = task.split("#")[0]
                scheduler = name.split(".")[0]
                wave = (layer["name"], scheduler, int(values[f"dts:{task}:wave"]))
                parallel = values.get(f"dts:{task}:parallel", 1.0) > 0
                group = (layer["name"], scheduler, module, name)
                rank = values.get(f"dts:{task}:executor_rank")
                index = values.get(f"dts:{task}:submit_index")
                out.setdefault(wave, (parallel, []))[1].append(
                    Task(seconds, values.get(f"dts:{task}:sync_bytes", 0.0), group,
                         None if rank is None else int(rank), None if index is None else int(index),
                         values.get(f"dts:{task}:cost", 0.0)))
    # Each wave's tasks in the order the scheduler hands them out: descending cost, then submit
    # order (the report's module order where it has no submit index).
    for _, tasks in out.values():
        if all(t.index is not None for t in tasks):
            tasks.sort(key=lambda t: t.index)
        tasks.sort(key=lambda t: -t.cost)
    return dict(sorted(out.items(), key=lambda item: (item[0][0], item[0][1], item[0][2])))


def setups(groups):
    """({group: setup seconds}, {group: base task seconds}, carriers) of the parallel groups whose
    tasks carry a setup; carriers holds the id() of each Task that carried one (see rebased).

    Where the report names each task's executor and submit index, a setup's carriers are each
    executor's first task of the group (the search's shared state is computed by the first task a
    rank runs in the run), and the group has a setup when they took on average more than twice
    the median of its other tasks, the base. Older reports: every task above twice the group's
    median is a carrier, which also counts a slow task in mid-search (a busy host) as a setup."""
    members = defaultdict(list)
    for parallel, tasks in groups.values():
        if parallel:
            for task in tasks:
                members[task.group].append(task)
    setup, bases, carriers = {}, {}, set()
    for group, tasks in members.items():
        if len(tasks) <= 2:
            continue
        if all(task.executor is not None for task in tasks):
            first = {}
            for task in sorted(tasks, key=lambda t: t.index):
                first.setdefault(task.executor, task)
            chosen = list(first.values())
            chosen_ids = {id(task) for task in chosen}
            others = [task.seconds for task in tasks if id(task) not in chosen_ids]
            if not others:
                continue
            base = statistics.median(others)
        else:
            base = statistics.median(task.seconds for task in tasks)
            chosen = [task for task in tasks if task.seconds > 2 * base]
        excess = sum(task.seconds - base for task in chosen) / len(chosen) if chosen else 0.0
        if excess > base:
            setup[group], bases[group] = excess, base
            carriers.update(id(task) for task in chosen)
    return setup, bases, carriers


def exchange_collectives(report, groups):
    """Collectives a tensor exchange took in this run: 2 over Gloo (every rank's view of the sizes,
    then the pairs' messages: ProcessGroup::exchangeInPlace), 1 for a packed all-gather within its
    slot (NCCL, and reports from before the exchange went point to point)."""
    settled = sum(value for layer in report["layers"] for values in layer.get("values", {}).values()
                  for key, value in values.items()
                  if key.startswith("dts:") and key.count(":") == 2 and key.endswith(":settled_collectives"))
    exchanges = sum(1 for parallel, tasks in groups.values() if parallel and sum(t.bytes for t in tasks) > 0)
    return max(1, round(settled / exchanges)) if exchanges and settled else 1


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
    sent = sum(t.bytes for parallel, tasks in groups.values() if parallel for t in tasks)
    return max(0.0, totals["settled_collective_seconds"] - sent / bandwidth) / totals["settled_collectives"]


def fitted_link(report, groups):
    """(seconds per exchange, bytes per second) fitted over the parallel waves that synced
    tensors: a wave's exchange (the sum of its tasks' :sync_seconds shares) against its bytes, by
    least squares. The intercept is the exchange's fixed cost, which its collectives share
    (exchange_collectives) and which also holds the setup of its point-to-point messages: more
    than a small collective's latency, the figure --latency_ms takes from collective_latency.py.
    Where the intercept is negative (the bytes explain the whole time, and the exchanges cannot
    resolve a latency that small), it is 0 and the bandwidth a fit through the origin. None when
    fewer than two waves synced tensors or their byte counts differ by less than a fifth."""
    synced = defaultdict(float)
    for layer in report["layers"]:
        for values in layer.get("values", {}).values():
            for key, value in values.items():
                if key.startswith("dts:") and key.endswith(":sync_seconds") and key.count(":") == 2:
                    task = key[len("dts:") : -len(":sync_seconds")]
                    wave = values.get(f"dts:{task}:wave")
                    if wave is not None:
                        synced[(layer["name"], task.split("#")[0].split(".")[0], int(wave))] += value
    points = [(sum(t.bytes for t in tasks), synced[wave]) for wave, (parallel, tasks) in groups.items()
              if parallel and wave in synced and sum(t.bytes for t in tasks) > 0]
    if len(points) < 2 or min(b for b, _ in points) > 0.8 * max(b for b, _ in points):
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    if slope <= 0:
        return None
    latency = mean_t - slope * mean_b
    if latency < 0:
        latency, slope = 0.0, sum(b * t for b, t in points) / sum(b * b for b, _ in points)
    return latency, 1.0 / slope


def rebased(task, bases, carriers):
    """A task's time without its search's setup: the group's base for a task that carried it."""
    return bases[task.group] if id(task) in carriers else task.seconds


def claim_size(weights, ranks):
    """The scheduler's guided chunk (scheduler::claimSize), operation for operation: the fewest of
    the unclaimed tasks' weights, in hand-out order, that reach a 4N-th of their sum; at least 1.
    The sum is a plain loop, as in C++ (Python 3.12's sum() compensates)."""
    total = 0.0
    for weight in weights:
        total += weight
    target, taken, chunk = total * (1 - 1e-9), 0.0, 0
    while chunk < len(weights) and (chunk == 0 or taken * (4.0 * ranks) < target):
        taken += weights[chunk]
        chunk += 1
    return max(1, chunk)


def makespan(tasks, ranks, dynamic, take, setup, seen):
    """The wave's wall time on `ranks`; tasks are (seconds, group, cost) in the order the scheduler
    hands them out. A rank's first task of a group with a setup pays it (seen[rank]: the groups it
    set up earlier in the run)."""
    def cost(rank, seconds, group):
        if group in setup and group not in seen[rank]:
            seen[rank].add(group)
            return seconds + setup[group]
        return seconds

    if not dynamic:
        per_rank = [0.0] * ranks
        for i, (seconds, group, _) in enumerate(tasks):
            per_rank[i % ranks] += cost(i % ranks, seconds, group)
        return max(per_rank)
    # Guided chunks, as the scheduler claims them, one store round trip each, the unclaimed tasks
    # as the claiming rank last saw the counter; weighed by cost where every task has one.
    weights = [w for _, _, w in tasks] if all(w > 0 for _, _, w in tasks) else [1.0] * len(tasks)
    counter, n = 0, len(tasks)
    free = [(0.0, r, 0) for r in range(ranks)]
    while counter < n:
        time, rank, seen_counter = heapq.heappop(free)
        chunk = claim_size(weights[seen_counter:], ranks)
        time += take + sum(cost(rank, seconds, group) for seconds, group, _ in tasks[counter : counter + chunk])
        counter += chunk
        heapq.heappush(free, (time, rank, counter))
    return max(time for time, _, _ in free)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 512])
    parser.add_argument("--latency_ms", type=float, default=None)
    parser.add_argument("--bandwidth_gbs", type=float, default=None)
    parser.add_argument("--no_setup", action="store_true", help="replay the recorded task times as they are")
    args = parser.parse_args()
    report = json.load(open(args.report))
    groups = waves(report)
    exchanging = exchange_collectives(report, groups)
    fit = fitted_link(report, groups) if args.bandwidth_gbs is None else None
    bandwidth = fit[1] if fit else (args.bandwidth_gbs or 1.0) * 1e9
    if args.latency_ms is not None:
        latency = args.latency_ms / 1000
    else:
        latency = fit[0] / exchanging if fit else measured_latency(report, groups, bandwidth)
    if latency is None:
        parser.error(f"{args.report} holds no settled collective (no parallel wave synced tensors): give "
                     "--latency_ms (tools/bench/collective_latency.py measures it)")
    runs = {(layer, scheduler) for (layer, scheduler, _), (parallel, _) in groups.items() if parallel}
    setup, bases, carriers = ({}, {}, set()) if args.no_setup else setups(groups)
    # The one-rank time: every task without a setup, every setup once.
    total = sum(rebased(t, bases, carriers) for _, tasks in groups.values() for t in tasks) + sum(setup.values())
    count = sum(len(tasks) for _, tasks in groups.values())
    print(f"{args.report}: {count} tasks in {len(groups)} waves, {total:.2f} s of tasks "
          f"({len(setup)} searches with a setup of {sum(setup.values()):.2f} s in all); "
          f"{latency * 1000:.3f} ms per collective, {bandwidth / 1e9:.2f} GB/s"
          f"{' (fitted to the exchanges)' if fit else ''}; collectives an exchange: {exchanging}")
    print()
    print("| ranks | assignment | projected s | speed-up | of N |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in args.ranks:
        depth = max(1.0, math.log2(n))
        for dynamic in (True, False):
            projected = len(runs) * latency * depth  # the agreements
            seen, run = None, None
            for (layer, scheduler, _), (parallel, tasks) in groups.items():
                if (layer, scheduler) != run:
                    run, seen = (layer, scheduler), [set() for _ in range(n)]
                costs = [(rebased(t, bases, carriers), t.group, t.cost) for t in tasks]
                if not parallel:
                    projected += sum(c for c, _, _ in costs)
                    continue
                sent = sum(t.bytes for t in tasks)
                collectives = 1 + exchanging if sent > 0 else 1
                sync = collectives * latency * depth + sent / bandwidth
                projected += makespan(costs, n, dynamic, latency / 10, setup, seen) + sync
            speedup = total / projected if projected else 1.0
            print(f"| {n} | {'dynamic' if dynamic else 'round-robin'} | {projected:.2f} | {speedup:.2f}x | "
                  f"{speedup / n:.2f} |")


if __name__ == "__main__":
    main()
