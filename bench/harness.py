"""Shared benchmark harness: interleaved medians, machine description, readable table + JSON.

Every benchmark runs the baseline and ours in the same process, alternating them run by run so
that machine noise hits both alike, and reports medians and ratios rather than single timings.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.host_memory import keep_freed_host_memory, release_freed_host_memory

# Every benchmark runs on the heap turbogrpo's commands use (freed blocks kept, not unmapped:
# turbogrpo/host_memory.py), baseline and ours alike, since they share the process.
keep_freed_host_memory()

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    """What ran the benchmark: CPU, cores, torch build and threads, accelerator if any."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        # The project's machines differ from session to session (AMD EPYC, Intel Xeon with AMX): bf16
        # matmuls run ~5x float32's rate on AMX tiles and slower than float32 without native bf16.
        "cpu_matmul_extensions": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        # What turbogrpo's kernel choices saw (level, native bf16, AMX; forced or not): the same record a run
        # writes, so a result can be told apart by what ran, not only by the CPU's name.
        "cpu_capability": cpu_capability().record(),
        "num_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": "cpu",
        # PASSIVE makes every small parallel op wake sleeping threads (~0.1 ms each on this machine):
        # it changes decoding speed by up to 1.5x, so results say which policy they ran under.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        # Both contenders of a benchmark share the process, so both run on the kept heap (see below).
        "host_malloc": "keep" if keep_freed_host_memory() else "system",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def timed_with_peak(call: Callable[[], object], *, warmups: int, repeats: int) -> dict:
    """``call`` timed on this process's device (synchronized on CUDA): the peak memory of the first warm-up call
    (None off CUDA: a GPU part's CPU smoke run), then the median of ``repeats`` calls after ``warmups`` in all."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    call()
    sync()
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    for _ in range(warmups - 1):
        call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "times_s": times, "peak_gb": peak_gb}


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                        warmup: int = 1) -> dict[str, dict]:
    """Time each callable ``repeats`` times after ``warmup`` runs, alternating between them.

    Returns ``{name: {"median_s", "min_s", "times_s"}}``.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "times_s": ts}
            for name, ts in times.items()}


def peak_rss_delta_mb(argv: list[str]) -> float:
    """Run ``argv`` (a Python child that prints one line ``PEAK_MB <x>``) and return x.

    Peak memory is measured in a fresh process per variant: on CPU there is no allocator counter
    that can be reset between variants in one process.
    """
    out = subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("PEAK_MB "):
            return float(line.split()[1])
    raise RuntimeError(f"memory probe printed no PEAK_MB line:\n{out}")


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> float:
    """Reset the process's peak resident set (Linux clear_refs) and return the current RSS in MB.

    Freed heap blocks are returned to the OS first: the process keeps them otherwise
    (``turbogrpo.host_memory``), and a step reusing them would not raise the peak."""
    release_freed_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_mb("VmRSS")


def peak_rss_mb() -> float:
    """Peak resident set since the last :func:`reset_peak_rss`, in MB."""
    return _proc_status_mb("VmHWM")


def print_table(title: str, columns: list[str], rows: list[list]) -> str:
    """Print and return a fixed-width table."""
    cells = [[str(c) for c in columns]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(cells[0], widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_results(name: str, payload: dict) -> Path:
    """Write ``bench/results/<name>.json`` with the machine description added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    if not any(key in payload for key in ("load_average", "load", "load_average_before", "load_average_after")):
        payload["load_average_after"] = list(os.getloadavg())  # at least the load as the measurement ended
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
