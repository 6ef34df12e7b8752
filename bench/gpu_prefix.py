"""GPU part "prefix" of bench/gpu.py: the shared-prefix training forward against the standard forward
and prefix_grouper, on Qwen2-shaped models (issue 10's table).

    python bench/gpu.py --only prefix

For each (model, P/S/G) row, in priority order (the rows with targets first) while the budget lasts:
forward + backward of the mean completion log-prob, median of 3 runs after 2 warm-ups, for
``standard`` (share_prefix=False), ``prefix_grouper`` (when importable; SDPA with flash-style
lower-right causal masks, its README's flash-attn convention), ``auto`` and each shared backend
(varlen, flex, cascade); peak GPU memory of one call (weights and gradients included) and the
row's FLOP ratio (standard / shared forward work). Models are random-init bf16, built on the GPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, timed_with_peak  # noqa: E402
from prefix import _PrefixGrouperAttention, run_prefix_grouper  # noqa: E402

import turbogrpo  # noqa: E402
from turbogrpo.prefix.cost import ModelDims, layout_flops  # noqa: E402

MODELS = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# (model, P, S, G) in priority order: the rows with issue-10 targets first, grouped by model so each
# model is built once.
ROWS = [("0.5B", 2048, 512, 16), ("0.5B", 1024, 256, 8), ("0.5B", 256, 1024, 8),
        ("7B", 1024, 256, 8), ("1.5B", 1024, 256, 8), ("1.5B", 2048, 512, 16)]
BACKENDS = ["auto", "varlen", "flex", "cascade"]
REPEATS, WARMUPS = 3, 2


class _PrefixGrouperFlashAttention(_PrefixGrouperAttention):
    """prefix_grouper's two attention calls as its README runs them with flash-attn: causal for the
    prefix, bottom-right-aligned causal for the suffix rows (SDPA's ``causal_lower_right``, which
    keeps the flash kernel). Every key is real in these batches, so its padding mask is all ones."""

    def _attend(self, q, k, v, key_padding_mask, scale):
        if q.shape[2] == k.shape[2]:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                                 scale=scale)
        return out.transpose(1, 2)


def build_model(name: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**MODELS[name], max_position_embeddings=32768)
    with torch.device("cuda"):
        return Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)


def make_batch(vocab: int, prompt_len: int, completion_len: int, group: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = [torch.randint(0, vocab, (prompt_len,), device="cuda", generator=g)]
    completions = [[torch.randint(0, vocab, (completion_len,), device="cuda", generator=g) for _ in range(group)]]
    return prompts, completions


def contenders() -> dict:
    def ours(**kwargs):
        def step(model, prompts, completions):
            per_group = turbogrpo.completion_logprobs(model, prompts, completions, **kwargs)
            torch.cat([t for group in per_group for t in group]).float().mean().backward()
        return step
    table = {"standard": ours(share_prefix=False)}
    try:
        import prefix_grouper  # noqa: F401
        table["prefix_grouper"] = lambda m, p, c: run_prefix_grouper(m, p, c, _PrefixGrouperFlashAttention)
    except ImportError:
        print("[gpu prefix] prefix_grouper is not installed: its column is skipped", flush=True)
    table.update({name: ours(backend=name) for name in BACKENDS})
    return table


def measure(fn, model, prompts, completions) -> dict:
    """Peak memory of the first warm-up call, then the median of ``REPEATS`` timed calls. Off CUDA (a
    part's CPU smoke run) the peak is None."""
    def call():
        model.zero_grad(set_to_none=True)
        fn(model, prompts, completions)
    result = timed_with_peak(call, warmups=WARMUPS, repeats=REPEATS)
    model.zero_grad(set_to_none=True)
    return result


def run(results: dict, budget_s: float) -> None:
    if not torch.cuda.is_available():
        print("[gpu prefix] no CUDA device: skipped", flush=True)
        results.update(status="skipped", reason="no CUDA device")
        return
    deadline = time.perf_counter() + budget_s
    table = contenders()
    results.update(dtype="bfloat16", repeats=REPEATS, warmups=WARMUPS, models=MODELS, rows=[],
                   device=torch.cuda.get_device_name())
    printed, model, model_name = [], None, None
    for name, P, S, G in ROWS:
        if time.perf_counter() > deadline:
            results.setdefault("skipped_rows", []).append(f"{name} {P}/{S}/{G}: out of budget")
            continue
        if name != model_name:
            model = model_name = None
            torch.cuda.empty_cache()
            model, model_name = build_model(name), name
        prompts, completions = make_batch(model.config.vocab_size, P, S, G)
        flops = layout_flops(ModelDims.of(model), [P], [[S] * G])
        row = {"model": name, "prompt_len": P, "completion_len": S, "group_size": G, "flop_ratio": flops.ratio,
               "times": {}, "errors": {}}
        for contender, fn in table.items():
            if time.perf_counter() > deadline:
                row["errors"][contender] = "out of budget"
                continue
            try:
                row["times"][contender] = measure(fn, model, prompts, completions)
            except Exception as error:  # one contender's failure (OOM, missing kernel) must not lose the row
                row["errors"][contender] = f"{type(error).__name__}: {str(error)[:200]}"
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        _add_ratios(row)
        results["rows"].append(row)
        printed.append(_table_row(row, table))
        print(f"[gpu prefix] done {name} {P}/{S}/{G}", flush=True)
    model = None
    torch.cuda.empty_cache()
    print_table("fwd+bwd seconds (peak GB), median of %d after %d warm-ups, bf16, %s"
                % (REPEATS, WARMUPS, torch.cuda.get_device_name()),
                ["model", "P/S/G", *table, "FLOP ratio", "auto x std", "auto x pg", "auto / FLOP"], printed)


def _add_ratios(row: dict) -> None:
    times = {k: v["median_s"] for k, v in row["times"].items()}
    if "auto" in times and "standard" in times:
        row["auto_speedup_vs_standard"] = times["standard"] / times["auto"]
        row["auto_speedup_over_flop_ratio"] = row["auto_speedup_vs_standard"] / row["flop_ratio"]
    if "auto" in times and "prefix_grouper" in times:
        row["auto_speedup_vs_prefix_grouper"] = times["prefix_grouper"] / times["auto"]


def _table_row(row: dict, table: dict) -> list:
    cells = [row["model"], f"{row['prompt_len']}/{row['completion_len']}/{row['group_size']}"]
    for contender in table:
        t = row["times"].get(contender)
        cells.append(f"{t['median_s']:.3f} ({t['peak_gb']:.1f})" if t else "-")
    cells.append(f"{row['flop_ratio']:.2f}")
    for key in ("auto_speedup_vs_standard", "auto_speedup_vs_prefix_grouper", "auto_speedup_over_flop_ratio"):
        cells.append(f"{row[key]:.2f}" if key in row else "-")
    return cells
