"""Training the draft head: one implementation for offline training (``turbogrpo draft train``) and
online learning inside GRPO (``turbogrpo.train.draft_learning``).

The data is one ``turbogrpo.batch.Groups``: prompts and their completions with the policy's features
(``prompt_hidden`` and ``hidden``). A batch of groups is packed in the shared-prefix layout of ``turbogrpo.prefix`` (each prompt once, every
completion attending to its prompt and causally to itself), so a long prompt costs the draft once
per group, not once per completion.

Draft alignment (see ``draft.py``): the draft's input at position s is (f[s-1], x[s]) and its output
is trained to equal f[s]. For a completion ``c`` of a prompt of length P, its features ``hidden[i][j]``
are f[P-1+j], the feature that predicted ``c[j]``; so token ``c[j]`` is fed with
``hidden[i][j]`` and trained towards ``hidden[i][j+1]``: every token whose next
feature is known is trained. A rollout's hidden states (``return_hidden``) give S features for S
tokens (S - 1 trained positions); a full policy forward gives S + 1 (all S trained).

Loss: ``w_v * SmoothL1(g, f) + w_p * CE(draft logits, policy distribution)`` (EAGLE), AdamW. Both
distributions are over the draft vocabulary when the draft has one (``DraftHead.vocabulary_logits``):
on SmolLM2 the whole 49k-row head was most of a training step.

Legend: T packed tokens, Np prompt tokens, M trained positions, Hd hidden size, V the draft's vocabulary
(Vd rows of the head, or all of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from turbogrpo.batch import Groups
from turbogrpo.hook import run_decoder
from turbogrpo.prefix.auto import fastest_shared_backend
from turbogrpo.prefix.backends import select_backend
from turbogrpo.prefix.layout import pack_groups
from turbogrpo.rollout.plans import padded_prompts
from turbogrpo.speculative.draft import CausalPlan, DraftHead, prompt_pairs
from turbogrpo.speculative.draft_unroll import position_losses, unrolled_draft_loss


class DraftTrainingSettings(Protocol):
    """The [draft] settings draft training reads: ``turbogrpo.config.DraftLearningConfig`` (the section)
    has them. Named here rather than imported, so that speculative/ builds on nothing of config.py
    (which imports the drafts' registries to check the [draft] section)."""

    lr: float
    weight_decay: float
    feature_weight: float
    logit_weight: float
    max_grad_norm: float
    ttt_steps: int
    """Unrolled steps of training-time test (1: teacher forcing alone; ``draft_unroll.py``)."""

    def check(self, key: str) -> None: ...


def DraftGroup(prompt: torch.Tensor, prompt_features: torch.Tensor, completions: list[torch.Tensor],
               completion_features: list[torch.Tensor]) -> Groups:
    """Deprecated (kept for one release): one group of draft data is a ``turbogrpo.batch.Groups`` with
    ``prompt_hidden`` and ``hidden``; ``Groups.concat`` joins several."""
    warnings.warn("turbogrpo.speculative.DraftGroup is deprecated; draft data is a turbogrpo.batch.Groups "
                  "(prompt_hidden=, hidden=; Groups.concat joins groups)", DeprecationWarning, stacklevel=2)
    return Groups([prompt], list(completions), [len(completions)], hidden=list(completion_features),
                  prompt_hidden=[prompt_features])


def num_trained(groups: Groups) -> int:
    """Positions ``groups`` trains: one per completion token whose next feature is known."""
    return sum(min(len(c), len(f) - 1) for c, f in zip(groups.completions, groups.hidden))


# -- data ---------------------------------------------------------------------------------------------


@torch.no_grad()
def prompt_features(policy: nn.Module, prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The policy's final hidden state ``[P, Hd]`` at every position of each prompt, in one forward.

    Prompts that start alike (a system prompt, a few-shot preamble) have equal features over their
    common prefix, so it runs once: the prefix is packed as the "prompt" and the rest of each prompt
    as its "completion" in the shared-prefix layout (exact, as in the trainer's forward).
    """
    prompts = list(prompts)
    shared = _common_prefix_length(prompts)
    if shared == 0:
        # Right padding and a causal mask: no real position sees padding.
        hidden_GPH = run_decoder(policy, *padded_prompts(prompts), CausalPlan())
        return [hidden_GPH[g, :len(p)] for g, p in enumerate(prompts)]
    layout = pack_groups([prompts[0][:shared]], [[p[shared:] for p in prompts]])
    plan = _shared_plan(layout, next(policy.parameters()).dtype, requires_grad=False)
    hidden_TH = run_decoder(policy, layout.input_ids[None], layout.position_ids[None], plan)[0]
    rests = hidden_TH[shared:].split([len(p) - shared for p in prompts])
    return [torch.cat([hidden_TH[:shared], rest]) for rest in rests]


def _common_prefix_length(prompts: list[torch.Tensor]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own."""
    limit = min(len(p) for p in prompts) - 1
    if limit < 1:
        return 0
    heads_GL = torch.stack([p[:limit] for p in prompts])
    # Host sync: the prefix length decides the packed layout (once per call).
    differs_L = (heads_GL != heads_GL[:1]).any(0)
    return int(differs_L.int().argmax()) if bool(differs_L.any()) else limit


@torch.no_grad()
def draft_groups(policy: nn.Module, prompts: Sequence[torch.Tensor],
                 completions: Sequence[Sequence[torch.Tensor]], *, groups_per_forward: int = 8,
                 draft: DraftHead | None = None) -> Groups:
    """Offline data: the policy's features of its own completions (a list per prompt), from
    shared-prefix forwards of ``groups_per_forward`` groups; every completion token is trained.
    ``draft``: the draft they are for, when it reads more of the policy's layers than the final one
    ("eagle3": the features are then its tapped layers' outputs and the final feature, from the same forwards)."""
    kept = [(p, [c.to(p.device) for c in cs if len(c) > 0]) for p, cs in zip(prompts, completions)]
    kept = [(p, cs) for p, cs in kept if cs]
    prompt_hidden, hidden = [], []
    for first in range(0, len(kept), groups_per_forward):
        chunk = kept[first:first + groups_per_forward]
        layout = pack_groups([p for p, _ in chunk], [cs for _, cs in chunk])
        plan = _shared_plan(layout, next(policy.parameters()).dtype, requires_grad=False)
        hidden_TH = _policy_features(policy, layout.input_ids[None], layout.position_ids[None], plan, draft)[0]
        # Per completion token, the flat position that predicted it (f[P-1+j]); then each completion's
        # last position (f[P+S-1]) completes its S + 1 features.
        predictors = hidden_TH[layout.predictor_index].split(layout.flat_completion_lengths)
        completion_ends = torch.tensor(layout.flat_completion_lengths).cumsum(0) + layout.num_prompt_tokens - 1
        last_H = hidden_TH[completion_ends.to(layout.device)]
        prompt_hidden.extend(hidden_TH[:layout.num_prompt_tokens].split(layout.prompt_lengths))
        hidden.extend(torch.cat([predictor, last_H[i, None]]) for i, predictor in enumerate(predictors))
    return Groups([p for p, _ in kept], [c for _, cs in kept for c in cs], [len(cs) for _, cs in kept], hidden=hidden,
                  prompt_hidden=prompt_hidden)


def _policy_features(policy: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, plan,
                     draft: DraftHead | None) -> torch.Tensor:
    """The policy features ``[B, T, draft.feature_width]`` a draft reads (the final hidden states, or with
    its tapped layers' outputs first), from one forward."""
    tap = None if draft is None else draft.feature_tap()
    if tap is None:
        return run_decoder(policy, input_ids, position_ids, plan)
    with tap:
        return tap.features(run_decoder(policy, input_ids, position_ids, plan))


def _shared_plan(layout, dtype: torch.dtype, requires_grad: bool):
    """The shared-prefix attention plan of ``layout``: these packs need the shared layout itself, so
    "auto"'s choice of the standard layout does not apply; the device's fastest shared backend does."""
    name = fastest_shared_backend(layout.device, dtype, requires_grad)
    return select_backend(name, layout.device, requires_grad=requires_grad).plan(layout)


# -- loss and optimizer steps ---------------------------------------------------------------------------


class PackedDraftBatch(NamedTuple):
    """Groups packed for one draft forward (shared-prefix layout of ``turbogrpo.prefix``)."""

    tokens_T: torch.Tensor        # [T] the draft's input tokens x[s]
    positions_T: torch.Tensor     # [T]
    features_TH: torch.Tensor     # [T, Hd] the draft's input features f[s-1]
    targets_MH: torch.Tensor      # [M, Hd] f[s] at the trained positions (the packed completion tokens)
    plan: Callable                # the shared-prefix attention over the pack
    num_prompt_tokens: int
    prompt_lengths: tuple[int, ...] = ()      # per packed prompt, its pairs (P')
    completion_lengths: tuple[int, ...] = ()  # per packed completion, its trained tokens (S), in pack order
    completion_prompts: tuple[int, ...] = ()  # per packed completion, its prompt's index in the pack
    next_tokens_M: torch.Tensor | None = None  # [M] the token after each trained one (x[s+1]), -1 where unknown


def pack_draft_batch(groups: Groups, *, requires_grad: bool, context_start: int = 0,
                     hidden_size: int | None = None) -> PackedDraftBatch:
    """Pack ``groups`` (completions cut to their trained tokens; completions with none are left out), each
    prompt from the pair at ``context_start`` on (the draft layout's first seen pair). ``hidden_size``: the
    width of the final feature, the last block of wider ("eagle3") features and the training target."""
    prompts, completions, inputs, targets, prompt_inputs, next_tokens = [], [], [], [], [], []
    for prompt, features, group, group_features in zip(groups.prompts, groups.prompt_hidden, groups.nested(),
                                                        groups.split(groups.hidden)):
        cut = [(c[:len(f) - 1], f) for c, f in zip(group, group_features) if len(f) > 1]
        if not cut:
            continue
        # The prompt pairs the draft sees (its layout may skip the first); completions follow them.
        prompt_tokens, prompt_features = prompt_pairs(prompt, features, context_start)
        prompts.append(prompt_tokens)
        completions.append([c for c, _ in cut])
        prompt_inputs.append(prompt_features)
        for (c, f), full in zip(cut, (c for c, f in zip(group, group_features) if len(f) > 1)):
            inputs.append(f[:len(c)])
            targets.append(f[1:len(c) + 1, -(hidden_size or f.shape[-1]):])
            following = full[1:len(c) + 1]
            next_tokens.append(torch.cat([following, following.new_full((len(c) - len(following),), -1)]))
    if not prompts:
        raise ValueError("no draft training data: every completion is shorter than two features")
    layout = pack_groups(prompts, completions)
    plan = _shared_plan(layout, groups.prompt_hidden[0].dtype, requires_grad=requires_grad)
    features_TH = torch.cat(prompt_inputs + inputs).to(layout.device)
    return PackedDraftBatch(layout.input_ids, layout.position_ids, features_TH, torch.cat(targets).to(layout.device),
                            plan, layout.num_prompt_tokens, tuple(len(p) for p in prompts),
                            tuple(len(c) for cs in completions for c in cs),
                            tuple(g for g, cs in enumerate(completions) for _ in cs),
                            torch.cat(next_tokens).to(layout.device))


def draft_loss(draft: DraftHead, groups: Groups,
               config: DraftTrainingSettings) -> tuple[torch.Tensor, dict]:
    """``w_v * SmoothL1(g, f) + w_p * CE(draft logits, policy distribution)`` over the trained positions
    (``config``: the [draft] section, its feature_weight and logit_weight).

    Returns the loss and metrics (both terms and the draft's top-1 agreement with the policy, both
    argmaxes taken over the draft vocabulary), as device tensors.
    """
    batch = pack_draft_batch(groups, requires_grad=torch.is_grad_enabled(),
                             context_start=draft.layout.context_start, hidden_size=draft.config.hidden_size)
    if getattr(config, "ttt_steps", 1) > 1:  # training-time test (draft_unroll.py); the deprecated config has none
        return unrolled_draft_loss(draft, batch, config)
    dtype = next(draft.parameters()).dtype
    predicted_1TH = draft(draft.input_features(batch.features_TH[None].to(dtype)), batch.tokens_T[None],
                          batch.positions_T[None], batch.plan)
    predicted_MH = predicted_1TH[0, batch.num_prompt_tokens:]
    return position_losses(draft, predicted_MH, batch.targets_MH.to(predicted_MH.dtype), config)


def make_optimizer(draft: DraftHead, config: DraftTrainingSettings) -> torch.optim.Optimizer:
    """AdamW over the draft's own parameters; a ValueError for a learning rate or weight decay that is not
    a finite number (an inf lr turns every weight into inf or NaN at the first step)."""
    for name in ("lr", "weight_decay"):
        value = getattr(config, name)
        if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
            raise ValueError(f"draft.{name} must be a finite number {'> 0' if name == 'lr' else '>= 0'}, got {value!r}")
    return torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def batches_of(groups: Groups, batch_size: int, generator: torch.Generator) -> list[Groups]:
    """The groups in a random order, cut into batches of at least ``batch_size`` completions (whole groups)."""
    batches, current, count = [], [], 0
    for index in torch.randperm(groups.num_groups, generator=generator).tolist():
        current.append(index)
        count += groups.sizes[index]
        if count >= batch_size:
            batches.append(groups.select(current))
            current, count = [], 0
    if current:
        batches.append(groups.select(current))
    return batches


def train_draft(draft: DraftHead, groups: Groups | Sequence[Groups], config: DraftTrainingSettings, *,
                num_epochs: int = 1, batch_size: int = 8, optimizer: torch.optim.Optimizer | None = None,
                seed: int = 0, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train ``draft`` on ``groups`` (the policy's parts get no gradient) for ``num_epochs`` passes, in
    batches of at least ``batch_size`` completions (whole groups).

    groups: a ``Groups`` with ``prompt_hidden`` and ``hidden`` (``draft_groups``; a list of them, as
        the deprecated ``DraftGroup`` built, is joined).

    config: the [draft] section (``turbogrpo.config.DraftLearningConfig()`` for the defaults), whose
        loss weights, lr, weight decay and clipping are used; checked here as a config file's is.
    Pass a persistent ``optimizer`` for online training across rollouts. Returns per-step metrics
    (floats); ``on_step(step, metrics)`` is called after every step (progress bars, logging).
    """
    num_epochs, batch_size = getattr(config, "num_epochs", num_epochs), getattr(config, "batch_size", batch_size)
    config.check("draft")
    if num_epochs < 1 or batch_size < 1:
        raise ValueError(f"num_epochs and batch_size must be >= 1, got {num_epochs} and {batch_size}")
    if not isinstance(groups, Groups):
        groups = Groups.concat(groups) if groups else Groups([], [], [])
    optimizer = optimizer or make_optimizer(draft, config)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(num_epochs):
        for batch in batches_of(groups, batch_size, generator):
            history.append(draft_train_step(draft, batch, optimizer, config))
            if on_step is not None:
                on_step(len(history), history[-1])
    return history


def draft_train_step(draft: DraftHead, batch: Groups, optimizer: torch.optim.Optimizer,
                     config: DraftTrainingSettings) -> dict[str, float]:
    """One AdamW step of the draft on ``batch``; returns its metrics as floats."""
    loss, metrics = draft_loss(draft, batch, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), config.max_grad_norm)
    optimizer.step()
    # Host sync, once per draft step: the metrics the caller logs.
    values = torch.stack([metrics[k] for k in metrics]).tolist()
    return dict(zip(metrics, values))


@dataclass(frozen=True)
class DraftTrainConfig:
    """Deprecated (kept for one release): pass the [draft] section, ``turbogrpo.config.DraftLearningConfig``,
    and give ``train_draft`` its ``num_epochs`` and ``batch_size``."""

    feature_weight: float = 1.0
    logit_weight: float = 0.1
    lr: float = 1e-4
    weight_decay: float = 0.0
    num_epochs: int = 1
    batch_size: int = 8
    max_grad_norm: float = 0.5

    def __post_init__(self):
        warnings.warn("turbogrpo.speculative.DraftTrainConfig is deprecated; pass turbogrpo.config."
                      "DraftLearningConfig and train_draft(..., num_epochs=, batch_size=)", DeprecationWarning,
                      stacklevel=3)
        self.check("draft training")

    def check(self, key: str) -> None:
        for name in ("lr", "batch_size", "num_epochs", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{key} {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("feature_weight", "logit_weight", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{key} {name} must be >= 0, got {getattr(self, name)!r}")
