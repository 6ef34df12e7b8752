"""How much do GRPO siblings share beyond the prompt, and what does the tree forward make of it?

SmolLM2-135M-Instruct samples G completions for each of K GSM8K *train* questions (the data and system
prompt of configs/smollm2_gsm8k.toml, under the model's chat template) with ``turbogrpo.rollout.generate``
at temperature 1. On those exact sequences the benchmark reports, per group, the tokens of three layouts:
rows (every completion with its own prompt), the prompt-sharing layout (train.sharing = "prompt": the
prompt once, every completion whole) and the trie (train.sharing = "tree": completions' common starts
once too), and the forward + backward seconds of a loss on every completion log-prob through the prompt
path and the tree path (both on the whole batch in one call, alternated in one process, medians). The
ratio of trie to prompt-layout tokens against the ratio of their times is what sets train.sharing =
"auto"'s threshold (``turbogrpo.tree.completions.AUTO_MIN_SAVED``).

    python bench/tree_siblings.py                      # 8 prompts x G=8, 256 new tokens, 5 repeats
    python bench/tree_siblings.py --num-prompts 2 --group 4 --max-new-tokens 32 --repeats 1 --out tree_siblings_smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import chat_prompts, load_real_model  # noqa: E402

from turbogrpo.models import enable_activation_checkpointing  # noqa: E402
from turbogrpo.prefix import compute_logprobs  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.train.setup import stop_token_ids  # noqa: E402
from turbogrpo.tree import trie_of_groups  # noqa: E402
from turbogrpo.tree.completions import AUTO_MIN_SAVED, compute_tree_logprobs, saves_enough  # noqa: E402


def group_tokens(prompt: torch.Tensor, completions: list[torch.Tensor]) -> dict:
    """One group's token counts in the three layouts, and its siblings' shared tokens past the prompt."""
    completion_tokens = sum(c.numel() for c in completions)
    prompt_layout = prompt.numel() + completion_tokens
    trie = trie_of_groups([prompt], [completions]).num_tokens
    return {"prompt_tokens": prompt.numel(), "completion_tokens": completion_tokens,
            "rows_tokens": prompt.numel() * len(completions) + completion_tokens,
            "prompt_layout_tokens": prompt_layout, "trie_tokens": trie,
            "shared_completion_tokens": prompt_layout - trie,
            "shared_fraction_of_completions": (prompt_layout - trie) / completion_tokens}


def forward_backward(model, fn, prompts, completions):
    """One timed call: the log-probs of every completion token, summed, differentiated."""
    def run():
        model.zero_grad(set_to_none=True)
        fn(model, prompts, completions, backend="auto", with_entropy=False).logps.sum().backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep activations (the shipped GSM8K config recomputes them)")
    parser.add_argument("--out", default="tree_siblings", help="results/<out>.json")
    args = parser.parse_args()

    model, tokenizer = load_real_model()
    prompts = chat_prompts(tokenizer, args.num_prompts, few_shot=False, split="train")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              stop_token_ids=stop_token_ids(model, tokenizer))
    with torch.no_grad():
        batch = generate(model, prompts, num_samples=args.group, sampling=sampling, seed=args.seed).groups
    completions = batch.nested()
    groups = [group_tokens(p, cs) for p, cs in zip(prompts, completions)]
    print_table(f"tokens per group: {args.num_prompts} GSM8K train prompts x G={args.group}, "
                f"<= {args.max_new_tokens} new tokens, T={args.temperature}",
                ["group", "prompt", "completions", "rows", "prompt layout", "trie", "shared past prompt", "shared %"],
                [[g, r["prompt_tokens"], r["completion_tokens"], r["rows_tokens"], r["prompt_layout_tokens"],
                  r["trie_tokens"], r["shared_completion_tokens"], 100 * r["shared_fraction_of_completions"]]
                 for g, r in enumerate(groups)])
    whole_trie = trie_of_groups(prompts, completions)
    prompt_layout = sum(r["prompt_layout_tokens"] for r in groups)

    model.train()
    if not args.no_gradient_checkpointing:
        enable_activation_checkpointing(model)
    timings = interleaved_medians({
        "prompt": forward_backward(model, lambda m, p, c, **k: compute_logprobs(m, p, c, share_prefix=True, **k),
                                   prompts, completions),
        "tree": forward_backward(model, compute_tree_logprobs, prompts, completions),
    }, repeats=args.repeats, warmup=1)
    ratio = timings["tree"]["median_s"] / timings["prompt"]["median_s"]
    print_table("forward + backward of the whole batch in one call (medians, s)",
                ["path", "tokens", "median s", "min s", "tree / prompt"],
                [["prompt", prompt_layout, timings["prompt"]["median_s"], timings["prompt"]["min_s"], ""],
                 ["tree", whole_trie.num_tokens, timings["tree"]["median_s"], timings["tree"]["min_s"], ratio]])
    token_ratio = whole_trie.num_tokens / prompt_layout
    print(f"trie / prompt-layout tokens {token_ratio:.3f}, time ratio {ratio:.3f}; train.sharing=\"auto\" "
          f"(AUTO_MIN_SAVED={AUTO_MIN_SAVED}) would run the "
          f"{'tree' if saves_enough(whole_trie, prompts, completions) else 'prompt'} path here")
    write_results(args.out, {
        "shape": {"num_prompts": args.num_prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                  "temperature": args.temperature, "seed": args.seed, "model": "smollm2-135m-instruct",
                  "data": "gsm8k train (configs/smollm2_gsm8k.toml's system prompt, chat template)",
                  "gradient_checkpointing": not args.no_gradient_checkpointing, "dtype": "float32"},
        "groups": groups,
        "median_shared_fraction_of_completions": statistics.median(r["shared_fraction_of_completions"]
                                                                   for r in groups),
        "batch": {"rows_tokens": sum(r["rows_tokens"] for r in groups), "prompt_layout_tokens": prompt_layout,
                  "trie_tokens": whole_trie.num_tokens, "trie_over_prompt_layout": token_ratio},
        "timings": timings, "tree_over_prompt_time": ratio, "auto_min_saved": AUTO_MIN_SAVED,
        "auto_would_run": "tree" if saves_enough(whole_trie, prompts, completions) else "prompt",
    })


if __name__ == "__main__":
    main()
