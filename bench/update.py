"""Where the real model's training update spends its time, and the choices that follow from it.

On SmolLM2-135M-Instruct (bench/real_model.py), zero-shot GSM8K chat prompts with G=8 completions of
115 token ids (the zero-shot step's mean length), float32 unless said. Each part pits a baseline
against the choice turbogrpo makes, alternated in one process:

* lm_head: the LM head's per-chunk log-prob math (341 x 49,152 float32 logits, entropy on):
  ``torch.logsumexp`` and then a second exp pass for the entropy (the former code) against one exp
  pass that serves both (``prefix.lm_head.logprobs_forward``). CPU seconds, one thread.
* packs: forward + backward of 8 groups as one pack (8,100 tokens, what the default 8192-token
  micro-batch budget gives) against packs of 2 groups (``train.micro_batch_tokens = 2048``), the same
  tokens and gradient. Wall seconds, the process's threads.
* dtype: forward + backward of one group in float32 against bfloat16 autocast (as
  ``model.dtype = "bfloat16"`` trains), beside the large-matmul rate of each dtype. CPU seconds, one
  thread (on a shared machine one thread keeps other jobs' threads out of the ratio).
* profile: self CPU time by operator of one group's forward + backward, float32, one thread.
* kernels: forward + backward of 8 groups in packs of 2 (``train.micro_batch_tokens = 2048``) with the
  weight matmuls as torch runs them (``F.linear``: MKL's sgemm) against oneDNN (``model.linear_kernel``,
  ``turbogrpo.linears.OneDnnLinear``), float32, with the rate of each against the same process's
  large-matmul rate (the faster of MKL and oneDNN on 2048^3). Wall seconds, the process's threads.
* gemm_bound: the ceiling of the kernels part. Every weight product of that forward + backward (the
  three per linear: forward, input gradient, weight gradient; LM-head chunks included) is recorded
  with its shapes and operand layouts, then replayed alone, by MKL (``F.linear``) and by oneDNN, with
  nothing else between them. The step's FLOPs over that time is the rate the step would reach if
  attention, the log-softmax over the vocabulary, norms, activations and the optimizer's bookkeeping
  were free: no kernel choice can lift the whole step above it. Wall seconds, the process's threads;
  written with the kernels part.
* allocator: forward + backward of 8 groups as one pack (float32 and bf16 autocast) on glibc's
  default heap against the kept heap of ``turbogrpo.host_memory``. The malloc setting is per
  process, so each run is a fresh child process, alternating the two. Wall s, 2 threads; its own
  results file.

    python bench/update.py                     # lm_head,packs,dtype,profile; bench/results/update_smollm2.json
    python bench/update.py --parts lm_head,dtype
    python bench/update.py --parts allocator   # bench/results/update_allocator_smollm2.json
    python bench/update.py --parts kernels --repeats 3   # bench/results/update_kernels_smollm2.json
    python bench/update.py --parts kernels,gemm_bound --repeats 3 --out update_kernels_smollm2_amd_bound
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, large_matmul_gflops, load_real_model  # noqa: E402

import turbogrpo  # noqa: E402
from turbogrpo.host_memory import ENV, keep_freed_host_memory  # noqa: E402
from turbogrpo.prefix.cost import ModelDims, layout_flops  # noqa: E402
from turbogrpo.prefix.lm_head import logprobs_forward  # noqa: E402

COMPLETION_LEN, GROUP = 115, 8


def logsumexp_then_entropy(logits, targets, temperature, with_entropy):
    """The baseline chunk math: ``torch.logsumexp``, then exp(z - lse) again for the entropy."""
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - torch.linalg.vecdot(torch.exp(logits - lse[:, None]), logits)
    return logps, lse, entropy


def cpu_seconds(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return times


def one_thread(fn):
    """Run ``fn`` with one torch thread, then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def part_lm_head(repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(341, 49152, generator=generator) * 3
    targets = torch.randint(49152, (341,), generator=generator)
    contenders = {"logsumexp_then_entropy": logsumexp_then_entropy, "one_exp_pass": logprobs_forward}
    gap = max((a - b).abs().max().item() for a, b in zip(*(f(logits, targets, 1.0, True) for f in contenders.values())))

    def measure():
        out = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, fn in contenders.items():
                out[name] += cpu_seconds(lambda fn=fn: fn(logits, targets, 1.0, True), 1)
        return out
    times = one_thread(measure)
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"shape": [341, 49152], "cpu_s": times, "median_cpu_s": medians, "max_abs_gap": gap,
            "speedup": medians["logsumexp_then_entropy"] / medians["one_exp_pass"]}


def group_batch(tokenizer, vocab: int, num_groups: int):
    prompts = chat_prompts(tokenizer, num_groups, few_shot=False)
    generator = torch.Generator().manual_seed(0)
    completions = [[torch.randint(0, vocab, (COMPLETION_LEN,), generator=generator) for _ in range(GROUP)]
                   for _ in range(num_groups)]
    return prompts, completions


def forward_backward(model, prompts, completions, groups_per_pack: int, autocast=None) -> None:
    """Forward + backward of a token-mean loss over all completions, ``groups_per_pack`` groups per pack."""
    model.zero_grad(set_to_none=True)
    num_tokens = sum(c.numel() for cs in completions for c in cs)
    for first in range(0, len(prompts), groups_per_pack):
        with autocast or nullcontext():
            per_group = turbogrpo.completion_logprobs(model, prompts[first:first + groups_per_pack],
                                                      completions[first:first + groups_per_pack])
        torch.cat([t for group in per_group for t in group]).float().sum().div(num_tokens).backward()


def part_packs(model, tokenizer, repeats: int) -> dict:
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 8)
    tokens = sum(p.numel() for p in prompts) + 8 * GROUP * COMPLETION_LEN
    timings = interleaved_medians({f"{k}_groups_per_pack": (lambda k=k: forward_backward(model, prompts, completions, k))
                                   for k in (8, 2)}, repeats=repeats, warmup=1)
    one, two = timings["8_groups_per_pack"]["median_s"], timings["2_groups_per_pack"]["median_s"]
    return {"num_groups": 8, "tokens": tokens, "timings": timings, "speedup_of_2_per_pack": one / two}


def part_kernels(model, tokenizer, repeats: int) -> dict:
    from turbogrpo.linears import TRAINING_LINEAR_KERNELS
    from turbogrpo.prefix.cost import ModelDims, layout_flops
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 8)

    def run(kernel: str):
        with TRAINING_LINEAR_KERNELS[kernel]([model]):
            forward_backward(model, prompts, completions, 2)

    timings = interleaved_medians({kernel: (lambda k=kernel: run(k)) for kernel in ("module", "onednn")},
                                  repeats=repeats, warmup=1)
    dims = ModelDims.of(model)
    flops = 3 * layout_flops(dims, [p.numel() for p in prompts], [[COMPLETION_LEN] * GROUP] * len(prompts)).shared
    large = large_matmul_gflops(torch.float32)
    rates = {k: flops / t["median_s"] / 1e9 for k, t in timings.items()}
    return {"num_groups": 8, "groups_per_pack": 2, "timings": timings, "flops": flops, "gflops": rates,
            "large_matmul_gflops": large, "fraction_of_large_matmul": {k: r / large for k, r in rates.items()},
            "speedup_of_onednn": timings["module"]["median_s"] / timings["onednn"]["median_s"]}


def _operand_layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """(shape, transposed): a 2-D operand given as the transpose of a contiguous tensor, or a contiguous
    one (the two layouts the training products pass; anything else is replayed contiguous)."""
    transposed = tensor.dim() == 2 and not tensor.is_contiguous() and tensor.t().is_contiguous()
    return tuple(tensor.shape), transposed


def recorded_products(model, prompts, completions) -> list[tuple]:
    """The weight products of one forward + backward in packs of 2 under the oneDNN training kernel,
    in order: ``(input layout, weight layout, bias length or 0)`` per ``F.linear``-shaped product."""
    from turbogrpo import linears
    from turbogrpo.linears import TRAINING_LINEAR_KERNELS
    calls, product = [], linears.onednn_product

    def spy(input, weight, bias=None):
        calls.append((_operand_layout(input), _operand_layout(weight), 0 if bias is None else bias.numel()))
        return product(input, weight, bias)
    linears.onednn_product = spy
    try:
        with TRAINING_LINEAR_KERNELS["onednn"]([model]):
            forward_backward(model, prompts, completions, 2)
    finally:
        linears.onednn_product = product
    return calls


def part_gemm_bound(model, tokenizer, repeats: int, step_flops: float, large: float) -> dict:
    """Time the recorded products alone (one operand tensor per distinct layout, reused: cache-warm, so
    the bound is if anything optimistic) by each kernel; the step's FLOPs over the faster time."""
    from turbogrpo.linears import onednn_product
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 8)
    calls = recorded_products(model, prompts, completions)
    generator = torch.Generator().manual_seed(0)
    operands: dict = {}

    def operand(layout):
        if layout not in operands:
            shape, transposed = layout
            dims = shape[::-1] if transposed else shape
            tensor = torch.randn(dims, generator=generator)
            operands[layout] = tensor.t() if transposed else tensor
        return operands[layout]
    products = [(operand(x), operand(w), torch.zeros(b) if b else None) for x, w, b in calls]
    gemm_flops = sum(2 * x.numel() * w.shape[0] for x, w, _ in products)
    kernels = {"module": torch.nn.functional.linear, "onednn": onednn_product}

    def replay(kernel):
        for x, w, b in products:
            kernel(x, w, b)
    timings = interleaved_medians({name: (lambda k=k: replay(k)) for name, k in kernels.items()},
                                  repeats=repeats, warmup=1)
    best = min(t["median_s"] for t in timings.values())
    return {"num_products": len(products), "gemm_gflop": gemm_flops / 1e9, "timings": timings,
            "gemm_gflops": {k: gemm_flops / t["median_s"] / 1e9 for k, t in timings.items()},
            "gemm_fraction_of_large_matmul": {k: gemm_flops / t["median_s"] / 1e9 / large for k, t in timings.items()},
            "step_ceiling_fraction_of_large_matmul": step_flops / best / 1e9 / large}


def part_dtype(model, tokenizer, repeats: int) -> dict:
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 1)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    contenders = {"float32": lambda: forward_backward(model, prompts, completions, 1),
                  "bfloat16_autocast": lambda: forward_backward(model, prompts, completions, 1, bf16)}

    def measure():
        for fn in contenders.values():
            fn()  # warm-up
        out = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, fn in contenders.items():
                out[name] += cpu_seconds(fn, 1)
        rates = {"float32": large_matmul_gflops(torch.float32), "bfloat16": large_matmul_gflops(torch.bfloat16)}
        return out, rates
    times, rates = one_thread(measure)
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"cpu_s": times, "median_cpu_s": medians, "speedup_of_bf16": medians["float32"] / medians["bfloat16_autocast"],
            "large_matmul_gflops_one_thread": rates}


def part_profile(model, tokenizer) -> dict:
    from torch.profiler import ProfilerActivity, profile
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 1)

    def run():
        forward_backward(model, prompts, completions, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward_backward(model, prompts, completions, 1)
        return prof.key_averages()
    events, large_rate = one_thread(lambda: (run(), large_matmul_gflops(torch.float32)))
    total = sum(e.self_cpu_time_total for e in events)
    shares = {e.key: e.self_cpu_time_total / total for e in events}
    groups = {"matmul (aten::mm)": shares.get("aten::mm", 0.0),
              "attention (CPU flash)": sum(v for k, v in shares.items() if "flash_attention" in k)}
    groups["everything else"] = 1.0 - sum(groups.values())
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:12]
    # Forward + backward = 3x the shared layout's forward FLOPs, all of it in the matmuls but attention's.
    flops = 3 * layout_flops(ModelDims.of(model), [prompts[0].numel()], [[COMPLETION_LEN] * GROUP]).shared
    matmul_rate = flops / (total / 1e6 * groups["matmul (aten::mm)"]) / 1e9
    return {"self_cpu_total_s": total / 1e6, "shares": groups, "top_ops": dict(top), "gflop": flops / 1e9,
            "matmul_gflops": matmul_rate, "large_matmul_gflops_one_thread": large_rate,
            "matmul_fraction_of_large": matmul_rate / large_rate}


def allocator_child(dtype: str) -> None:
    """One child run of the allocator part: load, one warm-up, two timed 8-group forward+backwards;
    prints the times as the last line (JSON)."""
    model, tokenizer = load_real_model()
    model.train()
    prompts, completions = group_batch(tokenizer, model.config.vocab_size, 8)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else (lambda: None)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        forward_backward(model, prompts, completions, 8, autocast())
        times.append(time.perf_counter() - start)
    print(json.dumps({"times_s": times[1:], "heap": "keep" if keep_freed_host_memory() else "system"}))


def part_allocator(repeats: int) -> dict:
    import subprocess
    out: dict = {}
    for dtype in ("float32", "bfloat16"):
        runs = {"system": [], "keep": []}
        for _ in range(repeats):
            for heap in runs:
                child = subprocess.run([sys.executable, __file__, "--allocator-child", dtype], check=True,
                                       capture_output=True, text=True, env={**os.environ, ENV: heap})
                record = json.loads(child.stdout.strip().splitlines()[-1])
                assert record["heap"] == heap, record
                runs[heap] += record["times_s"]
        medians = {heap: statistics.median(t) for heap, t in runs.items()}
        out[dtype] = {"times_s": runs, "median_s": medians, "speedup_of_keep": medians["system"] / medians["keep"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="lm_head,packs,dtype,profile")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="update_kernels_smollm2",
                        help="results name of the kernels part (bench/results/<out>.json)")
    parser.add_argument("--allocator-child", choices=["float32", "bfloat16"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allocator_child:
        return allocator_child(args.allocator_child)
    parts = args.parts.split(",")
    if "gemm_bound" in parts and "kernels" not in parts:
        raise SystemExit("--parts gemm_bound replays the kernels part's products: pass --parts kernels,gemm_bound")
    if "allocator" in parts:
        r = part_allocator(args.repeats)
        print_table("8 zero-shot groups as one pack, forward+backward wall s (2 threads), a fresh process per run",
                    ["dtype", "glibc default heap", "kept heap", "speedup"],
                    [[d, v["median_s"]["system"], v["median_s"]["keep"], v["speedup_of_keep"]] for d, v in r.items()])
        write_results("update_allocator_smollm2", {"model": "smollm2-135m-instruct", "completion_len": COMPLETION_LEN,
                                                   "group_size": GROUP, "num_groups": 8, "allocator": r,
                                                   "load_average": os.getloadavg()})
        parts.remove("allocator")
        if not parts:
            return
    model, tokenizer = load_real_model()
    model.train()
    results: dict = {"model": "smollm2-135m-instruct", "completion_len": COMPLETION_LEN, "group_size": GROUP}
    if "lm_head" in parts:
        r = results["lm_head"] = part_lm_head(max(args.repeats, 5))
        print_table("LM-head chunk math, CPU ms (one thread, 341 x 49152 float32)", ["logsumexp + 2nd exp", "one exp pass",
                    "speedup", "max |gap|"], [[1e3 * r["median_cpu_s"]["logsumexp_then_entropy"],
                                                1e3 * r["median_cpu_s"]["one_exp_pass"], r["speedup"], r["max_abs_gap"]]])
    if "packs" in parts:
        r = results["packs"] = part_packs(model, tokenizer, args.repeats)
        print_table(f"8 zero-shot groups, forward+backward wall s ({torch.get_num_threads()} threads)",
                    ["1 pack of 8", "4 packs of 2", "speedup"],
                    [[r["timings"]["8_groups_per_pack"]["median_s"], r["timings"]["2_groups_per_pack"]["median_s"],
                      r["speedup_of_2_per_pack"]]])
    if "kernels" in parts:
        r = part_kernels(model, tokenizer, args.repeats)
        if "gemm_bound" in parts:
            bound = r["gemm_bound"] = part_gemm_bound(model, tokenizer, args.repeats, r["flops"],
                                                      r["large_matmul_gflops"])
            print_table(f"the same step's {bound['num_products']} weight products alone ({bound['gemm_gflop']:.0f} "
                        "GFLOP), replayed with nothing between them", ["kernel", "s", "GFLOP/s", "of large matmul"],
                        [[k, t["median_s"], bound["gemm_gflops"][k], bound["gemm_fraction_of_large_matmul"][k]]
                         for k, t in bound["timings"].items()])
            print(f"ceiling of the whole step if everything but the weight products were free: "
                  f"{bound['step_ceiling_fraction_of_large_matmul']:.0%} of the large-matmul rate")
            parts.remove("gemm_bound")
        print_table(f"8 zero-shot groups in packs of 2, forward+backward wall s ({torch.get_num_threads()} threads, "
                    f"float32; large-matmul rate {r['large_matmul_gflops']:.0f} GFLOP/s)",
                    ["kernel", "s", "GFLOP/s", "of large matmul"],
                    [[k, r["timings"][k]["median_s"], r["gflops"][k], r["fraction_of_large_matmul"][k]]
                     for k in ("module", "onednn")])
        print(f"speedup of oneDNN: {r['speedup_of_onednn']:.2f}x")
        write_results(args.out, {"model": "smollm2-135m-instruct", "completion_len": COMPLETION_LEN,
                                                 "group_size": GROUP, "kernels": r, "load_average": os.getloadavg()})
        parts.remove("kernels")
        if not parts:
            return
    if "dtype" in parts:
        r = results["dtype"] = part_dtype(model, tokenizer, args.repeats)
        rates = r["large_matmul_gflops_one_thread"]
        print_table("one zero-shot group, forward+backward CPU s (one thread)",
                    ["float32", "bf16 autocast", "speedup", "fp32 GEMM GFLOP/s", "bf16 GEMM GFLOP/s"],
                    [[r["median_cpu_s"]["float32"], r["median_cpu_s"]["bfloat16_autocast"], r["speedup_of_bf16"],
                      rates["float32"], rates["bfloat16"]]])
    if "profile" in parts:
        r = results["profile"] = part_profile(model, tokenizer)
        print_table("self CPU time of one group's forward+backward (float32, one thread)", ["part", "share"],
                    [[name, share] for name, share in r["shares"].items()])
        print(f"its matmuls ran at {r['matmul_gflops']:.0f} GFLOP/s, {r['matmul_fraction_of_large']:.0%} of the "
              f"one-thread 2048^3 rate ({r['large_matmul_gflops_one_thread']:.0f})")
    results["load_average"] = os.getloadavg()
    print(f"load average {results['load_average']}")
    write_results("update_smollm2", results)


if __name__ == "__main__":
    main()
