"""Shared-prefix training forward vs. the standard forward vs. prefix_grouper 0.0.1.post1.

Forward + backward of a loss on the completion log-probs, for GRPO-shaped batches
(one prompt of P tokens, G completions of S tokens), on the "bench model" (Qwen2-style, hidden 512,
8 layers, intermediate 1536, 8 heads / 2 KV heads, vocab 16384, float32).

    python bench/prefix.py            # all shapes, 3 interleaved repeats, memory probes
    python bench/prefix.py --quick    # 1 repeat, no memory probes
    python bench/prefix.py --shapes 1024x128x8   # some shapes (writes results/prefix_partial.json)
    python bench/prefix.py --model smollm2       # the real model on GSM8K prompts (results/prefix_smollm2.json)
    python bench/prefix.py --model smollm2 --dtype bfloat16   # the same under CPU autocast (..._bf16.json)
    python bench/prefix.py --model smollm2 --linear-kernel onednn --out prefix_smollm2_amd_onednn
                                                 # every contender's weight matmuls by oneDNN (the trainer's
                                                 # "auto" picks it where it is 1.1x faster; default: as torch)
    python bench/prefix.py --model gemma3        # Gemma 3 270M (results/prefix_gemma3.json): the few-shot
                                                 # shape exceeds its 512-token sliding window

On the real model (bench/real_model.py) the batch is one GSM8K test prompt under the chat template, with
and without 4 worked train solutions in the system prompt, and G=8 completions of 128 token ids drawn
uniformly (the content of a completion does not change the work). Each contender's achieved GFLOP/s
(3x the forward weight FLOPs of its own layout, i.e. forward + backward) is reported as a fraction of
the large-matmul rate measured in the same process.

prefix_grouper is used as its README describes (concat_input -> model forward with its
``forward(attn_func, q, k, v)`` -> full-sequence logits -> split_output(include_prefix_last=1)),
with the attention function it calls supplied here: its README assumes flash-attn's bottom-right
causal masking, which SDPA on CPU does not do, so our adapter builds the correct boolean mask
(prefix: causal; suffix: whole prefix + causal within the own completion) for each of its two
SDPA calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (interleaved_medians, peak_rss_delta_mb, peak_rss_mb, print_table, reset_peak_rss,  # noqa: E402
                     write_results)

import turbogrpo  # noqa: E402
from turbogrpo.hook import lm_head_of, run_decoder  # noqa: E402
from turbogrpo.prefix.auto import sliding_window_applies  # noqa: E402
from turbogrpo.prefix.cost import ModelDims, layout_flops  # noqa: E402

SHAPES = [(1024, 128, 8), (2048, 256, 16), (256, 256, 4), (128, 512, 8)]
BENCH_MODEL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)


def bench_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**BENCH_MODEL)).float()


def make_batch(prompt_len: int, completion_len: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = BENCH_MODEL["vocab_size"]
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g)]
    completions = [[torch.randint(0, vocab, (completion_len,), generator=g) for _ in range(group)]]
    return prompts, completions


def flop_ratio(prompt_len: int, completion_len: int, group: int) -> dict:
    """Forward FLOPs of standard and shared layouts (backward scales both alike)."""
    flops = layout_flops(ModelDims.of(Qwen2Config(**BENCH_MODEL)), [prompt_len], [[completion_len] * group])
    return {"standard_gflop": flops.standard / 1e9, "shared_gflop": flops.shared / 1e9, "ratio": flops.ratio}


# ---------------------------------------------------------------- the three contenders

def run_turbogrpo(model, prompts, completions, share_prefix: bool) -> None:
    per_group = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=share_prefix)
    torch.cat([t for group in per_group for t in group]).mean().backward()


def run_prefix_grouper(model, prompts, completions, attention_cls=None) -> None:
    """``attention_cls``: the adapter of its attention calls (default: the CPU one below)."""
    from prefix_grouper import PrefixGrouper

    flat = [c for cs in completions for c in cs]
    prompt_ids = nn.utils.rnn.pad_sequence(prompts, batch_first=True)   # [b1, P], right-padded
    completion_ids = nn.utils.rnn.pad_sequence(flat, batch_first=True)  # [b2, S]
    prompt_mask = torch.arange(prompt_ids.shape[1]) < torch.tensor([len(p) for p in prompts])[:, None]
    completion_mask = torch.arange(completion_ids.shape[1]) < torch.tensor([len(c) for c in flat])[:, None]
    grouper = PrefixGrouper.from_ungrouped_masks(prompt_mask, completion_mask,
                                                 group_sizes=[len(cs) for cs in completions],
                                                 padding_mode="right")
    input_ids = grouper.concat_input(prompt_ids, prompt_mask, completion_ids, completion_mask)
    position_ids = _prefix_grouper_positions(grouper).to(input_ids.device)
    attention = (attention_cls or _PrefixGrouperAttention)(grouper)
    hidden = run_decoder(model, input_ids, position_ids, attention)
    logits = lm_head_of(model)(hidden)                                 # every position, as its README does
    _, _, suffix_logits, suffix_mask = grouper.split_output(logits, include_prefix_last=1)
    targets = grouper.convert_padding(completion_ids, completion_mask, padding_mode="right")
    suffix_logits, suffix_mask = suffix_logits[:, :-1], suffix_mask[:, 1:]
    logps = suffix_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - suffix_logits.logsumexp(-1)
    (logps * suffix_mask).sum().div(suffix_mask.sum()).backward()


def _prefix_grouper_positions(grouper) -> torch.Tensor:
    rows = []
    for info in grouper.group_info:
        ids = [torch.arange(info.prefix_len)] + [torch.arange(info.prefix_len, info.prefix_len + s)
                                                  for s in info.suffix_lens]
        rows.append(torch.cat(ids))
    width = grouper.padding_mask.shape[1]
    return torch.stack([F.pad(r, (0, width - r.numel())) for r in rows])


class _PrefixGrouperAttention:
    """Our plan hands q/k/v to prefix_grouper, with a correct CPU attention function for its calls."""

    def __init__(self, grouper):
        self.grouper = grouper
        self.suffix_mask = None  # built once per batch, shared by all layers

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        num_rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(num_rep, 1), value.repeat_interleave(num_rep, 1)
        return self.grouper.forward(self._attend, query, key, value, scale=scaling)

    def _attend(self, q, k, v, key_padding_mask, scale):
        if q.shape[2] == k.shape[2]:  # the prefix call: causal within the prompt
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril() & key_padding_mask[:, None, None, :]
        else:                         # the suffix call: whole prompt + causal within own completion
            mask = self._suffix_rule(q.shape[2], k.shape[2]) & key_padding_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.transpose(1, 2)

    def _suffix_rule(self, num_q, num_k):
        # Each suffix row is one completion [S] against [its prompt (P), itself (S)]: the whole prompt,
        # then causal (bottom-right aligned, which is what flash-attn's causal flag would give).
        if self.suffix_mask is None:
            prefix = num_k - num_q
            self.suffix_mask = torch.cat([torch.ones(num_q, prefix, dtype=torch.bool),
                                          torch.ones(num_q, num_q, dtype=torch.bool).tril()], dim=1)
        return self.suffix_mask


CONTENDERS = {
    "standard": lambda m, p, c: run_turbogrpo(m, p, c, share_prefix=False),
    "turbogrpo": lambda m, p, c: run_turbogrpo(m, p, c, share_prefix=True),
    "prefix_grouper": run_prefix_grouper,
}


def memory_probe(name: str, prompt_len: int, completion_len: int, group: int) -> None:
    """Child process entry: one forward+backward, print peak RSS growth over the set-up state."""
    model = bench_model()
    prompts, completions = make_batch(prompt_len, completion_len, group)
    before = reset_peak_rss()
    CONTENDERS[name](model, prompts, completions)
    print(f"PEAK_MB {peak_rss_mb() - before:.1f}")


def check_agreement(model, prompts, completions) -> float:
    with torch.no_grad():
        a = torch.cat(turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False)[0])
        b = torch.cat(turbogrpo.completion_logprobs(model, prompts, completions)[0])
    return (a - b).abs().max().item()


def real_model_main(repeats: int, warmup: int, dtype: str = "float32", completion_len: int = 128,
                    group: int = 8, model_key: str = "smollm2", linear_kernel: str = "module",
                    out: str | None = None) -> None:
    """``dtype`` "bfloat16": every contender runs under CPU autocast (float32 weights, bfloat16 matmuls),
    as turbogrpo's ``model.dtype = "bfloat16"`` trains, against the bfloat16 large-matmul rate.
    ``model_key``: a key of ``real_model.REAL_MODELS``. ``linear_kernel``: a training kernel of
    ``turbogrpo.linears`` that every contender's weight matmuls run under (the same for all three: the
    contest is the attention layout). ``out``: the results name (default ``prefix_<model_key>``)."""
    from real_model import REAL_MODELS, chat_prompts, large_matmul_gflops, load_real_model

    from turbogrpo.linears import TRAINING_LINEAR_KERNELS

    model_name = REAL_MODELS[model_key]
    model, tokenizer = load_real_model(model_name)
    model.train()
    compute_dtype = getattr(torch, dtype)
    large_rate = large_matmul_gflops(compute_dtype)
    autocast = torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    dims = ModelDims.of(model)
    rows, records = [], []
    for few_shot in (True, False):
        prompts = chat_prompts(tokenizer, 1, few_shot=few_shot)
        generator = torch.Generator().manual_seed(0)
        completions = [[torch.randint(0, model.config.vocab_size, (completion_len,), generator=generator)
                        for _ in range(group)]]
        P = prompts[0].numel()
        max_gap = check_agreement(model, prompts, completions)
        def timed(fn):
            def step():
                model.zero_grad(set_to_none=True)
                with autocast, TRAINING_LINEAR_KERNELS[linear_kernel]([model]):
                    fn(model, prompts, completions)
            return step
        times = interleaved_medians({name: timed(fn) for name, fn in CONTENDERS.items()}, repeats=repeats,
                                    warmup=warmup)
        flops = layout_flops(dims, [P], [[completion_len] * group])
        # Forward + backward = 3x the forward's weight FLOPs; prefix_grouper does the shared layout's work.
        work = {"standard": 3 * flops.standard, "turbogrpo": 3 * flops.shared, "prefix_grouper": 3 * flops.shared}
        gflops = {name: work[name] / times[name]["median_s"] / 1e9 for name in CONTENDERS}
        std, ours, pg = (times[n]["median_s"] for n in ("standard", "turbogrpo", "prefix_grouper"))
        record = {"prompt": "few-shot" if few_shot else "zero-shot", "prompt_len": P, "completion_len": completion_len,
                  "group_size": group, "times": times, "speedup_vs_standard": std / ours,
                  "speedup_vs_prefix_grouper": pg / ours, "flop_ratio": flops.ratio,
                  "speedup_over_flop_ratio": (std / ours) / flops.ratio, "gflops": gflops,
                  "fraction_of_large_matmul": {n: g / large_rate for n, g in gflops.items()},
                  "max_abs_logprob_gap": max_gap,
                  # prefix_grouper's attention is full causal: under a window that applies it does the
                  # same work but computes other values (timed only); ours and standard apply the window.
                  "sliding_window_applies": sliding_window_applies(model.config, P + completion_len)}
        records.append(record)
        rows.append([record["prompt"], P, std, pg, ours, std / ours, flops.ratio, pg / ours, gflops["turbogrpo"],
                     gflops["turbogrpo"] / large_rate, f"{max_gap:.1e}"])
        write_results(out or f"prefix_{model_key}" + ("" if dtype == "float32" else "_bf16"), {
            "model": model_name, "dtype": dtype, "linear_kernel": linear_kernel, "repeats": repeats, "warmup": warmup,
            "large_matmul_gflops": large_rate, "load_average": os.getloadavg(), "shapes": records})
    print_table(f"fwd+bwd seconds on {model_name} ({dtype}, linears {linear_kernel}, median of {repeats}), GSM8K prompt + "
                f"{group} x {completion_len}; "
                f"large-matmul rate {large_rate:.0f} GFLOP/s",
                ["prompt", "P", "standard", "prefix_grouper", "turbogrpo", "x std", "FLOP ratio", "x pg",
                 "ours GFLOP/s", "of matmul", "max |dlogp|"], rows)
    print(f"load average {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bench", "smollm2", "gemma3"], default="bench",
                        help="bench: the random bench model (default); smollm2: the real instruct model; "
                             "gemma3: Gemma 3 270M (sliding-window layers, 262k vocabulary)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, no warm-up, no memory probes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=None, help="e.g. 1024x128x8,256x256x4")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="smollm2: compute dtype (bfloat16: CPU autocast over float32 weights)")
    parser.add_argument("--linear-kernel", choices=["module", "onednn", "auto"], default="module",
                        help="real models: the weight-matmul kernel of every contender (turbogrpo.linears)")
    parser.add_argument("--out", default=None, help="real models: results name (bench/results/<out>.json)")
    parser.add_argument("--memory-probe", nargs=4, metavar=("NAME", "P", "S", "G"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        name, *dims = args.memory_probe
        return memory_probe(name, *map(int, dims))

    if args.model != "bench":
        return real_model_main(*((1, 0) if args.quick else (args.repeats, 1)), dtype=args.dtype,
                               model_key=args.model, linear_kernel=args.linear_kernel, out=args.out)
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    repeats, warmup = (1, 0) if args.quick else (args.repeats, 1)
    # Only a full run replaces the committed results; a partial one is written beside them.
    results_name = "prefix_quick" if args.quick else "prefix" if shapes == SHAPES else "prefix_partial"
    model = bench_model()
    rows, records = [], []
    for P, S, G in shapes:
        prompts, completions = make_batch(P, S, G)
        max_gap = check_agreement(model, prompts, completions)
        times = interleaved_medians({name: (lambda fn=fn: (model.zero_grad(set_to_none=True),
                                                            fn(model, prompts, completions)))
                                     for name, fn in CONTENDERS.items()}, repeats=repeats, warmup=warmup)
        flops = flop_ratio(P, S, G)
        memory = {}
        if not args.quick:
            for name in CONTENDERS:
                memory[name] = peak_rss_delta_mb([__file__, "--memory-probe", name, str(P), str(S), str(G)])
        std, ours, pg = (times[n]["median_s"] for n in ("standard", "turbogrpo", "prefix_grouper"))
        record = {"prompt_len": P, "completion_len": S, "group_size": G, "times": times,
                  "speedup_vs_standard": std / ours, "speedup_vs_prefix_grouper": pg / ours,
                  "prefix_grouper_speedup_vs_standard": std / pg, "flops": flops,
                  "speedup_over_flop_ratio": (std / ours) / flops["ratio"],
                  "peak_memory_mb": memory, "max_abs_logprob_gap": max_gap}
        if memory:
            record["memory_ratio_vs_standard"] = memory["turbogrpo"] / memory["standard"]
        records.append(record)
        rows.append([f"{P}/{S}/{G}", std, pg, ours, std / ours, pg / ours, flops["ratio"],
                     record["speedup_over_flop_ratio"],
                     f"{memory['standard']:.0f}/{memory['turbogrpo']:.0f}" if memory else "-",
                     f"{record.get('memory_ratio_vs_standard', float('nan')):.2f}", f"{max_gap:.1e}"])
        print(f"done {P}/{S}/{G}", flush=True)
        # Written after every shape, so an interrupted run keeps what it measured.
        # The 1/5/15-minute load averages: a shared machine slows every contender, so compare ratios.
        write_results(results_name, {"load_average": os.getloadavg(), "model": BENCH_MODEL, "dtype": "float32",
                                     "repeats": repeats, "warmup": warmup, "shapes": records})

    print_table(
        "fwd+bwd seconds (median of %d), bench model float32 on CPU" % repeats,
        ["P/S/G", "standard", "prefix_grouper", "turbogrpo", "x std", "x pg", "FLOP ratio",
         "x std / FLOP", "peak MB std/ours", "mem ratio", "max |dlogp|"], rows)


if __name__ == "__main__":
    main()
