#!/usr/bin/env python3
"""The latency of one small Gloo collective between two processes on this host: the figure
tools/bench/dts_simulate.py --latency_ms takes when the in-run measurement (the schedulers'
settled tensor exchanges) is missing or disturbed by other work.

    .venv/bin/python tools/bench/collective_latency.py [--iterations 300] [--work_ms 2]

Two ranks all-reduce one int64 (the scheduler's agreement) `iterations` times, first back to back,
then with `work_ms` of CPU work on each rank between collectives, as between a scheduler's waves.
Prints the median, 90th percentile and mean on rank 0. Then the bandwidth (--bandwidth_gbs), in
bytes received a second: 8 MiB a rank in an all-gather (how a wave's synced tensors travel where
the group cannot exchange them in place), and sent and received point to point at once (how they
travel over Gloo, ProcessGroup::exchangeInPlace).
PyTorch's Gloo is the library qpipe's process group links.
"""

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, port, iterations, work_ms):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    value = torch.zeros(2, dtype=torch.int64)
    for _ in range(50):
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    for label, work in (("back to back", 0.0), (f"after {work_ms} ms of work", work_ms / 1000)):
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            while time.perf_counter() - start < work:
                pass
            start = time.perf_counter()
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            times.append(time.perf_counter() - start)
        times.sort()
        if rank == 0:
            median, p90 = times[len(times) // 2], times[len(times) * 9 // 10]
            mean = sum(times) / len(times)
            print(f"{label:>22}: median {median * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms")
    part = torch.zeros(8 << 20, dtype=torch.uint8)
    parts = [torch.empty_like(part) for _ in range(2)]

    def point_to_point():
        sent, received = dist.isend(part, 1 - rank), dist.irecv(parts[1 - rank], 1 - rank)
        sent.wait()
        received.wait()

    for label, exchange in (("8 MiB all-gather", lambda: dist.all_gather(parts, part)),
                            ("8 MiB point to point", point_to_point)):
        times = []
        for _ in range(20):
            dist.barrier()
            start = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - start)
        times.sort()
        if rank == 0:
            median = times[len(times) // 2]
            print(f"{label:>22}: median {median * 1e3:.3f} ms, {part.numel() / median / 1e9:.2f} GB/s")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--work_ms", type=float, default=2.0)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.iterations, args.work_ms)
        return
    port = free_port()
    common = ["--port", str(port), "--iterations", str(args.iterations), "--work_ms", str(args.work_ms)]
    print(f"Gloo all-reduce of 2 int64, 2 ranks on {os.cpu_count()} cores, {args.iterations} iterations")
    peer = subprocess.Popen([sys.executable, __file__, "--rank", "1", *common])
    rank_main(0, port, args.iterations, args.work_ms)
    sys.exit(peer.wait())


if __name__ == "__main__":
    main()
