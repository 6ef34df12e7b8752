"""Draft recipes at T = 1 (issue 54): today's layout against "eagle3", with and without training-time test.

One process samples the policy's own T = 1 completions once, holds the last prompts out, and trains every
variant on the same completions for the same epochs (the same token budget), then measures each on the
held-out ones:

* held-out acceptance by depth (``draft_acceptance.acceptance_by_depth``): top-1 agreement with the policy, the
  T = 1 expected acceptance sum_x min(p(x), q(x)) at depth 1.., the share of top-1 chains accepted through each
  depth, and the tokens one chain of ``--depth`` emits per verification (top-1 and sampled drafts);
* measured tokens per verification: a speculative rollout of the held-out prompts at T = 1 with fixed
  1 x depth chains (``--depth``) and with fixed 4-wide trees of that depth, mean accepted length;
* the draft vocabulary's coverage of the held-out completions' tokens (``--draft-tokens``, 0: all of it).

Variants (``VARIANTS``): ``turbogrpo`` (today's, the baseline), ``turbogrpo+ttt``, ``eagle3``, ``eagle3+ttt``,
``eagle3+ttt+init`` (the layer started as the policy's last), ``eagle3+ttt+ce`` and ``turbogrpo+ttt+ce``
(EAGLE-3's loss: the distribution alone, no feature regression; weights 0 / 1).

    PYTHONPATH=. python bench/draft_recipes.py --quick          # demo model, seconds; *_quick file
    PYTHONPATH=. python bench/draft_recipes.py                  # demo model, 128 prompts x 8, 6 epochs
    PYTHONPATH=. python bench/draft_recipes.py --model smollm2 --config configs/smollm2_gsm8k.toml \\
        --num-prompts 128 --num-samples 4 --max-new-tokens 256 --epochs 4 --draft-tokens 4096 \\
        --validation-prompts 8 --out draft_recipes_smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import write_results  # noqa: E402
from turbogrpo.commands.draft_build import choose_draft_tokens, new_draft, sample_completions, vocabulary_coverage  # noqa: E402
from turbogrpo.config import DraftLearningConfig  # noqa: E402
from turbogrpo.rollout import SamplingConfig  # noqa: E402
from turbogrpo.speculative.draft import DraftHead  # noqa: E402
from turbogrpo.speculative.built_drafts import DraftRecipe  # noqa: E402
from turbogrpo.speculative.draft_training import draft_groups, make_optimizer, train_draft  # noqa: E402
from turbogrpo.speculative.draft_acceptance import acceptance_by_depth  # noqa: E402
from turbogrpo.speculative.sizing import FixedSizing  # noqa: E402
from turbogrpo.speculative.speculation import Speculation, generate_speculative  # noqa: E402
from turbogrpo.speculative.tree import TreeShape  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One draft recipe: its layout, its training-time-test steps, its initialisation, its loss weights."""

    layout: str
    ttt_steps: int
    init_from_policy: bool = False
    feature_weight: float = 1.0
    logit_weight: float = 0.1


VARIANTS: dict[str, Variant] = {
    "turbogrpo": Variant("turbogrpo", 1),
    "turbogrpo+ttt": Variant("turbogrpo", 3),
    "eagle3": Variant("eagle3", 1),
    "eagle3+ttt": Variant("eagle3", 3),
    "eagle3+ttt+init": Variant("eagle3", 3, init_from_policy=True),
    "eagle3+ttt+ce": Variant("eagle3", 3, feature_weight=0.0, logit_weight=1.0),
    "turbogrpo+ttt+ce": Variant("turbogrpo", 3, feature_weight=0.0, logit_weight=1.0),
}
"""Name -> recipe; "turbogrpo" is the baseline (today's draft)."""


def load(args):
    """(model, tokenizer, prompts): the demo model and its arithmetic task, or a model with a config's prompts."""
    from turbogrpo.data import build_prompts, demo_records
    from turbogrpo.models import load_demo_model, load_model_and_tokenizer, resolve_model_path

    if args.model == "demo":
        model, tokenizer = load_demo_model()
        examples = build_prompts(demo_records("train", args.num_prompts, seed=args.seed), tokenizer).examples
    else:
        from turbogrpo.config import load_config
        from turbogrpo.data.prompt_sets import load_train_prompts
        from turbogrpo.train.setup import position_limit

        model, tokenizer = load_model_and_tokenizer(resolve_model_path(args.model))
        config = load_config(args.config)
        examples = load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                                      max_new_tokens=config.rollout.max_new_tokens,
                                      max_positions=position_limit(model)).examples
    return model, tokenizer, [ex.token_ids for ex in examples[:args.num_prompts]]


def measured_accepted_length(model, draft, prompts, shape: TreeShape, max_new_tokens: int, stop_ids, seed: int) -> float:
    """Tokens per verification of a speculative rollout of ``prompts`` at T = 1 with fixed trees of ``shape``,
    stopping at the model's stop tokens as the completions the drafts learned from did."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=tuple(stop_ids))
    rollout = generate_speculative(model, prompts, num_samples=4, seed=seed, sampling=sampling,
                                   draft=Speculation(draft, FixedSizing(shape)))
    return rollout.stats.mean_accepted_length


def features_of(wide, draft, hidden_size: int):
    """The policy features ``draft`` reads, from ``wide`` (the eagle3 layers' and the final ones, computed once):
    all of them for an "eagle3" draft, the final block for the others."""
    if draft.config.feature_layers:
        return wide
    final = [h[..., -hidden_size:] for h in wide.hidden]
    return dataclasses.replace(wide, hidden=final, prompt_hidden=[h[..., -hidden_size:] for h in wide.prompt_hidden])


def run_variant(name: str, variant: Variant, model, prompts, wide, args, stop_ids) -> dict:
    torch.manual_seed(args.seed)  # every variant's layer starts from the same random numbers
    recipe = DraftRecipe(num_prompts=len(prompts), num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                         epochs=args.epochs, batch_size=args.batch_size, num_draft_tokens=args.draft_tokens,
                         lr=args.lr, layout=variant.layout, ttt_steps=variant.ttt_steps,
                         init_from_policy=variant.init_from_policy, validation_prompts=args.validation_prompts)
    draft = new_draft(model, recipe)
    groups = features_of(wide, draft, model.config.hidden_size)
    num_train = groups.num_groups - args.validation_prompts
    train, held_out = groups.select(range(num_train)), groups.select(range(num_train, groups.num_groups))
    coverage = None
    if args.draft_tokens:
        choose_draft_tokens(draft, torch.cat(list(train.completions)).cpu())
        coverage = vocabulary_coverage(draft, held_out)
    config = DraftLearningConfig(lr=args.lr, ttt_steps=variant.ttt_steps, feature_weight=variant.feature_weight,
                                 logit_weight=variant.logit_weight)
    optimizer = make_optimizer(draft, config)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        train_draft(draft, train, config, batch_size=args.batch_size, optimizer=optimizer, seed=args.seed + epoch)
    training_s = time.perf_counter() - start
    acceptance = acceptance_by_depth(draft, held_out, args.depth)
    held_out_prompts = list(prompts[num_train:])
    chain = measured_accepted_length(model, draft, held_out_prompts, TreeShape(1, args.depth, args.depth + 1),
                                     args.max_new_tokens, stop_ids, args.seed)
    tree = measured_accepted_length(model, draft, held_out_prompts, TreeShape(4, args.depth, 4 * args.depth + 1),
                                    args.max_new_tokens, stop_ids, args.seed)
    result = {"layout": variant.layout, "ttt_steps": variant.ttt_steps, "init_from_policy": variant.init_from_policy,
              "feature_weight": variant.feature_weight, "logit_weight": variant.logit_weight,
              "training_s": round(training_s, 2), "held_out_draft_token_coverage": coverage,
              "top1_agreement": acceptance["top1_agreement"],
              "expected_acceptance_depth1": acceptance["expected_acceptance"][0],
              "acceptance": acceptance, "measured_tokens_per_verification_chain": chain,
              "measured_tokens_per_verification_tree": tree}
    print(f"{name:>16}: top-1 {result['top1_agreement']:.3f}, E[accept] d1 {result['expected_acceptance_depth1']:.3f}, "
          f"chain tokens/verify est {acceptance['tokens_per_verification_top1']:.2f} (top-1) "
          f"{acceptance['tokens_per_verification_sampled']:.2f} (sampled), measured {chain:.2f}, "
          f"4x{args.depth} trees {tree:.2f}, trained in {training_s:.0f}s", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--config", help="a training config whose [data] prompts a --model other than demo uses")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--validation-prompts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-tokens", type=int, default=0, help="draft vocabulary (0: the whole vocabulary)")
    parser.add_argument("--depth", type=int, default=4, help="depths of the acceptance report and the chains")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 prompts x 4, 2 epochs")
    parser.add_argument("--out", default="draft_recipes")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.num_samples, args.epochs, args.validation_prompts = 16, 4, 2, 4
        args.max_new_tokens, args.out = 24, f"{args.out}_quick"
    if args.model != "demo" and not args.config:
        parser.error("--model other than demo needs --config (its [data] section gives the prompts)")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model, tokenizer, prompts = load(args)
    from turbogrpo.train.setup import stop_token_ids

    stop_ids = stop_token_ids(model, tokenizer)
    sampling_recipe = DraftRecipe(num_prompts=len(prompts), num_samples=args.num_samples,
                                  max_new_tokens=args.max_new_tokens, epochs=1, batch_size=1, seed=args.seed)
    start = time.perf_counter()
    completions = sample_completions(model, prompts, stop_ids, sampling_recipe)
    sampling_s = time.perf_counter() - start
    num_tokens = sum(len(c) for cs in completions for c in cs)
    print(f"{len(prompts)} prompts x {args.num_samples}: {num_tokens} tokens sampled at T = 1 in {sampling_s:.0f}s")
    # The policy's features once for all variants: the eagle3 layers and the final one, from one forward per pack.
    start = time.perf_counter()
    wide = draft_groups(model, prompts, completions, draft=DraftHead(model, layout="eagle3"))
    features_s = time.perf_counter() - start
    variants = {name: run_variant(name, VARIANTS[name], model, prompts, wide, args, stop_ids) for name in args.variants}
    baseline = variants.get("turbogrpo")
    if baseline is not None:
        for result in variants.values():
            result["vs_baseline_expected_acceptance"] = (result["expected_acceptance_depth1"]
                                                         / max(baseline["expected_acceptance_depth1"], 1e-9))
            result["vs_baseline_measured_chain"] = (result["measured_tokens_per_verification_chain"]
                                                    / baseline["measured_tokens_per_verification_chain"])
    record = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "shapes": {"model": args.model, "config": args.config, "num_prompts": len(prompts),
                         "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
                         "validation_prompts": args.validation_prompts, "epochs": args.epochs,
                         "batch_size": args.batch_size, "lr": args.lr, "draft_tokens": args.draft_tokens,
                         "depth": args.depth, "num_sampled_tokens": num_tokens, "temperature": 1.0},
              "sampling_s": round(sampling_s, 1), "features_s": round(features_s, 1), "variants": variants}
    write_results(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
