"""Issue 53 part 2: speculative rollouts of a hybrid, chains only: plain decoding against history chains, the neural
draft's chains, and the two merged (history's chain where it runs as deep), alternated run by run in one process.

The shipped hybrid demo model (Qwen3.5-shaped, 1.8M parameters) on the demo's arithmetic prompts at T = 1, K prompts
x G samples, up to N new tokens, stopping at EOS. The draft is trained first on the model's own completions of other
prompts (``draft_groups`` + ``train_draft``, as ``turbogrpo draft train`` does), and every speculative rollout
verifies one chain of ``--depth`` tokens per row (``FixedSizing``; a hybrid's recurrent states follow one path). The
history store is emptied before each timed rollout, so history drafts only from the group's siblings. Reported per
variant: the median time, the accepted length (tokens per sequence per verification) and the draft's time.

    python bench/hybrid_speculation.py            # demo-hybrid, 8 x 8, up to 64 tokens, chains of 4, 3 repeats
    python bench/hybrid_speculation.py --quick    # smoke run: 2 x 2, 8 tokens, a draft trained one epoch, 1 repeat
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402

from turbogrpo.config import DraftLearningConfig  # noqa: E402
from turbogrpo.data.arithmetic import generate_problems  # noqa: E402
from turbogrpo.models import load_model_and_tokenizer  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.speculative.draft import DraftHead  # noqa: E402
from turbogrpo.speculative.draft_training import draft_groups, train_draft  # noqa: E402
from turbogrpo.speculative.history import HistoryDrafts  # noqa: E402
from turbogrpo.speculative.sizing import FixedSizing  # noqa: E402
from turbogrpo.speculative.speculation import Speculation  # noqa: E402
from turbogrpo.speculative.tree import TreeShape  # noqa: E402


def prompts_of(tokenizer, split: str, count: int) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(p.prompt)["input_ids"]) for p in generate_problems(split, count, seed=0)]


def trained_draft(model, tokenizer, sampling: SamplingConfig, num_prompts: int, epochs: int) -> DraftHead:
    """A draft trained on the model's own T = 1 completions of ``num_prompts`` training prompts (4 each)."""
    prompts = prompts_of(tokenizer, "train", num_prompts)
    completions = generate(model, prompts, num_samples=4, sampling=sampling, seed=123).tokens_per_group()
    torch.manual_seed(0)
    draft = DraftHead(model)
    train_draft(draft, draft_groups(model, prompts, completions), DraftLearningConfig(lr=3e-3), num_epochs=epochs,
                batch_size=16)
    return draft.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="draft tokens per chain")
    parser.add_argument("--draft-prompts", type=int, default=64, help="training prompts the draft learns from")
    parser.add_argument("--draft-epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 x 2, 8 tokens, a one-epoch draft")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.new_tokens, args.repeats = 2, 2, 8, 1
        args.draft_prompts, args.draft_epochs = 4, 1
    model, tokenizer = load_model_and_tokenizer("demo-hybrid")
    model.eval()
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[tokenizer.eos_token_id])
    prompts = prompts_of(tokenizer, "eval", args.prompts)
    draft = trained_draft(model, tokenizer, sampling, args.draft_prompts, args.draft_epochs)
    chain = FixedSizing(TreeShape(1, args.depth, args.depth + 1))
    variants = {"plain": lambda: None,
                "history chains": lambda: Speculation(None, chain, history=HistoryDrafts(store=None)),
                "neural chains": lambda: Speculation(draft, chain),
                "neural + history": lambda: Speculation(draft, chain, history=HistoryDrafts(store=None))}
    stats: dict[str, list] = {name: [] for name in variants}
    seeds = iter(range(10_000))

    def run(name: str):
        def rollout():
            out = generate(model, prompts, num_samples=args.samples, sampling=sampling, seed=next(seeds),
                           draft=variants[name]())
            stats[name].append(out.stats)
        return rollout

    load_before = os.getloadavg()
    with torch.no_grad():
        times = interleaved_medians({name: run(name) for name in variants}, repeats=args.repeats, warmup=1)
    for name, timing in times.items():
        timed = stats[name][-args.repeats:]   # after the warm-up
        timing["tokens"] = [s.num_generated_tokens for s in timed]
        timing["num_forwards"] = [s.num_forwards for s in timed]
        # Tokens per sequence per policy forward over the speculative steps (plain decoding: 1).
        timing["accepted_length"] = sum(getattr(s, "mean_accepted_length", 1.0) for s in timed) / len(timed)
        timing["draft_seconds"] = [getattr(s, "draft_seconds", 0.0) for s in timed]
    shape = {"model": "demo-hybrid", "model_type": model.config.model_type,
             "parameters": sum(p.numel() for p in model.parameters()), "num_prompts": args.prompts,
             "num_samples": args.samples, "max_new_tokens": args.new_tokens, "temperature": 1.0, "depth": args.depth,
             "draft": {"layers": 1, "body": type(draft.layers[0]).__name__, "train_prompts": args.draft_prompts,
                       "epochs": args.draft_epochs},
             "repeats": args.repeats, "threads": torch.get_num_threads()}
    base = times["plain"]["median_s"]
    for timing in times.values():
        timing["speedup_vs_plain"] = base / timing["median_s"]
    write_results("hybrid_speculation_quick" if args.quick else "hybrid_speculation",
                  {"shape": shape, "times": times,
                   "load_average": {"before": load_before, "after": os.getloadavg()}})
    print_table(f"Speculation on the hybrid demo model, {args.prompts} x {args.samples}, up to {args.new_tokens} "
                f"tokens, T = 1, chains of {args.depth} (medians of {args.repeats})",
                ["variant", "time s", "accepted length", "draft s", "time / plain"],
                [[n, t["median_s"], t["accepted_length"], sorted(t["draft_seconds"])[len(t["draft_seconds"]) // 2],
                  t["median_s"] / base] for n, t in times.items()])
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
