"""Rollout measurements on a GPU (issue 9), called by bench/gpu.py: ``run(results, budget_s)``.

For the Qwen2-0.5B and Qwen2-7B shapes (random init, bfloat16, built on the GPU), 8 prompts x G=8,
prompt 512, temperature 1, every completion running the full length (no stop token):

* ``hf_dynamic``: ``model.generate`` with each prompt repeated G times (its dynamic cache);
* ``hf_static_compiled``: the same with ``cache_implementation="static"``, with which transformers
  compiles the decoding forward itself (its first, compiling run is a warm-up, not timed);
* ``turbogrpo`` / ``turbogrpo_compiled``: ``turbogrpo.rollout.generate`` with the device's default
  schedule, eager and with ``DecodeSchedule(runner="compiled")``;
* ``step_ms_B64``: one plain decoding step of 64 live sequences (eager and compiled), from the
  engine's own ``PlainStep``;
* ``latency_curve``: ``turbogrpo.speculative.profile_latency`` (seconds per forward vs tokens).

Without CUDA it records why it skipped and returns. Each item checks the time left in ``budget_s``
before it starts and records "skipped: budget" instead of overrunning.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, new_tokens=256),
    "qwen2-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, new_tokens=128),
}
NUM_PROMPTS, NUM_SAMPLES, PROMPT_LEN = 8, 8, 512


def build_model(shape: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in shape.items() if k != "new_tokens"}, max_position_embeddings=4096,
                         torch_dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    return model


def timed(work: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_generate(model, prompts: list[torch.Tensor], new_tokens: int, static: bool) -> None:
    input_ids = torch.stack(prompts).repeat_interleave(NUM_SAMPLES, dim=0)
    extra = {"cache_implementation": "static"} if static else {}
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0, **extra)
    assert out.shape == (NUM_PROMPTS * NUM_SAMPLES, PROMPT_LEN + new_tokens), out.shape


def ours_generate(model, prompts: list[torch.Tensor], new_tokens: int, runner: str) -> None:
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.rollout.engine import DecodeSchedule, default_schedule

    base = default_schedule(torch.device("cuda"))
    schedule = DecodeSchedule(base.host_check_every, base.buckets, runner)
    rollout = generate(model, prompts, num_samples=NUM_SAMPLES, seed=0, schedule=schedule,
                       sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=1.0))
    assert rollout.stats.num_generated_tokens == NUM_PROMPTS * NUM_SAMPLES * new_tokens


def step_ms(model, prompts: list[torch.Tensor], runner: str, num_steps: int = 32) -> float:
    """Milliseconds per plain decoding step with 64 live sequences (the engine's own step)."""
    from turbogrpo.rollout import SamplingConfig
    from turbogrpo.rollout.compiled import RUNNERS
    from turbogrpo.rollout.engine import first_draw
    from turbogrpo.rollout.step import PlainStep

    max_new = 2 * num_steps + 8
    sampling = SamplingConfig(max_new_tokens=max_new)
    generator = torch.Generator(device="cuda").manual_seed(0)
    step = PlainStep(RUNNERS[runner]())
    with torch.no_grad():
        state = first_draw(model, prompts, NUM_SAMPLES, sampling, generator, False,
                            [max_new] * (len(prompts) * NUM_SAMPLES), 0, static_slots=runner != "eager")
        for _ in range(num_steps // 2):  # warm-up (and compilation)
            step(state)
        seconds = timed(lambda: [step(state) for _ in range(num_steps)])
    return 1000 * seconds / num_steps


def run(results: dict, budget_s: float) -> None:
    """Add the rollout GPU measurements to ``results["rollout"]`` within about ``budget_s`` seconds."""
    record: dict = {}
    results["rollout"] = record
    if not torch.cuda.is_available():
        record["skipped"] = "no CUDA device"
        print("rollout: skipped (no CUDA device)")
        return
    deadline = time.perf_counter() + budget_s
    record["device"] = torch.cuda.get_device_name()
    record["shapes"] = {}
    for name, shape in SHAPES.items():
        entry: dict = {"config": shape, "num_prompts": NUM_PROMPTS, "num_samples": NUM_SAMPLES,
                       "prompt_len": PROMPT_LEN}
        record["shapes"][name] = entry
        if time.perf_counter() > deadline - 30:
            entry["skipped"] = "budget"
            continue
        model = build_model(shape)
        generator = torch.Generator(device="cuda").manual_seed(0)
        prompts = [torch.randint(shape["vocab_size"], (PROMPT_LEN,), device="cuda", generator=generator)
                   for _ in range(NUM_PROMPTS)]
        new = shape["new_tokens"]
        contenders = {
            "hf_dynamic": lambda: hf_generate(model, prompts, new, static=False),
            "turbogrpo": lambda: ours_generate(model, prompts, new, "eager"),
            "hf_static_compiled": lambda: hf_generate(model, prompts, new, static=True),
            "turbogrpo_compiled": lambda: ours_generate(model, prompts, new, "compiled"),
        }
        seconds: dict = {}
        for contender, work in contenders.items():
            if time.perf_counter() > deadline - 20:
                seconds[contender] = "skipped: budget"
                continue
            try:
                timed(work)  # warm-up: allocations, kernel selection, compilation
                seconds[contender] = min(timed(work) for _ in range(2))
            except Exception as error:  # a contender that fails is recorded, not fatal to the bench
                seconds[contender] = f"failed: {type(error).__name__}: {error}"[:300]
            print(f"rollout {name} {contender}: {seconds[contender]}", flush=True)
        entry["seconds"] = seconds
        for contender in ("turbogrpo", "turbogrpo_compiled"):
            for baseline in ("hf_dynamic", "hf_static_compiled"):
                ours, theirs = seconds.get(contender), seconds.get(baseline)
                if isinstance(ours, float) and isinstance(theirs, float):
                    entry[f"speedup_{contender}_vs_{baseline}"] = theirs / ours
        if time.perf_counter() < deadline - 30:
            entry["step_ms_B64"] = {}
            for runner in ("eager", "compiled"):
                try:
                    entry["step_ms_B64"][runner] = step_ms(model, prompts, runner)
                except Exception as error:
                    entry["step_ms_B64"][runner] = f"failed: {type(error).__name__}: {error}"[:300]
            print(f"rollout {name} step at B=64 (ms): {entry['step_ms_B64']}", flush=True)
        if name == "qwen2-0.5b" and time.perf_counter() < deadline - 40:
            from turbogrpo.speculative import profile_latency

            curve = profile_latency(model, context_length=PROMPT_LEN + new // 2, max_tokens=1024, repeats=3).verify
            entry["latency_curve"] = {"num_tokens": list(curve.num_tokens), "seconds": list(curve.seconds),
                                      "knee_tokens": curve.knee()}
            print(f"rollout {name} latency knee: {curve.knee()} tokens", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    out: dict = {}
    run(out, budget_s=float(sys.argv[1]) if len(sys.argv) > 1 else 240.0)
    print(json.dumps(out, indent=1))
