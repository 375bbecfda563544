#!/usr/bin/env python3
"""tools/bench/dts_simulate.py's fit of the link to a run's exchanges, on synthetic reports whose
exchanges cost a known latency and bandwidth: the fit recovers them, falls back to a line through
the origin when the intercept would be negative, and declines when every wave carried the same
bytes. And the searches' setups it finds, with and without the executors in the report. Exits
non-zero with the first failed check."""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench"))
import dts_simulate  # noqa: E402


def report(exchanges, settled=None):
    """One layer per exchange (bytes, seconds): a parallel wave of two product tasks that share
    the bytes and the exchange's seconds, then a local task; `settled` adds the schedulers'
    settled-collective totals the fallback reads."""
    layers = []
    for index, (size, seconds) in enumerate(exchanges):
        values = {}
        for chunk in range(2):
            key = f"dts:sched.product#p{chunk}:"
            values[f"m{chunk}"] = {key + "seconds": 0.01, key + "wave": 0, key + "parallel": 1,
                                   key + "sync_bytes": size / 2, key + "sync_seconds": seconds / 2}
        values["m2"] = {"dts:sched.fuse:seconds": 0.001, "dts:sched.fuse:wave": 1, "dts:sched.fuse:parallel": 0,
                        "dts:sched.fuse:sync_bytes": 0, "dts:sched.fuse:sync_seconds": 0}
        if settled:
            values[f"model.layers.{index}"] = {"dts:sched:settled_collective_seconds": settled[0],
                                               "dts:sched:settled_collectives": settled[1]}
        layers.append({"name": f"model.layers.{index}", "values": values})
    return {"layers": layers}


def check(condition, message):
    if not condition:
        print("FAIL:", message)
        sys.exit(1)


def fit(exchanges):
    data = report(exchanges)
    return dts_simulate.fitted_link(data, dts_simulate.waves(data))


# 1 ms a collective, 0.5 GB/s.
link = fit([(b, 1e-3 + b / 0.5e9) for b in (2e6, 8e6, 2e6, 8e6)])
check(link is not None, "no fit for exchanges of 2 and 8 MB")
check(abs(link[0] - 1e-3) < 1e-9 and abs(link[1] - 0.5e9) < 1.0, f"fitted {link}, expected (1 ms, 0.5 GB/s)")

# Larger exchanges cost more a byte: the line's intercept is negative, so no latency, and the
# bandwidth of a line through the origin.
points = [(2e6, 4e-3), (8e6, 20e-3)]
link = fit(points)
expected = sum(b * b for b, _ in points) / sum(b * t for b, t in points)
check(link is not None and link[0] == 0.0 and abs(link[1] - expected) < 1.0, f"fitted {link}, expected (0, {expected})")

# One size only: nothing to separate latency from bandwidth.
check(fit([(4e6, 9e-3), (4.1e6, 9.2e-3)]) is None, "fitted exchanges of one size")

# Setups: each executor's first task of a search carries the search's shared state. A task slowed
# in mid-search (a busy host) is no setup where the report names the executors; older reports
# take every task above twice the median for one.
def search(executors):
    """One parallel wave of 8 candidates of one module, 0.01 s each, on ranks 0 and 1 alternately:
    each rank's first carries 0.05 s of setup, and candidate 5 ran 0.04 s slow."""
    values = {}
    for index in range(8):
        key = f"dts:sched.candidate#c{index}:"
        seconds = 0.01 + (0.05 if index < 2 else 0.0) + (0.04 if index == 5 else 0.0)
        values[key + "seconds"], values[key + "wave"], values[key + "parallel"] = seconds, 0, 1
        if executors:
            values[key + "executor_rank"], values[key + "submit_index"] = index % 2, index
    return {"layers": [{"name": "model.layers.0", "values": {"m": values}}]}


group = ("model.layers.0", "sched", "m", "sched.candidate")
groups = dts_simulate.waves(search(True))
setup, bases, carriers = dts_simulate.setups(groups)
tasks = groups[("model.layers.0", "sched", 0)][1]
check(abs(setup[group] - 0.05) < 1e-9 and abs(bases[group] - 0.01) < 1e-9, f"setup {setup}, bases {bases}")
check(carriers == {id(tasks[0]), id(tasks[1])}, "the carriers are not each rank's first task")
check(abs(dts_simulate.rebased(tasks[5], bases, carriers) - 0.05) < 1e-9, "the slow task was rebased")
groups = dts_simulate.waves(search(False))
setup, bases, carriers = dts_simulate.setups(groups)
check(len(carriers) == 3 and abs(setup[group] - (0.05 + 0.05 + 0.04) / 3) < 1e-9, f"older report: setup {setup}")

# A wave's tasks replay in the order the scheduler hands them out: descending cost, then submit
# order (the report lists them in its own order).
values = {}
for index, cost in [(3, 4.0), (0, 1.0), (2, 0.0), (1, 4.0)]:
    key = f"dts:sched.candidate#c{index}:"
    values[key + "seconds"], values[key + "wave"], values[key + "parallel"] = 0.01 * (index + 1), 0, 1
    values[key + "executor_rank"], values[key + "submit_index"], values[key + "cost"] = 0, index, cost
tasks = dts_simulate.waves({"layers": [{"name": "model.layers.0", "values": {"m": values}}]})[
    ("model.layers.0", "sched", 0)][1]
check([t.index for t in tasks] == [1, 3, 0, 2], f"replay order {[t.index for t in tasks]}")

# The script end to end: the fitted figures in its first line, the exchange's fixed cost shared by
# its two collectives (2 settled collectives a layer, one exchange each: point to point), and the
# fallback (settled collectives less the bytes at the given bandwidth) when --bandwidth_gbs is
# given.
with tempfile.TemporaryDirectory() as work:
    path = os.path.join(work, "quant_report.json")
    with open(path, "w") as f:
        json.dump(report([(b, 1e-3 + b / 0.5e9) for b in (2e6, 8e6)], settled=(0.05, 2)), f)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench", "dts_simulate.py")
    out = subprocess.run([sys.executable, script, path, "--ranks", "2"], capture_output=True, text=True, check=True)
    first = out.stdout.splitlines()[0]
    check("0.500 ms per collective, 0.50 GB/s (fitted to the exchanges); collectives an exchange: 2" in first,
          f"first line: {first}")
    out = subprocess.run([sys.executable, script, path, "--ranks", "2", "--bandwidth_gbs", "1"], capture_output=True,
                         text=True, check=True)
    first = out.stdout.splitlines()[0]
    # (2 layers × 0.05 s − 10 MB at 1 GB/s) / 4 collectives.
    check("22.500 ms per collective, 1.00 GB/s;" in first and "fitted" not in first, f"first line: {first}")
print("dts_simulate fits the link")
