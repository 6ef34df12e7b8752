"""Rollout on three engines, side by side in one process: turbogrpo's native engine, the vLLM engine
(``rollout.engine = "vllm"``: vLLM's CPU build in this process) and Hugging Face ``generate`` with the prompts
repeated G times (TRL without vLLM), on SmolLM2-135M-Instruct (bench/real_model.py) with GSM8K test prompts
under its chat template, T = 1.

Two workloads per dtype (float32, bfloat16: the weights themselves in that dtype on every side):
    eos     each completion stops at the model's end of turn / EOS, or at max_new_tokens: lengths differ
            between engines (random draws), so the table gives time per generated token too
    fixed   no stop token: every completion runs max_new_tokens, the same token count on every side

The three contenders alternate run by run (``harness.interleaved_medians``); the vLLM engine is built once
per dtype (its build time is recorded, with a full weight push's time: issue 44 part 7c), and checked
against the native engine and the trainer first (``exactness``: greedy completions equal? the
sampler-trainer log-prob gap).

    python bench/vllm_rollout.py                       # 8 prompts x 8 samples, up to 256 tokens, 3 repeats
    python bench/vllm_rollout.py --dtypes bfloat16     # one dtype
    python bench/vllm_rollout.py --quick               # smoke run: 2 x 2, 8 tokens, float32, 1 repeat
    python bench/vllm_rollout.py --competing-job 1 --engines native,vllm,native_1_thread --workloads eos
                                                       # beside another job: a 1-thread GEMM loop runs throughout
    python bench/vllm_rollout.py --engines native,native_compiled,vllm --out vllm_rollout_native_compiled
                                                       # the native step compiled too (issue 54)
    python bench/vllm_rollout.py --threads 1 --competing-job 1 --engines native_compiled,vllm,native --workloads eos
                                                       # a shared machine: torch at 1 thread (compiled for it) beside
                                                       # a 1-thread job; the first engine is the ratios' base
    python bench/vllm_rollout.py --vllm-eager --engines native,vllm --dtypes float32 --workloads fixed
                                                       # the vLLM engine built eager (rollout.vllm_enforce_eager)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402

from turbogrpo import completion_logprobs  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.rollout.compiled import compiled_candidate, timing_steps  # noqa: E402
from turbogrpo.rollout.decode import COMPILED_BUCKETS, DecodeSchedule  # noqa: E402
from turbogrpo.engines.vllm import VllmEngine  # noqa: E402

WORKLOADS = ("eos", "fixed")
ENGINES = ("native", "vllm", "hf_generate", "native_1_thread", "native_compiled")
"""The contenders; "native_compiled" is the native engine with its plain step compiled (``DecodeSchedule.runner`` =
the compiled runner "auto" would time here, ``compiled.compiled_candidate``: "compiled-onednn" where oneDNN's packed
products are faster, else "compiled"; step8 buckets: one static graph per bucket, compiled in the warm-up rollouts,
``warm_compiled``);
"native_1_thread" is the native engine with torch at one thread (``train.num_threads = 1``: what a user on a shared
machine sets), for the runs beside another job."""
WARM_ROLLOUTS = 4
"""Most untimed compiled rollouts before the timed ones (``warm_compiled``)."""


@contextlib.contextmanager
def competing_job(threads: int):
    """Another job on the machine for as long as the block runs: a process multiplying float32 matrices
    on ``threads`` threads without pause (a second training run, a test suite); 0: none."""
    if threads <= 0:
        yield
        return
    loop = (f"import torch; torch.set_num_threads({threads}); a = torch.randn(512, 512)\n"
            "while True: a = torch.tanh(a @ a)")
    job = subprocess.Popen([sys.executable, "-c", loop])
    try:
        yield
    finally:
        job.kill()
        job.wait()


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an answer: EOS and the chat template's end of turn."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tuple(sorted(i for i in ids if isinstance(i, int) and i >= 0))


def hf_generate(model, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig, pad_id: int) -> int:
    """HF generate on the prompts left-padded, each repeated G times (TRL's way); returns tokens generated
    (up to each row's first stop token)."""
    width = max(p.numel() for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.numel(),), pad_id), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.numel()), torch.ones(p.numel())]) for p in prompts]).long()
    fixed = not sampling.stop_token_ids
    out = model.generate(ids.repeat_interleave(num_samples, 0), attention_mask=mask.repeat_interleave(num_samples, 0),
                         do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0,
                         max_new_tokens=sampling.max_new_tokens,
                         min_new_tokens=sampling.max_new_tokens if fixed else None,
                         eos_token_id=None if fixed else list(sampling.stop_token_ids), pad_token_id=pad_id)
    new = out[:, width:]
    if fixed:
        return new.numel()
    stops = torch.isin(new, torch.tensor(sampling.stop_token_ids))
    ends = torch.where(stops.any(1), stops.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
    return int(ends.sum())


def exactness(model, engine: VllmEngine, prompts: list[torch.Tensor], num_samples: int, new_tokens: int,
              stops: tuple[int, ...]) -> dict:
    """Greedy completions of vLLM and the native engine compared (how many equal, and where the first
    difference falls), and the sampler-trainer log-prob gap of a T = 1 vLLM rollout (|sampler - trainer| over
    its tokens, the trainer being ``completion_logprobs`` on the same weights)."""
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=stops)
    ours = engine.sample(model, prompts, num_samples=1, sampling=greedy, seed=0).tokens
    native = generate(model, prompts, num_samples=1, sampling=greedy, seed=0).tokens
    first_differences = [next((i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y),
                              min(len(a), len(b))) for a, b in zip(ours, native) if a.tolist() != b.tolist()]
    sampled = engine.sample(model, prompts, num_samples=num_samples, seed=1, sampling=SamplingConfig(
        max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=stops))
    with torch.no_grad():
        trainer = completion_logprobs(model, sampled.prompts, sampled.tokens_per_group(), temperature=1.0)
    gaps = torch.cat([(a.float() - b.float()).abs() for ga, gb in zip(sampled.logprobs_per_group(), trainer)
                      for a, b in zip(ga, gb)])
    return {"greedy_equal": len(ours) - len(first_differences), "greedy_compared": len(ours),
            "greedy_first_differences": first_differences, "gap_mean": float(gaps.mean()),
            "gap_max": float(gaps.max()), "gap_tokens": gaps.numel()}


def compiled_step(runner: str):
    """The process's ``CompiledStep`` of the plain step for a compiled ``runner`` (its graphs by bucket)."""
    from turbogrpo.rollout.compiled import STACKED_PRODUCT_RUNNERS, _compiled
    from turbogrpo.rollout.step import plain_step
    products = "stacked" if runner in STACKED_PRODUCT_RUNNERS else "aten"
    return _compiled(plain_step, "inductor", static=True, products=products)


def step_profile(step_seconds: dict[tuple, list[float]], rollout_s: float) -> dict:
    """One compiled rollout's warm steps by live-batch bucket (rows, groups): how many and their milliseconds (total,
    median), and the rollout's time outside them (prefill, host checks, retiring rows, a cold compile)."""
    buckets = [{"rows": bucket[0], "groups": bucket[1], "steps": len(times), "total_ms": sum(times) * 1e3,
                "median_ms": statistics.median(times) * 1e3} for bucket, times in step_seconds.items()]
    buckets.sort(key=lambda b: (-b["rows"], -b["groups"]))
    in_steps = sum(b["total_ms"] for b in buckets) / 1e3
    return {"buckets": buckets, "rollout_s": rollout_s, "steps_s": in_steps, "outside_steps_s": rollout_s - in_steps}


def warm_compiled(rollout, runner: str, max_rollouts: int = WARM_ROLLOUTS) -> int:
    """Run the compiled contender's ``rollout`` until one compiles no new graph (at most ``max_rollouts``), so that
    the timed runs meet warm buckets: where sequences end depends on the seed, and so do the live batches met.
    Returns the number of graphs compiled so far."""
    graphs = compiled_step(runner).compile_seconds
    for _ in range(max_rollouts):
        before = len(graphs)
        rollout()
        if len(graphs) == before:
            break
    return len(graphs)


def bench_dtype(dtype: torch.dtype, num_prompts: int, num_samples: int, new_tokens: int, repeats: int,
                engines: list[str], workloads: list[str], competing_threads: int, vllm_eager: bool = False) -> dict:
    model, tokenizer = load_real_model()
    model = model.to(dtype)
    prompts = chat_prompts(tokenizer, num_prompts, few_shot=False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = VllmEngine(dtype, torch.device("cpu"), tokenizer, enforce_eager=vllm_eager)
    engine.build(model)
    pushes = []
    for _ in range(3):  # a full push (every weight), as the first push into an engine another run built
        engine.synced = False
        start = time.perf_counter()
        engine.push_weights(model)
        pushes.append(time.perf_counter() - start)
    compiled_runner = compiled_candidate(model)  # the compiled runner "auto" times here: compiled-onednn where it packs
    record = {"dtype": str(dtype).removeprefix("torch."), "build_s": engine.build_seconds,
              "full_push_s": sorted(pushes)[1], "native_compiled_runner": compiled_runner, "workloads": {}}
    record["exactness"] = exactness(model, engine, prompts, num_samples, new_tokens, stop_ids(tokenizer))
    for workload in workloads:
        sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0,
                                  stop_token_ids=stop_ids(tokenizer) if workload == "eos" else ())
        tokens: dict[str, list[int]] = {name: [] for name in ENGINES}
        profiles: list[dict] = []  # native_compiled's rollouts, step by bucket
        seeds = iter(range(10_000))

        def native():
            rollout = generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=next(seeds))
            tokens["native"].append(rollout.stats.num_generated_tokens)

        def vllm():
            rollout = engine.sample(model, prompts, num_samples=num_samples, sampling=sampling, seed=next(seeds))
            tokens["vllm"].append(rollout.stats.num_generated_tokens)

        def native_1_thread():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                rollout = generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=next(seeds))
            finally:
                torch.set_num_threads(threads)
            tokens["native_1_thread"].append(rollout.stats.num_generated_tokens)

        def native_compiled():
            start = time.perf_counter()
            with timing_steps(compiled_step(compiled_runner)) as step_seconds:
                rollout = generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=next(seeds),
                                   schedule=DecodeSchedule(1, COMPILED_BUCKETS, compiled_runner))
            tokens["native_compiled"].append(rollout.stats.num_generated_tokens)
            profiles.append(step_profile(step_seconds, time.perf_counter() - start))

        def hf():
            tokens["hf_generate"].append(hf_generate(model, prompts, num_samples, sampling, pad_id))

        contenders = {"native": native, "vllm": vllm, "hf_generate": hf, "native_1_thread": native_1_thread,
                       "native_compiled": native_compiled}
        with torch.no_grad(), competing_job(competing_threads):
            graphs_before = warm_compiled(native_compiled, compiled_runner) if "native_compiled" in engines else 0
            times = interleaved_medians({name: contenders[name] for name in engines}, repeats=repeats, warmup=1)
        if "native_compiled" in engines:  # a timed run that met a new bucket held a cold compile: say so
            times["native_compiled"]["graphs_compiled_in_timed_runs"] = \
                len(compiled_step(compiled_runner).compile_seconds) - graphs_before
            times["native_compiled"]["step_profiles"] = profiles[-repeats:]
        for name, timing in times.items():
            counted = tokens[name][-repeats:]  # the timed runs (after the warm-up)
            timing["tokens"] = counted
            timing["median_s_per_token"] = sorted(t / n for t, n in zip(timing["times_s"], counted))[len(counted) // 2]
        record["workloads"][workload] = times
    if "native_compiled" in engines:  # every graph the compiled step met (a new bucket or group layout compiles)
        compiled = compiled_step(compiled_runner).compile_seconds
        record["native_compiled_graphs"] = {"count": len(compiled), "first_call_s": sorted(compiled.values())}
    del engine
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="native,vllm,hf_generate",
                        help=f"the contenders, the first the ratios' base, of {', '.join(ENGINES)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--competing-job", type=int, default=0, metavar="THREADS",
                        help="run a GEMM loop on THREADS threads in another process while timing (0: none)")
    parser.add_argument("--vllm-eager", action="store_true", help="build the vLLM engine without compilation "
                        "(rollout.vllm_enforce_eager); results name vllm_rollout_eager")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the whole run, set before "
                        "anything compiles (a compiled graph keeps the thread count it was compiled for); default: "
                        "torch's")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 x 2, 8 tokens, float32, 1 repeat")
    parser.add_argument("--out", default=None, help="results name (default vllm_rollout[_competing], or _quick)")
    args = parser.parse_args()
    if args.quick:
        args.dtypes, args.prompts, args.samples, args.new_tokens, args.repeats = "float32", 2, 2, 8, 1
    engines, workloads = args.engines.split(","), args.workloads.split(",")
    if not set(engines) <= set(ENGINES) or len(set(engines)) < len(engines) or not set(workloads) <= set(WORKLOADS):
        parser.error(f"--engines: any of {ENGINES}, the first the ratios' base; --workloads: any of {WORKLOADS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = {"num_prompts": args.prompts, "num_samples": args.samples, "max_new_tokens": args.new_tokens,
             "repeats": args.repeats, "temperature": 1.0, "model": "smollm2-135m-instruct",
             "prompts": "GSM8K test, zero-shot chat template", "competing_job_threads": args.competing_job,
             "vllm_enforce_eager": args.vllm_eager, "torch_threads": torch.get_num_threads(), "base": engines[0]}
    name = args.out or ("vllm_rollout" + ("_eager" if args.vllm_eager else "") +
                        ("_competing" if args.competing_job else "") + ("_quick" if args.quick else ""))
    records, load_before = [], os.getloadavg()
    for dtype in args.dtypes.split(","):
        # Each dtype's record is written when it is done: a run killed during the next one keeps it.
        records.append(bench_dtype(getattr(torch, dtype), args.prompts, args.samples, args.new_tokens, args.repeats,
                                   engines, workloads, args.competing_job, args.vllm_eager))
        write_results(name, {"shape": shape, "results": records,
                             "load_average": {"before": load_before, "after": os.getloadavg()}})
    rows = []
    for r in records:
        for workload, times in r["workloads"].items():
            base = times[engines[0]]
            for name, t in times.items():
                rows.append([r["dtype"], workload, name, t["median_s"], t["median_s_per_token"] * 1e3,
                             t["median_s"] / base["median_s"], t["median_s_per_token"] / base["median_s_per_token"]])
    beside = f", beside a {args.competing_job}-thread GEMM job" if args.competing_job else ""
    print_table(f"Rollout, SmolLM2-135M, {args.prompts} x {args.samples}, up to {args.new_tokens} tokens "
                f"(medians of {args.repeats}{beside})", ["dtype", "workload", "engine", "time s", "ms/token",
                                                 f"time / {engines[0]}", f"per token / {engines[0]}"], rows)
    for r in records:
        for workload, times in r["workloads"].items():
            for profile in times.get("native_compiled", {}).get("step_profiles", []):
                buckets = ", ".join(f"{b['rows']}: {b['steps']} x {b['median_ms']:.0f}" for b in profile["buckets"])
                print(f"{r['dtype']} {workload} compiled rollout {profile['rollout_s']:.1f} s, outside the steps "
                      f"{profile['outside_steps_s']:.1f} s; rows: steps x median ms {buckets}")
    for r in records:
        e = r["exactness"]
        print(f"{r['dtype']}: vLLM engine built in {r['build_s']:.1f} s, full weight push {r['full_push_s']:.3f} s; "
              f"greedy equal to native {e['greedy_equal']}/{e['greedy_compared']} (first differences at "
              f"{e['greedy_first_differences']}); sampler-trainer gap mean {e['gap_mean']:.2e}, max {e['gap_max']:.2e} "
              f"over {e['gap_tokens']} tokens")


if __name__ == "__main__":
    main()
