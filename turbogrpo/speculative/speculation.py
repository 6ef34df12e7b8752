"""``Speculation``: what ``generate(draft=...)`` and ``generate_multiturn(draft=...)`` are given.

It holds the draft head, the history store and the tree sizing, and hands each rollout loop its
speculative step: the single-turn engine asks ``make_step`` (``turbogrpo.speculative.decode``), the
multi-turn rollout calls ``run_multiturn`` (``turbogrpo.speculative.multiturn``). The rollout package
never imports this one; it finds both through the object it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from turbogrpo.architectures import hybrid_layers
from turbogrpo.rollout.compiled import RUNNERS
from turbogrpo.rollout.decode import generate
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.types import Rollout
from turbogrpo.speculative.decode import TreeStep, check_draft
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.history import HistoryDrafts, speculation_sizing
from turbogrpo.speculative.multiturn import run_multiturn
from turbogrpo.speculative.profiler import LatencyProfile, cached_profile
from turbogrpo.speculative.sizing import SizingPolicy


@dataclass
class Speculation:
    """How ``generate(draft=...)`` speculates: the draft head, its tree sizing and runner."""

    draft: DraftHead | None
    """The neural draft; None speculates with ``history`` alone (no draft forward)."""
    sizing: SizingPolicy | str = "cost"
    """A sizing policy object (it keeps its acceptance statistics across rollouts) or a registered
    name (``off``, ``fixed``, ``fastgrpo``, ``cost``), built afresh for each rollout. With both a neural
    draft and ``history``, an adaptive name builds a ``MergedSizing``: each step the better of the neural
    tree (history chains merged in) and the history's chains alone (``history.speculation_sizing``)."""
    profile: LatencyProfile | None = None
    """Latency curves for ``fastgrpo``/``cost``; None reads the profile cache or measures on first use."""
    runner: str = "eager"
    """Key of ``turbogrpo.rollout.compiled.RUNNERS``: how the tree step's device parts, and the plain steps between
    trees, run (eager, or compiled whole by ``torch.compile``; "compiled-onednn" with the rollout's packed weight
    products). The parts compile with dynamic sizes (tree shape, catch-up width, cache bound), so a rollout compiles
    each a few times at its start; the default stays eager (not yet measured faster)."""
    history: HistoryDrafts | None = None
    """Suffix-match candidates from the group's siblings and earlier rollouts (``history.py``), merged
    into the neural draft's trees, or alone when ``draft`` is None. Keep one object across rollouts so
    that its store remembers earlier completions of recurring prompts."""

    def rollout_modules(self) -> list[nn.Module]:
        """Modules the rollout runs besides the policy (their weight matmuls follow
        ``DecodeSchedule.linears`` like the policy's)."""
        return [] if self.draft is None else [self.draft]

    def make_step(self, model: nn.Module, prompts: list[torch.Tensor], sampling: SamplingConfig) -> TreeStep:
        """The engine's ``DecodeStep`` for one rollout (see ``turbogrpo.rollout.step``)."""
        # A hybrid's recurrent states follow a chain (kept per length until the commit, rollout.states), not a tree's
        # branches: it speculates with one chain per row (the neural draft's top path, or a history chain).
        chains_only = hybrid_layers(model.config) is not None
        if self.draft is not None or self.history is None:
            check_draft(self.draft, model)
        if self.history is not None and not isinstance(self.history, HistoryDrafts):
            raise ValueError(f"Speculation.history must be a HistoryDrafts or None, got {type(self.history).__name__}")
        if self.runner not in RUNNERS:
            raise ValueError(f"Speculation.runner must be one of {sorted(RUNNERS)}, got {self.runner!r}")
        return TreeStep(self.draft, resolve_sizing(self, model, prompts, sampling), self.runner, self.history,
                        chains_only)

    def run_multiturn(self, model: nn.Module, prompts: list[torch.Tensor], num_samples: int, conversations: list,
                      sampling: SamplingConfig, limits, generator: torch.Generator | None, pool, timing,
                      recorder=None):
        """The multi-turn rollout's loop with this speculation (``generate_multiturn(draft=...)`` calls it;
        ``turbogrpo.speculative.multiturn``): its stats, and with ``recorder`` (a ``moe_routes.RouteRecorder``) the
        prompts' MoE routes (the conversations keep theirs)."""
        if self.draft is not None and self.draft.config.feature_layers:
            raise ValueError("multi-turn rollouts do not keep the policy layers an \"eagle3\" draft reads; use a "
                             "\"turbogrpo\" or \"eagle\" draft (draft.layout) for multi-turn speculation")
        return run_multiturn(model, prompts, num_samples, conversations, sampling, limits, generator, pool, timing,
                             self.make_step, recorder)


def generate_speculative(model: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
                         sampling: SamplingConfig, draft: DraftHead | Speculation, seed: int | None = None,
                         return_hidden: bool = False,
                         max_new_tokens_per_completion: Sequence[int] | None = None) -> Rollout:
    """``turbogrpo.rollout.generate(..., draft=Speculation(draft))``: the same inputs, checks and outputs;
    a bare ``DraftHead`` is wrapped as ``Speculation(draft)`` (the default sizing)."""
    speculation = Speculation(draft) if isinstance(draft, DraftHead) else draft
    return generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=seed,
                    return_hidden=return_hidden, draft=speculation,
                    max_new_tokens_per_completion=max_new_tokens_per_completion)


def resolve_sizing(speculation: Speculation, model: nn.Module, prompts: list[torch.Tensor],
                   sampling: SamplingConfig) -> SizingPolicy:
    if isinstance(speculation.sizing, SizingPolicy):
        return speculation.sizing
    profile = speculation.profile
    if profile is None and speculation.sizing in ("fastgrpo", "cost"):
        # The context a typical step attends to: the longest prompt plus half the generation.
        context = max(len(p) for p in prompts) + sampling.max_new_tokens // 2
        profile = cached_profile(model, context_length=context, draft=speculation.draft)
    return speculation_sizing(speculation.sizing, profile, neural=speculation.draft is not None,
                              history=speculation.history is not None,
                              chains=hybrid_layers(model.config) is not None)
