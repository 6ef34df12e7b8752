"""Speculation is lossless on the real model too: SmolLM2 on its arithmetic task, 32 held-out prompts x 8
samples per rollout, T=1, stop at <|im_end|> or 32 tokens; plain sampling against forced 4x3x8 trees of
the built GSM8K draft (``turbogrpo draft build --model smollm2``) on every decoding step. Compares the
completion-length distributions (two-sample chi-square, 99.9% bound).

    python scripts/smollm2_lossless_check.py 4     # 4 rollouts each -> bench/results/smollm2_lossless_check.json
"""
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from bench.harness import machine_info  # noqa: E402
from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.host_memory import keep_freed_host_memory  # noqa: E402
from turbogrpo.placement import join_job  # noqa: E402
from turbogrpo.rewards import build_rewards  # noqa: E402
from turbogrpo.rollout import generate  # noqa: E402
from turbogrpo.speculative import Speculation  # noqa: E402
from turbogrpo.speculative.built_drafts import resolve_draft_path  # noqa: E402
from turbogrpo.speculative.draft import DraftHead  # noqa: E402
from turbogrpo.speculative.sizing import FixedSizing  # noqa: E402
from turbogrpo.train.run import build_run  # noqa: E402
from turbogrpo.train.output_dir import run_record  # noqa: E402


def chi_square_equal(a: list[int], b: list[int]) -> dict:
    """Two-sample chi-square of equal distributions (equal sample sizes) and its 99.9% quantile
    (Wilson-Hilferty), as in tests/train/test_draft_learning.py."""
    size = max(a + b) + 1
    counts_a, counts_b = (torch.bincount(torch.tensor(x), minlength=size).double() for x in (a, b))
    seen = (counts_a + counts_b) > 0
    statistic = float(((counts_a - counts_b)[seen] ** 2 / (counts_a + counts_b)[seen]).sum())
    dof = int(seen.sum()) - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    return {"length_chi2": statistic, "dof": dof, "bound_999": bound, "equal": statistic < bound}


def main(num_rollouts: int) -> None:
    keep_freed_host_memory()
    config = load_config("configs/smollm2_arithmetic.toml", ['train.output_dir="runs/lossless_check"',
                                                             "log.tensorboard=false", "log.progress_bar=false"])
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    draft = DraftHead.load(resolve_draft_path("smollm2-gsm8k"), run.policy)
    prompts = [e.token_ids for e in run.held_out.examples[:32]]
    cap = run.sampling.max_new_tokens
    out, summary = {}, {}
    with torch.no_grad():
        for name, speculation in (("plain", None), ("trees", Speculation(draft, FixedSizing((4, 3, 8))))):
            lengths, start = [], time.perf_counter()
            for seed in range(num_rollouts):
                rollout = generate(run.policy, prompts, num_samples=8, sampling=run.sampling, seed=100 + seed,
                                   draft=speculation)
                lengths += [len(tokens) for tokens in rollout.tokens]
            out[name] = {"lengths": lengths, "seconds": time.perf_counter() - start}
            summary[name] = {"completions": len(lengths), "mean_length": statistics.mean(lengths),
                             "length_standard_error": statistics.stdev(lengths) / len(lengths) ** 0.5,
                             "at_cap": sum(n == cap for n in lengths), "seconds": out[name]["seconds"],
                             "tokens_per_forward": rollout.stats.mean_accepted_length}
            print(name, summary[name], flush=True)
    test = chi_square_equal(out["plain"]["lengths"], out["trees"]["lengths"])
    print(test)
    with open("bench/results/smollm2_lossless_check.json", "w") as f:
        json.dump({"machine": machine_info(), "summary": summary, **test, **out}, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
