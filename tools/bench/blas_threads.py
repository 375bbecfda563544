#!/usr/bin/env python3
"""MKL's fp32 GEMM on one and two threads, as LibTorch runs it, with and without MKL's strict
conditional numerical reproducibility (what `qpipe` asks for: docs/multirank.md, "Threads").

For each mode, in a fresh process (MKL takes the mode only before its first computation): how many
shapes of a grid give other bits on two threads than on one, and the GFLOP/s of SmolLM2-like
shapes on two threads (best of five rounds). Run it with the project's torch:
    .venv/bin/python tools/bench/blas_threads.py [--rounds 3]
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import time

GRID = list(itertools.product([1, 8, 32, 37, 64, 128, 512], [96, 576, 1031, 1536, 4096], [16, 19, 64, 192, 576]))
SPEED = [(512, 576, 576), (512, 576, 192), (512, 576, 1536), (512, 1536, 576), (4096, 576, 1536),
         (4096, 1536, 576), (128, 1536, 576), (32, 576, 49152), (512, 576, 49152)]


def measure():
    import torch

    torch.manual_seed(0)
    differing = 0
    for m, k, n in GRID:
        a, b = torch.randn(m, k), torch.randn(n, k)
        torch.set_num_threads(2)
        two = torch.nn.functional.linear(a, b)
        torch.set_num_threads(1)
        differing += not torch.equal(torch.nn.functional.linear(a, b), two)
    torch.set_num_threads(2)
    speed = []
    for m, k, n in SPEED:
        a, b = torch.randn(m, k), torch.randn(n, k)
        for _ in range(3):
            torch.nn.functional.linear(a, b)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                torch.nn.functional.linear(a, b)
            best = min(best, (time.perf_counter() - start) / 10)
        speed.append(2 * m * k * n / best / 1e9)
    print(json.dumps({"differing": differing, "gflops": speed}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each mode")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure()
        return
    rows = []
    for _ in range(args.rounds):
        for mode, cbwr in (("default", None), ("strict", "AUTO,STRICT")):
            env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
            if cbwr:
                env["MKL_CBWR"] = cbwr
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True, capture_output=True,
                                 text=True).stdout
            rows.append((mode, json.loads(out.strip().splitlines()[-1])))
    header = " ".join(f"{m}x{k}x{n}" for m, k, n in SPEED)
    print(f"shapes differing on 2 vs 1 threads (of {len(GRID)}); then GFLOP/s on 2 threads: {header}")
    for mode, r in rows:
        print(f"{mode:8s} {r['differing']:3d}   " + " ".join(f"{g:7.1f}" for g in r["gflops"]))


if __name__ == "__main__":
    main()
