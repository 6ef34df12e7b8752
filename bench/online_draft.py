"""Speculation inside GRPO with online draft learning, against speculation off (issue 11).

Four GRPO runs with the same config and seed, built in one process and stepped in turn (step s of
every run, then step s + 1), so machine noise hits all of them alike:

* ``off``      speculation off (the plain engine);
* ``online``   speculation on (``--sizing``, default cost) with a draft pretrained offline on the
               step-0 policy's completions, then trained online after every rollout;
* ``frozen``   the same pretrained draft, frozen at step 0;
* ``scratch``  speculation on with an untrained draft, trained online from step 0.

Reported: acceptance length per step of the three drafts (PNG), the draft-training time as a share
of the step time, seconds per GRPO step and rollout seconds (off vs online), and held-out accuracy
before and after training with speculation on and off (per seed).

Acceptance per step is measured twice: inside the run (tokens per policy forward over the decoding
steps where the sizing policy chose a tree; none when it chose none), and by a probe outside the
timed step: after every step, each draft drafts fixed 4x4x16 trees for its own run's current policy
on 4 held-out prompts x 4 samples (``--probe-tokens`` new tokens), so the drafts' quality is
compared at every step whether or not the sizing used them.

    PYTHONPATH=. python bench/online_draft.py                       # configs/longform.toml, 30 steps
    PYTHONPATH=. python bench/online_draft.py --config demo --steps 30
    PYTHONPATH=. python bench/online_draft.py --quick               # 3 steps, *_quick files

Samples differ between runs (speculation draws its random numbers per tree node), so the runs see
equally distributed but different completions; their mean completion lengths are reported with the
times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RESULTS_DIR, machine_info  # noqa: E402
from turbogrpo.cli import demo_config  # noqa: E402
from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.data.prompt_sets import load_train_prompts  # noqa: E402
from turbogrpo.placement import join_job  # noqa: E402
from turbogrpo.rewards import build_rewards  # noqa: E402
from turbogrpo.rollout import generate  # noqa: E402
from turbogrpo.speculative.speculation import Speculation  # noqa: E402
from turbogrpo.speculative.draft import DraftHead  # noqa: E402
from turbogrpo.speculative.sizing import FixedSizing  # noqa: E402
from turbogrpo.config import DraftLearningConfig  # noqa: E402
from turbogrpo.speculative.draft_training import draft_groups, train_draft  # noqa: E402
from turbogrpo.train import setup  # noqa: E402
from turbogrpo.train.loop import grpo_step  # noqa: E402
from turbogrpo.train.run import build_run  # noqa: E402
from turbogrpo.train.output_dir import run_record  # noqa: E402
from turbogrpo.train.precision import run_precision  # noqa: E402
from turbogrpo.train.state import evaluate, start  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DRAFTS = ("online", "frozen", "scratch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/longform.toml", help='a config file, or "demo"')
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sizing", default="cost", choices=["fixed", "fastgrpo", "cost"])
    parser.add_argument("--eval-every", type=int, default=10, help="held-out accuracy of off/online every N steps")
    parser.add_argument("--no-eval", action="store_true", help="no held-out accuracy at all (a speed-only run)")
    parser.add_argument("--draft-prompts", type=int, default=64, help="prompts for the offline-pretrained draft")
    parser.add_argument("--draft", help='a built or saved draft for online/frozen (e.g. "smollm2-gsm8k", from '
                                        '`turbogrpo draft build`) instead of pretraining one on step-0 completions')
    parser.add_argument("--variants", nargs="+", default=["off", *DRAFTS], choices=["off", *DRAFTS],
                        help="runs to step (off and online are needed for the speedups)")
    parser.add_argument("--probe-tokens", type=int, default=48, help="new tokens per probe completion (0: no probe)")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--quick", action="store_true", help="3 steps, a small draft pretraining; *_quick files")
    parser.add_argument("--out", help="results file stem under bench/results (default: online_draft[_<config>][_<sizing>])")
    args = parser.parse_args()
    if not {"off", "online"} <= set(args.variants):
        parser.error("--variants must include off and online (the speedups compare them)")
    if args.quick:
        args.steps, args.draft_prompts, args.eval_every = 3, 8, 0
    if args.no_eval:
        args.eval_every = 0
    out_root = REPO / "runs" / f"bench_{args.out or results_name(args.config, args.sizing)}{'_quick' if args.quick else ''}"
    results = {"machine": {**machine_info(), "note": "2-core CPU, shared with other jobs (loaded machine)"},
               "config": args.config, "steps": args.steps, "sizing": args.sizing, "seeds": {},
               "name": args.out or results_name(args.config, args.sizing), "variants": args.variants}
    for seed in args.seeds:
        results["seeds"][str(seed)] = run_seed(args, seed, out_root / f"seed{seed}")
        write(results, args.quick)
    results["summary"] = summarise(results["seeds"])
    results["across_seeds"] = accuracy_across_seeds(results["summary"])
    write(results, args.quick)
    print_table(results)
    plot(results, args.quick)
    return 0


def base_config(args, seed: int, output_dir: Path, overrides: list[str]):
    common = [*args.set, f"train.seed={seed}", f"train.num_steps={args.steps}", "train.checkpoint_every=0",
              "train.save_final_model=false", "log.progress_bar=false", "log.tensorboard=false",
              "log.completions_every=0", "log.report=false", f'train.output_dir="{output_dir}"', *overrides]
    if args.config == "demo":
        return demo_config(common)
    return load_config(REPO / args.config if not Path(args.config).is_absolute() else args.config, common)


def pretrain_draft(args, seed: int, out: Path) -> tuple[Path, dict]:
    """A draft trained offline on the step-0 policy's own completions (as `turbogrpo draft train`)."""
    config = base_config(args, seed, out / "pretrain", [])
    cpu = torch.device("cpu")
    precision = run_precision(config.model.dtype, config.model.pure_bf16, cpu)
    policy, tokenizer = setup.load_policy(config.model, config.lora, cpu, precision)
    examples = load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                                  max_new_tokens=config.rollout.max_new_tokens).examples
    prompts = [e.token_ids for e in examples[-args.draft_prompts:]]  # the end of the shuffled-later list
    sampling = setup.rollout_sampling(config.rollout, policy, tokenizer)
    start = time.perf_counter()
    completions = []
    for first in range(0, len(prompts), 8):
        completions += generate(policy, prompts[first:first + 8], num_samples=4, sampling=sampling,
                                seed=10_000 + first).tokens_per_group()
    groups = draft_groups(policy, prompts, completions)
    draft = DraftHead(policy)
    history = train_draft(draft, groups, DraftLearningConfig(lr=3e-3), num_epochs=2 if args.quick else 8,
                          batch_size=16)
    path = draft.save(out / "draft0")
    info = {"prompts": len(prompts), "completions": groups.num_completions,
            "final_top1_agreement": history[-1]["top1_agreement"], "seconds": time.perf_counter() - start}
    print(f"pretrained draft: {info}", flush=True)
    return path, info


def run_seed(args, seed: int, out: Path) -> dict:
    needs_draft = {"online", "frozen"} & set(args.variants)
    if args.draft:
        draft_path, draft_info = args.draft, {"path": args.draft}
    else:
        draft_path, draft_info = pretrain_draft(args, seed, out) if needs_draft else ("scratch", {})
    variants = {
        "off": ["rollout.speculation=off"],
        "online": [f"rollout.speculation={args.sizing}", f'draft.path="{draft_path}"', "draft.learn=true"],
        "frozen": [f"rollout.speculation={args.sizing}", f'draft.path="{draft_path}"', "draft.learn=false"],
        "scratch": [f"rollout.speculation={args.sizing}", "draft.path=scratch", "draft.learn=true"],
    }
    variants = {name: variants[name] for name in args.variants}
    rewards = build_rewards(base_config(args, seed, out, []).rewards)
    dist = join_job("cpu", "auto")
    runs = {}
    for name, overrides in variants.items():
        config = base_config(args, seed, out / name, overrides)
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        runs[name] = build_run(config, dist, rewards, run_record(config))
        start(runs[name], resume=False)
    evaluated = () if args.no_eval else ("off", "online")
    for name in evaluated:
        if args.eval_every or not args.quick:
            evaluate(runs[name])
    records = {name: [] for name in runs}
    probe_prompts = [e.token_ids for e in runs["off"].held_out.examples[:4]]
    for step in range(args.steps):
        for name, run in runs.items():
            metrics = grpo_step(run, step)
            run.state.step += 1
            run.state.log.log(run.state.step, metrics)
            if run.draft is not None and args.probe_tokens:
                metrics["probe/accepted_length"] = probe(run, probe_prompts, args.probe_tokens)
            records[name].append({k: v for k, v in metrics.items() if isinstance(v, float)})
        line = "  ".join(f"{n} {records[n][-1]['time/step']:.1f}s acc.len {records[n][-1].get('spec/accepted_length', 1):.2f}"
                         for n in runs)
        print(f"seed {seed} step {step + 1}/{args.steps}: {line}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            for name in evaluated:
                evaluate(runs[name])
    if not args.quick or args.eval_every:
        for name in evaluated:
            evaluate(runs[name])
    for run in runs.values():
        run.state.log.close()
    return {"pretrained_draft": draft_info,
            "runs": {name: {"steps": records[name], "evals": runs[name].state.evals} for name in runs}}


def probe(run, prompts, max_new_tokens: int) -> float:
    """Tokens per policy forward when ``run``'s draft drafts fixed 4x4x16 trees for its current policy."""
    sampling = dataclasses.replace(run.sampling, max_new_tokens=max_new_tokens)
    rollout = generate(run.policy, prompts, num_samples=4, sampling=sampling, seed=12_345,
                       draft=Speculation(run.draft.draft, sizing=FixedSizing((4, 4, 16))))
    return rollout.stats.mean_accepted_length


def summarise(seeds: dict) -> dict:
    per_seed = {}
    for seed, result in seeds.items():
        runs = result["runs"]
        entry = {
            "s_per_step": {n: statistics.median(r["time/step"] for r in runs[n]["steps"]) for n in runs},
            "rollout_s_per_step": {n: statistics.median(r["time/rollout"] for r in runs[n]["steps"]) for n in runs},
            "total_s": {n: sum(r["time/step"] for r in runs[n]["steps"]) for n in runs},
            "total_rollout_s": {n: sum(r["time/rollout"] for r in runs[n]["steps"]) for n in runs},
            "mean_completion_length": {n: statistics.mean(r["completion_length/mean"] for r in runs[n]["steps"])
                                       for n in runs},
            "draft_share_of_step": {n: sum(r.get("time/draft", 0.0) for r in runs[n]["steps"])
                                    / sum(r["time/step"] for r in runs[n]["steps"]) for n in DRAFTS if n in runs},
            "mean_accepted_length": {n: _mean_defined(accepted_lengths(runs[n]["steps"])) for n in DRAFTS if n in runs},
            "probe_accepted_length_first_last": {n: [runs[n]["steps"][0].get("probe/accepted_length"),
                                                     runs[n]["steps"][-1].get("probe/accepted_length")]
                                                 for n in DRAFTS if n in runs},
            "accuracy": {n: {"first": runs[n]["evals"][0], "last": runs[n]["evals"][-1]}
                         for n in ("off", "online") if runs[n]["evals"]},
        }
        entry["end_to_end_speedup"] = entry["total_s"]["off"] / entry["total_s"]["online"]
        entry["rollout_speedup"] = entry["total_rollout_s"]["off"] / entry["total_rollout_s"]["online"]
        entry["length_ratio_online_over_off"] = (entry["mean_completion_length"]["online"]
                                                 / entry["mean_completion_length"]["off"])
        # Speculation draws other (equally distributed) samples, so over a few steps the two runs
        # generate different token counts; per generated token the comparison is not confounded by that.
        entry["end_to_end_speedup_per_token"] = entry["end_to_end_speedup"] * entry["length_ratio_online_over_off"]
        entry["rollout_speedup_per_token"] = entry["rollout_speedup"] * entry["length_ratio_online_over_off"]
        per_seed[seed] = entry
    return per_seed


def accuracy_across_seeds(summary: dict) -> dict:
    """Final held-out accuracy (greedy and sampled) of off vs online over the seeds: the mean of the
    per-seed differences against the seed-to-seed spread ("learning unchanged" when the difference is
    within 2 standard errors of it; with one seed the spread is unknown and the verdict is None)."""
    out = {}
    for metric in ("accuracy", "sampled_accuracy"):
        last = {name: [entry["accuracy"][name]["last"][metric] for entry in summary.values()
                       if name in entry["accuracy"] and metric in entry["accuracy"][name]["last"]]
                for name in ("off", "online")}
        if not last["off"] or len(last["off"]) != len(last["online"]):
            continue
        differences = [on - off for on, off in zip(last["online"], last["off"])]
        spread = {name: statistics.stdev(values) if len(values) > 1 else math.nan for name, values in last.items()}
        standard_error = math.sqrt((spread["off"] ** 2 + spread["online"] ** 2) / len(differences))
        mean_difference = statistics.mean(differences)
        out[metric] = {"off": last["off"], "online": last["online"], "mean_online_minus_off": mean_difference,
                       "seed_to_seed_std": spread, "standard_error_of_difference": standard_error,
                       "within_seed_noise": None if math.isnan(standard_error)
                       else abs(mean_difference) <= 2 * standard_error}
    return out


def accepted_lengths(steps: list[dict]) -> list[float]:
    """Per step: mean tokens per verify over the step's tree steps (NaN when no tree was verified)."""
    return [r["spec/accepted_length"] if r.get("spec/frac_tree_steps", 0) > 0 else math.nan for r in steps]


def _mean_defined(values: list[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return sum(defined) / len(defined) if defined else math.nan


def results_name(config: str, sizing: str = "cost") -> str:
    """online_draft for the default config, online_draft_<config stem> for the others; _<sizing> unless
    the sizing is the default (cost)."""
    name = "online_draft" if config == "configs/longform.toml" else f"online_draft_{Path(config).stem}"
    return name if sizing == "cost" else f"{name}_{sizing}"


def write(results: dict, quick: bool) -> None:
    name = results["name"]
    path = RESULTS_DIR / (f"{name}_quick.json" if quick else f"{name}.json")
    path.write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote {path}", flush=True)


def print_table(results: dict) -> None:
    print(f"\n{results['config']}, {results['steps']} GRPO steps, sizing {results['sizing']}; "
          f"{results['machine']['note']}")
    print(f"{'seed':>4} {'variant':>8} {'s/step':>8} {'rollout s':>10} {'len':>6} {'acc.len':>8} {'draft %':>8}")
    for seed, entry in results["summary"].items():
        for name in entry["s_per_step"]:
            print(f"{seed:>4} {name:>8} {entry['s_per_step'][name]:>8.2f} {entry['rollout_s_per_step'][name]:>10.2f} "
                  f"{entry['mean_completion_length'][name]:>6.1f} "
                  f"{entry['mean_accepted_length'].get(name, float('nan')):>8.2f} "
                  f"{100 * entry['draft_share_of_step'].get(name, 0.0):>7.1f}%")
        print(f"     end to end off/online {entry['end_to_end_speedup']:.2f}x ({entry['end_to_end_speedup_per_token']:.2f}x "
              f"per token), rollout {entry['rollout_speedup']:.2f}x ({entry['rollout_speedup_per_token']:.2f}x per token); "
              f"accuracy {json.dumps(entry['accuracy'])}")
    for metric, row in results.get("across_seeds", {}).items():
        print(f"final {metric}: off {row['off']}, online {row['online']}; online - off "
              f"{row['mean_online_minus_off']:+.3f} (SE {row['standard_error_of_difference']:.3f}): "
              f"within seed noise: {row['within_seed_noise']}")


def plot(results: dict, quick: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (probe_ax, run_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for seed, result in results["seeds"].items():
        for name, color in zip(DRAFTS, ("C0", "C1", "C2")):
            if name not in result["runs"]:
                continue
            steps = result["runs"][name]["steps"]
            label = f"{name} (seed {seed})" if len(results["seeds"]) > 1 else name
            probe_ax.plot(range(1, len(steps) + 1), [r.get("probe/accepted_length", math.nan) for r in steps], "o-",
                          color=color, markersize=3, label=label)
            run_ax.plot(range(1, len(steps) + 1), accepted_lengths(steps), "o-", color=color, markersize=3, label=label)
    probe_ax.set_title("Probe: fixed 4x4x16 trees on the run's current policy", fontsize=10)
    run_ax.set_title(f"In the run ({results['sizing']} sizing; gaps: no tree chosen)", fontsize=10)
    for ax in (probe_ax, run_ax):
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("tokens per policy forward")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Acceptance length per step: online-learnt, frozen at step 0, online from scratch ({results['config']})")
    fig.tight_layout()
    name = results["name"]
    fig.savefig(RESULTS_DIR / (f"{name}_acceptance_quick.png" if quick else f"{name}_acceptance.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
