"""How far each sampler is from the trainer, and what measuring it costs (issue 55, parts 4(b) and the 1% target).

SmolLM2-135M-Instruct (bench/real_model.py), GSM8K test questions zero-shot under its chat template, T = 1. Three
samplers draw the same prompts: the native engine with the weights in float32 (the trainer's own forward), the
native engine with a bf16 copy, and the vLLM engine (vLLM's CPU build, in this process) in bf16. The trainer then
scores every completion in float32 (the shared-prefix forward), and the run's own mismatch metrics
(``turbogrpo.algo.mismatch``, what ``metrics.jsonl`` logs as ``mismatch/*``) are computed from the two log-probs:
K3 KL(sampler || trainer), |delta log p| mean / p50 / p99 / max, and the shares of tokens and sequences each
correction of the family masks (the default "tis" truncates and masks none; TRL's sequence_mask, IcePop, ...).

Cost: the metrics' computation (``mismatch_statistics``, its host read and ``mismatch_metrics``) is timed against
the update's forward + backward on the same batch, alternated in one process (``harness.interleaved_medians``).
The forward + backward (in micro-batches, ``MICRO_BATCH_TOKENS``) is less than a step's update (no optimizer, no
reference, no recomputation), so the share is an upper bound.

    python bench/mismatch.py            # 16 prompts x 8, up to 256 tokens; bench/results/mismatch.json
    python bench/mismatch.py --quick    # 2 x 2, 8 tokens, 1 repeat; bench/results/mismatch_quick.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402
from vllm_rollout import stop_ids  # noqa: E402

from turbogrpo.algo.losses import AUTO_TIS_CAP, OFF_POLICY_CORRECTIONS, CorrectionBounds  # noqa: E402
from turbogrpo.algo.mismatch import mismatch_metrics, mismatch_statistics  # noqa: E402
from turbogrpo.config import AlgoConfig  # noqa: E402
from turbogrpo.prefix import compute_logprobs  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402

SHAPES = {"full": dict(num_prompts=16, num_samples=8, new_tokens=256, repeats=5),
          "quick": dict(num_prompts=2, num_samples=2, new_tokens=8, repeats=1)}
MICRO_BATCH_TOKENS = 4096
"""The cost's forward + backward runs in micro-batches of this many tokens without gradient checkpointing (about
5 GB of activations for SmolLM2; the shipped config's 16,384 with checkpointing recomputes, so it is slower and the
metrics' share of it smaller: the share measured here is an upper bound)."""
CORRECTIONS = ("tis", "token_mask", "sequence_mask", "geometric_mask", "icepop", "k3_reject")
"""The corrections whose masked shares are reported ("tis", the default, truncates: it masks nothing)."""


def samplers(model, tokenizer, names: list[str]) -> dict:
    """Name -> ``sample(prompts, num_samples, sampling, seed) -> Groups`` for each sampler of ``names``."""
    built = {}
    if "native_float32" in names:
        built["native_float32"] = lambda *a: generate(model, a[0], num_samples=a[1], sampling=a[2], seed=a[3]).groups
    if "native_bf16" in names:
        half = copy.deepcopy(model).to(torch.bfloat16)
        built["native_bf16"] = lambda *a: generate(half, a[0], num_samples=a[1], sampling=a[2], seed=a[3]).groups
    if "vllm_bf16" in names:
        from turbogrpo.engines.vllm import VllmEngine
        # Built at its first draw (after the native samplers): vLLM's build pins this process to one torch thread.
        engine = VllmEngine(torch.bfloat16, torch.device("cpu"), tokenizer)
        built["vllm_bf16"] = lambda *a: engine.sample(model, a[0], num_samples=a[1], sampling=a[2], seed=a[3]).groups
    return built


def statistics(trainer_logps, sampler_logps, correction: str) -> dict:
    """The run's ``mismatch/*`` metrics of one batch under ``correction`` (its default bounds, cap 2)."""
    algo = AlgoConfig(off_policy_correction=correction)
    if correction == "icepop":
        algo.tis_cap_low = 0.5
    sums, quantiles, maxima = mismatch_statistics(trainer_logps, sampler_logps, correction,
                                                  CorrectionBounds.of(algo, AUTO_TIS_CAP))
    return mismatch_metrics(sums.tolist(), quantiles.tolist(), maxima.tolist(), corrected=True)  # host sync


def trainer_forward(model, batch) -> torch.Tensor:
    """The float32 trainer's log-probs ``[N]`` of ``batch``'s completion tokens in flat order, micro-batch by
    micro-batch (their concatenation is the whole batch's, ``Groups.micro_batches``)."""
    with torch.no_grad():
        return torch.cat([compute_logprobs(model, micro.prompts, micro.nested(), with_entropy=False).logps
                          for micro in batch.micro_batches(MICRO_BATCH_TOKENS)])


def measure(model, sample, prompts, shape: dict, sampling: SamplingConfig, seed: int) -> dict:
    batch = sample(prompts, shape["num_samples"], sampling, seed)
    trainer_logps = list(trainer_forward(model, batch).split(batch.lengths))
    sampler_logps = [s.float() for s in batch.sampler_logps]
    by_correction = {c: statistics(trainer_logps, sampler_logps, c) for c in CORRECTIONS}
    record = {k.removeprefix("mismatch/"): v for k, v in by_correction["tis"].items() if "masked" not in k}
    record["num_tokens"], record["num_sequences"] = sum(batch.lengths), len(batch.lengths)
    record["masked"] = {c: {"tokens": m["mismatch/frac_tokens_masked"],
                            "sequences": m["mismatch/frac_sequences_masked"]} for c, m in by_correction.items()}
    return record, batch, trainer_logps, sampler_logps


def metric_cost(model, batch, trainer_logps, sampler_logps, repeats: int) -> dict:
    """The mismatch metrics' time on ``batch``'s log-probs (per sequence, as ``measure`` computed them) against
    the update's forward + backward on ``batch`` (alternated medians)."""
    micro_batches = batch.micro_batches(MICRO_BATCH_TOKENS)

    def update():  # per micro-batch, as the trainer's update runs: the whole batch's activations do not fit 24 GB
        model.zero_grad(set_to_none=True)
        for micro in micro_batches:
            compute_logprobs(model, micro.prompts, micro.nested(), with_entropy=False).logps.sum().backward()

    times = interleaved_medians({"forward_backward": update,
                                 "mismatch_metrics": lambda: statistics(trainer_logps, sampler_logps, "tis")},
                                repeats=repeats, warmup=1)
    model.zero_grad(set_to_none=True)
    return {"forward_backward_s": times["forward_backward"]["median_s"], "micro_batches": len(micro_batches),
            "micro_batch_tokens": MICRO_BATCH_TOKENS,
            "mismatch_metrics_s": times["mismatch_metrics"]["median_s"],
            "share": times["mismatch_metrics"]["median_s"] / times["forward_backward"]["median_s"],
            "num_tokens": sum(batch.lengths) + sum(batch.prompt_lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 x 2, 8 tokens, 1 repeat")
    parser.add_argument("--samplers", default="native_float32,native_bf16,vllm_bf16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape_name = "quick" if args.quick else "full"
    shape = SHAPES[shape_name]
    load_before = os.getloadavg()
    torch.manual_seed(args.seed)
    model, tokenizer = load_real_model()
    prompts = chat_prompts(tokenizer, shape["num_prompts"], few_shot=False)
    sampling = SamplingConfig(max_new_tokens=shape["new_tokens"], temperature=1.0, stop_token_ids=stop_ids(tokenizer))
    results, cost = {}, None
    for name, sample in samplers(model, tokenizer, args.samplers.split(",")).items():
        results[name], *drawn = measure(model, sample, prompts, shape, sampling, args.seed)
        if cost is None:  # timed on the first sampler's batch, before vLLM's build leaves this process one thread
            cost = metric_cost(model, *drawn, shape["repeats"])
    print_table(f"Sampler vs float32 trainer, SmolLM2-135M, {shape['num_prompts']} x {shape['num_samples']}, "
                f"up to {shape['new_tokens']} tokens", ["sampler", "tokens", "K3 KL", "|d| mean", "|d| p50", "|d| p99",
                                                        "|d| max", "seq-mask seqs", "icepop tokens"],
                [[n, r["num_tokens"], r["k3_kl"], r["abs_delta_mean"], r["abs_delta_p50"], r["abs_delta_p99"],
                  r["abs_delta_max"], r["masked"]["sequence_mask"]["sequences"], r["masked"]["icepop"]["tokens"]]
                 for n, r in results.items()])
    print(f"mismatch metrics {cost['mismatch_metrics_s'] * 1e3:.3f} ms vs forward+backward "
          f"{cost['forward_backward_s'] * 1e3:.1f} ms: {cost['share']:.2%} (target < 1%)")
    write_results("mismatch" + ("_quick" if args.quick else ""), {
        "shape": {**shape, "model": "smollm2-135m-instruct", "prompts": "GSM8K test, zero-shot chat template",
                  "temperature": 1.0, "trainer": "float32, shared-prefix forward"},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "samplers": results, "cost": cost})


if __name__ == "__main__":
    main()
