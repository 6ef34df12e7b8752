"""GPU part "hybrid" of bench/gpu.py (issue 53 part 6 d): the Qwen3.5-shaped hybrid of bench/hybrid_prefix.py on a GPU.

    python bench/gpu.py --only hybrid
    python bench/gpu_hybrid.py --quick     # the CPU smoke form: the tiny hybrid, tiny shapes (no GPU number)

Random-init bf16 weights built on the device. The gated DeltaNet layers run flash-linear-attention's kernels
(and causal-conv1d's) where those packages are installed, transformers' PyTorch fallbacks otherwise; the results
say which (``kernels``). While the budget lasts, in order:

* ``prefix``: forward + backward of the mean completion log-prob, the model's own forward of G rows against
  turbogrpo's shared-prefix forward (cascade), P/S/G random ids, with the FLOP ratio (``HybridFlops``);
* ``tree``: the same for bench/tree.py's synthetic deep trie, one row per sequence against the trie forward;
* ``rollout``: native engine against HF ``generate``, 8 x 8 x 256 at T = 1 (random weights: no stop token is
  drawn, every sample runs 256 tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, timed_with_peak  # noqa: E402
from hybrid_prefix import (HYBRID_MODEL, QUICK_MODEL, HybridFlops, hybrid_model, run_rows, run_shared,  # noqa: E402
                           run_standard, run_tree)
from tree_cases import Case  # noqa: E402

PREFIX_ROWS = [(1024, 256, 8), (128, 512, 8)]     # P, S, G: few-shot-like, then zero-shot-like
TREE_SHAPE = "512/4x2x2/64"
ROLLOUT = (8, 8, 256)                               # prompts, samples, new tokens
QUICK = {"prefix": [(48, 16, 4)], "tree": "32/2x2/8", "rollout": (2, 2, 8)}
REPEATS, WARMUPS = 3, 2


def kernels() -> dict:
    """Which optimized kernels transformers' Qwen3.5 layers find installed (else its PyTorch fallbacks run)."""
    return {"flash_linear_attention": importlib.util.find_spec("fla") is not None,
            "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None}


def timed(call, device: str) -> dict:
    """Median of ``REPEATS`` calls after ``WARMUPS`` (peak memory of the first on CUDA)."""
    return timed_with_peak(call, warmups=WARMUPS, repeats=REPEATS)


def prefix_rows(model, shapes, device: str, deadline: float) -> list[dict]:
    flops, rows, g = HybridFlops.of(model), [], torch.Generator(device=device).manual_seed(0)
    vocab = model.config.vocab_size
    for P, S, G in shapes:
        if time.perf_counter() > deadline:
            rows.append({"shape": f"{P}/{S}/{G}", "skipped": "out of budget"})
            continue
        prompts = [torch.randint(0, vocab, (P,), device=device, generator=g)]
        completions = [[torch.randint(0, vocab, (S,), device=device, generator=g) for _ in range(G)]]

        def step(fn):
            return lambda: (model.zero_grad(set_to_none=True), fn(model, prompts, completions))
        times = {name: timed(step(fn), device) for name, fn in (("standard", run_standard), ("shared", run_shared))}
        speedup, ratio = times["standard"]["median_s"] / times["shared"]["median_s"], flops.prefix_ratio(P, S, G)
        rows.append({"shape": f"{P}/{S}/{G}", "times": times, "speedup": speedup, "flop_ratio": ratio,
                     "speedup_over_flop_ratio": speedup / ratio})
    return rows


def tree_row(model, shape: str, device: str) -> dict:
    case = Case.synthetic(shape, vocab=model.config.vocab_size)

    def step(fn):
        return lambda: (model.zero_grad(set_to_none=True), fn(model, case))
    times = {name: timed(step(fn), device) for name, fn in (("rows", run_rows), ("tree", run_tree))}
    speedup, ratio = times["rows"]["median_s"] / times["tree"]["median_s"], HybridFlops.of(model).tree_ratio(case.trie)
    return {"shape": shape, "times": times, "speedup": speedup, "flop_ratio": ratio,
            "speedup_over_flop_ratio": speedup / ratio}


def rollout_row(model, shape: tuple[int, int, int], device: str) -> dict:
    from vllm_rollout import hf_generate

    from turbogrpo.rollout import SamplingConfig, generate
    num_prompts, num_samples, new_tokens = shape
    g = torch.Generator(device=device).manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (64 + 16 * k,), device=device, generator=g)
               for k in range(num_prompts)]
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(model.config.vocab_size - 1,))
    with torch.no_grad():
        times = {"native": timed(lambda: generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=0),
                                 device),
                 "hf_generate": timed(lambda: hf_generate(model, [p.cpu() for p in prompts], num_samples, sampling, 0),
                                      device)}
    return {"shape": "x".join(map(str, shape)), "times": times,
            "speedup_vs_hf_generate": times["hf_generate"]["median_s"] / times["native"]["median_s"]}


def run(results: dict, budget_s: float, quick: bool = False) -> None:
    """Fill ``results`` with the hybrid measurements (module docstring), or why they were skipped."""
    device = "cpu" if quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        results.update(status="skipped", reason="no CUDA device")
        return
    deadline = time.perf_counter() + budget_s
    settings = QUICK_MODEL if quick else HYBRID_MODEL
    with torch.device(device):
        model = hybrid_model(settings).to(torch.bfloat16)
    results.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (--quick: no GPU number)",
                   model={"type": "qwen3_5_text", "weights": "random", **settings}, dtype="bfloat16",
                   kernels=kernels(), repeats=REPEATS, warmups=WARMUPS)
    results["prefix"] = prefix_rows(model, QUICK["prefix"] if quick else PREFIX_ROWS, device, deadline)
    if time.perf_counter() < deadline:
        results["tree"] = tree_row(model, QUICK["tree"] if quick else TREE_SHAPE, device)
    if time.perf_counter() < deadline:
        results["rollout"] = rollout_row(model.eval(), QUICK["rollout"] if quick else ROLLOUT, device)
    rows = [[f"prefix {r['shape']}", r["times"]["standard"]["median_s"], r["times"]["shared"]["median_s"],
             r["speedup"], r["flop_ratio"]] for r in results["prefix"] if "times" in r]
    if "times" in results.get("tree", {}):
        t = results["tree"]
        rows.append([f"tree {t['shape']}", t["times"]["rows"]["median_s"], t["times"]["tree"]["median_s"],
                     t["speedup"], t["flop_ratio"]])
    print_table(f"hybrid fwd+bwd seconds, bf16, {results['device']}, kernels {results['kernels']}",
                ["case", "own forward", "turbogrpo", "speedup", "FLOP ratio"], rows)
    rollout = results.get("rollout", {})
    print(f"[gpu hybrid] rollout: {rollout.get('skipped') or rollout.get('speedup_vs_hf_generate')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CPU smoke form (tiny hybrid, tiny shapes)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for the part")
    args = parser.parse_args()
    from harness import write_results
    results: dict = {}
    run(results, args.budget if not args.quick else 1e9, quick=args.quick)
    results.setdefault("status", "ok")
    write_results("gpu_hybrid_quick" if args.quick else "gpu_hybrid", {"parts": {"hybrid": results}})


if __name__ == "__main__":
    main()
