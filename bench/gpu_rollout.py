"""Rollout measurements on a GPU (issue 9), called by bench/gpu.py: ``run(results, budget_s)``.

For the Qwen2-0.5B and Qwen2-7B shapes (random init, bfloat16, built on the GPU), 8 prompts x G=8,
prompt 512, temperature 1, every completion running the full length (no stop token):

* ``hf_dynamic``: ``model.generate`` with each prompt repeated G times (its dynamic cache);
* ``hf_static_compiled``: the same with ``cache_implementation="static"``, with which transformers
  compiles the decoding forward itself (its first, compiling run is a warm-up, not timed);
* ``turbogrpo`` / ``turbogrpo_compiled`` / ``turbogrpo_cudagraph`` / ``turbogrpo_compiled-cudagraph``:
  ``turbogrpo.rollout.generate`` with the device's default schedule and each plain-step runner
  (``turbogrpo.rollout.compiled.PLAIN_RUNNERS``: eager, inductor, CUDA-graph replay of the eager or of
  the compiled step). The CUDA default runner is to be set from these numbers (not yet measured);
* ``step_ms_B64``: one plain decoding step of 64 live sequences under each runner, from the engine's
  own ``PlainStep``;
* ``latency_curve``: ``turbogrpo.speculative.profile_latency`` (seconds per forward vs tokens).

Without CUDA it records why it skipped and returns. Items run in priority order; one that would start
with under 15 s of ``budget_s`` left is listed under "skipped" instead, one that fails under "failed".
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
GRAPH_RUNNERS = ("compiled", "cudagraph", "compiled-cudagraph")  # plain-step runners measured against eager


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
    from turbogrpo.rollout.decode import DecodeSchedule, default_schedule

    base = default_schedule(torch.device("cuda"))
    schedule = DecodeSchedule(base.host_check_every, base.buckets, runner)
    rollout = generate(model, prompts, num_samples=NUM_SAMPLES, seed=0, schedule=schedule,
                       sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=1.0))
    assert rollout.stats.num_generated_tokens == NUM_PROMPTS * NUM_SAMPLES * new_tokens


def step_ms(model, prompts: list[torch.Tensor], runner: str, num_steps: int = 32) -> float:
    """Milliseconds per plain decoding step with 64 live sequences (the engine's own step)."""
    from turbogrpo.rollout import SamplingConfig
    from turbogrpo.rollout.compiled import PLAIN_RUNNERS
    from turbogrpo.rollout.decode import first_draw
    from turbogrpo.rollout.step import PlainStep, plain_step

    max_new = 2 * num_steps + 8
    sampling = SamplingConfig(max_new_tokens=max_new)
    generator = torch.Generator(device="cuda").manual_seed(0)
    step = PlainStep(PLAIN_RUNNERS[runner](plain_step))
    with torch.no_grad():
        state = first_draw(model, prompts, NUM_SAMPLES, sampling, generator, False,
                            [max_new] * (len(prompts) * NUM_SAMPLES), 0, static_slots=runner != "eager")
        for _ in range(num_steps // 2):  # warm-up (and compilation)
            step(state)
        seconds = timed(lambda: [step(state) for _ in range(num_steps)])
    return 1000 * seconds / num_steps


def run(results: dict, budget_s: float) -> None:
    """Add the rollout GPU measurements to ``results`` (bench/gpu.py's part dict) within about
    ``budget_s`` seconds: the cheap, most telling items first, compiled contenders last."""
    if not torch.cuda.is_available():
        results.update(status="skipped", reason="no CUDA device")
        print("rollout: skipped (no CUDA device)")
        return
    deadline = time.perf_counter() + budget_s
    results["device"] = torch.cuda.get_device_name()
    results["shapes"] = {name: {"config": shape, "num_prompts": NUM_PROMPTS, "num_samples": NUM_SAMPLES,
                                "prompt_len": PROMPT_LEN, "seconds": {}} for name, shape in SHAPES.items()}
    models: dict = {}

    def model_and_prompts(name: str):
        if name not in models:
            shape = SHAPES[name]
            generator = torch.Generator(device="cuda").manual_seed(0)
            models[name] = (build_model(shape), [torch.randint(shape["vocab_size"], (PROMPT_LEN,), device="cuda",
                                                               generator=generator) for _ in range(NUM_PROMPTS)])
        return models[name]

    def rollout_item(name: str, contender: str):
        def measure():
            model, prompts = model_and_prompts(name)
            new = SHAPES[name]["new_tokens"]
            work = {"hf_dynamic": lambda: hf_generate(model, prompts, new, static=False),
                    "hf_static_compiled": lambda: hf_generate(model, prompts, new, static=True),
                    "turbogrpo": lambda: ours_generate(model, prompts, new, "eager"),
                    **{f"turbogrpo_{runner}": (lambda runner=runner: ours_generate(model, prompts, new, runner))
                       for runner in GRAPH_RUNNERS}}[contender]
            timed(work)  # warm-up: allocations, kernel selection, compilation
            results["shapes"][name]["seconds"][contender] = timed(work)
        return measure

    def step_item(name: str, runner: str):
        def measure():
            model, prompts = model_and_prompts(name)
            results["shapes"][name].setdefault("step_ms_B64", {})[runner] = step_ms(model, prompts, runner)
        return measure

    def curve_item(name: str):
        def measure():
            from turbogrpo.speculative import profile_latency

            model, _ = model_and_prompts(name)
            context = PROMPT_LEN + SHAPES[name]["new_tokens"] // 2
            curve = profile_latency(model, context_length=context, max_tokens=1024, repeats=3).verify
            results["shapes"][name]["latency_curve"] = {"num_tokens": list(curve.num_tokens),
                                                        "seconds": list(curve.seconds), "knee_tokens": curve.knee()}
        return measure

    small, large = SHAPES
    items = [(f"{small} hf_dynamic", rollout_item(small, "hf_dynamic")),
             (f"{small} turbogrpo", rollout_item(small, "turbogrpo")),
             (f"{small} step eager", step_item(small, "eager")),
             (f"{large} hf_dynamic", rollout_item(large, "hf_dynamic")),
             (f"{large} turbogrpo", rollout_item(large, "turbogrpo")),
             (f"{small} latency curve", curve_item(small)),
             (f"{small} hf_static_compiled", rollout_item(small, "hf_static_compiled")),
             (f"{small} step cudagraph", step_item(small, "cudagraph")),
             (f"{small} turbogrpo_cudagraph", rollout_item(small, "turbogrpo_cudagraph")),
             (f"{small} step compiled", step_item(small, "compiled")),
             (f"{small} turbogrpo_compiled", rollout_item(small, "turbogrpo_compiled")),
             (f"{small} step compiled-cudagraph", step_item(small, "compiled-cudagraph")),
             (f"{small} turbogrpo_compiled-cudagraph", rollout_item(small, "turbogrpo_compiled-cudagraph")),
             (f"{large} turbogrpo_cudagraph", rollout_item(large, "turbogrpo_cudagraph"))]
    results["skipped"], results["failed"] = [], {}
    for label, measure in items:
        if time.perf_counter() > deadline - 15:
            results["skipped"].append(label)
            continue
        try:
            measure()
            print(f"rollout: {label} done", flush=True)
        except Exception as error:  # a failing item is recorded; the others still run
            results["failed"][label] = f"{type(error).__name__}: {error}"[:300]
            print(f"rollout: {label} failed: {results['failed'][label]}", flush=True)
    for entry in results["shapes"].values():
        seconds = entry["seconds"]
        for ours in ("turbogrpo", *(f"turbogrpo_{runner}" for runner in GRAPH_RUNNERS)):
            for baseline in ("hf_dynamic", "hf_static_compiled"):
                if ours in seconds and baseline in seconds:
                    entry[f"speedup_{ours}_vs_{baseline}"] = seconds[baseline] / seconds[ours]
    models.clear()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    out: dict = {}
    run(out, budget_s=float(sys.argv[1]) if len(sys.argv) > 1 else 105.0)
    print(json.dumps(out, indent=1))
