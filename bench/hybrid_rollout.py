"""Issue 53 part 6 (c): rollout of a Qwen3.5-shaped hybrid, turbogrpo's native engine against HF ``generate``.

K prompts x G samples, up to N new tokens at T = 1, stopping at EOS / end of turn, alternated run by run in one
process (``harness.interleaved_medians``), with vLLM's engine beside them where vLLM serves the model type
(``turbogrpo.engines.VLLM_HYBRIDS``). Two models (``--model``):

    bench         bench/hybrid_prefix.py's hybrid at SmolLM2-135M's size, RANDOM weights, SmolLM2's GSM8K chat
                  prompts (zero-shot); random weights rarely draw a stop token, so most samples run N tokens:
                  the table gives time per generated token too
    demo-hybrid   the shipped hybrid demo model (turbogrpo/assets/demo_hybrid_model, 1.8M parameters) on the
                  demo's arithmetic prompts: trained, it stops at EOS after ~20 tokens

HF ``generate`` gets the prompts left-padded and repeated G times (TRL without vLLM; bench/vllm_rollout.py's
``hf_generate``). Before timing, the native engine's greedy completions are compared with HF's (equal, or where
they first differ).

    python bench/hybrid_rollout.py                        # bench model, 8 x 8, up to 256 tokens, 3 repeats
    python bench/hybrid_rollout.py --model demo-hybrid    # the demo hybrid, 8 x 8, up to 256 tokens
    python bench/hybrid_rollout.py --quick                # smoke run: tiny hybrid, 2 x 2, 8 tokens, 1 repeat
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from hybrid_prefix import HYBRID_MODEL, QUICK_MODEL, hybrid_model  # noqa: E402
from vllm_rollout import hf_generate, stop_ids  # noqa: E402

from turbogrpo.engines import engine_refusal  # noqa: E402
from turbogrpo.engines.vllm import VllmEngine  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402


def bench_setting(num_prompts: int):
    """(model, tokenizer or None, prompts, stop ids, pad id) of the random SmolLM2-size hybrid."""
    from real_model import chat_prompts, load_real_model
    _, tokenizer = load_real_model()
    return (hybrid_model(HYBRID_MODEL).eval(), tokenizer, chat_prompts(tokenizer, num_prompts, few_shot=False),
            stop_ids(tokenizer), tokenizer.pad_token_id)


def demo_hybrid_setting(num_prompts: int):
    """The same of the shipped hybrid demo model on the demo task's held-out prompts."""
    from turbogrpo.data.arithmetic import generate_problems
    from turbogrpo.models import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer("demo-hybrid")
    prompts = [torch.tensor(tokenizer(p.prompt)["input_ids"]) for p in generate_problems("eval", num_prompts, seed=0)]
    return model.eval(), tokenizer, prompts, (tokenizer.eos_token_id,), tokenizer.pad_token_id


def quick_setting(num_prompts: int):
    """A tiny random hybrid on random prompts, its last id the stop id."""
    model = hybrid_model(QUICK_MODEL).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (12 + 5 * k,), generator=generator) for k in range(num_prompts)]
    return model, None, prompts, (vocab - 1,), 0


SETTINGS = {"bench": bench_setting, "demo-hybrid": demo_hybrid_setting, "quick": quick_setting}


def greedy_agreement(model, prompts, stops, pad_id: int, new_tokens: int) -> dict:
    """Native greedy completions against HF greedy ``generate`` (to the first stop id, kept)."""
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=stops)
    native = generate(model, prompts, num_samples=1, sampling=sampling, seed=0).tokens
    hf = []
    for prompt in prompts:   # one at a time: no padding, HF's own greedy path
        out = model.generate(prompt[None], do_sample=False, max_new_tokens=new_tokens, eos_token_id=list(stops),
                             pad_token_id=pad_id)[0, prompt.numel():].tolist()
        hf.append(out[:next((i + 1 for i, t in enumerate(out) if t in stops), len(out))])
    differ = [next((i for i, (x, y) in enumerate(zip(a.tolist(), b)) if x != y), min(len(a), len(b)))
              for a, b in zip(native, hf) if a.tolist() != b]
    return {"greedy_equal": len(prompts) - len(differ), "greedy_compared": len(prompts), "first_differences": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bench", "demo-hybrid"], default="bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny hybrid, 2 x 2, 8 tokens, 1 repeat")
    args = parser.parse_args()
    setting = "quick" if args.quick else args.model
    if args.quick:
        args.prompts, args.samples, args.new_tokens, args.repeats = 2, 2, 8, 1
    model, tokenizer, prompts, stops, pad_id = SETTINGS[setting](args.prompts)
    model_type = model.config.model_type
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stops)
    tokens: dict[str, list[int]] = {}
    seeds = iter(range(10_000))

    def native():
        rollout = generate(model, prompts, num_samples=args.samples, sampling=sampling, seed=next(seeds))
        tokens.setdefault("native", []).append(rollout.stats.num_generated_tokens)

    def hf():
        tokens.setdefault("hf_generate", []).append(hf_generate(model, prompts, args.samples, sampling, pad_id))

    contenders = {"native": native, "hf_generate": hf}
    engine = None
    if not engine_refusal("vllm", model_type):
        engine = VllmEngine(model.dtype, torch.device("cpu"), tokenizer)

        def vllm():
            rollout = engine.sample(model, prompts, num_samples=args.samples, sampling=sampling, seed=next(seeds))
            tokens.setdefault("vllm", []).append(rollout.stats.num_generated_tokens)
        contenders["vllm"] = vllm
    load_before = os.getloadavg()
    with torch.no_grad():
        agreement = greedy_agreement(model, prompts, stops, pad_id, min(args.new_tokens, 32))
        times = interleaved_medians(contenders, repeats=args.repeats, warmup=1)
    for name, timing in times.items():
        counted = tokens[name][-args.repeats:]   # the timed runs (after the warm-up)
        timing["tokens"] = counted
        timing["median_s_per_token"] = sorted(t / n for t, n in zip(timing["times_s"], counted))[len(counted) // 2]
    shape = {"model": setting, "model_type": model_type, "parameters": sum(p.numel() for p in model.parameters()),
             "weights": "trained (shipped)" if setting == "demo-hybrid" else "random (speed does not depend on them)",
             "num_prompts": args.prompts, "num_samples": args.samples, "max_new_tokens": args.new_tokens,
             "temperature": 1.0, "repeats": args.repeats, "vllm": "served" if engine else "does not serve this type"}
    name = "hybrid_rollout_quick" if args.quick else f"hybrid_rollout_{args.model.replace('-', '_')}"
    write_results(name, {"shape": shape, "times": times, "greedy_vs_hf": agreement,
                         "speedup_vs_hf_generate": times["hf_generate"]["median_s"] / times["native"]["median_s"],
                         "load_average": {"before": load_before, "after": os.getloadavg()}})
    base = times["native"]
    print_table(f"Rollout, {model_type} ({setting}), {args.prompts} x {args.samples}, up to {args.new_tokens} tokens, "
                f"T = 1 (medians of {args.repeats})", ["engine", "time s", "ms/token", "time / native"],
                [[n, t["median_s"], t["median_s_per_token"] * 1e3, t["median_s"] / base["median_s"]]
                 for n, t in times.items()])
    print(f"greedy equal to HF generate: {agreement['greedy_equal']}/{agreement['greedy_compared']}; "
          f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
