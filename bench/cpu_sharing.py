"""What two processes get from this machine's cores at once: the rate of one thread's work alone, beside an
identical process, and of one process on every core.

The asynchronous loop (train.max_staleness = k > 0) runs the trainer and the rollout worker side by side, one
thread each on 2 cores; its best case assumes each keeps the speed it has alone (bench/async_grpo.py's
"overlap bound"). This measures that assumption on the two kinds of work a GRPO step does, with nothing of
turbogrpo in the way:

  gemm      float32 [1024 x 1024] @ [1024 x 1024] products (compute-bound: the update's training forward)
  decode    float32 [8 x 576] @ [576 x 49152] products, a weight matrix of 113 MB streamed per call
            (bandwidth-bound: a decode step's LM head, SmolLM2-135M's shape)

For each: one process with 1 thread alone, the same two processes at once (each with 1 thread, started
together), and one process with one thread per core; rates in calls per second, medians of ``--repeats`` runs
of ``--seconds`` each, the variants alternated.

    python bench/cpu_sharing.py            # ~2 minutes; writes bench/results/cpu_sharing.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_results  # noqa: E402

WORK = {"gemm": ((1024, 1024), (1024, 1024)), "decode": ((8, 576), (576, 49152))}
"""kind -> (left operand shape, right operand shape) of the product each call computes."""


def calls_per_second(kind: str, threads: int, seconds: float, start, result) -> None:
    """In a process of its own: ``threads`` torch threads, wait for ``start``, then count products of ``kind``
    for ``seconds``; the rate goes into ``result`` (a queue)."""
    import torch
    torch.set_num_threads(threads)
    left, right = (torch.randn(shape) for shape in WORK[kind])
    for _ in range(3):  # warm the allocator and the kernels
        left @ right
    start.wait()
    calls, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        left @ right
        calls += 1
    result.put(calls / elapsed)


def measure(kind: str, processes: int, threads: int, seconds: float) -> list[float]:
    """Each process's calls per second when ``processes`` run ``kind`` at once with ``threads`` threads each."""
    context = mp.get_context("spawn")
    start, result = context.Event(), context.Queue()
    workers = [context.Process(target=calls_per_second, args=(kind, threads, seconds, start, result))
               for _ in range(processes)]
    for w in workers:
        w.start()
    time.sleep(5.0)  # every process has imported torch and warmed up before any starts counting
    start.set()
    rates = [result.get() for _ in workers]
    for w in workers:
        w.join()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of one timed run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (medians)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    variants = {"1 thread alone": (1, 1), f"1 thread each, {cores} processes at once": (cores, 1),
                f"{cores} threads, one process": (1, cores)}
    rows, results = [], []
    for kind in WORK:
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # alternated: a drift of the machine touches every variant alike
            for name, (processes, threads) in variants.items():
                runs[name].append(statistics.mean(measure(kind, processes, threads, args.seconds)))
        alone = statistics.median(runs["1 thread alone"])
        for name, r in runs.items():
            results.append({"work": kind, "variant": name, "calls_per_s_per_process": statistics.median(r),
                            "vs_alone": statistics.median(r) / alone, "runs": r})
            rows.append([kind, name, statistics.median(r), statistics.median(r) / alone])
    table = print_table(f"one thread's work beside another process ({cores} cores, {args.seconds:g} s runs, "
                        f"medians of {args.repeats})", ["work", "variant", "calls/s per process", "vs alone"], rows)
    write_results("cpu_sharing", {"work": {k: {"left": list(a), "right": list(b)} for k, (a, b) in WORK.items()},
                                  "seconds": args.seconds, "repeats": args.repeats, "results": results,
                                  "table": table})


if __name__ == "__main__":
    main()
