"""Drafts trained on the policy's own completions: the one training routine of ``turbogrpo draft train``
and ``turbogrpo draft build``, and the building of a draft into the cache.

    turbogrpo draft build --model smollm2      trains the SmolLM2 draft once (~55 min on 2 CPU cores) into
                                               <cache>/drafts/, beside the model cache; later calls reuse it
    [draft] path = "smollm2-gsm8k"             a training config names a built draft by its name

The built drafts' recipes and cache folders are in ``built_drafts.py`` (``BUILT_DRAFTS``). A draft
holds only its own layers: the policy's embeddings and 49k-row LM head are shared, not copied (see
``draft.py``), so SmolLM2's is 17 MB (one decoder layer and the fusion), not the 113 MB more a copied
head would add. The sampled completions are kept beside the drafts (``built_drafts.samples_file``), so
changing how a draft trains (epochs, learning rate, vocabulary) retrains it without sampling again;
the figures of the last build are in its folder's ``turbogrpo_draft_build.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from turbogrpo.linears import TRAINING_LINEAR_KERNELS
from turbogrpo.speculative.built_drafts import (BUILD_RECORD, BuiltDraft, DraftRecipe, built_draft_folder,
                                                checkout_path, is_built, samples_file)
from turbogrpo.speculative.draft import DraftHead


def build_draft(built: BuiltDraft, *, refresh: bool = False, device: torch.device | None = None,
                log: Callable[[str], None] = print) -> Path:
    """The folder of ``built``, training it first unless it is already built (``refresh``: train anew,
    on the kept completions when its sampling fields have not changed)."""
    from turbogrpo.config import load_config
    from turbogrpo.files import write_folder_atomically
    from turbogrpo.models import load_model_and_tokenizer, resolve_model_path
    from turbogrpo.data.prompt_sets import load_train_prompts
    from turbogrpo.train.setup import position_limit, stop_token_ids

    folder = built_draft_folder(built)
    if is_built(folder) and not refresh:
        log(f"draft {built.name!r} is built: {folder}")
        return folder
    config = load_config(checkout_path(built.config))
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(built.model), device=device or "cpu")
    examples = load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                                  max_new_tokens=config.rollout.max_new_tokens,
                                  max_positions=position_limit(model)).examples
    prompts = [ex.token_ids for ex in examples[:built.recipe.num_prompts]]

    def write(tmp: Path) -> None:
        draft = new_draft(model, built.recipe)
        record = train_on_own_completions(model, draft, prompts, stop_token_ids(model, tokenizer), built.recipe,
                                          samples=samples_file(built), log=log)
        draft.save(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps({"name": built.name, "model": built.model, "config": built.config,
                                                    "recipe": asdict(built.recipe), **record}, indent=1))

    log(f"building draft {built.name!r} into {folder}")
    return write_folder_atomically(folder, write, f"draft {built.name!r}")


def new_draft(model: nn.Module, recipe: DraftRecipe) -> DraftHead:
    """A new draft for ``model`` as ``recipe`` says (layers, vocabulary, layout, initialisation)."""
    draft = DraftHead(model, num_layers=recipe.num_layers, num_draft_tokens=recipe.num_draft_tokens,
                      layout=recipe.layout)
    if recipe.init_from_policy:
        draft.init_from_policy()
    return draft


def train_on_own_completions(model: nn.Module, draft: DraftHead, prompts: Sequence[torch.Tensor],
                             stop_token_ids: Sequence[int], recipe: DraftRecipe, *, samples: Path | None = None,
                             log: Callable[[str], None] = print) -> dict:
    """Sample ``recipe.num_samples`` completions of each prompt (token ids ``[P]``) from ``model``, then
    train ``draft`` on the model's features of them. ``samples``: a file keeping the completions, read
    instead of sampling when it holds these prompts' (``built_drafts.samples_file``), written otherwise.

    The last ``recipe.validation_prompts`` groups are held out: each epoch ends with the draft's loss and
    top-1 agreement on them, and the last with its acceptance by depth (``draft_unroll.acceptance_by_depth``:
    top-1 and T = 1 expected acceptance, sum_x min(p, q)). Returns what was done: counts, seconds per phase,
    the last epoch's mean training loss and top-1 agreement with the policy, the held-out figures per epoch
    and the acceptance report.
    """
    recipe.check()
    if not prompts:
        raise ValueError("no usable prompts (all empty or too long)")
    start = time.perf_counter()
    completions = read_samples(samples, prompts) if samples is not None else None
    if completions is None:
        completions = sample_completions(model, prompts, stop_token_ids, recipe)
        if samples is not None:
            write_samples(samples, prompts, completions)
    else:
        log(f"completions read from {samples}")
    sampled = time.perf_counter()
    # The features pass and the draft's training run their weight matmuls by the faster kernel here.
    with TRAINING_LINEAR_KERNELS["auto"]([model, draft]):
        return _featurize_and_train(model, draft, prompts, completions, recipe, start, sampled, log)


def _featurize_and_train(model: nn.Module, draft: DraftHead, prompts: Sequence[torch.Tensor],
                         completions: list[list[torch.Tensor]], recipe: DraftRecipe, start: float, sampled: float,
                         log: Callable[[str], None]) -> dict:
    """The second half of ``train_on_own_completions``: features, vocabulary, epochs, the record."""
    from tqdm import tqdm

    from turbogrpo.config import DraftLearningConfig
    from turbogrpo.speculative.draft_training import draft_groups, make_optimizer, train_draft

    groups = draft_groups(model, prompts, completions, draft=draft)
    featured = time.perf_counter()
    num_completions = groups.num_completions
    num_tokens = sum(len(c) for c in groups.completions)
    log(f"{num_completions} completions ({num_tokens} tokens) sampled in {sampled - start:.0f}s, "
        f"features in {featured - sampled:.0f}s")
    coverage = held_out_coverage = None
    num_train = groups.num_groups - recipe.validation_prompts
    train, held_out = groups.select(range(num_train)), groups.select(range(num_train, groups.num_groups))
    if draft.config.num_draft_tokens:
        # From the trained completions only, so the held-out figures include the vocabulary's misses.
        tokens = torch.cat(list(train.completions)).cpu()
        coverage = choose_draft_tokens(draft, tokens)
        held_out_coverage = vocabulary_coverage(draft, held_out)
        log(f"draft vocabulary: the {draft.config.num_draft_tokens} most frequent tokens cover {coverage:.1%} of "
            "the completions' tokens" + ("" if held_out_coverage is None else
                                         f" ({held_out_coverage:.1%} of the held-out ones)"))
    config = DraftLearningConfig(lr=recipe.lr, ttt_steps=recipe.ttt_steps)
    optimizer = make_optimizer(draft, config)
    num_steps, per_epoch = 0, []
    steps_per_epoch = -(-train.num_completions // recipe.batch_size)  # about: batches hold whole groups
    with tqdm(total=recipe.epochs * steps_per_epoch, desc="training draft", unit="step") as bar:
        def on_step(step, metrics):
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1_agreement']:.2f}")
        for epoch in range(recipe.epochs):
            steps = train_draft(draft, train, config, batch_size=recipe.batch_size, optimizer=optimizer,
                                seed=recipe.seed + epoch, on_step=on_step)
            num_steps += len(steps)
            per_epoch.append({"train_top1_agreement": _mean(steps, "top1_agreement"),
                              "train_loss": _mean(steps, "loss"),
                              **({f"held_out_{k}": v for k, v in held_out_metrics(draft, held_out, config).items()}
                                 if held_out.num_groups else {})})
            log(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_epoch[-1].items()))
    trained = time.perf_counter()
    acceptance = None
    if held_out.num_groups:
        from turbogrpo.speculative.draft_acceptance import acceptance_by_depth, rows_by_depth

        acceptance = acceptance_by_depth(draft, held_out, recipe.report_depth)
        acceptance["by_depth"] = rows_by_depth(acceptance)
        log(acceptance_table(acceptance))
    record = {"num_prompts": groups.num_groups, "num_completions": num_completions, "num_tokens": num_tokens,
              "num_held_out_prompts": held_out.num_groups,
              "num_draft_tokens": draft.config.num_draft_tokens, "draft_token_coverage": coverage,
              "held_out_draft_token_coverage": held_out_coverage, "layout": draft.config.layout,
              "ttt_steps": recipe.ttt_steps, "init_from_policy": recipe.init_from_policy,
              "held_out_acceptance": acceptance,
              "sampling_s": round(sampled - start, 1), "features_s": round(featured - sampled, 1),
              "training_s": round(trained - featured, 1), "num_steps": num_steps,
              "final_loss": per_epoch[-1]["train_loss"], "final_top1_agreement": per_epoch[-1]["train_top1_agreement"],
              "per_epoch": per_epoch}
    log(f"draft trained in {record['training_s']:.0f}s: loss {record['final_loss']:.3f}, top-1 agreement with the "
        f"policy {record['final_top1_agreement']:.2f} (last epoch)")
    return record


def acceptance_table(acceptance: dict) -> str:
    """The held-out acceptance report as lines a person reads: per depth, the share of chains accepted so far."""
    lines = [f"held-out acceptance at T = 1 (top-1 agreement with the policy {acceptance['top1_agreement']:.3f})",
             f"{'depth':>6} {'roots':>8} {'top-1 accepted':>15} {'E[accept] sum min(p,q)':>23} {'sampled chain':>14}"]
    for row in acceptance["by_depth"]:
        lines.append(f"{row['depth']:>6} {int(row['num_roots']):>8} {row['top1_accepted']:>15.3f} "
                     f"{row['expected_acceptance']:>23.3f} {row['sampled_accepted']:>14.3f}")
    lines.append(f"tokens per verification of one chain: {acceptance['tokens_per_verification_top1']:.2f} (top-1), "
                 f"{acceptance['tokens_per_verification_sampled']:.2f} (sampled)")
    return "\n".join(lines)


def vocabulary_coverage(draft: DraftHead, groups) -> float | None:
    """The share of ``groups``' completion tokens inside the draft's vocabulary (None without completions)."""
    if not groups.num_completions:
        return None
    tokens = torch.cat(list(groups.completions)).cpu()
    inside = torch.isin(tokens, draft.draft_token_ids.cpu())
    return float(inside.double().mean()) if len(tokens) else None


def _mean(history: list[dict], key: str) -> float:
    return sum(m[key] for m in history) / max(1, len(history))


@torch.no_grad()
def held_out_metrics(draft: DraftHead, groups, config, *, batch_size: int = 8) -> dict[str, float]:
    """The draft's loss and top-1 agreement on ``groups`` (never trained on), weighted by trained tokens."""
    from turbogrpo.speculative.draft_training import batches_of, draft_loss, num_trained

    totals, count = {"loss": 0.0, "top1_agreement": 0.0}, 0
    for batch in batches_of(groups, batch_size, torch.Generator().manual_seed(0)):
        metrics, weight = draft_loss(draft, batch, config)[1], num_trained(batch)
        for key in totals:
            totals[key] += float(metrics[key]) * weight
        count += weight
    return {key: value / max(1, count) for key, value in totals.items()}


def sample_completions(model: nn.Module, prompts: Sequence[torch.Tensor], stop_token_ids: Sequence[int],
                       recipe: DraftRecipe) -> list[list[torch.Tensor]]:
    """``recipe.num_samples`` completions ``[S]`` of each prompt, sampled by ``model`` as the recipe says."""
    from tqdm import tqdm

    from turbogrpo.rollout import SamplingConfig, generate

    sampling = SamplingConfig(max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature,
                              stop_token_ids=tuple(stop_token_ids))
    completions: list[list[torch.Tensor]] = []
    chunk = max(1, 64 // recipe.num_samples)  # ~64 sequences per rollout keeps memory flat
    for first in tqdm(range(0, len(prompts), chunk), desc="sampling completions", unit="rollout"):
        rollout = generate(model, list(prompts[first:first + chunk]), num_samples=recipe.num_samples,
                           sampling=sampling, seed=recipe.seed + first)
        completions.extend(rollout.tokens_per_group())
    return completions


def write_samples(path: Path, prompts: Sequence[torch.Tensor], completions: Sequence[Sequence[torch.Tensor]]) -> None:
    """Keep ``completions`` (a list per prompt) with their ``prompts`` in one safetensors file, atomically."""
    from turbogrpo.files import save_tensors

    flat = [c.cpu() for cs in completions for c in cs]
    tensors = {"prompt_tokens": torch.cat([p.cpu() for p in prompts]),
               "prompt_lengths": torch.tensor([len(p) for p in prompts]),
               "completion_tokens": torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long),
               "completion_lengths": torch.tensor([len(c) for c in flat], dtype=torch.long),
               "group_sizes": torch.tensor([len(cs) for cs in completions], dtype=torch.long)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_tensors(tensors, tmp)
    os.replace(tmp, path)


def read_samples(path: Path, prompts: Sequence[torch.Tensor]) -> list[list[torch.Tensor]] | None:
    """The completions kept in ``path`` for exactly these ``prompts``; None when the file is absent,
    unreadable or holds other prompts (then they are sampled anew and the file rewritten)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        kept = load_file(str(path))
        prompt_tokens = list(kept["prompt_tokens"].split(kept["prompt_lengths"].tolist()))
        flat = list(kept["completion_tokens"].split(kept["completion_lengths"].tolist()))
        sizes = kept["group_sizes"].tolist()
    except (OSError, SafetensorError, KeyError, RuntimeError):
        return None
    if sum(sizes) != len(flat) or len(prompt_tokens) != len(prompts) or not all(
            torch.equal(a, b.cpu()) for a, b in zip(prompt_tokens, prompts)):
        return None
    offsets = [0, *itertools.accumulate(sizes)]
    return [flat[offsets[k]:offsets[k + 1]] for k in range(len(sizes))]


def choose_draft_tokens(draft: DraftHead, tokens: torch.Tensor) -> float:
    """Make the ``draft.config.num_draft_tokens`` most frequent of ``tokens`` ``[T]`` (long) the draft's
    vocabulary (ties and unseen tokens by id); returns the share of ``tokens`` it covers."""
    counts_V = torch.bincount(tokens, minlength=draft.config.vocab_size).double()
    # Stable order: frequency first, then the lower id (a tiny tie-break below one count).
    ranked_V = (counts_V - torch.arange(len(counts_V), dtype=torch.double) / (2 * len(counts_V))).argsort(descending=True)
    chosen = ranked_V[:draft.config.num_draft_tokens]
    draft.set_draft_tokens(chosen.sort().values.to(draft.draft_token_ids.device))
    return float(counts_V[chosen].sum() / max(1.0, float(counts_V.sum())))
