"""The vLLM engine's weight push after an optimizer step (issue 44 part 2 and 7c), full fine-tune against LoRA, on
SmolLM2-135M-Instruct in float32: what the step pays (``time/weight_push``) besides the rollout.

Each push is what the step does after its optimizer step (``VllmEngine.push_weights``): the changed modules'
checkpoint tensors (LoRA: the adapted projections with ``W + B A * scale`` merged, sent with the rest of their
fused vLLM layer), vLLM's in-place reload re-running each layer's post-processing (on the CPU, oneDNN packing),
the tied LM head packed again, the prefix cache emptied. Before each timed push the trainable parameters are
nudged, as an optimizer step would, and after the last one vLLM's greedy completions are checked against the
native engine's on the pushed weights (the push is exact, not just fast).

    python bench/vllm_push.py              # full and LoRA (r = 16, every linear), 5 pushes each
    python bench/vllm_push.py --quick      # smoke: 2 pushes each
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402

from turbogrpo.config import LoraConfig  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.engines.vllm import VllmEngine  # noqa: E402
from turbogrpo.engines.weights import checkpoint_weights  # noqa: E402


def with_lora(model, lora: LoraConfig):
    """``model`` with peft adapters as turbogrpo's [lora] section builds them, B non-zero (a trained adapter)."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    policy = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                  target_modules=lora.target_modules))
    nudge(policy)
    return policy


@torch.no_grad()
def nudge(policy, scale: float = 1e-3) -> None:
    """A stand-in for an optimizer step: every trainable parameter moves a little."""
    for param in policy.parameters():
        if param.requires_grad:
            param.add_(torch.randn_like(param) * scale)


def time_pushes(engine: VllmEngine, policy, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        nudge(policy)
        start = time.perf_counter()
        engine.push_weights(policy)
        times.append(time.perf_counter() - start)
    return times


def greedy_equal(engine: VllmEngine, policy, prompts, new_tokens: int) -> tuple[int, int]:
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)
    ours = engine.sample(policy, prompts, num_samples=1, sampling=greedy, seed=0).tokens
    native = generate(policy, prompts, num_samples=1, sampling=greedy, seed=0).tokens
    return sum(a.tolist() == b.tolist() for a, b in zip(ours, native)), len(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke: 2 pushes each, 4 greedy tokens")
    args = parser.parse_args()
    repeats, new_tokens = (2, 4) if args.quick else (args.repeats, 32)
    model, tokenizer = load_real_model()
    prompts = chat_prompts(tokenizer, 4, few_shot=False)
    lora = LoraConfig(enabled=True)
    variants = {}
    for name in ("full", "lora"):
        policy = model if name == "full" else with_lora(model, lora)  # LoRA last: peft adapts the model in place
        engine = VllmEngine(torch.float32, torch.device("cpu"), tokenizer)
        engine.build(policy)
        times = time_pushes(engine, policy, repeats)
        equal, compared = greedy_equal(engine, policy, prompts, new_tokens)
        sent = sum(t.numel() for t in checkpoint_weights(policy, engine.pushed).values())
        variants[name] = {"push_s_median": statistics.median(times), "push_s": times, "modules_sent": len(engine.pushed),
                          "parameters_sent": sent, "build_s": engine.build_seconds,
                          "greedy_equal_after_push": equal, "greedy_compared": compared}
        del engine
    shape = {"model": "smollm2-135m-instruct", "dtype": "float32", "repeats": repeats,
             "lora": {"r": lora.r, "alpha": lora.alpha, "target_modules": lora.target_modules}}
    table = print_table("vLLM weight push after an optimizer step, SmolLM2-135M, float32",
                        ["variant", "push s (median)", "modules", "parameters sent", "greedy equal"],
                        [[name, v["push_s_median"], v["modules_sent"], v["parameters_sent"],
                          f"{v['greedy_equal_after_push']}/{v['greedy_compared']}"] for name, v in variants.items()])
    write_results("vllm_push_quick" if args.quick else "vllm_push", {"shape": shape, "variants": variants,
                                                                      "table": table})


if __name__ == "__main__":
    main()
