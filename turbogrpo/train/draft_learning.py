"""Speculative rollouts inside GRPO, and the draft's online learning (DESIGN.md Part 2).

    rollout with the draft (rollout.speculation: its tree-sizing policy), keeping the policy's
        features of every generated token (return_hidden)
    collect: the rollout's features plus the policy's features of the prompts (one forward over the
        distinct prompts, the same weights as the rollout), within the token budget
    ... rewards, advantages, policy update (the draft frozen) ...
    learn: draft.steps AdamW steps on the collected data (the policy frozen)

The draft trains on every group, zero-advantage groups included (the policy update skips those; the
draft learns the policy's distribution, which they show as well as any). Acceptance statistics live
in the sizing policy, which is built once per run: after a draft update, older acceptance counts are
discounted (``FORGET``), so the sizing follows the improving draft.

Determinism: the draft's data selection and batch order are seeded by the rollout seed, and the draft,
its optimizer and the sizing statistics are in the checkpoint, so a resumed run continues the same
draft. With ``fixed`` sizing a run (and its resume) is bit-exact; ``fastgrpo`` and ``cost`` choose
tree shapes from measured times, and the shape decides how many random numbers a step draws, so
their samples (equally distributed) can differ between runs.

History drafts (draft.history): one ``HistoryStore`` for the run keeps earlier steps' completions of
each prompt; it is not in the checkpoint, so a resumed run starts it empty (its samples keep their
distribution; only which trees are proposed differs).

Distributed: every rank trains its own draft on its own rollouts and saves it with its RNG state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from turbogrpo.architectures import hybrid_layers
from turbogrpo.batch import Groups
from turbogrpo.config import DraftLearningConfig
from turbogrpo.rollout import Rollout
from turbogrpo.speculative.decode import SpeculativeStats
from turbogrpo.speculative.speculation import Speculation
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.built_drafts import resolve_draft_path
from turbogrpo.speculative.history import HistoryDrafts, speculation_sizing
from turbogrpo.speculative.draft_training import (draft_groups, make_optimizer, num_trained, prompt_features,
                                                  train_draft)
from turbogrpo.speculative.profiler import cached_profile
from turbogrpo.speculative.sizing import SizingPolicy

FORGET = 0.5
"""Weight of the acceptance counts seen before a draft update: about the last two rollouts count."""


@contextlib.contextmanager
def frozen(module: nn.Module | None) -> Iterator[None]:
    """No parameter of ``module`` takes a gradient inside the block; the flags are restored after."""
    params = list(module.parameters()) if module is not None else []
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


@dataclass
class OnlineDraft:
    """A run's draft head, its optimizer (None: frozen) and its tree-sizing policy."""

    draft: DraftHead
    sizing: SizingPolicy
    optimizer: torch.optim.Optimizer | None
    settings: DraftLearningConfig
    """The [draft] section: loss weights, lr, steps per GRPO step, the token budget (max_tokens)."""
    history: HistoryDrafts | None = None
    """History/sibling drafts merged into the draft's trees; one object for the run, so that its store
    keeps earlier steps' completions of recurring prompts (None: the neural draft alone)."""

    @property
    def learns(self) -> bool:
        return self.optimizer is not None

    def speculation(self) -> Speculation:
        return Speculation(self.draft, sizing=self.sizing, history=self.history)

    def collect(self, policy: nn.Module, rollout: Rollout, seed: int) -> Groups:
        """The draft's training data from ``rollout`` (generated with ``return_hidden``): every group,
        zero-advantage ones included, or a random (seeded) share of them within the token budget.
        Call before the policy update, so that the prompts' features come from the weights that
        generated the completions."""
        batch = rollout.groups
        generator = torch.Generator().manual_seed(seed)
        if batch.hidden is None or self.draft.config.feature_layers:
            # An engine that keeps no features (vLLM), or a draft that reads more of the policy's layers than
            # the rollout keeps ("eagle3"): one shared-prefix forward of the picked groups gives them, every
            # completion token trained.
            picked = batch.pick(within_budget(batch.prompt_lengths, batch.split(batch.lengths),
                                              self.settings.max_tokens, generator))
            return draft_groups(policy, picked.prompts, picked.nested(), draft=self.draft)
        chosen = within_budget(batch.prompt_lengths, batch.split([n - 1 for n in batch.lengths]),
                               self.settings.max_tokens, generator)
        picked = batch.pick(chosen)
        return replace(picked, sampler_logps=None, prompt_hidden=prompt_features(policy, picked.prompts))

    def learn(self, policy: nn.Module, groups: Groups, seed: int) -> dict[str, float]:
        """``steps`` AdamW steps of the draft on ``groups`` with the policy frozen; the step's metrics."""
        if not groups.num_groups:
            return {}
        num_completions = groups.num_completions
        with frozen(policy):
            history = train_draft(self.draft, groups, self.settings, optimizer=self.optimizer, seed=seed,
                                  batch_size=-(-num_completions // self.settings.steps))
        self.sizing.forget(FORGET)
        metrics = {f"draft/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}
        metrics["draft/tokens"] = float(num_trained(groups))
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON scalars): the draft's weights, its optimizer's state, the sizing statistics."""
        tensors = {f"draft/{k}": v for k, v in self.draft.state_dict().items()}
        scalars: dict = {"sizing": {}}
        for key, value in self.sizing.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors[f"sizing/{key}"] = value
            else:
                scalars["sizing"][key] = value
        if self.optimizer is not None:
            state = self.optimizer.state_dict()
            for index, per_param in state["state"].items():
                for key, value in per_param.items():
                    tensors[f"optimizer/{index}/{key}"] = value
            scalars["optimizer_groups"] = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                                           for g in state["param_groups"]]
        return tensors, scalars

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        device = next(self.draft.parameters()).device
        self.draft.load_state_dict({k.removeprefix("draft/"): v.to(device) for k, v in tensors.items()
                                    if k.startswith("draft/")})
        sizing = dict(scalars["sizing"])
        sizing.update({k.removeprefix("sizing/"): v for k, v in tensors.items() if k.startswith("sizing/")})
        self.sizing.load_state_dict(sizing)
        if self.optimizer is not None:
            state: dict[int, dict] = {}
            for key, value in tensors.items():
                if key.startswith("optimizer/"):
                    _, index, name = key.split("/")
                    state.setdefault(int(index), {})[name] = value.to(device) if name != "step" else value
            groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in scalars["optimizer_groups"]]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def within_budget(prompt_lengths: list[int], trainable: list[list[int]], max_tokens: int,
                  generator: torch.Generator) -> list[list[int]]:
    """Per group, the completions (indices, in order) to train on: all of them when ``max_tokens`` is 0.

    Otherwise groups are taken in a random order, each with as many of its completions as fit, until
    the draft's tokens (a group's prompt once, plus its completions' trained tokens) reach
    ``max_tokens``: whole groups cost the fewest prompt tokens per trained token. At least one
    completion is always taken.
    """
    if max_tokens == 0:
        return [list(range(len(group))) for group in trainable]
    chosen: list[list[int]] = [[] for _ in trainable]
    total = 0
    for g in torch.randperm(len(trainable), generator=generator).tolist():
        cost = prompt_lengths[g]
        for i, tokens in enumerate(trainable[g]):
            if total and total + cost + tokens > max_tokens:
                break
            chosen[g].append(i)
            total += cost + tokens
            cost = 0
    return chosen


def build_online_draft(speculation: str, settings: DraftLearningConfig, policy: nn.Module,
                       context_length: int) -> OnlineDraft | None:
    """The run's draft from the [draft] section, sized by the tree-sizing policy ``speculation``
    (rollout.speculation; None when "off"). ``context_length``: the tokens a typical decoding step
    attends to (longest prompt + half the completion limit), for the profile."""
    if speculation == "off":
        if settings.path != "scratch":  # a [draft] section set for nothing is a mistake worth a line
            warnings.warn(f"draft.path = {settings.path!r} is not used: rollout.speculation is \"off\", so "
                          "rollouts decode without a draft; set rollout.speculation (e.g. \"cost\") to use it",
                          UserWarning, stacklevel=2)
        return None
    draft = (DraftHead(policy, num_layers=settings.num_layers, layout=settings.layout) if settings.path == "scratch"
             else DraftHead.load(resolve_draft_path(settings.path), policy))
    if settings.init_from_policy:  # the config allows it for a scratch draft only
        draft.init_from_policy()
    profile = None
    if speculation in ("fastgrpo", "cost"):
        # Measured once per (model, device, context) and cached on disk: a few seconds the first time.
        profile = cached_profile(policy, context_length=context_length, draft=draft)
    history = HistoryDrafts() if settings.history else None  # one store for the run: prompts recur
    sizing = speculation_sizing(speculation, profile, neural=True, history=history is not None,
                                chains=hybrid_layers(policy.config) is not None)   # a hybrid verifies chains
    optimizer = make_optimizer(draft, settings) if settings.learn else None
    return OnlineDraft(draft, sizing, optimizer, settings, history)


def speculation_metrics(stats) -> dict[str, float]:
    """Per-step speculation figures from a rollout's stats ({} for a plain rollout).

    accepted_length: tokens emitted per sequence per policy forward over the tree steps;
    tokens_per_forward: the same over every decoding step (plain steps count 1);
    tree_size: mean nodes per sequence over the tree steps; frac_tree_steps: steps that verified a tree;
    live_batch: mean live sequences per step; draft_forwards; time/draft_forward: seconds in the draft's
    own passes (prompt, catch-up, tree levels), within time/rollout.
    """
    if not isinstance(stats, SpeculativeStats):
        return {}
    batches, trees, accepted = stats.live_batch_sizes, stats.tree_sizes, stats.accepted_lengths
    num_steps = max(len(trees), 1)
    tree_steps = [n for n in trees if n > 1]
    rows = sum(batches[:len(accepted)]) or 1
    metrics = {
        "spec/accepted_length": stats.mean_accepted_length,
        "spec/tokens_per_forward": sum(b * a for b, a in zip(batches, accepted)) / rows,
        "spec/tree_size": sum(tree_steps) / len(tree_steps) if tree_steps else 1.0,
        "spec/frac_tree_steps": len(tree_steps) / num_steps,
        "spec/live_batch": sum(batches) / max(len(batches), 1),
        "spec/draft_forwards": float(stats.num_draft_forwards),
    }
    metrics["time/draft_forward"] = float(stats.draft_seconds)
    return metrics
