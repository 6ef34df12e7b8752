"""Speculative rollouts vs. the plain engine, on the demo task's model with a draft trained on its own
completions.

    .venv/bin/python bench/speculative.py [--quick] [--model demo] [--draft DIR] [--threads N]
    .venv/bin/python bench/speculative.py --model smollm2-135m-instruct [--batches 1,4,8,32] [--new-tokens 64]
        [--kinds history,neural,both] [--tail-kinds neural+siblings] [--draft smollm2-gsm8k|DIR]
    .venv/bin/python bench/speculative.py --model smollm2-135m-instruct --batches 1,4 --tail-kinds '' \
        --kinds tree1x1x2,tree1x2x3,tree1x3x4,tree4x1x5,tree2x2x5,tree4x2x9,tree4x3x13 --out speculative_smollm2_fixed_trees

With ``--model smollm2-135m-instruct`` (the real model) it runs GSM8K test prompts with the chat
template instead (``main_real_model``): per live batch B (prompts x G samples, EOS ignored so all B
run the same steps, temperature 1 or ``--temperature``), plain vs. each draft kind of ``REAL_KINDS``
(history drafts, the neural draft, both merged), sized by the cost policy; acceptance per draft kind
and the tree sizes chosen. Then the GRPO shape with its natural tail: 8 prompts x G=8, stop at
<|im_end|>, a 512-token cap. The neural draft is the one ``turbogrpo draft build --model smollm2``
made (or ``--draft``); without one only the history kinds run. Writes
bench/results/speculative_smollm2[_neural][_greedy].json (or ``--out``) and a speedup plot.

Parts (every variant is timed in the same process, interleaved with the plain engine, medians):

1. Fixed live batch B in {1, 4, 16, 64}: B prompts x 1 sample, no stop token, so all B sequences
   run the same ``--fixed-new-tokens`` steps; each sizing policy vs. plain.
2. GRPO-shaped rollouts: 8 prompts x G=8 at temperature 1, for the sizing policies off / fixed /
   fastgrpo / cost, on two workloads:
   * ``long-tail``: every completion gets a length drawn once from a long-tail (Pareto) distribution,
     the same for every variant and run (the stop token is ignored, as serving benchmarks do with
     fixed output lengths), so all variants generate exactly the same number of tokens per sequence
     and the live batch shrinks the same way: many short completions, a few long ones.
   * ``demo``: stop at the end-of-text token, as the demo's training run does. The demo model's
     completions are ~20 tokens and end together, so this one has no tail.
   Speed is compared in generated tokens per second, with the k-th run of every variant using seed k.

Reported per variant: tokens/s, speedup over plain, acceptance length (tokens per policy forward in
speculative steps) and tree sizes. Writes bench/results/speculative.json, speculative_speedup.png
(speedup vs. B) and speculative_tree_sizes.png (tree size and live batch over a rollout's steps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# OMP_WAIT_POLICY is left at OpenMP's default (idle threads spin briefly). With PASSIVE, every small
# parallel GEMM pays a thread wake-up (~0.1 ms here, measured), which slows plain decoding by up to
# 1.5x and makes an 8-token verify cost twice a 1-token step: a handicap for both engines, and not
# what users run. The knee profile records the policy it was measured under.
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, interleaved_medians, print_table, write_results  # noqa: E402
from real_model import REAL_MODEL, chat_prompts, load_real_model  # noqa: E402

from turbogrpo.data import build_prompts, demo_records  # noqa: E402
from turbogrpo.models import load_demo_model, load_model_and_tokenizer  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.speculative.speculation import Speculation  # noqa: E402
from turbogrpo.speculative.draft import DraftHead  # noqa: E402
from turbogrpo.config import DraftLearningConfig  # noqa: E402
from turbogrpo.speculative.draft_training import draft_groups, train_draft  # noqa: E402
from turbogrpo.speculative.history import HistoryDrafts, HistoryStore, speculation_sizing  # noqa: E402
from turbogrpo.speculative.profiler import cached_profile  # noqa: E402
from turbogrpo.speculative.sizing import FixedSizing, OffSizing, make_sizing  # noqa: E402
from turbogrpo.speculative.tree import TreeShape  # noqa: E402

FIXED_SHAPE = TreeShape(2, 4, 8)  # a small EAGLE-like tree: 2 children per node, 4 levels, 8 nodes
POLICIES = ("off", "fixed", "fastgrpo", "cost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="model folder or 'demo' (the shipped demo model)")
    parser.add_argument("--draft", help="a saved draft to use instead of training one")
    parser.add_argument("--save-draft", help="where to save the trained draft (for reuse with --draft)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small sizes and one repeat (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixed-new-tokens", type=int, default=24)
    parser.add_argument("--grpo-new-tokens", type=int, default=64, help="max new tokens of the demo workload")
    parser.add_argument("--tail-min", type=int, default=16, help="shortest completion of the long-tail workload")
    parser.add_argument("--tail-max", type=int, default=256, help="longest completion of the long-tail workload")
    parser.add_argument("--tail-alpha", type=float, default=1.2, help="Pareto exponent of the long-tail lengths")
    parser.add_argument("--draft-prompts", type=int, default=64)
    parser.add_argument("--draft-epochs", type=int, default=12)
    parser.add_argument("--batches", default="1,4,8,32", help="real model: live batches B (G = min(B, 8))")
    parser.add_argument("--new-tokens", type=int, default=64, help="real model: new tokens per completion")
    parser.add_argument("--temperature", type=float, default=1.0, help="real model: sampling temperature (0: greedy)")
    parser.add_argument("--kinds", default="history,neural,both",
                        help=f"real model: draft kinds at fixed B ({', '.join(REAL_KINDS)}; or "
                             f"{FIXED_TREE_KIND}<top_k>x<depth>x<nodes>: the neural draft with one fixed tree)")
    parser.add_argument("--tail-kinds", default="neural+siblings",
                        help="real model: draft kinds on the natural-tail GSM8K rollout ('' to skip it)")
    parser.add_argument("--tail-repeats", type=int, default=2, help="real model: timed natural-tail rollouts")
    parser.add_argument("--tail-new-tokens", type=int, default=512, help="real model: the natural tail's cap")
    parser.add_argument("--out", help="real model: results name (default speculative_smollm2[_neural][_greedy])")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == REAL_MODEL:
        return main_real_model(args)
    repeats = 1 if args.quick else args.repeats
    batch_sizes = (1, 4) if args.quick else (1, 4, 16, 64)

    model, tokenizer = load_demo_model() if args.model == "demo" else load_model_and_tokenizer(args.model)
    eos = tokenizer.eos_token_id
    eval_prompts = [ex.token_ids for ex in build_prompts(demo_records("eval", 64, seed=1), tokenizer).examples]
    draft, draft_info = load_or_train_draft(model, tokenizer, args, quick=args.quick)
    context = max(len(p) for p in eval_prompts) + args.grpo_new_tokens // 2
    start = time.perf_counter()
    profile = cached_profile(model, context_length=context, draft=draft)
    print(f"latency profile {profile.key}: C_peak = {profile.c_peak} tokens ({time.perf_counter() - start:.1f}s)")

    fixed_rows, fixed_results = bench_fixed_batches(model, draft, profile, eval_prompts, batch_sizes, repeats,
                                                    args.fixed_new_tokens)
    print_table(f"Fixed live batch: B prompts x 1 sample, {args.fixed_new_tokens} new tokens, temperature 1",
                ["B", "policy", "plain tok/s", "spec tok/s", "speedup", "accept len", "tree sizes"], fixed_rows)
    workloads = {"long-tail": Workload(SamplingConfig(max_new_tokens=args.tail_max, temperature=1.0),
                                       long_tail_lengths(64, args.tail_min, args.tail_max, args.tail_alpha)),
                 "demo": Workload(SamplingConfig(max_new_tokens=args.grpo_new_tokens, temperature=1.0,
                                                 stop_token_ids=(eos,)), None)}
    grpo_results, traces = [], {}
    for workload_name, workload in workloads.items():
        rows, results, workload_traces = bench_grpo_shaped(model, draft, profile, eval_prompts[:8], workload,
                                                           repeats)
        print_table(f"GRPO-shaped, {workload_name}: 8 prompts x G=8, temperature 1, {workload.describe()}",
                    ["policy", "tok/s", "speedup", "accept len", "steps", "spec steps", "tree sizes"], rows)
        grpo_results += [{"workload": workload_name, **r} for r in results]
        traces[workload_name] = workload_traces

    best = max((r for r in grpo_results if r["policy"] != "off"), key=lambda r: r["speedup"])
    worst_fixed = min(fixed_results, key=lambda r: r["speedup"]) if fixed_results else None
    print(f"best GRPO-shaped policy: {best['policy']} on {best['workload']} at {best['speedup']:.2f}x "
          f"(target >= 2x); slowest fixed-B variant: {worst_fixed['policy']} at B={worst_fixed['batch']} "
          f"{worst_fixed['speedup']:.2f}x")
    name = "speculative_quick" if args.quick else "speculative"  # a smoke run never overwrites the real results
    plot_speedup(fixed_results, RESULTS_DIR / f"{name}_speedup.png")
    plot_tree_sizes(traces["long-tail"], RESULTS_DIR / f"{name}_tree_sizes.png")
    write_results(name, {
        "model": args.model, "draft": draft_info, "profile": {"key": profile.key, "c_peak": profile.c_peak,
                                                              "verify": profile.to_json()["verify"],
                                                              "draft": profile.to_json()["draft"]},
        "fixed_shape": list(FIXED_SHAPE), "repeats": repeats,
        "fixed_batch": fixed_results, "grpo_shaped": grpo_results,
        "long_tail": {"min": args.tail_min, "max": args.tail_max, "alpha": args.tail_alpha,
                      "lengths": workloads["long-tail"].lengths},
        "grpo_traces": traces, "best_grpo_policy": best["policy"], "best_grpo_workload": best["workload"],
        "best_grpo_speedup": best["speedup"],
    })


def load_or_train_draft(model, tokenizer, args, *, quick: bool) -> tuple[DraftHead, dict]:
    if args.draft:
        info_path = Path(args.draft) / "bench_info.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        return DraftHead.load(args.draft, model), {**info, "loaded_from": args.draft}
    num_prompts = 8 if quick else args.draft_prompts
    epochs = 1 if quick else args.draft_epochs
    prompts = [ex.token_ids for ex in build_prompts(demo_records("train", num_prompts, seed=0), tokenizer).examples]
    # The draft learns the text it will be asked to predict: half the prompts' completions stop at EOS
    # (the demo workload), the other half run on past it to the long-tail workload's longest length.
    stop_at_eos = SamplingConfig(max_new_tokens=args.grpo_new_tokens, temperature=1.0,
                                 stop_token_ids=(tokenizer.eos_token_id,))
    run_on = SamplingConfig(max_new_tokens=args.tail_max, temperature=1.0)
    start = time.perf_counter()
    completions = []
    for first in range(0, len(prompts), 8):
        sampling, samples = (stop_at_eos, 8) if first < len(prompts) // 2 else (run_on, 2)
        completions += generate(model, prompts[first:first + 8], num_samples=samples, sampling=sampling,
                                seed=first).tokens_per_group()
    groups = draft_groups(model, prompts, completions)
    draft = DraftHead(model)
    history = train_draft(draft, groups, DraftLearningConfig(lr=3e-3), num_epochs=epochs, batch_size=16)
    num_completions = groups.num_completions
    info = {"trained_on": f"{num_completions} demo-model completions of {num_prompts} train prompts (temperature 1; "
                          f"half stopped at EOS, half ran on to {args.tail_max} tokens)",
            "epochs": epochs, "lr": config.lr, "final_loss": history[-1]["loss"],
            "final_top1_agreement": history[-1]["top1_agreement"], "seconds": time.perf_counter() - start}
    print(f"draft trained: {info}")
    if args.save_draft:
        draft.save(args.save_draft)
        (Path(args.save_draft) / "bench_info.json").write_text(json.dumps(info, indent=2))
    return draft, info


def sizing_of(name: str, profile):
    if name == "off":
        return OffSizing()
    if name == "fixed":
        return FixedSizing(FIXED_SHAPE)
    return make_sizing(name, profile=profile)


class Runner:
    """A rollout callable for ``interleaved_medians`` that uses seed k on its k-th call and keeps
    every call's rollout (for tokens/s and speculation statistics)."""

    def __init__(self, run):
        self.run, self.rollouts = run, []

    def __call__(self):
        self.rollouts.append(self.run(len(self.rollouts)))


def race_policies(rollout, policies, draft, profile, repeats) -> tuple[dict[str, dict], object]:
    """Time plain decoding and each sizing policy on the same ``rollout(seed, speculation)``,
    interleaved. Returns per policy its result fields (plus ``stats``: its last rollout's
    SpeculativeStats, not for the JSON) and the last plain rollout's stats."""
    runners = {"plain": Runner(rollout)}
    sizings = {name: sizing_of(name, profile) for name in policies}  # each learns across its runs
    for name in policies:
        runners[name] = Runner(lambda seed, s=Speculation(draft, sizings[name]): rollout(seed, s))
    timings = interleaved_medians(runners, repeats=repeats, warmup=1)
    plain_rate = _median_rate(runners["plain"], timings["plain"])
    results = {}
    for name in policies:
        rate = _median_rate(runners[name], timings[name])
        stats = runners[name].rollouts[-1].stats
        results[name] = {"policy": name, "plain_tokens_per_s": plain_rate, "tokens_per_s": rate,
                         "speedup": rate / plain_rate, "accept_length": stats.mean_accepted_length,
                         "times_s": timings[name]["times_s"], "plain_times_s": timings["plain"]["times_s"],
                         "tokens": [r.stats.num_generated_tokens for r in runners[name].rollouts],
                         "learnt": _learnt(sizings[name]), "stats": stats}
    return results, runners["plain"].rollouts[-1].stats


def bench_fixed_batches(model, draft, profile, prompts, batch_sizes, repeats, new_tokens):
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    rows, results = [], []
    for batch in batch_sizes:
        def rollout(seed, speculation=None, group=prompts[:batch]):
            return generate(model, group, num_samples=1, sampling=sampling, seed=seed, draft=speculation)

        raced, _ = race_policies(rollout, POLICIES[1:], draft, profile, repeats)
        for name, result in raced.items():
            stats = result.pop("stats")
            results.append({"batch": batch, **result, "tree_sizes": sorted(set(stats.tree_sizes))})
            rows.append([batch, name, result["plain_tokens_per_s"], result["tokens_per_s"], result["speedup"],
                         result["accept_length"], _sizes_text(stats.tree_sizes)])
    return rows, results


@dataclass
class Workload:
    """How a GRPO-shaped rollout is sampled: the config, and fixed per-completion lengths (or None)."""

    sampling: SamplingConfig
    lengths: list[int] | None

    def describe(self) -> str:
        if self.lengths is None:
            return f"stop at EOS, max {self.sampling.max_new_tokens} new tokens"
        return (f"fixed long-tail lengths {min(self.lengths)}..{max(self.lengths)} "
                f"(median {statistics.median(self.lengths):.0f}, {sum(self.lengths)} tokens)")


def long_tail_lengths(num: int, shortest: int, longest: int, alpha: float) -> list[int]:
    """``num`` completion lengths at evenly spaced quantiles of a Pareto(alpha) distribution with
    minimum ``shortest``, capped at ``longest``: most completions short, a few long (deterministic)."""
    quantiles = [(i + 0.5) / num for i in range(num)]
    lengths = [min(longest, round(shortest * (1 - q) ** (-1 / alpha))) for q in quantiles]
    return random.Random(0).sample(lengths, num)  # spread the long ones over the groups


def bench_grpo_shaped(model, draft, profile, prompts, workload: Workload, repeats):
    sampling, lengths = workload.sampling, workload.lengths

    def rollout(seed, speculation=None):
        return generate(model, prompts, num_samples=8, sampling=sampling, seed=seed, draft=speculation,
                        max_new_tokens_per_completion=lengths)

    raced, plain_stats = race_policies(rollout, POLICIES, draft, profile, repeats)
    rows, results, traces = [], [], {}
    for name, result in raced.items():
        stats = result.pop("stats")
        num_spec = sum(1 for n in stats.tree_sizes if n > 1)
        results.append({**result, "num_steps": len(stats.tree_sizes), "num_speculative_steps": num_spec})
        traces[name] = {"live_batch": stats.live_batch_sizes, "tree_size": stats.tree_sizes,
                        "accepted_length": stats.accepted_lengths}
        rows.append([name, result["tokens_per_s"], result["speedup"], result["accept_length"],
                     len(stats.tree_sizes), num_spec, _sizes_text(stats.tree_sizes)])
    traces["plain"] = {"live_batch": plain_stats.live_batch_sizes}
    return rows, results, traces


def _learnt(sizing) -> dict | None:
    return sizing.describe() if hasattr(sizing, "describe") else None


def _rates(runner: Runner, timing: dict) -> list[float]:
    """Tokens/s of each timed call (the last ``len(times)`` rollouts; earlier ones warmed up)."""
    timed = runner.rollouts[-len(timing["times_s"]):]
    return [r.stats.num_generated_tokens / t for r, t in zip(timed, timing["times_s"])]


def _median_rate(runner: Runner, timing: dict) -> float:
    return statistics.median(_rates(runner, timing))


def paired_speedups(plain: Runner, plain_timing: dict, ours: Runner, ours_timing: dict) -> list[float]:
    """Per repeat k, the k-th timed rollout's token rate over the k-th plain one's: the two ran back to
    back, so the ratios' spread shows how far the machine's drift alone moves a speedup."""
    return [o / p for o, p in zip(_rates(ours, ours_timing), _rates(plain, plain_timing))]


def _sizes_text(sizes: list[int]) -> str:
    spec = [n for n in sizes if n > 1]
    if not spec:
        return "off"
    return f"{min(spec)}..{max(spec)} ({len(spec)}/{len(sizes)} steps)"


def plot_speedup(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in POLICIES[1:]:
        points = sorted((r["batch"], r["speedup"]) for r in results if r["policy"] == name)
        ax.plot([b for b, _ in points], [s for _, s in points], marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("live batch B (sequences)")
    ax.set_ylabel("speedup over plain (tokens/s)")
    ax.set_title("Speculative rollouts on the demo model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_tree_sizes(traces: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name in ("fixed", "fastgrpo", "cost"):
        top.step(range(len(traces[name]["tree_size"])), traces[name]["tree_size"], where="post", label=name)
        bottom.plot(traces[name]["live_batch"], label=name)
    bottom.plot(traces["plain"]["live_batch"], color="grey", linestyle="--", label="plain")
    top.set_ylabel("tree size N (1 = off)")
    top.set_yscale("log", base=2)
    top.set_title("GRPO-shaped rollout (8 prompts x G=8): tree size and live batch per step")
    top.legend()
    bottom.set_ylabel("live batch B")
    bottom.set_xlabel("decoding step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


REAL_KINDS = ("off", "siblings", "history", "neural", "both", "neural+siblings")
"""Draft kinds on the real model: ``off`` (the speculative loop with sizing "off": its plain path,
against the plain engine), history drafts alone (the group's siblings; siblings plus a store of
earlier rollouts' completions of the same prompts, as when prompts recur across epochs), the neural
draft alone, and the neural draft merged with history (with the store, or siblings only)."""

FIXED_TREE_KIND = "tree"
"""``tree<K>x<L>x<N>``: the neural draft with one fixed tree shape on every step (``FixedSizing``,
``TreeShape(top_k=K, depth=L, num_nodes=N)``), no cost policy. A sweep of these measures what the best
tree can reach on this machine, with the policy out of the way (``--kinds tree1x1x2,tree2x2x5,...``)."""


def fixed_tree_shape(kind: str) -> TreeShape | None:
    """The tree shape of a ``tree<K>x<L>x<N>`` kind (validated), or None for any other kind."""
    if not kind.startswith(FIXED_TREE_KIND):
        return None
    try:
        return TreeShape(*(int(n) for n in kind[len(FIXED_TREE_KIND):].split("x"))).validate()
    except (TypeError, ValueError) as error:
        raise SystemExit(f"draft kind {kind!r}: expected tree<top_k>x<depth>x<nodes> ({error})") from None


def real_model_speculation(kind: str, draft, profiles) -> Speculation:
    """A fresh ``Speculation`` of ``kind`` (``REAL_KINDS``) with its own cost sizing, which learns over
    its runs (acceptance and step times) as a trainer's does over steps."""
    if kind == "off":
        return Speculation(draft, "off")
    if kind in ("siblings", "history"):
        sizing = speculation_sizing("cost", profiles["none"], neural=False, history=True)
        return Speculation(None, sizing, history=HistoryDrafts(store=HistoryStore() if kind == "history" else None))
    if draft is None:
        raise SystemExit(f"draft kind {kind!r} needs a neural draft: build it with `turbogrpo draft build "
                         f"--model smollm2` or pass --draft DIR")
    shape = fixed_tree_shape(kind)
    if shape is not None:
        return Speculation(draft, FixedSizing(shape))
    history = {"neural": None, "both": HistoryDrafts(store=HistoryStore()),
               "neural+siblings": HistoryDrafts(store=None)}[kind]
    # Merged kinds size with MergedSizing: each step the neural tree (chains merged in) or chains alone.
    sizing = speculation_sizing("cost", profiles["draft"], neural=True, history=history is not None)
    return Speculation(draft, sizing, history=history)


def race_kinds(rollout, kinds, draft, profiles, *, repeats: int, warmup: int) -> tuple[list[dict], dict]:
    """Time plain decoding and each draft kind on ``rollout(seed, speculation)``, interleaved (the k-th
    call of every variant uses seed k). Returns one result per kind and each variant's last rollout."""
    runners = {"plain": Runner(rollout)}
    speculation_of = {kind: real_model_speculation(kind, draft, profiles) for kind in kinds}
    for kind, speculation in speculation_of.items():
        runners[kind] = Runner(lambda seed, s=speculation: rollout(seed, s))
    timings = interleaved_medians(runners, repeats=repeats, warmup=warmup)  # a warm-up fills the stores
    plain_rate = _median_rate(runners["plain"], timings["plain"])
    results = []
    for kind in kinds:
        rate = _median_rate(runners[kind], timings[kind])
        stats = runners[kind].rollouts[-1].stats
        sizes = [n for n in stats.tree_sizes if n > 1]
        paired = paired_speedups(runners["plain"], timings["plain"], runners[kind], timings[kind])
        results.append({"kind": kind, "plain_tokens_per_s": plain_rate, "tokens_per_s": rate,
                        "speedup": rate / plain_rate, "paired_speedups": paired,
                        "paired_speedup_quartiles": statistics.quantiles(paired, n=4) if len(paired) > 1 else paired,
                        "accept_length": stats.mean_accepted_length,
                        "times_s": timings[kind]["times_s"], "plain_times_s": timings["plain"]["times_s"],
                        "tokens": [r.stats.num_generated_tokens for r in runners[kind].rollouts],
                        "tree_sizes": stats.tree_sizes, "live_batch": stats.live_batch_sizes,
                        "tree_size_counts": {n: sizes.count(n) for n in sorted(set(sizes))},
                        "num_steps": len(stats.tree_sizes), "num_speculative_steps": len(sizes),
                        "draft_seconds": stats.draft_seconds, "learnt": _learnt(speculation_of[kind].sizing)})
    return results, {name: runner.rollouts[-1] for name, runner in runners.items()}


def main_real_model(args) -> None:
    """Plain vs. history, neural and merged drafts on SmolLM2 with GSM8K test prompts: fixed live batches
    (EOS ignored), then the natural tail (8 prompts x G=8, stop at <|im_end|>)."""
    import os
    from turbogrpo.speculative.built_drafts import BUILT_DRAFTS, built_draft_folder, is_built, resolve_draft_path
    from turbogrpo.train.setup import stop_token_ids

    load_before = os.getloadavg()
    model, tokenizer = load_real_model()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else []
    kinds = [k for k in args.kinds.split(",") if k]
    tail_kinds = [k for k in args.tail_kinds.split(",") if k]
    for kind in kinds + tail_kinds:
        if kind not in REAL_KINDS and fixed_tree_shape(kind) is None:
            raise SystemExit(f"unknown draft kind {kind!r}; choose from {', '.join(REAL_KINDS)} or "
                             f"{FIXED_TREE_KIND}<top_k>x<depth>x<nodes>")
    repeats = 1 if args.quick else args.repeats
    prompts = chat_prompts(tokenizer, max([8] + [-(-b // min(b, 8)) for b in batches]), few_shot=False)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=args.temperature)  # EOS ignored: fixed B
    draft_path = args.draft
    if draft_path is None and is_built(built_draft_folder(BUILT_DRAFTS["smollm2-gsm8k"])):
        draft_path = "smollm2-gsm8k"  # the draft `turbogrpo draft build --model smollm2` made
    draft = DraftHead.load(resolve_draft_path(draft_path), model) if draft_path else None
    if draft is None:
        print("no neural draft (build one with `turbogrpo draft build --model smollm2`): history kinds only")
        kinds = [k for k in kinds if k in ("siblings", "history")]
        tail_kinds = [k for k in tail_kinds if k in ("siblings", "history")]
    context = max(len(p) for p in prompts) + args.new_tokens // 2
    start = time.perf_counter()
    # Up to 128 tokens per forward: trees are priced inside that range only (B * N <= 128).
    profiles = {"none": cached_profile(model, context_length=context, max_tokens=128)}
    if draft is not None:
        profiles["draft"] = cached_profile(model, context_length=context, draft=draft, max_tokens=128)
    print(f"latency profile {profiles['none'].key}: C_peak = {profiles['none'].c_peak} tokens "
          f"({time.perf_counter() - start:.1f}s)")

    rows, results = [], []
    for batch in batches:
        samples = min(batch, 8)
        group = prompts[:batch // samples]

        def rollout(seed, speculation=None, group=group, samples=samples):
            return generate(model, group, num_samples=samples, sampling=sampling, seed=seed, draft=speculation)

        raced, _ = race_kinds(rollout, kinds, draft, profiles, repeats=repeats, warmup=1)
        load = os.getloadavg()[0]
        for result in raced:
            results.append({"batch": batch, "prompts": len(group), "num_samples": samples, "load_average": load,
                            **result})
            rows.append([batch, f"{len(group)}x{samples}", result["kind"], result["plain_tokens_per_s"],
                         result["tokens_per_s"], result["speedup"],
                         "-".join(f"{q:.2f}" for q in result["paired_speedup_quartiles"][::2]), result["accept_length"],
                         _sizes_text(result["tree_sizes"]), f"{load:.1f}"])
        print(f"B={batch} done, load average {load:.2f}", flush=True)
    if rows:
        print_table(f"SmolLM2-135M-Instruct, GSM8K test prompts (chat template), {args.new_tokens} new tokens, "
                    f"temperature {args.temperature:g}, EOS ignored; cost sizing; median of {repeats} (after 1 "
                    "warm-up)", ["B", "prompts x G", "draft", "plain tok/s", "spec tok/s", "speedup", "paired IQR", "accept len",
                                 "tree sizes", "load"], rows)

    tail = None
    if tail_kinds and args.tail_repeats:
        # The GRPO shape with its natural tail: 8 prompts x G=8, stop at <|im_end|>, 512-token cap.
        tail_sampling = SamplingConfig(max_new_tokens=args.tail_new_tokens, temperature=args.temperature,
                                       stop_token_ids=stop_token_ids(model, tokenizer))

        def tail_rollout(seed, speculation=None):
            return generate(model, prompts[:8], num_samples=8, sampling=tail_sampling, seed=seed, draft=speculation)

        raced, last = race_kinds(tail_rollout, tail_kinds, draft, profiles, repeats=args.tail_repeats, warmup=0)
        load = os.getloadavg()[0]
        lengths = sorted(len(c) for group in last["plain"].tokens_per_group() for c in group)
        tail = {"prompts": 8, "num_samples": 8, "max_new_tokens": args.tail_new_tokens, "load_average": load,
                "plain_live_batch": last["plain"].stats.live_batch_sizes, "results": raced,
                "plain_completion_lengths": lengths}
        print(f"plain completion lengths: median {statistics.median(lengths):.0f}, "
              f"{sum(n >= args.tail_new_tokens for n in lengths)}/{len(lengths)} at the cap")
        print_table(f"GSM8K natural tail: 8 prompts x G=8, stop at <|im_end|>, {args.tail_new_tokens}-token cap, "
                    f"temperature {args.temperature:g}; median of {args.tail_repeats}, no warm-up (stores start "
                    f"empty); load {load:.1f}",
                    ["draft", "plain tok/s", "spec tok/s", "speedup", "accept len", "steps", "tree sizes"],
                    [[r["kind"], r["plain_tokens_per_s"], r["tokens_per_s"], r["speedup"], r["accept_length"],
                      r["num_steps"], _sizes_text(r["tree_sizes"])] for r in raced])
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (a shared 2-core machine: "
          f"figures from a loaded machine)")
    name = args.out or ("speculative_smollm2" + ("_neural" if draft is not None else "")
                        + ("_greedy" if args.temperature == 0 else "") + ("_quick" if args.quick else ""))
    build_record = None
    if draft_path:
        record_path = Path(resolve_draft_path(draft_path)) / "turbogrpo_draft_build.json"
        build_record = json.loads(record_path.read_text()) if record_path.is_file() else None
    write_results(name, {
        "model": REAL_MODEL, "prompts": "GSM8K test, zero-shot chat template", "new_tokens": args.new_tokens,
        "temperature": args.temperature, "eos_ignored": True, "sizing": "cost", "repeats": repeats,
        "neural_draft": draft_path, "neural_draft_build": build_record,
        "load_average_before": load_before, "load_average_after": load_after,
        "prompt_lengths": [len(p) for p in prompts],
        "profile": {key: {"key": p.key, "c_peak": p.c_peak, "verify": p.to_json()["verify"],
                          "draft": p.to_json()["draft"]} for key, p in profiles.items()},
        "results": results, "natural_tail": tail})
    if results:
        plot_real_model(results, RESULTS_DIR / f"{name}_speedup.png", args.temperature)


def plot_real_model(results: list[dict], path: Path, temperature: float) -> None:
    """Speedup over plain vs. live batch, one line per draft kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in dict.fromkeys(r["kind"] for r in results):
        points = [(r["batch"], r["speedup"]) for r in results if r["kind"] == kind]
        ax.plot(*zip(*points), marker="o", label=kind)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.5, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("live batch B")
    ax.set_ylabel("speedup over plain")
    ax.set_title(f"SmolLM2-135M, GSM8K prompts, T={temperature:g}, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
