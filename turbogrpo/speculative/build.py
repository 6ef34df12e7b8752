"""Drafts trained on the policy's own completions: the one training routine of ``turbogrpo draft train``
and ``turbogrpo draft build``, and the building of a draft into the cache.

    turbogrpo draft build --model smollm2      trains the SmolLM2 draft once (~48 min on 2 CPU cores) into
                                               <cache>/drafts/, beside the model cache; later calls reuse it
    [draft] path = "smollm2-gsm8k"             a training config names a built draft by its name

The built drafts' recipes and cache folders are in ``built_drafts.py`` (``BUILT_DRAFTS``). A draft
holds only its own layers: the policy's embeddings and 49k-row LM head are shared, not copied (see
``draft.py``), so SmolLM2's is 17 MB (one decoder layer and the fusion), not the 113 MB more a copied
head would add. Built on this project's shared 2-core CPU (load average 5-7): 26 min sampling 512
completions (128k tokens), 8 min of features, 14 min of training; top-1 agreement with the policy 0.31
in the last epoch (0.17 in the first: more epochs would still help).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from turbogrpo.speculative.built_drafts import (BUILD_RECORD, BuiltDraft, DraftRecipe, built_draft_folder,
                                                checkout_path, is_built)
from turbogrpo.speculative.draft import DraftHead


def build_draft(built: BuiltDraft, *, refresh: bool = False, device: torch.device | None = None,
                log: Callable[[str], None] = print) -> Path:
    """The folder of ``built``, training it first unless it is already built (``refresh``: train anew)."""
    from turbogrpo.config import load_config
    from turbogrpo.files import write_folder_atomically
    from turbogrpo.models import load_model_and_tokenizer, resolve_model_path
    from turbogrpo.train.setup import load_train_prompts, position_limit, stop_token_ids

    folder = built_draft_folder(built)
    if is_built(folder) and not refresh:
        log(f"draft {built.name!r} is built: {folder}")
        return folder
    config = load_config(checkout_path(built.config))
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(built.model), device=device or "cpu")
    examples = load_train_prompts(config, tokenizer, position_limit(model)).examples
    prompts = [ex.token_ids for ex in examples[:built.recipe.num_prompts]]

    def write(tmp: Path) -> None:
        draft = DraftHead(model, num_layers=built.recipe.num_layers, num_draft_tokens=built.recipe.num_draft_tokens)
        record = train_on_own_completions(model, draft, prompts, stop_token_ids(model, tokenizer), built.recipe,
                                          log=log)
        draft.save(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps({"name": built.name, "model": built.model, "config": built.config,
                                                    "recipe": asdict(built.recipe), **record}, indent=1))

    log(f"building draft {built.name!r} into {folder}")
    return write_folder_atomically(folder, write, f"draft {built.name!r}")


def train_on_own_completions(model: nn.Module, draft: DraftHead, prompts: Sequence[torch.Tensor],
                             stop_token_ids: Sequence[int], recipe: DraftRecipe, *,
                             log: Callable[[str], None] = print) -> dict:
    """Sample ``recipe.num_samples`` completions of each prompt (token ids ``[P]``) from ``model``, then
    train ``draft`` on the model's features of them. Returns what was done: counts, seconds per phase,
    and the final loss and top-1 agreement with the policy (mean over the last epoch's steps)."""
    from tqdm import tqdm

    from turbogrpo.config import DraftLearningConfig
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.speculative.draft_training import draft_groups, train_draft

    recipe.check()
    if not prompts:
        raise ValueError("no usable prompts (all empty or too long)")
    sampling = SamplingConfig(max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature,
                              stop_token_ids=tuple(stop_token_ids))
    start = time.perf_counter()
    completions: list[list[torch.Tensor]] = []
    chunk = max(1, 64 // recipe.num_samples)  # ~64 sequences per rollout keeps memory flat
    for first in tqdm(range(0, len(prompts), chunk), desc="sampling completions", unit="rollout"):
        rollout = generate(model, list(prompts[first:first + chunk]), num_samples=recipe.num_samples,
                           sampling=sampling, seed=recipe.seed + first)
        completions.extend(rollout.tokens_per_group())
    sampled = time.perf_counter()
    groups = draft_groups(model, prompts, completions)
    featured = time.perf_counter()
    num_completions = groups.num_completions
    num_tokens = sum(len(c) for c in groups.completions)
    log(f"{num_completions} completions ({num_tokens} tokens) sampled in {sampled - start:.0f}s, "
        f"features in {featured - sampled:.0f}s")
    coverage = None
    if draft.config.num_draft_tokens:
        tokens = torch.cat(list(groups.completions)).cpu()
        coverage = choose_draft_tokens(draft, tokens)
        log(f"draft vocabulary: the {draft.config.num_draft_tokens} most frequent tokens cover {coverage:.1%} of "
            "the completions' tokens")
    config = DraftLearningConfig(lr=recipe.lr)
    num_steps = recipe.epochs * -(-num_completions // recipe.batch_size)  # about: batches hold whole groups
    with tqdm(total=num_steps, desc="training draft", unit="step") as bar:
        def on_step(step, metrics):
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1_agreement']:.2f}")
        history = train_draft(draft, groups, config, num_epochs=recipe.epochs, batch_size=recipe.batch_size,
                              seed=recipe.seed, on_step=on_step)
    trained = time.perf_counter()
    last_epoch = history[-max(1, len(history) // recipe.epochs):]
    record = {"num_prompts": groups.num_groups, "num_completions": num_completions, "num_tokens": num_tokens,
              "num_draft_tokens": draft.config.num_draft_tokens, "draft_token_coverage": coverage,
              "sampling_s": round(sampled - start, 1), "features_s": round(featured - sampled, 1),
              "training_s": round(trained - featured, 1), "num_steps": len(history),
              "final_loss": sum(m["loss"] for m in last_epoch) / len(last_epoch),
              "final_top1_agreement": sum(m["top1_agreement"] for m in last_epoch) / len(last_epoch),
              "top1_agreement_per_epoch": [
                  sum(m["top1_agreement"] for m in history[e * len(history) // recipe.epochs:
                                                            (e + 1) * len(history) // recipe.epochs])
                  / max(1, len(history) // recipe.epochs) for e in range(recipe.epochs)]}
    log(f"draft trained in {record['training_s']:.0f}s: loss {record['final_loss']:.3f}, top-1 agreement with the "
        f"policy {record['final_top1_agreement']:.2f} (last epoch)")
    return record


def choose_draft_tokens(draft: DraftHead, tokens: torch.Tensor) -> float:
    """Make the ``draft.config.num_draft_tokens`` most frequent of ``tokens`` ``[T]`` (long) the draft's
    vocabulary (ties and unseen tokens by id); returns the share of ``tokens`` it covers."""
    counts_V = torch.bincount(tokens, minlength=draft.config.vocab_size).double()
    # Stable order: frequency first, then the lower id (a tiny tie-break below one count).
    ranked_V = (counts_V - torch.arange(len(counts_V), dtype=torch.double) / (2 * len(counts_V))).argsort(descending=True)
    chosen = ranked_V[:draft.config.num_draft_tokens]
    draft.set_draft_tokens(chosen.sort().values.to(draft.draft_token_ids.device))
    return float(counts_V[chosen].sum() / max(1.0, float(counts_V.sum())))
