"""What the trainer checks in each rollout its worker sends (train.max_staleness > 0) before training on it: that it
is the rollout of the request the trainer made. A worker that sends another step's rollout, other prompts, groups of
another size or ids past the vocabulary would otherwise be trained on (or fail deep in the loss, blaming the data).

Each check is one line of ``RolloutMismatch``, which the trainer raises as the worker's fault.
"""

from __future__ import annotations

import torch

from turbogrpo.data import PromptExample
from turbogrpo.train.worker.protocol import Drawn, Request

PER_TOKEN_FIELDS = ("sampler_logps", "model_mask", "versions")
"""``Groups`` fields with one ``[S_i]`` tensor per completion."""


class RolloutMismatch(ValueError):
    """A rollout is not the one asked for; the message says how."""


def check_rollout(request: Request, drawn: Drawn, *, num_generations: int, vocab_size: int,
                  rows: dict[int, PromptExample]) -> None:
    """Raise ``RolloutMismatch`` where ``drawn`` is not ``request``'s rollout: its groups' prompts are the request's
    (with partial rollouts: the prompts of known rows, ``request.num_groups`` groups; an [env] run's as many), each
    group has
    ``num_generations`` completions, every completion id lies in ``[0, vocab_size)`` and every per-token field has
    its completion's length."""
    groups = drawn.rollout.groups
    if drawn.examples is None:
        expected = request.prompts
    else:
        unknown = [e.index for e in drawn.examples if e.index not in rows]
        if unknown:
            raise RolloutMismatch(f"it names prompt rows {unknown[:5]} that this run does not have")
        expected = [rows[e.index].token_ids for e in drawn.examples]
        if len(expected) != request.num_groups:
            raise RolloutMismatch(f"it has {len(expected)} groups where step {request.step + 1} trains "
                                  f"{request.num_groups}")
    if len(groups.prompts) != len(expected):
        raise RolloutMismatch(f"it has {len(groups.prompts)} groups for the {len(expected)} prompts asked")
    # An [env] run's prompts are rendered on the worker's side (each environment's reset adds to them): counted
    # above, their ids checked below.
    for k, (got, asked) in enumerate(zip(groups.prompts, expected) if drawn.episodes is None else ()):
        if got.shape != asked.shape or not torch.equal(got.cpu(), asked.cpu()):
            raise RolloutMismatch(f"group {k}'s prompt is not the prompt asked ({got.numel()} tokens for "
                                  f"{asked.numel()})")
    if len(groups.sizes) != len(expected) or any(size != num_generations for size in groups.sizes):
        raise RolloutMismatch(f"its groups have {list(groups.sizes)[:8]} completions where each has "
                              f"{num_generations} (rollout.num_generations)")
    if len(groups.completions) != sum(groups.sizes):
        raise RolloutMismatch(f"it has {len(groups.completions)} completions for groups of {sum(groups.sizes)}")
    sequences = [*groups.completions, *groups.prompts]
    for i, ids in enumerate(sequences):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise RolloutMismatch(f"{_sequence(i, groups)} is a {ids.dtype} tensor of shape {list(ids.shape)}, "
                                  "not token ids")
    outside = [(ids < 0) | (ids >= vocab_size) for ids in sequences]
    if outside and torch.cat([o.any().reshape(1) for o in outside]).any():  # one host sync per rollout
        i = next(i for i, o in enumerate(outside) if o.any())
        ids = sequences[i]
        raise RolloutMismatch(f"{_sequence(i, groups)} has token ids outside the vocabulary [0, {vocab_size}) (from "
                              f"{int(ids.min())} to {int(ids.max())})")
    for name in PER_TOKEN_FIELDS:
        values = getattr(groups, name)
        if values is None:
            continue
        if len(values) != len(groups.completions) or any(
                v.shape != c.shape for v, c in zip(values, groups.completions)):
            raise RolloutMismatch(f"its {name} do not have one value per completion token")


def _sequence(index: int, groups) -> str:
    """How a message names sequence ``index`` of the completions, then the prompts, that ``check_rollout`` reads."""
    num_completions = len(groups.completions)
    return f"completion {index}" if index < num_completions else f"group {index - num_completions}'s prompt"
