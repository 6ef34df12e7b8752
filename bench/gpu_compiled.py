"""The compiled decoding step and speculation on a GPU (issue 54), called by bench/gpu.py: ``run(results, budget_s)``.

SmolLM2-135M-Instruct (the packaged model where this machine has it, else a random model of its shape:
``gpu_vllm.load_policy``), bfloat16, arithmetic prompts under its chat template:

* ``step_ms``: one plain decoding step at live batches 1, 4, 16 and 64 (min(B, 8) prompts x the rest as
  samples) under each plain-step runner (eager, compiled: one static graph per bucket, compiled-cudagraph),
  each from its own prefilled state (``compiled_step.Contender``), with each compiled bucket's first-call
  seconds (the compile) apart;
* ``rollout_s``: 8 prompts x G = 8, 256 new tokens at T = 1 (no stop): plain eager, plain compiled, and
  speculative (a draft of layout "eagle" trained within ``draft_seconds`` on the policy's own completions,
  ``gpu_vllm.train_eagle_draft``; the cost sizing) with the tree step's parts eager and compiled, with the
  tokens accepted per verification; and the same greedy (speculative greedy equals plain greedy, checked).

Items run in order while the budget lasts; one that would start with too little left is listed under
"skipped", one that fails under "failed".

``python bench/gpu_compiled.py --quick`` runs the same code on the CPU with the demo model (float32, B = 1 and 2,
2 prompts x 2, 8 tokens, the "dynamo" runner in place of inductor), a smoke test of this script, and writes
bench/results/gpu_compiled_quick.json (git-ignored).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_step import Contender  # noqa: E402
from gpu_vllm import FULL, QUICK, load_policy, prompts_of, timed, train_eagle_draft  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    batches: tuple[int, ...]
    runners: tuple[str, ...]
    tree_runners: tuple[str, ...]
    steps: int


FULL_SHAPES = Shapes((1, 4, 16, 64), ("eager", "compiled", "compiled-cudagraph"), ("eager", "compiled"), 16)
QUICK_SHAPES = Shapes((1, 2), ("eager", "dynamo"), ("eager", "dynamo"), 2)


def run(results: dict, budget_s: float, quick: bool = False) -> None:
    """Fill ``results`` with the measurements of the module docstring, or why they were skipped."""
    setting, shapes = (QUICK, QUICK_SHAPES) if quick else (FULL, FULL_SHAPES)
    if setting.device == "cuda" and not torch.cuda.is_available():
        results.update(status="skipped", reason="no CUDA device")
        return
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.rollout.decode import DecodeSchedule, default_schedule
    from turbogrpo.speculative import Speculation

    deadline = time.perf_counter() + budget_s
    device = setting.device
    model, tokenizer, weights = load_policy(setting, quick)
    prompts = prompts_of(tokenizer, model.config.vocab_size, max(8, setting.num_prompts), 0, device)
    results.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (--quick: no GPU number)",
                   torch=torch.__version__, weights=weights, dtype=str(setting.dtype).removeprefix("torch."),
                   step_ms={}, compile_s={}, rollout_s={}, accepted_per_verification={}, skipped=[], failed={})
    state: dict = {}
    base = default_schedule(torch.device(device))

    def step_item(batch: int, runner: str):
        def measure():
            num_prompts = min(batch, 8)
            contender = Contender(runner, model, prompts[:num_prompts], batch // num_prompts, 4 * shapes.steps + 8,
                                  shapes.steps)
            contender.fresh_state()
            first, _ = timed(device, lambda: contender.step(contender.state))
            contender.left -= 1
            seconds, _ = timed(device, contender)
            results["step_ms"].setdefault(str(batch), {})[runner] = 1e3 * seconds / shapes.steps
            if runner != "eager":
                results["compile_s"].setdefault(str(batch), {})[runner] = first
        return measure

    def rollout_item(name: str, temperature: float, runner: str, speculate: bool):
        def measure():
            sampling = SamplingConfig(max_new_tokens=setting.new_tokens, temperature=temperature)
            schedule = DecodeSchedule(base.host_check_every, "pow2", runner if not speculate else "eager")
            draft = Speculation(state["draft"], runner=runner) if speculate else None
            work = lambda: generate(model, prompts[:setting.num_prompts], num_samples=setting.num_samples,  # noqa: E731
                                    sampling=sampling, seed=0, schedule=schedule, draft=draft)
            timed(device, work)  # warm-up: compiles, the latency profile
            seconds, rollout = timed(device, work)
            results["rollout_s"][name] = seconds
            if speculate:
                results["accepted_per_verification"][name] = rollout.stats.mean_accepted_length
            state[name] = [t.tolist() for t in rollout.tokens]
        return measure

    def draft():
        train_prompts = prompts_of(tokenizer, model.config.vocab_size, setting.num_prompts, 1, device)
        seconds, (trained, info) = timed(device, lambda: train_eagle_draft(model, train_prompts, setting))
        state["draft"] = trained
        results["draft"] = {"seconds": seconds, **info}

    items = [(f"step B={b} {r}", step_item(b, r)) for r in shapes.runners for b in shapes.batches
             if r != "compiled-cudagraph" or device == "cuda"]
    items += [(f"plain {r} T=1", rollout_item(f"plain_{r}", 1.0, r, False)) for r in shapes.runners[:2]]
    items += [("draft", draft)]
    items += [(f"speculative {r} T=1", rollout_item(f"speculative_{r}", 1.0, r, True)) for r in shapes.tree_runners]
    items += [("plain eager greedy", rollout_item("plain_eager_greedy", 0.0, "eager", False)),
              ("speculative eager greedy", rollout_item("speculative_eager_greedy", 0.0, "eager", True))]
    for label, measure in items:
        if time.perf_counter() > deadline - setting.min_item_s:
            results["skipped"].append(label)
            continue
        try:
            with torch.no_grad():  # as a rollout runs (a step traced with grad mode on is another graph)
                measure()
            print(f"[compiled] {label} done", flush=True)
        except Exception as error:  # a failing item is recorded; the others still run
            results["failed"][label] = f"{type(error).__name__}: {error}"[:300]
            print(f"[compiled] {label} failed: {results['failed'][label]}", flush=True)
    if "plain_eager_greedy" in state and "speculative_eager_greedy" in state:
        results["speculative_greedy_equals_plain"] = state["plain_eager_greedy"] == state["speculative_eager_greedy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CPU smoke form (demo model, no GPU number)")
    parser.add_argument("--budget", type=float, default=150.0)
    args = parser.parse_args()
    from harness import write_results
    results: dict = {}
    run(results, args.budget, quick=args.quick)
    write_results("gpu_compiled_quick" if args.quick else "gpu_compiled", results)


if __name__ == "__main__":
    main()
