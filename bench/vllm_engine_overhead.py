"""Where turbogrpo's vLLM engine loses time against TRL's use of the same vLLM (issue 54 part 5), in one process.

bench/trl_vllm.py measured a whole step's rollout with ``rollout.engine = "vllm"`` at 1.49x TRL's on the same
vLLM build. This separates the engine from everything else in a step: one vLLM ``LLM`` (built by our
``VllmEngine`` from SmolLM2-135M-Instruct), the same GSM8K zero-shot prompts, 8 x 8, up to 256 tokens, stopping
at the end of turn, T = 1, and these calls on it, alternated (``harness.interleaved_medians``):

    ours            ``VllmEngine.sample``: one request per prompt, ``n = G``, seeded per request (reproducible)
    trl             TRL 1.16's colocated call: every prompt repeated G times, ``n = 1``, unseeded, ``logprobs=0``
    trl_n           TRL's server-mode shape: one request per prompt, ``n = G``, unseeded, ``logprobs=0``
    ours_unseeded   ours without the per-request seed
    ours_no_logprobs ours without log-probs (``logprobs=None``)
    ours_g_requests ours as G seeded requests of ``n = 1`` per prompt

and, with ``--trl-build``, a second ``LLM`` built as TRL builds it (chunked prefill on, 4,096 batched tokens,
``max_num_seqs`` = P x G, a 2,048-token context) beside ours in the process, timed with TRL's call:

    trl_build       TRL's call on TRL's build

Each variant's time per generated token is the comparable figure (random draws stop at different lengths).
``--profile VARIANT`` adds a cProfile of one call of that variant (the top functions by own time).

    python bench/vllm_engine_overhead.py                    # float32, compiled vLLM, 3 repeats; ~6-10 min on 2 cores
    python bench/vllm_engine_overhead.py --trl-build        # also TRL's own build (a second engine, +2 min)
    python bench/vllm_engine_overhead.py --trl-build --trl-build-first   # the same, TRL's engine built first
    python bench/vllm_engine_overhead.py --dtype bfloat16
    python bench/vllm_engine_overhead.py --quick            # smoke: 2 x 2, 8 tokens, vLLM eager, 1 repeat
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402
from vllm_cpu import MAX_MODEL_LENGTH  # noqa: E402
from vllm_rollout import stop_ids  # noqa: E402

from turbogrpo.engines.vllm import VllmEngine, request_seed, sampling_params  # noqa: E402
from turbogrpo.rollout import SamplingConfig  # noqa: E402


def trl_params(sampling: SamplingConfig, n: int):
    """TRL 1.16's ``SamplingParams`` (``vllm_generation.py``, colocate): its defaults top_p 1, top_k 0, min_p 0,
    repetition penalty 1, ``logprobs=0``, no seed; stopping as ours (the end-of-turn ids, kept)."""
    from vllm import SamplingParams
    return SamplingParams(n=n, temperature=sampling.temperature, top_p=1.0, top_k=0, min_p=0.0,
                          repetition_penalty=1.0, max_tokens=sampling.max_new_tokens, logprobs=0,
                          stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True)


def generated(outputs) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


class Variants:
    """The calls of the module docstring on ``engine``'s LLM (and ``trl_llm``, TRL's build, where given); each
    returns the tokens it generated."""

    def __init__(self, engine: VllmEngine, model, prompts: list[torch.Tensor], num_samples: int,
                 sampling: SamplingConfig, trl_llm=None):
        self.engine, self.model, self.num_samples, self.sampling, self.trl_llm = engine, model, num_samples, sampling, trl_llm
        self.prompts = prompts
        self.requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
        self.seeds = iter(range(1, 1 << 30))

    def ours(self) -> int:
        rollout = self.engine.sample(self.model, self.prompts, num_samples=self.num_samples, sampling=self.sampling,
                                     seed=next(self.seeds))
        return rollout.stats.num_generated_tokens

    def _ours_params(self, n: int, **changes) -> list:
        seed = next(self.seeds)
        params = [sampling_params(self.sampling, n, request_seed(seed, g)) for g in range(len(self.prompts))]
        for p in params:
            for name, value in changes.items():
                setattr(p, name, value)
        return params

    def ours_unseeded(self) -> int:
        return generated(self.engine.llm.generate(self.requests, self._ours_params(self.num_samples, seed=None),
                                                  use_tqdm=False))

    def ours_no_logprobs(self) -> int:
        return generated(self.engine.llm.generate(self.requests, self._ours_params(self.num_samples, logprobs=None),
                                                  use_tqdm=False))

    def ours_g_requests(self) -> int:
        seed = next(self.seeds)
        params = [sampling_params(self.sampling, 1, request_seed(seed, g) + i) for g in range(len(self.prompts))
                  for i in range(self.num_samples)]
        repeated = [r for r in self.requests for _ in range(self.num_samples)]
        return generated(self.engine.llm.generate(repeated, params, use_tqdm=False))

    def trl(self, llm=None) -> int:
        repeated = [r for r in self.requests for _ in range(self.num_samples)]
        return generated((llm or self.engine.llm).generate(repeated, trl_params(self.sampling, 1), use_tqdm=False))

    def trl_n(self) -> int:
        return generated(self.engine.llm.generate(self.requests, trl_params(self.sampling, self.num_samples),
                                                  use_tqdm=False))

    def trl_build(self) -> int:
        return self.trl(self.trl_llm)

    def table(self, names: list[str]) -> dict[str, Callable[[], int]]:
        return {name: getattr(self, name) for name in names}


VARIANTS = ("ours", "trl", "trl_n", "ours_unseeded", "ours_no_logprobs", "ours_g_requests", "trl_build")


def trl_build(model, tokenizer, dtype: torch.dtype, num_seqs: int, eager: bool):
    """A vLLM ``LLM`` of ``model`` as TRL 1.16 builds it in colocate mode (``vllm_generation.py``), on the CPU."""
    import tempfile

    from vllm import LLM

    from turbogrpo.engines.vllm import MEMORY, process_state_kept, write_checkpoint
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as TRL's colocated engine
    with tempfile.TemporaryDirectory(prefix="turbogrpo-trl-build-") as folder, process_state_kept():
        write_checkpoint(model, folder)
        tokenizer.save_pretrained(folder)
        return LLM(model=folder, dtype=str(dtype).removeprefix("torch."), seed=0, max_num_seqs=num_seqs,
                   max_model_len=MAX_MODEL_LENGTH, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
                   enforce_eager=eager, **MEMORY["cpu"])


def profiled(call: Callable[[], int], top: int = 25) -> list[dict]:
    """The ``top`` functions by own time over one call of ``call``."""
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}:{name}", "calls": calls, "own_s": own, "cumulative_s": cum}
            for (file, line, name), (_, calls, own, cum, _) in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="ours,trl,trl_n,ours_unseeded,ours_no_logprobs,ours_g_requests",
                        help=f"any of {', '.join(VARIANTS)}, ours first (the ratios' base)")
    parser.add_argument("--trl-build", action="store_true", help="also build an LLM as TRL does and time trl_build")
    parser.add_argument("--trl-build-first", action="store_true", help="with --trl-build: build TRL's engine before "
                        "ours (which engine is the process's second changes? run both orders)")
    parser.add_argument("--vllm-eager", action="store_true", help="build vLLM without its compilation")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile once each (cProfile)")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 x 2, 8 tokens, vLLM eager, 1 repeat")
    parser.add_argument("--out", default=None, help="results name (default vllm_engine_overhead[_bf16][_quick])")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.new_tokens, args.repeats, args.vllm_eager = 2, 2, 8, 1, True
    variants = args.variants.split(",") + (["trl_build"] if args.trl_build else [])
    if variants[0] != "ours" or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: ours first, then any of {VARIANTS}")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_real_model()
    model = model.to(dtype)
    prompts = chat_prompts(tokenizer, args.prompts, few_shot=False)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stop_ids(tokenizer))
    load_before = os.getloadavg()
    engine = VllmEngine(dtype, torch.device("cpu"), tokenizer, enforce_eager=args.vllm_eager)
    trl_llm = None
    if args.trl_build and args.trl_build_first:
        trl_llm = trl_build(model, tokenizer, dtype, args.prompts * args.samples, args.vllm_eager)
    engine.build(model)
    if args.trl_build and not args.trl_build_first:
        trl_llm = trl_build(model, tokenizer, dtype, args.prompts * args.samples, args.vllm_eager)
    table = Variants(engine, model, prompts, args.samples, sampling, trl_llm)
    tokens: dict[str, list[int]] = {name: [] for name in variants}

    def counted(name: str) -> Callable[[], None]:
        call = getattr(table, name)
        return lambda: tokens[name].append(call())

    with torch.no_grad():
        times = interleaved_medians({name: counted(name) for name in variants}, repeats=args.repeats, warmup=1)
        profiles = {name: profiled(getattr(table, name)) for name in args.profile.split(",") if name}
    for name, timing in times.items():
        timing["tokens"] = tokens[name][-args.repeats:]
        per_token = sorted(t / n for t, n in zip(timing["times_s"], timing["tokens"]))
        timing["median_s_per_token"] = per_token[len(per_token) // 2]
    shape = {"model": "smollm2-135m-instruct", "prompts": "GSM8K test, zero-shot chat template", "dtype": args.dtype,
             "num_prompts": args.prompts, "num_samples": args.samples, "max_new_tokens": args.new_tokens,
             "temperature": 1.0, "repeats": args.repeats, "vllm_enforce_eager": args.vllm_eager,
             "trl_build": args.trl_build, "trl_build_first": args.trl_build_first}
    name = args.out or ("vllm_engine_overhead" + ("" if args.dtype == "float32" else "_bf16") +
                        ("_quick" if args.quick else ""))
    write_results(name, {"shape": shape, "variants": times, "profiles": profiles, "build_s": engine.build_seconds,
                         "load_average": {"before": load_before, "after": os.getloadavg()}})
    ours = times["ours"]
    print_table(f"vLLM calls on one engine, SmolLM2-135M {args.dtype}, {args.prompts} x {args.samples}, up to "
                f"{args.new_tokens} tokens (medians of {args.repeats})",
                ["variant", "time s", "ms/token", "time / ours", "per token / ours"],
                [[n, t["median_s"], t["median_s_per_token"] * 1e3, t["median_s"] / ours["median_s"],
                  t["median_s_per_token"] / ours["median_s_per_token"]] for n, t in times.items()])
    for variant, rows in profiles.items():
        print_table(f"cProfile of one {variant} call (own time)", ["function", "calls", "own s", "cumulative s"],
                    [[r["function"], r["calls"], r["own_s"], r["cumulative_s"]] for r in rows[:15]])


if __name__ == "__main__":
    main()
