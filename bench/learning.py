"""Does a faster way of training learn what the on-policy native run learns? Held-out accuracy over 30 steps of
variants of one run (the same config, the same seeds) on the SmolLM2 tasks, in one plot per task.

Variants (``VARIANTS``): ``k0`` the on-policy run on the native engine (the reference), ``k1`` / ``k2``
asynchronous GRPO (train.max_staleness = 1, 2: issue 43), ``vllm`` the on-policy run sampling on the vLLM
engine (rollout.engine = "vllm": issue 44), ``vllm_bf16_<correction>`` the vLLM engine in bf16 under one off-policy
correction (``--corrections``: issue 55). Every other variant runs with TIS (algo.tis_cap = 2), so the loss is the
same function of (trainer, sampler) log-probs everywhere.

Each (task, variant) is a ``turbogrpo train`` run of a shipped config (below, cut to a CPU's budget), held-out
greedy and sampled accuracy every ``--eval-every`` steps; a finished run is kept and not run again, and an
interrupted one resumes from its last checkpoint, so the script can be stopped and started again. Writes
bench/results/<name>.json (the curves and each run's wall time) and <name>.png (one panel per task: greedy
solid, sampled dashed, a colour per variant).

    python bench/learning.py --variants k0,k1 --name async_learning      # issue 43 (hours on 2 CPU cores)
    python bench/learning.py --tasks gsm8k --variants k0,vllm --name vllm_learning    # issue 44
    python bench/learning.py --tasks calculator --corrections none,token_tis,sequence_mask,icepop \
        --name correction_learning --set data.num_eval_problems=50 data.num_eval_samples=2
        # issue 55 4(c): vLLM in bf16 under each correction, one curve each (50 held-out problems: ~1 h a run)
    python bench/learning.py --tasks demo --steps 2 --eval-every 1 --variants k0,k1 --name learning_smoke   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, write_results  # noqa: E402
from turbogrpo.train.checkpoint import latest_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

TASKS = {
    # GSM8K zero-shot at bench/e2e.py's rollout shape (8 prompts x 8), answers up to 256 tokens, and the learning
    # rate of the e2e benchmark (the shipped 1e-6 moves nothing in 30 steps); 100 held-out problems, 2 samples each.
    "gsm8k": ("smollm2_gsm8k.toml", ["train.prompts_per_step=8", "rollout.max_new_tokens=256", "optim.lr=1e-5",
                                     "optim.warmup_steps=2", "data.num_eval_problems=100", "data.num_eval_samples=2"]),
    # The multi-turn calculator as shipped (30 steps of 8 x 8 conversations, 100 held-out problems, 4 samples).
    "calculator": ("smollm2_calculator.toml", []),
    # The smoke test of this script: the shipped demo model on its arithmetic task, cut small.
    "demo": ("demo.toml", ["train.prompts_per_step=4", "data.num_eval_problems=8", "data.num_eval_samples=1"]),
}
"""task -> (shipped config, overrides)."""

VARIANTS = {
    "k0": [],
    "k1": ["train.max_staleness=1"],
    "k2": ["train.max_staleness=2"],
    "vllm": ['rollout.engine="vllm"'],
}
"""variant -> overrides on top of the task's (the same seeds everywhere)."""

CORRECTIONS = {
    # Issue 55 4(c): the correction families a TRL / verl / AReaL user knows, caps as those trainers default them.
    "none": ["algo.tis_cap=0"],
    "token_tis": ['algo.off_policy_correction="token_truncate"', "algo.tis_cap=2"],
    "sequence_mask": ['algo.off_policy_correction="sequence_mask"', "algo.tis_cap=3"],
    "icepop": ['algo.off_policy_correction="icepop"', "algo.tis_cap_low=0.5", "algo.tis_cap=5"],
}
"""``--corrections`` name -> its [algo] settings, run as variant ``vllm_bf16_<name>``: the vLLM engine sampling in
bf16 (model.dtype = "bfloat16": vLLM's bf16 kernels, the trainer's bf16 autocast over float32 masters)."""
VARIANTS.update({f"vllm_bf16_{name}": ['rollout.engine="vllm"', 'model.dtype="bfloat16"', *settings]
                 for name, settings in CORRECTIONS.items()})

COMMON = ["algo.tis_cap=2"]
"""Every variant's loss unless it sets its own (a variant's settings come after): TIS at cap 2, a no-op where
sampler and trainer agree (k0) and the correction where they do not (stale weights, another engine's kernels)."""


def run(task: str, variant: str, steps: int, eval_every: int, workdir: Path, extra: list[str]) -> Path:
    """The (task, variant) run's output folder, trained unless a finished one is there; ``extra``: KEY=VALUE
    overrides on top of everything else (``--set``)."""
    config, cuts = TASKS[task]
    out = workdir / f"{task}-{variant}"
    if (out / "complete.json").exists():
        return out
    sets = [*cuts, *COMMON, *VARIANTS[variant], f"train.num_steps={steps}", f"train.eval_every={eval_every}",
            "train.checkpoint_every=10", "train.save_final_model=false", "log.progress_bar=false",
            f'train.output_dir="{out}"', *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Resume a run cut off after a checkpoint; one cut off before its first starts again.
    flag = "--resume" if out.exists() and latest_checkpoint(out) is not None else "--overwrite"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "turbogrpo", "train", str(REPO / "configs" / config), flag, "--set", *sets],
                   cwd=REPO, env=env, check=True)
    (out / "wall_s.txt").write_text(f"{time.perf_counter() - started:.1f}\n")
    return out


def curves(out: Path) -> dict:
    """Held-out accuracy by step (greedy, sampled) and the mean reward of the training steps."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/accuracy" in r]
    wall = out / "wall_s.txt"
    return {"steps": [r["step"] for r in evals], "greedy": [r["eval/accuracy"] for r in evals],
            "sampled": [r.get("eval/sampled_accuracy") for r in evals],
            "train_reward": [r["reward"] for r in records if "reward" in r],
            "step_s": [r["time/step"] for r in records if "time/step" in r],
            "wall_s": float(wall.read_text()) if wall.exists() else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (task, by_variant) in zip(axes[0], results.items()):
        for colour, (variant, c) in enumerate(by_variant.items()):
            ax.plot(c["steps"], c["greedy"], "-", color=f"C{colour}", marker="o", label=f"{variant}, greedy")
            if any(v is not None for v in c["sampled"]):
                ax.plot(c["steps"], c["sampled"], "--", color=f"C{colour}", marker="s", label=f"{variant}, sampled")
        ax.set(title=f"{task} ({TASKS[task][0]})", xlabel="GRPO step", ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{' vs '.join(next(iter(results.values())))}: same config, same seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="gsm8k,calculator", help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--variants", default="k0,k1", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--corrections", default="", help=f"comma-separated, of {', '.join(CORRECTIONS)}: the "
                        "variants vllm_bf16_<name> (vLLM sampling in bf16 under that correction) instead of --variants")
    parser.add_argument("--workdir", default="runs/learning", help="the runs' folders (kept for restarts; shared "
                        "by the variants, so k0 runs once for every comparison)")
    parser.add_argument("--name", default="learning", help="bench/results/<name>.json and .png")
    parser.add_argument("--note", default="", help="what the reader should know about how the runs ran (shown "
                        "under the table), e.g. that they shared the cores")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run, after "
                        "the task's and the variant's (e.g. a smaller held-out set: data.num_eval_problems=50)")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    variants = ([f"vllm_bf16_{name}" for name in args.corrections.split(",")] if args.corrections
                else args.variants.split(","))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    results = {task: {v: curves(run(task, v, args.steps, args.eval_every, workdir, args.set)) for v in variants}
               for task in args.tasks.split(",")}
    for task, by_variant in results.items():
        for variant, c in by_variant.items():
            print(f"{task} {variant}: greedy {c['greedy']} sampled {c['sampled']} (steps {c['steps']}), wall {c['wall_s']} s")
    write_results(args.name, {"tasks": {t: {"config": TASKS[t][0], "overrides": TASKS[t][1]} for t in results},
                              "variants": {v: VARIANTS[v] for v in variants}, "common": COMMON,
                              "steps": args.steps, "eval_every": args.eval_every, "overrides": args.set,
                              "curves": results,
                              **({"note": args.note} if args.note else {})})
    plot(results, RESULTS_DIR / f"{args.name}.png")


if __name__ == "__main__":
    main()
