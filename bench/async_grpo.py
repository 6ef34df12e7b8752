"""Asynchronous GRPO (train.max_staleness = k): step time and tokens per second at k = 0, 1, 2 on one config,
the same seeds, and the CPU split between the trainer and the rollout worker at k = 1.

Each variant is a whole ``turbogrpo train`` run in its own process (the worker is a second process; a fresh
run per variant keeps thread settings and caches apart), ``--warmup`` steps then ``--steps`` timed ones, no
held-out evaluation, no checkpoints. A step's time is the loop's ``time/step`` (its phases; at k > 0 the
rollout phase is the wait for the worker, what the overlap did not hide); tokens per second are the timed
steps' generated tokens over their summed time. k = 0 runs with every core in the trainer (train.num_threads =
the core count); k > 0 splits them (``--splits``: rollout-worker threads, the trainer gets the rest).

Equal workloads (``--frozen``). A task the policy learns within a few steps (the calculator: reward 0.25 -> 0.95
in 3 steps) gives each variant different work: one step behind, k = 1 samples a weaker policy, whose groups more
often differ in reward and so are trained rather than skipped, and its update takes longer for that alone.
``--frozen`` sets optim.lr = 1e-30 (the config refuses 0): an AdamW step of that size rounds away on every float32
weight (and weight decay multiplies by 1 - 1e-32, which rounds to 1), so every version's weights are the same and
every variant draws the same rollouts
(same seeds) and trains the same groups, and the step times compare the machinery alone (learning is
bench/learning.py's).

The overlap's bound. With k > 0 among the variants, k = 0 also runs on the trainer's share of the split (the
"reference": rollout and update one after the other, each at the threads it would have at k = 1). Perfect
overlap would make a step the longer of its two sides, max(rollout, the rest of the step), each at those
threads: ``overlap_bound_s`` (the median over steps), what k = 1 could reach on this machine if the two
processes did not slow each other down, and the ceiling's reason when it falls short of the target.
``--partial-rollouts c,..`` adds, for every k >= c, a variant with train.partial_rollouts = c at the default split
(the worker then draws k - c steps ahead; docs/design/async.md, "Partial rollouts"); "tokens/s" there counts the
tokens each step's rollout decoded (carried generations' tails included), not the tokens trained.

Shapes:
  gsm8k        SmolLM2-135M-Instruct, GSM8K zero-shot (configs/smollm2_gsm8k.toml cut to bench/e2e.py's shape:
               8 prompts x 8, 128 new tokens, micro-batches of 2048 tokens)
  calculator   SmolLM2-135M-Instruct, the multi-turn calculator tool task (configs/smollm2_calculator.toml)
  demo         the shipped demo model on its arithmetic task (configs/demo.toml, 4 prompts x 8): the smoke test

    python bench/async_grpo.py --shapes gsm8k,calculator          # the measurement (quiet machine)
    python bench/async_grpo.py --quick                            # smoke: demo, 1 warm-up + 2 timed steps
    python bench/async_grpo.py --staleness 1,2 --partial-rollouts 1   # with partial rollouts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "gsm8k": ("smollm2_gsm8k.toml", ["train.prompts_per_step=8", "rollout.max_new_tokens=128",
                                     "train.micro_batch_tokens=2048", "optim.warmup_steps=0"]),
    "calculator": ("smollm2_calculator.toml", ["optim.warmup_steps=0"]),
    "demo": ("demo.toml", ["train.prompts_per_step=4", "optim.warmup_steps=0"]),
}
"""name -> (shipped config, overrides that cut it to the benchmark's shape)."""


def run_variant(shape: str, max_staleness: int, trainer_threads: int, rollout_threads: int, steps: int,
                workdir: Path, partial_rollouts: int = 0, *, extra: Sequence[str] = (),
                python_path: Sequence[str] = ()) -> list[dict]:
    """One ``turbogrpo train`` run of ``steps`` steps; its per-step metrics records. ``extra`` (settings after the
    shape's cuts) and ``python_path`` (folders the run imports from, such as a reward's module) adapt the shape
    (bench/trl_async.py: TRL's prompts and reward)."""
    config, cuts = SHAPES[shape]
    out = workdir / f"{shape}-k{max_staleness}-c{partial_rollouts}-t{trainer_threads}-r{rollout_threads}"
    sets = [*cuts, *extra, f"train.num_steps={steps}", f"train.max_staleness={max_staleness}", "algo.tis_cap=2",
            f"train.partial_rollouts={partial_rollouts}",
            f"train.num_threads={trainer_threads}", f"train.rollout_threads={rollout_threads}",
            'train.accuracy_reward=""', "train.checkpoint_every=0", "train.save_final_model=false",
            "log.report=false", "log.tensorboard=false", "log.progress_bar=false", "log.completions_every=0",
            f'train.output_dir="{out}"']
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *python_path, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "turbogrpo", "train", str(REPO / "configs" / config), "--overwrite",
                           "--set", *sets], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{shape} k={max_staleness} c={partial_rollouts} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "time/step" in r]


def summarise(records: list[dict], warmup: int) -> dict:
    """Median step time and phase times of the timed steps, and their tokens per second."""
    timed = records[warmup:]
    step_s = [r["time/step"] for r in timed]
    overlapped = [max(r["time/rollout"], r["time/step"] - r["time/rollout"]) for r in timed]  # see the docstring
    tokens = sum(r["tokens_per_s"] * r["time/step"] for r in timed)  # generated tokens of each step
    phases = sorted({k for r in timed for k in r if k.startswith("time/") and k != "time/step"})
    return {"step_s_median": statistics.median(step_s), "step_s": step_s, "tokens_per_s": tokens / sum(step_s),
            **{f"{k.removeprefix('time/')}_s_median": statistics.median(r.get(k, 0.0) for r in timed) for k in phases},
            "lag_mean": statistics.mean(r.get("staleness/lag_mean", 0.0) for r in timed),
            "overlap_bound_s": statistics.median(overlapped),
            "reward_mean": statistics.mean(r["reward"] for r in timed)}


def variants(cores: int, splits: list[int], staleness: list[int], partial: list[int] = ()
             ) -> list[tuple[int, int, int, int]]:
    """(k, c, trainer threads, rollout threads): k = 0 on every core, and on the trainer's share of the default
    split (the reference: module docstring) when some k > 0 runs; each k > 0 at the default split (half the cores
    each); k = 1 also at every split of ``splits``; each k >= c > 0 of ``partial`` with partial rollouts c at the
    default split."""
    half = max(1, cores // 2)
    reference = [(0, 0, max(1, cores - half), 0)] if any(staleness) and cores - half < cores else []
    chosen = [(0, 0, cores, 0), *reference] + [(k, 0, max(1, cores - half), half) for k in staleness if k > 0]
    chosen += [(1, 0, max(1, cores - r), r) for r in splits
               if 1 in staleness and (1, 0, max(1, cores - r), r) not in chosen]
    chosen += [(k, c, max(1, cores - half), half) for k in staleness for c in partial if 0 < c <= k]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="gsm8k,calculator", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--staleness", default="0,1,2", help="the k values (0 always runs: the baseline)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (the worker's start, caches)")
    parser.add_argument("--splits", default="", help="k=1 rollout-worker thread counts to sweep (default: 1..cores-1)")
    parser.add_argument("--quick", action="store_true", help="smoke: the demo shape, 1 warm-up + 2 timed steps")
    parser.add_argument("--partial-rollouts", default="", help="c values: train.partial_rollouts variants (k >= c)")
    parser.add_argument("--name", default="async_grpo", help="bench/results/<name>_<shape>.json")
    parser.add_argument("--frozen", action="store_true",
                        help="optim.lr = 1e-30, weights unchanged: equal workloads (module docstring)")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.steps, args.warmup = "demo", 2, 1
    cores = os.cpu_count() or 1
    staleness = sorted({0, *(int(k) for k in args.staleness.split(","))})
    splits = [int(r) for r in args.splits.split(",")] if args.splits else list(range(1, cores))
    partial = [int(c) for c in args.partial_rollouts.split(",")] if args.partial_rollouts else []
    for shape in args.shapes.split(","):
        rows, results = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for k, c, trainer, rollout in variants(cores, splits, staleness, partial):
                summary = summarise(run_variant(shape, k, trainer, rollout, args.warmup + args.steps, Path(tmp), c,
                                                extra=["optim.lr=1e-30"] if args.frozen else []), args.warmup)
                if k or trainer == cores:  # the bound is the reference's alone (module docstring)
                    del summary["overlap_bound_s"]
                results.append({"max_staleness": k, "partial_rollouts": c, "trainer_threads": trainer,
                                "rollout_threads": rollout, **summary})
        base = results[0]["step_s_median"]
        for r in results:
            r["speedup_vs_k0"] = base / r["step_s_median"]
            rows.append([r["max_staleness"], r["partial_rollouts"], r["trainer_threads"], r["rollout_threads"],
                         r["step_s_median"],
                         r.get("rollout_s_median", 0.0), r.get("update_s_median", 0.0), r["tokens_per_s"],
                         r["speedup_vs_k0"], r["lag_mean"],
                         r.get("overlap_bound_s", "")])
        table = print_table(f"async GRPO, {shape} ({args.steps} timed steps after {args.warmup}, {cores} cores; "
                            "rollout at k > 0 = the wait for the worker)",
                            ["k", "c", "trainer thr", "worker thr", "step s", "rollout s", "update s", "tokens/s",
                             "vs k=0", "lag", "overlap bound s"], rows)
        write_results(f"{args.name}_{shape}", {"shape": shape, "config": SHAPES[shape][0], "overrides": SHAPES[shape][1],
                                               "frozen": args.frozen,
                                               "warmup": args.warmup, "steps": args.steps, "variants": results,
                                               "table": table})


if __name__ == "__main__":
    main()
