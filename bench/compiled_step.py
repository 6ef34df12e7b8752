"""The plain decoding step eager against compiled (issue 54, 4a): SmolLM2-135M-Instruct, GSM8K zero-shot chat
prompts, T = 1, float32 and bf16, live batches 1, 4, 16 and 64, beside this machine's floors.

Per dtype and live batch B (min(B, 8) prompts x the rest as samples, every row live throughout: no stop
token), each contender decodes from its own prefilled state, ``--steps`` steps a timed call, the contenders
alternated (``harness.interleaved_medians``):

    eager      the plain step as ``generate`` runs it on the CPU (``rollout_linear_kernel``: oneDNN-packed
               weights where they pay), reading the KV slots in use
    compiled   ``DecodeSchedule.runner = "compiled"``: inductor, one static graph for the bucket, over every
               KV slot of the rollout's capacity (``--new-tokens``)
    compiled-pinned   the same with torch's threads pinned one per physical core (vLLM's CPU binding)
    compiled-onednn   the same graph with its weight products as ``graph_linears.stacked_linear``: one opaque
               call per input (q/k/v and gate/up stacked) on oneDNN-packed weights where they pay here

Floors: the weight-read floor (every weight matrix's bytes over this machine's measured read bandwidth,
``real_model.memory_read_gbps``: a step at B = 1 cannot beat it), the GEMM floor (the step's weight FLOPs at
the large-product rate, ``real_model.large_matmul_gflops``) and the streamed weight products alone
(``real_model.model_gemm_step_seconds``), by aten's ``F.linear`` (what ``compiled`` runs: ``streamed_products_s``)
and by the packed oneDNN products (what ``eager`` and ``compiled-onednn`` run: ``streamed_packed_products_s``). Targets (issue 54): compiled within 1.5x of the weight-read floor at
B = 1, of the GEMM floor at B = 64.

Compile times: each bucket's first call with inductor's cache empty (a temporary folder: ``cold``), then again
after ``torch._dynamo.reset()`` with that cache filled (``warm``: what a later process pays, dynamo's trace and
the cached kernels' load).

    python bench/compiled_step.py                       # both dtypes, B = 1, 4, 16, 64; ~25-40 min on 2 cores
    python bench/compiled_step.py --dtypes bfloat16 --batches 1,64
    python bench/compiled_step.py --runners eager,compiled,compiled-pinned --competing-job 1
    python bench/compiled_step.py --runners eager,compiled,compiled-onednn --batches 1,4
    python bench/compiled_step.py --quick               # smoke: float32, B = 1 and 4, 2 steps, 1 repeat
    python bench/compiled_step.py --batches 16,64 --runners eager,compiled-onednn --after-steps 200
                                                        # steps late in a rollout (200 slots in use)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import (chat_prompts, large_matmul_gflops, load_real_model, memory_read_gbps,  # noqa: E402
                        model_gemm_step_seconds, weight_flops_per_token)
from vllm_rollout import competing_job  # noqa: E402

from turbogrpo.cpu_capability import cpu_capability  # noqa: E402
from turbogrpo.rollout import SamplingConfig  # noqa: E402
from turbogrpo.rollout.compiled import PLAIN_RUNNERS, _compiled, runner_scope  # noqa: E402
from turbogrpo.rollout.decode import DecodeSchedule, first_draw, rollout_linear_kernel  # noqa: E402
from turbogrpo.rollout.step import PlainStep, plain_step  # noqa: E402

RUNNERS = ("eager", "compiled", "compiled-pinned", "compiled-onednn")


def weight_bytes(model) -> int:
    """Bytes of every weight matrix a decoding step reads once (the ``nn.Linear`` weights, LM head included)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def floors(model, batches: list[int], dtype: torch.dtype) -> dict:
    """This machine's floors of one step (see the module docstring), per live batch."""
    bandwidth = memory_read_gbps()
    rate = large_matmul_gflops(dtype)
    read_s = weight_bytes(model) / bandwidth / 1e9
    flops = weight_flops_per_token(model.config)
    return {"memory_read_gbps": bandwidth, "large_matmul_gflops": rate, "weight_bytes": weight_bytes(model),
            "per_batch": {str(b): {"weight_read_s": read_s, "gemm_s": b * flops / rate / 1e9,
                                   "streamed_products_s": model_gemm_step_seconds(model, b),
                                   "streamed_packed_products_s": model_gemm_step_seconds(model, b, kernel="onednn")
                                   if cpu_capability().packs(dtype) else None} for b in batches}}


class Contender:
    """One runner's model copy (under the linear kernel a rollout with that runner uses) and a decoding state of
    B rows prefilled from ``prompts``, stepped ``steps`` at a call; a fresh state before the capacity runs out."""

    def __init__(self, runner: str, model, prompts: list[torch.Tensor], num_samples: int, new_tokens: int, steps: int,
                 after_steps: int = 0):
        self.runner, self.model, self.prompts, self.num_samples = runner, model, prompts, num_samples
        self.sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
        self.steps, self.step = steps, PlainStep(PLAIN_RUNNERS[runner](plain_step))
        self.after_steps = after_steps
        self.state = None

    def fresh_state(self) -> None:
        generator = torch.Generator().manual_seed(0)
        rows = len(self.prompts) * self.num_samples
        self.state = first_draw(self.model, self.prompts, self.num_samples, self.sampling, generator, False,
                                [self.sampling.max_new_tokens] * rows, 0, static_slots=self.runner != "eager",
                                slot_block=DecodeSchedule(runner=self.runner).slot_block)
        self.left = self.sampling.max_new_tokens - 1
        with runner_scope(self.runner):  # untimed: the timed steps read as many KV slots as a step that late does
            for _ in range(self.after_steps):
                self.step(self.state)
        self.left -= self.after_steps

    def __call__(self) -> None:
        if self.state is None or self.left < self.steps:
            self.fresh_state()
        with runner_scope(self.runner):  # as a rollout holds it: once around its steps
            for _ in range(self.steps):
                self.step(self.state)
        self.left -= self.steps


def first_call_seconds(contender: Contender) -> float:
    """Seconds of a fresh state's first step (a compiled runner compiles its bucket there)."""
    contender.fresh_state()
    start = time.perf_counter()
    contender.step(contender.state)
    contender.left -= 1
    return time.perf_counter() - start


def bench_dtype(dtype: torch.dtype, batches: list[int], runners: list[str], new_tokens: int, steps: int,
                repeats: int, after_steps: int = 0) -> dict:
    model, tokenizer = load_real_model()
    model = model.to(dtype)
    record = {"dtype": str(dtype).removeprefix("torch."), "floors": floors(model, batches, dtype), "batches": {}}
    copies = {runner: copy.deepcopy(model) for runner in runners}
    with contextlib.ExitStack() as kernels, torch.no_grad():
        for runner in runners:  # each copy runs under the linear kernel a rollout with its runner uses
            kernels.enter_context(rollout_linear_kernel(DecodeSchedule(runner=runner))([copies[runner]]))
        for batch in batches:
            num_prompts = min(batch, 8)
            prompts = chat_prompts(tokenizer, num_prompts, few_shot=False)
            contenders = {r: Contender(r, copies[r], prompts, batch // num_prompts, new_tokens, steps, after_steps)
                          for r in runners}
            compile_s = {}
            for runner, contender in contenders.items():
                cold = first_call_seconds(contender)
                if runner == "eager" or after_steps:  # after_steps: the bucket compiled while advancing, untimed
                    continue
                torch._dynamo.reset()  # a later process: dynamo traces again, inductor's cache is warm
                _compiled.cache_clear()
                contender.step = PlainStep(PLAIN_RUNNERS[runner](plain_step))
                compile_s[runner] = {"cold_s": cold, "warm_s": first_call_seconds(contender)}
            times = interleaved_medians(contenders, repeats=repeats, warmup=1)
            entry = {"prompts": num_prompts, "samples": batch // num_prompts, "prompt_tokens":
                     [p.numel() for p in prompts], "compile": compile_s, "runners": {}}
            for runner, timing in times.items():
                entry["runners"][runner] = {**timing, "step_s": timing["median_s"] / steps}
            record["batches"][str(batch)] = entry
    return record


def rows_of(record: dict) -> list[list]:
    rows = []
    for batch, entry in record["batches"].items():
        floor = record["floors"]["per_batch"][batch]
        eager = entry["runners"].get("eager", {}).get("step_s")
        for runner, timing in entry["runners"].items():
            step = timing["step_s"]
            compile_s = entry["compile"].get(runner, {})
            rows.append([record["dtype"], int(batch), runner, step * 1e3, eager / step if eager else "",
                         step / floor["weight_read_s"], step / floor["gemm_s"], step / floor["streamed_products_s"],
                         step / floor["streamed_packed_products_s"] if floor.get("streamed_packed_products_s") else "",
                         compile_s.get("cold_s", ""), compile_s.get("warm_s", "")])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--runners", default="eager,compiled", help=f"any of {', '.join(RUNNERS)}, eager first")
    parser.add_argument("--new-tokens", type=int, default=256, help="the rollout's capacity (compiled reads all)")
    parser.add_argument("--steps", type=int, default=8, help="decoding steps per timed call")
    parser.add_argument("--after-steps", type=int, default=0, metavar="N",
                        help="time steps late in a rollout: each state first decodes N untimed steps (no compile times)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--competing-job", type=int, default=0, metavar="THREADS",
                        help="run a GEMM loop on THREADS threads in another process while timing (0: none)")
    parser.add_argument("--quick", action="store_true", help="smoke: float32, B = 1 and 4, 2 steps, 1 repeat")
    parser.add_argument("--out", default=None, help="results name (default compiled_step[_competing][_quick])")
    args = parser.parse_args()
    if args.quick:
        args.dtypes, args.batches, args.steps, args.repeats, args.new_tokens = "float32", "1,4", 2, 1, 16
    runners = args.runners.split(",")
    if runners[0] != "eager" or not set(runners) <= set(RUNNERS):
        parser.error(f"--runners: eager first, then any of {RUNNERS}")
    if args.after_steps and (1 + args.repeats) * args.steps + 1 > args.new_tokens - 1 - args.after_steps:
        parser.error("--after-steps: the timed calls ((1 + repeats) x steps, and one first step) must fit in the "
                     "capacity left after them (--new-tokens - 1 - N)")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 or (b > 8 and b % 8) for b in batches):
        parser.error("--batches: each 1-8, or a multiple of 8 (8 prompts x samples)")
    name = args.out or ("compiled_step" + ("_competing" if args.competing_job else "") + ("_quick" if args.quick else ""))
    shape = {"model": "smollm2-135m-instruct", "prompts": "GSM8K test, zero-shot chat template", "temperature": 1.0,
             "batches": batches, "capacity_tokens": args.new_tokens, "steps_per_call": args.steps,
             "repeats": args.repeats, "competing_job_threads": args.competing_job, "runners": runners,
             "after_steps": args.after_steps}
    load_before, records = os.getloadavg(), []
    # Inductor's cache in a fresh folder, so that the first compile of each bucket is timed cold.
    with tempfile.TemporaryDirectory(prefix="turbogrpo-bench-inductor-") as folder, competing_job(args.competing_job):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        for dtype in args.dtypes.split(","):
            records.append(bench_dtype(getattr(torch, dtype), batches, runners, args.new_tokens, args.steps,
                                       args.repeats, args.after_steps))
            write_results(name, {"shape": shape, "results": records,
                                 "load_average": {"before": load_before, "after": os.getloadavg()}})
    print_table(f"Plain decoding step, SmolLM2-135M, eager vs compiled (medians of {args.repeats} x {args.steps} steps)",
                ["dtype", "B", "runner", "ms/step", "eager / this", "x weight read", "x GEMM", "x aten products",
                 "x packed products",
                 "compile cold s", "compile warm s"], [row for r in records for row in rows_of(r)])
    for r in records:
        f = r["floors"]
        print(f"{r['dtype']}: memory read {f['memory_read_gbps']:.1f} GB/s, large GEMM {f['large_matmul_gflops']:.0f} "
              f"GFLOP/s, weights {f['weight_bytes'] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
