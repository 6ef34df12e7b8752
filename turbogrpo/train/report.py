"""End-of-run report: PNG plots drawn from metrics.jsonl, and a short markdown summary."""

from __future__ import annotations

from pathlib import Path


PHASES = ("rollout", "rewards", "logprobs", "update", "draft")


def write_report(output_dir: str | Path, records: list[dict]) -> Path:
    """Draw ``report/rewards.png`` (reward and accuracy curves), ``report/phases.png`` (time per phase)
    ``report/training.png`` (length, entropy, KL, clip fraction, grad norm) and ``report/mismatch.png`` (sampler
    vs trainer); write ``report/report.md``. ``records``: the run's metrics.jsonl (``metrics.read_metrics``)."""
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    out = Path(output_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r for r in records if "reward" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]
    sampled = [(r["step"], r["eval/sampled_accuracy"]) for r in records if r.get("eval/sampled_accuracy") is not None]

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["step"] for r in steps]
    if steps:
        reward = [r["reward"] for r in steps]
        ax.plot(xs, reward, label="reward (mean over the step's completions)")
        accuracy = [r.get("accuracy") for r in steps]
        if any(a is not None for a in accuracy) and accuracy != reward:
            ax.plot(xs, accuracy, ":", label="training accuracy (sampled)")
    if evals:
        ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="held-out accuracy (greedy)")
    if sampled:
        ax.plot([s for s, _ in sampled], [a for _, a in sampled], "s--", label="held-out accuracy (sampled)")
    ax.set_xlabel("step")
    ax.set_title("Reward and accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, out / "rewards.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        values = [r.get(f"time/{phase}", 0.0) for r in steps]
        ax.bar(xs, values, bottom=bottom, label=phase, width=1.0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per step, by phase")
    ax.legend()
    _save(plt, fig, out / "phases.png")

    panels = [("completion_length/mean", "completion length (tokens)"), ("entropy", "entropy (nats/token)"),
              ("kl", "KL to reference (k3)"), ("clip_ratio/region", "clipped fraction"), ("grad_norm", "grad norm"),
              ("logprob_gap", "sampler vs trainer |Δ log p|")]
    panels = [(key, title) for key, title in panels if any(key in r for r in steps)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3), squeeze=False)
        for ax, (key, title) in zip(axes[0], panels):
            ax.plot(xs, [r.get(key) for r in steps])
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        _save(plt, fig, out / "training.png")

    speculative = [r for r in steps if "spec/accepted_length" in r]
    if speculative:
        _plot_speculation(plt, speculative, out / "speculation.png")
    mismatched = [r for r in steps if "mismatch/k3_kl" in r]
    if mismatched:
        _plot_mismatch(plt, mismatched, out / "mismatch.png")

    (out / "report.md").write_text(_summary(steps, evals, sampled))
    return out


def _plot_speculation(plt, steps: list[dict], path: Path) -> None:
    """Acceptance length and tree use per step, and the draft's training time as a share of the step."""
    xs = [r["step"] for r in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(xs, [r["spec/accepted_length"] if r.get("spec/frac_tree_steps", 0) > 0 else float("nan")
                   for r in steps], "o-", markersize=3, label="accepted length (tree steps)")
    left.plot(xs, [r["spec/tokens_per_forward"] for r in steps], ":", label="tokens per forward (all steps)")
    left.set_title("Speculation: tokens per policy forward", fontsize=9)
    right.plot(xs, [r["spec/frac_tree_steps"] for r in steps], label="decoding steps with a tree")
    right.plot(xs, [r.get("time/draft", 0.0) / r["time/step"] for r in steps], label="draft training / step time")
    right.set_title("Tree use and draft-training share", fontsize=9)
    _save(plt, fig, path, step_axes=(left, right))


def _plot_mismatch(plt, steps: list[dict], path: Path) -> None:
    """How far the sampler is from the trainer per step (``algo.mismatch``): |delta log p| (mean, p50, p99, max)
    and the k3 KL on a log scale, and the shares of tokens and sequences the off-policy correction masked (and, with
    MoE routing replay, of tokens the trainer's routers would route otherwise)."""
    xs = [r["step"] for r in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, style in (("mean", "-"), ("p50", ":"), ("p99", "--"), ("max", "-.")):
        left.plot(xs, [r[f"mismatch/abs_delta_{key}"] for r in steps], style, label=f"|Δ log p| {key}")
    left.plot(xs, [r["mismatch/k3_kl"] for r in steps], "o-", markersize=3, label="KL(sampler || trainer), k3")
    if any(v > 0 for r in steps for k, v in r.items() if k.startswith("mismatch/abs_delta")):
        left.set_yscale("log")  # gaps span decades: float32 1e-7, bf16 1e-3, another engine 1e-2
    left.set_title("Sampler vs trainer, per token", fontsize=9)
    right.plot(xs, [r.get("mismatch/frac_tokens_masked", 0.0) for r in steps], label="tokens masked")
    right.plot(xs, [r.get("mismatch/frac_sequences_masked", 0.0) for r in steps], label="sequences masked")
    if any("mismatch/frac_tokens_routes_differ" in r for r in steps):  # MoE with algo.routing_replay
        right.plot(xs, [r.get("mismatch/frac_tokens_routes_differ", 0.0) for r in steps],
                   label="tokens routed otherwise (replayed)")
    right.set_title("Masked by the off-policy correction", fontsize=9)
    _save(plt, fig, path, step_axes=(left, right))


def _save(plt, fig, path: Path, step_axes=()) -> None:
    """Write ``fig`` to ``path`` (PNG) and free it; ``step_axes``: panels over steps, labelled and gridded alike."""
    for ax in step_axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speculation_summary(steps: list[dict]) -> list[str]:
    """Lines on speculative rollouts and online draft learning ([] for a run without speculation)."""
    steps = [r for r in steps if "spec/accepted_length" in r]
    if not steps:
        return []
    tenth = max(1, len(steps) // 10)
    first, last = steps[:tenth], steps[-tenth:]
    lines = [f"Speculation: accepted length {_mean(first, 'spec/accepted_length'):.2f} (first tenth of steps) -> "
             f"{_mean(last, 'spec/accepted_length'):.2f} (last tenth) tokens per policy forward on tree steps; "
             f"{_mean(steps, 'spec/frac_tree_steps'):.0%} of decoding steps verified a tree "
             f"(mean tree {_mean(steps, 'spec/tree_size'):.1f} nodes, mean live batch {_mean(steps, 'spec/live_batch'):.1f})."]
    if any("time/draft" in r for r in steps):
        share = sum(r.get("time/draft", 0.0) for r in steps) / (sum(r["time/step"] for r in steps) or 1.0)
        lines.append(f"Online draft learning: {share:.1%} of the step time; draft top-1 agreement with the policy "
                     f"{_mean(first, 'draft/top1_agreement'):.2f} -> {_mean(last, 'draft/top1_agreement'):.2f}.")
    return lines


def mismatch_summary(steps: list[dict]) -> list[str]:
    """A line on how far the sampler was from the trainer, means over the steps ([] without the metrics)."""
    steps = [r for r in steps if "mismatch/k3_kl" in r]
    if not steps:
        return []
    line = (f"Sampler vs trainer: |Δ log p| mean {_mean(steps, 'mismatch/abs_delta_mean'):.2e}, p99 "
            f"{_mean(steps, 'mismatch/abs_delta_p99'):.2e}, max {max(r['mismatch/abs_delta_max'] for r in steps):.2e}; "
            f"KL(sampler || trainer) {_mean(steps, 'mismatch/k3_kl'):.2e} per token (k3).")
    if any("mismatch/frac_tokens_masked" in r for r in steps):
        line += (f" The off-policy correction masked {_mean(steps, 'mismatch/frac_tokens_masked'):.2%} of tokens and "
                 f"{_mean(steps, 'mismatch/frac_sequences_masked'):.2%} of sequences.")
    return [line]


def _summary(steps: list[dict], evals: list[tuple[int, float]], sampled: list[tuple[int, float]]) -> str:
    lines = ["# Run report", ""]
    for name, points in (("greedy", evals), ("sampled", sampled)):
        if points:
            lines.append(f"Held-out accuracy ({name}): {points[0][1]:.1%} at step {points[0][0]} -> "
                         f"{points[-1][1]:.1%} at step {points[-1][0]}.")
    if steps:
        first, last = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
        lines.append(f"Mean reward: {_mean(first, 'reward'):.3f} (first tenth of steps) -> "
                     f"{_mean(last, 'reward'):.3f} (last tenth).")
        totals = {p: sum(r.get(f"time/{p}", 0.0) for r in steps) for p in PHASES}
        whole = sum(totals.values()) or 1.0
        lines.append("Time by phase: " + ", ".join(f"{p} {t:.1f} s ({t / whole:.0%})" for p, t in totals.items()))
        lines += speculation_summary(steps) + mismatch_summary(steps)
        lines.append(f"Steps: {len(steps)}; mean step time {_mean(steps, 'time/step'):.2f} s; "
                     f"skipped optimizer steps (NaN/inf): {int(steps[-1].get('skipped_steps_total', 0))}.")
    lines += ["", "![rewards](rewards.png)", "", "![phases](phases.png)", "", "![training](training.png)", ""]
    if any("spec/accepted_length" in r for r in steps):
        lines += ["![speculation](speculation.png)", ""]
    if any("mismatch/k3_kl" in r for r in steps):
        lines += ["![mismatch](mismatch.png)", ""]
    return "\n".join(lines)


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")
