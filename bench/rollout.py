"""Rollout engine vs. Hugging Face ``generate`` with the prompts repeated G times (TRL without vLLM).

Both sample at temperature 1 from the "bench model" of bench/prefix.py (Qwen2-style, hidden 512,
8 layers, intermediate 1536, 8 heads / 2 KV heads, vocab 16384, float32, random init, seed 0).
With random weights a stop token would end completions at random, so neither engine gets one:
every completion runs the full number of new tokens and both generate the same token count.

    python bench/rollout.py           # 2 interleaved repeats per shape
    python bench/rollout.py --quick   # 1 repeat
    python bench/rollout.py --model smollm2   # the real model (bench/real_model.py), with a roofline
    python bench/rollout.py --model smollm2 --repeats 2 --out rollout_smollm2_amd_kv   # another name
    python bench/rollout.py --model smollm2 --profile-only --out rollout_smollm2_amd_anatomy   # step anatomy
    python bench/rollout.py --model smollm2 --profile-only --runner compiled --out rollout_smollm2_compiled_anatomy
    python bench/rollout.py --model gemma3    # Gemma 3 270M (its 262k-row LM head is 63% of a token's FLOPs)

The real-model run samples GSM8K test prompts under SmolLM2-135M-Instruct's chat template (EOS ignored on
both sides, so both generate the same tokens) and reports each contender's time as a multiple of this
machine's roofline for the rollout: every weight matmul of every decoding step timed alone at its exact
shape in the same process (bench/real_model.py: step_bound_seconds), plus the prompts' prefill at the
large-matmul rate. Each of those matmuls reuses one weight that stays in cache, so the report also
gives a streaming bound: the step's matmuls run in the model's order on its own weights
(model_gemm_step_seconds), which stream from memory once per step as in a real step, plus the K/V the
steps must read from the cache (kv_read_bytes: each sequence's own tokens and each group's prompt once
per step and layer) at this machine's memory read bandwidth, measured in the same process. Every bound
takes the faster of torch's two CPU GEMMs (MKL's sgemm behind F.linear, and oneDNN on packed weights,
which turbogrpo's rollouts use where it is faster; HF generate runs F.linear). The JSON keeps the
weights-only streaming bound as well (``streaming_weights_roofline_s``).

Also draws the live batch size per decoding step of a long-tail rollout (8 prompts x G=8, up to 256
new tokens, stopping on any of 256 token ids, so lengths spread out as in real GRPO rollouts) next
to the padded batch that ``generate`` keeps until its longest completion ends, and times that
rollout under several ``DecodeSchedule``s (host check every k steps, exact or power-of-two
retirement): the CPU default of ``turbogrpo.rollout.decode.DEFAULT_SCHEDULES`` is read off it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, interleaved_medians, print_table, write_results  # noqa: E402
from prefix import BENCH_MODEL, bench_model  # noqa: E402

from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.rollout.decode import DecodeSchedule  # noqa: E402

# (prompts, samples per prompt G, prompt length, new tokens per completion)
SHAPES = [(8, 8, 512, 128), (2, 16, 1024, 128), (1, 1, 128, 128)]
LONG_TAIL = dict(num_prompts=8, num_samples=8, prompt_len=512, max_new_tokens=256, stop_every=64)
SCHEDULES = {"k1_exact": DecodeSchedule(1, "exact"), "k4_exact": DecodeSchedule(4, "exact"),
             "k1_pow2": DecodeSchedule(1, "pow2"), "k8_pow2": DecodeSchedule(8, "pow2")}


def make_prompts(num_prompts: int, prompt_len: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BENCH_MODEL["vocab_size"], (prompt_len,), generator=generator)
            for _ in range(num_prompts)]


def run_turbogrpo(model, prompts: list[torch.Tensor], num_samples: int, new_tokens: int, schedule=None) -> int:
    rollout = generate(model, prompts, num_samples=num_samples, seed=0, schedule=schedule,
                       sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=1.0))
    return rollout.stats.num_generated_tokens


def run_hf_generate(model, prompts: list[torch.Tensor], num_samples: int, new_tokens: int) -> int:
    input_ids = torch.stack(prompts).repeat_interleave(num_samples, dim=0)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0)
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def bench_shapes(model, repeats: int) -> tuple[list[list], list[dict]]:
    rows, records = [], []
    for num_prompts, num_samples, prompt_len, new_tokens in SHAPES:
        prompts = make_prompts(num_prompts, prompt_len)
        counts: dict[str, int] = {}

        def timed(name, fn):
            def call():
                counts[name] = fn(model, prompts, num_samples, new_tokens)
            return call

        print(f"shape {num_prompts} x G={num_samples}, prompt {prompt_len}, {new_tokens} new ...", flush=True)
        timings = interleaved_medians({"hf_generate": timed("hf_generate", run_hf_generate),
                                       "turbogrpo": timed("turbogrpo", run_turbogrpo)},
                                      repeats=repeats, warmup=0)
        expected = num_prompts * num_samples * new_tokens
        assert counts == {"hf_generate": expected, "turbogrpo": expected}, counts
        hf_tps = expected / timings["hf_generate"]["median_s"]
        ours_tps = expected / timings["turbogrpo"]["median_s"]
        rows.append([f"{num_prompts}x{num_samples}", prompt_len, new_tokens, expected,
                     timings["hf_generate"]["median_s"], timings["turbogrpo"]["median_s"], hf_tps, ours_tps,
                     ours_tps / hf_tps])
        records.append({"num_prompts": num_prompts, "num_samples": num_samples, "prompt_len": prompt_len,
                        "new_tokens": new_tokens, "generated_tokens": expected, "timings": timings,
                        "hf_generate_tokens_per_s": hf_tps, "turbogrpo_tokens_per_s": ours_tps,
                        "speedup": ours_tps / hf_tps})
    return rows, records


def long_tail_generate(model, schedule: DecodeSchedule | None = None):
    spec = LONG_TAIL
    sampling = SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=1.0,
                              stop_token_ids=tuple(range(0, BENCH_MODEL["vocab_size"], spec["stop_every"])))
    return generate(model, make_prompts(spec["num_prompts"], spec["prompt_len"], seed=1),
                    num_samples=spec["num_samples"], sampling=sampling, seed=0, schedule=schedule)


def bench_schedules(model, repeats: int) -> dict:
    """The long-tail rollout under each of ``SCHEDULES`` (same tokens under all; only time differs)."""
    tokens: dict[str, list] = {}

    def timed(name):
        def call():
            tokens[name] = [t.tolist() for t in long_tail_generate(model, SCHEDULES[name]).tokens]
        return call

    print("long-tail rollout under each decode schedule ...", flush=True)
    timings = interleaved_medians({name: timed(name) for name in SCHEDULES}, repeats=repeats, warmup=0)
    # A schedule changes which rows share a step's matmuls, and a float32 GEMM's rounding may depend on
    # its row count (the kernel's blocking): on some machines (this project's AMX Xeon) a rare sample
    # then flips and the completion diverges from there. The engine's logic is schedule-free (exact
    # token equality is tested on small models in tests/rollout); here the share of identical
    # completions is measured and reported rather than asserted.
    base_tokens = tokens["k1_exact"]
    identical = {name: sum(a == b for a, b in zip(t, base_tokens)) / len(base_tokens) for name, t in tokens.items()}
    if min(identical.values()) < 1.0:
        print(f"note: completions identical to k1_exact's: {identical} (batch-dependent GEMM rounding)")
    base = timings["k1_exact"]["median_s"]
    return {name: {"schedule": vars(SCHEDULES[name]), "timings": timings[name],
                   "time_vs_k1_exact": timings[name]["median_s"] / base,
                   "identical_completions_vs_k1_exact": identical[name]} for name in SCHEDULES}


def long_tail_rollout(model) -> dict:
    spec = LONG_TAIL
    rollout = long_tail_generate(model)
    lengths = [len(t) for t in rollout.tokens]
    return {**spec, "lengths": lengths, "live_batch_sizes": rollout.stats.live_batch_sizes,
            "num_forwards": rollout.stats.num_forwards, "generated_tokens": rollout.stats.num_generated_tokens,
            "wall_time_s": rollout.stats.wall_time_s, "tokens_per_s": rollout.stats.tokens_per_second,
            # Rows a padded batch (HF generate) would run: every completion until the longest one ends.
            "padded_batch_row_steps": len(lengths) * (max(lengths) - 1),
            "live_batch_row_steps": sum(rollout.stats.live_batch_sizes)}


def plot_long_tail(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = record["live_batch_sizes"]
    steps = range(1, len(live) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(steps, live, where="post", label="turbogrpo: live sequences")
    ax.step(steps, [len(record["lengths"])] * len(live), where="post", linestyle="--",
            label="padded batch (HF generate)")
    ax.set_xlabel("decoding step")
    ax.set_ylabel("sequences in the forward")
    ax.set_title(f"Long-tail rollout: {record['num_prompts']} prompts x G={record['num_samples']}, "
                 f"lengths {min(record['lengths'])}-{max(record['lengths'])}")
    ax.set_ylim(0, len(record["lengths"]) * 1.1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# Real-model shapes: (prompts, G, new tokens); 8 x 8 x 256 is the headline shape.
REAL_SHAPES = [(8, 8, 256), (4, 8, 128)]


def run_hf_generate_ragged(model, prompts: list[torch.Tensor], num_samples: int, new_tokens: int, *,
                           pad_id: int) -> int:
    """HF generate on prompts of different lengths: left-padded, each repeated G times (TRL's way)."""
    width = max(p.numel() for p in prompts)
    input_ids = torch.stack([torch.cat([torch.full((width - p.numel(),), pad_id), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.numel()), torch.ones(p.numel())]) for p in prompts]).long()
    out = model.generate(input_ids.repeat_interleave(num_samples, 0), attention_mask=mask.repeat_interleave(num_samples, 0),
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_id)
    return (out.shape[1] - width) * out.shape[0]


WEIGHT_PRODUCT_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")
"""Operators that run a decoding step's weight matmuls (oneDNN on packed weights, or MKL's)."""
ATTENTION_OPS = ("aten::bmm",)
"""Besides the flash-attention operators: the batched matmuls of ``rollout.attention``'s own-completion part."""
OPERATOR_PREFIXES = ("aten::", "mkldnn::")
VIEW_OPS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "transpose", "t", "unsqueeze",
    "squeeze", "expand", "permute", "alias", "detach", "unflatten", "flatten", "split", "chunk", "narrow",
    "empty", "empty_strided", "lift_fresh", "unbind", "_reshape_alias", "view_as_real", "resolve_conj"))
"""Operators that only make tensor metadata (views, empty buffers): a dispatch with no data pass."""


def profile_real_step(model, prompts, num_samples: int, new_tokens: int, top: int = 15, schedule=None) -> dict:
    """torch.profiler over rollouts of the real model: the top operators by self CPU time (one rollout of
    ``new_tokens``), and the decoding step's anatomy: the weight products, attention, other operators and
    views, as top-level calls and time per step, beside this machine's eager floor per call
    (``eager_call_floors_us``). The anatomy is the difference of rollouts of ``new_tokens`` and twice as
    many, over ``new_tokens`` steps: the prefill and the per-rollout setup (weight packing) cancel."""
    from torch.profiler import ProfilerActivity, profile
    profiles = []
    for tokens in (new_tokens, 2 * new_tokens):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_turbogrpo(model, prompts, num_samples, tokens, schedule)
        profiles.append(prof)
    events = sorted(profiles[0].key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    table = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
              "calls": e.count} for e in events[:top]]
    print_table(f"Top {top} operators by self time, one rollout ({len(prompts)} x G={num_samples}, {new_tokens} new)",
                ["op", "self_s", "share", "calls"], [[r["op"], r["self_s"], r["share"], r["calls"]] for r in table])
    short, long = (_top_level_parts(prof) for prof in profiles)
    anatomy = {name: {"ms_per_step": (long[name]["ms"] - short[name]["ms"]) / new_tokens,
                      "calls_per_step": (long[name]["calls"] - short[name]["calls"]) / new_tokens}
               for name in long}
    floors = eager_call_floors_us(len(prompts) * num_samples, model.config.hidden_size)
    for name, part in anatomy.items():
        floor = floors["view"] if name == "views" else floors["add"]
        part["eager_floor_ms_per_step"] = part["calls_per_step"] * floor / 1e3
    print_table(f"Per decoding step at B={len(prompts) * num_samples}, profiled (the profiler adds its own cost per "
                f"call); eager floor a call: {floors['add']:.1f} us an add, {floors['view']:.1f} us a view",
                ["part", "ms/step", "op calls/step", "eager floor ms/step"],
                [[name, p["ms_per_step"], p["calls_per_step"], p["eager_floor_ms_per_step"]]
                 for name, p in anatomy.items()])
    return {"top_ops": table, "anatomy_per_step": anatomy, "eager_call_floor_us": floors,
            "batch": len(prompts) * num_samples, "steps": new_tokens}


def _top_level_parts(prof) -> dict[str, dict[str, float]]:
    """Milliseconds and count of the top-level operator calls of a profile, by part of a step. Top level:
    the calls Python dispatches (an operator's inner calls, such as aten::to's copy_, are in its time)."""
    parts = {name: {"ms": 0.0, "calls": 0} for name in ("weight products", "attention", "other operators", "views")}
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith(OPERATOR_PREFIXES) and not (parent and parent.name.startswith(OPERATOR_PREFIXES)):
            name = ("weight products" if event.name in WEIGHT_PRODUCT_OPS
                    else "attention" if event.name in ATTENTION_OPS or "attention" in event.name
                    else "views" if event.name in VIEW_OPS else "other operators")
            parts[name]["ms"] += event.cpu_time_total / 1e3
            parts[name]["calls"] += 1
    return parts


def eager_call_floors_us(rows: int, hidden: int, calls: int = 2000) -> dict[str, float]:
    """Microseconds of the cheapest calls a step makes many of, the fastest of 5 runs of ``calls`` each:
    ``add``, an out-of-place add of two ``[rows, hidden]`` float32 tensors (dispatch, allocation, the
    thread pool's fork/join, a tiny data pass); ``view``, a transpose (dispatch and metadata only)."""
    a, b = torch.randn(rows, hidden), torch.randn(rows, hidden)

    def fastest(call) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - start) / calls)
        return best * 1e6
    return {"add": fastest(lambda: torch.add(a, b)), "view": fastest(lambda: a.transpose(0, 1))}


def real_model_profile_main(dtype: str = "float32", model_key: str = "smollm2", out: str | None = None,
                            runner: str = "eager") -> None:
    """The profile and step anatomy of ``--profile`` alone, after warm-up rollouts of the same shapes, with the
    plain step run by ``runner`` (``DecodeSchedule.runner``; a compiled one with pow2 buckets, its graphs
    compiled by the warm-up)."""
    from turbogrpo.rollout.decode import DecodeSchedule
    schedule = None if runner == "eager" else DecodeSchedule(1, "pow2", runner)
    from real_model import REAL_MODELS, chat_prompts, load_real_model
    model_name = REAL_MODELS[model_key]
    model, tokenizer = load_real_model(model_name)
    model = model.to(getattr(torch, dtype))
    prompts = chat_prompts(tokenizer, 4, few_shot=False)
    for tokens in (32, 64):  # warm-up: packing, the linears' timing, allocator; a compiled step's graphs
        run_turbogrpo(model, prompts, 8, tokens, schedule)
    profile = profile_real_step(model, prompts, 8, 32, schedule=schedule)
    timed = unprofiled_step(model, prompts, 8, 32, schedule=schedule)
    write_results(out or f"rollout_{model_key}_profile" + ("" if dtype == "float32" else "_bf16"),
                  {"model": model_name, "dtype": dtype, "load_average": os.getloadavg(),
                   "runner": runner, "step_anatomy_4x8x32": profile, "unprofiled_step_4x8": timed})


def unprofiled_step(model, prompts, num_samples: int, new_tokens: int, repeats: int = 3, schedule=None) -> dict:
    """The plain step without the profiler, which inflates small operators (the sampler's softmax read
    12.8 ms a step profiled; its whole draw takes 1.6 ms timed): seconds per decoding step at B = prompts
    x ``num_samples``, from the difference of rollouts of ``new_tokens`` and twice as many (median of
    ``repeats`` pairs), beside the step's weight products alone, streamed from memory in the model's order
    by the faster kernel (``real_model.model_gemm_step_seconds``)."""
    from real_model import model_gemm_step_seconds
    differences = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_turbogrpo(model, prompts, num_samples, new_tokens, schedule)
        middle = time.perf_counter()
        run_turbogrpo(model, prompts, num_samples, 2 * new_tokens, schedule)
        differences.append((time.perf_counter() - middle - (middle - start)) / new_tokens)
    step_s = sorted(differences)[len(differences) // 2]
    batch = len(prompts) * num_samples
    weights_s = min(model_gemm_step_seconds(model, batch, kernel=kernel) for kernel in ("mm", "onednn"))
    print(f"unprofiled step at B={batch}: {1e3 * step_s:.1f} ms; its weight products alone, streamed: "
          f"{1e3 * weights_s:.1f} ms; the rest: {1e3 * (step_s - weights_s):.1f} ms")
    return {"batch": batch, "step_s": step_s, "step_s_samples": differences, "weight_products_streamed_s": weights_s,
            "rest_s": step_s - weights_s}


def real_model_main(repeats: int, profile_ops: bool = False, dtype: str = "float32", model_key: str = "smollm2",
                    out: str | None = None) -> None:
    from real_model import REAL_MODELS, chat_prompts, kv_read_bytes, large_matmul_gflops, load_real_model, \
        memory_read_gbps, model_gemm_step_seconds, step_bound_seconds, weight_flops_per_token

    model_name = REAL_MODELS[model_key]
    model, tokenizer = load_real_model(model_name)
    # bfloat16: the weights themselves in bf16 on both sides (how HF generate serves a bf16 model).
    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype)
    name = out or f"rollout_{model_key}" + ("" if dtype == "float32" else "_bf16")
    config = model.config
    large_rate = large_matmul_gflops(torch_dtype)
    read_gbps = memory_read_gbps()
    run_turbogrpo(model, chat_prompts(tokenizer, 1, few_shot=False), 2, 4)  # warm-up
    rows, records = [], []
    for num_prompts, num_samples, new_tokens in REAL_SHAPES:
        prompts = chat_prompts(tokenizer, num_prompts, few_shot=False)
        batch = num_prompts * num_samples
        bound = step_bound_seconds(config, batch, torch_dtype)
        prefill_s = sum(p.numel() for p in prompts) * weight_flops_per_token(config) / (large_rate * 1e9)
        roofline_s = new_tokens * bound["bound_s"] + prefill_s
        # The same step's matmuls on the model's own weights in order: the weights stream from memory.
        streaming_by_kernel = {kernel: model_gemm_step_seconds(model, batch, kernel=kernel)
                               for kernel in ("mm", "onednn")}
        streaming_step_s = min(streaming_by_kernel.values())
        kv_bytes = kv_read_bytes(config, [p.numel() for p in prompts], num_samples, new_tokens, torch_dtype)
        kv_read_s = kv_bytes / (read_gbps * 1e9)
        streaming_weights_roofline_s = new_tokens * streaming_step_s + prefill_s
        streaming_roofline_s = streaming_weights_roofline_s + kv_read_s
        counts: dict[str, int] = {}
        contenders = {
            "hf_generate": lambda: counts.__setitem__("hf_generate", run_hf_generate_ragged(
                model, prompts, num_samples, new_tokens, pad_id=tokenizer.pad_token_id)),
            "turbogrpo": lambda: counts.__setitem__("turbogrpo", run_turbogrpo(model, prompts, num_samples, new_tokens)),
        }
        print(f"real model: {num_prompts} x G={num_samples}, {new_tokens} new ...", flush=True)
        timings = interleaved_medians(contenders, repeats=repeats, warmup=0)
        expected = batch * new_tokens
        assert counts == {"hf_generate": expected, "turbogrpo": expected}, counts
        hf_s, ours_s = timings["hf_generate"]["median_s"], timings["turbogrpo"]["median_s"]
        flops = (expected + sum(p.numel() for p in prompts)) * weight_flops_per_token(config)
        record = {"num_prompts": num_prompts, "num_samples": num_samples, "new_tokens": new_tokens,
                  "prompt_tokens": [p.numel() for p in prompts], "timings": timings, "speedup": hf_s / ours_s,
                  "roofline_s": roofline_s, "step_bound": bound, "prefill_bound_s": prefill_s,
                  "hf_vs_roofline": hf_s / roofline_s, "ours_vs_roofline": ours_s / roofline_s,
                  "streaming_step_s": streaming_step_s, "streaming_step_s_by_kernel": streaming_by_kernel,
                  "kv_read_bytes": kv_bytes, "kv_read_s": kv_read_s,
                  "streaming_weights_roofline_s": streaming_weights_roofline_s,
                  "streaming_roofline_s": streaming_roofline_s,
                  "hf_vs_streaming_roofline": hf_s / streaming_roofline_s,
                  "ours_vs_streaming_roofline": ours_s / streaming_roofline_s,
                  "ours_gflops": flops / ours_s / 1e9, "ours_fraction_of_large_matmul": flops / ours_s / 1e9 / large_rate}
        records.append(record)
        rows.append([f"{num_prompts}x{num_samples}", new_tokens, hf_s, ours_s, hf_s / ours_s, roofline_s,
                     hf_s / roofline_s, ours_s / roofline_s, kv_read_s, streaming_roofline_s,
                     ours_s / streaming_roofline_s,
                     record["ours_gflops"]])
        write_results(name, {"model": model_name, "dtype": dtype, "repeats": repeats,
                                          "large_matmul_gflops": large_rate, "memory_read_gbps": read_gbps,
                                          "load_average": os.getloadavg(),
                                          "baseline": "transformers generate, left-padded prompts repeated G times, "
                                                      "do_sample, temperature 1, EOS ignored on both sides",
                                          "shapes": records})
    if profile_ops:
        profile = profile_real_step(model, chat_prompts(tokenizer, 4, few_shot=False), 8, 32)
        write_results(name, {"model": model_name, "dtype": dtype, "repeats": repeats,
                                          "large_matmul_gflops": large_rate, "load_average": os.getloadavg(),
                                          "shapes": records, "profile_top_ops_4x8x32": profile["top_ops"],
                                          "step_anatomy_4x8x32": profile})
    print_table(f"Rollout on {model_name} (GSM8K test prompts, {dtype}, median of {repeats}); "
                f"large-matmul rate {large_rate:.0f} GFLOP/s, memory read {read_gbps:.1f} GB/s",
                ["prompts x G", "new", "hf_s", "ours_s", "speedup", "roofline_s", "hf x bound", "ours x bound",
                 "kv read_s", "streaming bound_s", "ours x streaming", "ours GFLOP/s"], rows)
    print(f"load average {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat per shape")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", choices=["bench", "smollm2", "gemma3"], default="bench",
                        help="bench: the random bench model (default); smollm2: the real instruct model; "
                             "gemma3: Gemma 3 270M (sliding-window layers, 262k vocabulary)")
    parser.add_argument("--profile", action="store_true", help="with --model smollm2: also the top operators "
                                                                  "and the step's anatomy (4 x G=8, 32 new tokens)")
    parser.add_argument("--profile-only", action="store_true",
                        help="with a real model: only the profile and anatomy (bench/results/<out>.json)")
    parser.add_argument("--runner", default="eager", help="with --profile-only: the plain step's runner "
                        "(DecodeSchedule.runner: eager, compiled, ...; issue 54's anatomy of the compiled step)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="with --model smollm2: the weights' dtype on both sides")
    parser.add_argument("--out", help="with a real model: results name under bench/results "
                                      "(default rollout_<model>[_bf16])")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    if args.model != "bench" and args.profile_only:
        return real_model_profile_main(args.dtype, model_key=args.model, out=args.out, runner=args.runner)
    if args.model != "bench":
        return real_model_main(repeats, args.profile, args.dtype, model_key=args.model, out=args.out)

    model = bench_model().eval()
    # Warm both paths up on a small shape so that one-time setup is not timed.
    tiny = make_prompts(2, 16)
    run_turbogrpo(model, tiny, 2, 4)
    run_hf_generate(model, tiny, 2, 4)

    rows, records = bench_shapes(model, repeats)
    table = print_table(
        f"Rollout: turbogrpo vs HF generate (bench model, float32, temperature 1, median of {repeats})",
        ["prompts x G", "prompt", "new", "tokens", "hf_s", "ours_s", "hf_tok/s", "ours_tok/s", "speedup"], rows)
    long_tail = long_tail_rollout(model)
    print(f"long-tail rollout: {long_tail['generated_tokens']} tokens in {long_tail['wall_time_s']:.1f} s, "
          f"{long_tail['live_batch_row_steps']} sequence-steps vs {long_tail['padded_batch_row_steps']} padded")
    plot_long_tail(long_tail, RESULTS_DIR / "rollout_live_batch.png")
    schedules = bench_schedules(model, repeats)
    print_table("Long-tail rollout per decode schedule (time relative to k=1, exact)",
                ["schedule", "median_s", "vs k1_exact"],
                [[name, r["timings"]["median_s"], r["time_vs_k1_exact"]] for name, r in schedules.items()])
    write_results("rollout", {"model": BENCH_MODEL, "dtype": "float32", "repeats": repeats,
                              "load": f"2-core CPU shared with other jobs; load average at the end "
                                      f"{os.getloadavg()[0]:.1f}",
                              "schedules": schedules,
                              "baseline": "transformers generate, prompts repeated G times, do_sample, "
                                          "temperature 1, top_k 0, top_p 1",
                              "shapes": records, "table": table, "long_tail": long_tail,
                              "target": "speedup >= 4 at 8 x G=8"})


if __name__ == "__main__":
    main()
