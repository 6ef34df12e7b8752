"""One compiled decoding step with its attention parts chosen in different ways, timed on one shared state (issue 54,
4d): SmolLM2-135M-Instruct, GSM8K zero-shot chat prompts, T = 1, the ``compiled-onednn`` runner.

A variant sets the choices the step's graph is traced with (``VARIANTS``); each variant compiles its own graphs (its
own copy of ``plain_step``'s code). Per dtype and live batch B (min(B, 8) prompts x the rest as samples, every row
live: no stop token), one state is prefilled and decoded ``--after-steps`` untimed steps (the variants taking turns,
so each has compiled its bucket), then the variants take turns ``--repeats`` times, each decoding ``--steps`` steps
of that same state a timed call: every variant reads the same K/V, as many slots in use, the same weights.

    before-kernel   the own-completion part by inductor's reduced form, the prompt part by CPU flash attention
                    (the compiled step before ``rollout.cpu_attention``)
    own-kernel      the own part by the CPU kernel from ``attention.KERNEL_ITEMS`` (row, KV head) products, the
                    prompt part by flash
    kernel          the own part as own-kernel, the prompt part by the kernel (``attention.prompt_attention_for``)
    kernel-cpp-wrapper  kernel, compiled with inductor's C++ wrapper (``cpp_wrapper``)

    python bench/step_variants.py                       # both dtypes, B = 16 and 64, after 120 steps; ~25 min
    python bench/step_variants.py --dtypes bfloat16 --batches 64 --variants own-kernel,kernel
    python bench/step_variants.py --batches 1,4 --variants kernel,kernel-cpp-wrapper --out step_variants_cpp_wrapper
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402

from turbogrpo.rollout import SamplingConfig, attention, plans  # noqa: E402
from turbogrpo.rollout.compiled import PLAIN_RUNNERS, runner_scope  # noqa: E402
from turbogrpo.rollout.decode import DecodeSchedule, first_draw, rollout_linear_kernel  # noqa: E402
from turbogrpo.rollout.step import PlainStep, plain_step  # noqa: E402

RUNNER = "compiled-onednn"
NEVER = {torch.float32: 10**9, torch.bfloat16: 10**9}


def flash_prompt(device: torch.device, may_hide_all: bool):
    """The prompt part's choice before the kernel took it: ``partial_attention_for``'s, compiled or not."""
    return attention.partial_attention_for(device, may_hide_all)


@contextlib.contextmanager
def choices(kernel_items: dict, prompt_choice):
    """While tracing (and running) a variant: ``attention.KERNEL_ITEMS`` and the plans' prompt-part choice."""
    saved = attention.KERNEL_ITEMS, plans.prompt_attention_for
    attention.KERNEL_ITEMS, plans.prompt_attention_for = kernel_items, prompt_choice
    try:
        yield
    finally:
        attention.KERNEL_ITEMS, plans.prompt_attention_for = saved


@contextlib.contextmanager
def cpp_wrapper():
    """The kernel variant with inductor's C++ wrapper: the graph's kernels called from compiled C++ instead of a
    Python function (what a step of few rows, where calls cost more than work, might save)."""
    import torch._inductor.config as inductor_config
    with choices(attention.KERNEL_ITEMS, attention.prompt_attention_for), inductor_config.patch(cpp_wrapper=True):
        yield


VARIANTS = {
    "before-kernel": lambda: choices(NEVER, flash_prompt),
    "own-kernel": lambda: choices(attention.KERNEL_ITEMS, flash_prompt),
    "kernel": lambda: choices(attention.KERNEL_ITEMS, attention.prompt_attention_for),
    "kernel-cpp-wrapper": cpp_wrapper,
}
"""Name -> the context its step is traced and run in."""


def own_step(name: str) -> PlainStep:
    """The compiled-onednn plain step over a copy of ``plain_step``'s code named for ``name``: dynamo keeps each
    code object's graphs apart, so variants never share (or evict) one another's."""
    code = plain_step.__code__.replace(co_name=f"plain_step_{name.replace('-', '_')}")
    function = types.FunctionType(code, plain_step.__globals__, code.co_name, plain_step.__defaults__,
                                  plain_step.__closure__)
    return PlainStep(PLAIN_RUNNERS[RUNNER](function))


class Variant:
    """A variant's step, called ``steps`` times on the shared state at a time."""

    def __init__(self, name: str, shared: dict, steps: int):
        self.name, self.shared, self.steps, self.step = name, shared, steps, own_step(name)

    def __call__(self) -> None:
        with VARIANTS[self.name](), runner_scope(RUNNER):
            for _ in range(self.steps):
                self.step(self.shared["state"])


def bench_dtype(dtype: torch.dtype, batches: list[int], names: list[str], new_tokens: int, steps: int, repeats: int,
                after_steps: int) -> dict:
    model, tokenizer = load_real_model()
    model = model.to(dtype)
    record = {"dtype": str(dtype).removeprefix("torch."), "batches": {}}
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    with torch.no_grad(), rollout_linear_kernel(DecodeSchedule(runner=RUNNER))([model]):
        for batch in batches:
            num_prompts = min(batch, 8)
            prompts = chat_prompts(tokenizer, num_prompts, few_shot=False)
            shared = {"state": first_draw(model, prompts, batch // num_prompts, sampling,
                                          torch.Generator().manual_seed(0), False, [new_tokens] * batch, 0,
                                          static_slots=True, slot_block=DecodeSchedule(runner=RUNNER).slot_block)}
            variants = {name: Variant(name, shared, 1) for name in names}
            for _ in range(after_steps // len(names)):  # untimed; each variant compiles its bucket here
                for variant in variants.values():
                    variant()
            for variant in variants.values():
                variant.steps = steps
            slots_before = int(shared["state"].cache.lengths_B.max())
            times = interleaved_medians(variants, repeats=repeats, warmup=0)
            base = times[names[0]]["median_s"]
            record["batches"][str(batch)] = {
                "prompts": num_prompts, "samples": batch // num_prompts, "prompt_tokens": [p.numel() for p in prompts],
                "slots_in_use": [slots_before, int(shared["state"].cache.lengths_B.max())],
                "variants": {name: {**timing, "step_s": timing["median_s"] / steps,
                                    f"speedup_over_{names[0]}": base / timing["median_s"]}
                             for name, timing in times.items()}}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}; the first is "
                        "the baseline of the speedups")
    parser.add_argument("--new-tokens", type=int, default=320, help="the state's capacity")
    parser.add_argument("--after-steps", type=int, default=120)
    parser.add_argument("--steps", type=int, default=4, help="decoding steps per timed call")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="step_variants")
    args = parser.parse_args()
    names = args.variants.split(",")
    if not set(names) <= set(VARIANTS) or len(names) < 2:
        parser.error(f"--variants: two or more of {', '.join(VARIANTS)}")
    if args.after_steps + args.repeats * args.steps * len(names) + 1 >= args.new_tokens:
        parser.error("--new-tokens must hold the untimed and the timed steps")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 or (b > 8 and b % 8) for b in batches):
        parser.error("--batches: each 1-8, or a multiple of 8 (8 prompts x samples)")
    shape = {"model": "smollm2-135m-instruct", "prompts": "GSM8K test, zero-shot chat template", "temperature": 1.0,
             "runner": RUNNER, "batches": batches, "capacity_tokens": args.new_tokens, "after_steps": args.after_steps,
             "steps_per_call": args.steps, "repeats": args.repeats, "variants": names}
    load_before, records = os.getloadavg(), []
    for dtype in args.dtypes.split(","):
        records.append(bench_dtype(getattr(torch, dtype), batches, names, args.new_tokens, args.steps, args.repeats,
                                   args.after_steps))
        write_results(args.out, {"shape": shape, "results": records,
                                 "load_average": {"before": load_before, "after": os.getloadavg()}})
    print_table(f"One compiled-onednn step, variants on one state (medians of {args.repeats} x {args.steps} steps)",
                ["dtype", "B", "slots", "variant", "ms/step", f"{names[0]} / this"],
                [[r["dtype"], int(b), "-".join(map(str, e["slots_in_use"])), name, v["step_s"] * 1e3,
                  v[f"speedup_over_{names[0]}"]] for r in records for b, e in r["batches"].items()
                 for name, v in e["variants"].items()])


if __name__ == "__main__":
    main()
