"""Every GPU measurement of the project in one script: one call on one GPU, at most about 8 minutes.

    python bench/gpu.py                  # all parts, writes bench/results/gpu.json
    python bench/gpu.py --only prefix    # one part (rollout, prefix, precision, trl, tree, hybrid, compiled, vllm)
    python bench/gpu.py --budget 480     # total seconds the parts share
    python bench/gpu_vllm.py --quick     # the vllm part's CPU smoke form (no GPU number)
    python bench/gpu_compiled.py --quick # the compiled part's CPU smoke form (no GPU number)

Each part is a module ``bench/gpu_<name>.py`` with ``run(results: dict, budget_s: float)``: it builds
random-init models directly on the device (``with torch.device("cuda")``), measures baseline and ours
side by side, and writes its rows into ``results[<name>]``. Parts need only torch, transformers and the
project; an optional contender (prefix_grouper, TRL) is skipped with a message when it is absent. A part
that fails is recorded with its error and the others still run, so one call never comes back empty.
The JSON is written after every part, so a run cut short by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results  # noqa: E402

PARTS: dict[str, float] = {
    # name -> share of the time budget
    "rollout": 0.30,
    "prefix": 0.25,
    "precision": 0.10,
    "trl": 0.15,
    "tree": 0.20,
    "hybrid": 0.25,   # the Qwen3.5-shaped hybrid: FLA kernels where installed, torch's fallbacks otherwise
    "compiled": 0.40,  # issue 54: the compiled step per live batch, speculation eager and compiled
    "vllm": 0.60,   # last: its engines keep some GPU memory; 180 s of the default 480 (two vLLM builds)
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(PARTS), action="append", help="run only these parts")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all parts together")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device; nothing to measure (the CPU benches are bench/prefix.py, "
              "bench/rollout.py, bench/speculative.py, bench/e2e.py, bench/tree.py)")
        return
    parts = args.only or list(PARTS)
    share = sum(PARTS[p] for p in parts)
    results: dict[str, object] = {"parts": {}}
    for name in parts:
        budget = args.budget * PARTS[name] / share
        start = time.perf_counter()
        part: dict = {}
        try:
            module = importlib.import_module(f"gpu_{name}")
            module.run(part, budget)
            part.setdefault("status", "ok")
        except Exception as error:  # one part's failure must not lose the others' numbers
            traceback.print_exc()
            part.update(status="failed", error=f"{type(error).__name__}: {error}")
        finally:
            torch.cuda.empty_cache()
        part["wall_s"] = round(time.perf_counter() - start, 1)
        part["budget_s"] = round(budget, 1)
        results["parts"][name] = part
        print(f"[gpu] {name}: {part['status']} in {part['wall_s']} s (budget {part['budget_s']} s)", flush=True)
        write_results("gpu", results)


if __name__ == "__main__":
    main()
