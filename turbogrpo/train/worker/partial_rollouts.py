"""Partial rollouts (train.partial_rollouts = c > 0): a step's rollout does not wait for its longest generations.

The rollout worker keeps a pool of groups. Step s's rollout (a *segment*) decodes every unfinished member of the
pool together with the G members of the groups it starts, and stops at the first host check where

    (1) at least ``num_groups`` (this rank's prompts per step) groups are whole (all G members finished), and
    (2) every group started c segments ago or earlier is whole (it cannot be carried again);

the step's batch is then the oldest ``num_groups`` whole groups (those of (2) among them), and the rest of the pool,
finished or not, is carried into segment s + 1. A carried member is continued from its ids (prompt + its tokens,
prefilled afresh: its KV is dropped, the new weights need a new one anyway) with the limit it has left; its tokens
keep the policy versions and the sampler's log-probs that drew them, so the decoupled-PPO weight is per token.
With MoE routing replay (algo.routing_replay) they keep their routes too: the group's prompt routes and each
member's token routes travel with the pool, and the carried prefix's prefill replays them, so every token runs
the experts the weights that drew it chose, in the segment that drew it and in every later one (and the trainer
replays those).

Why the pool holds two steps of groups. GRPO trains whole groups and a step trains ``num_groups`` of them; if a
segment started only as many as it must deliver, it would have to wait for all of them, and nothing would ever be
carried. So the first segment starts the prompts of steps 0 and 1, and segment s > 0 those of step s + 1 (APRIL
over-samples the same way): the pool is ``2 x num_groups`` groups at every segment's start and ``num_groups`` after
it. The last segment starts none (nothing would train them).

Staleness. Segment s samples with version max(0, s - (k - c)) (the worker runs k - c steps ahead), and a group is
trained at most c segments after the one that started it, so its oldest token lags at most (k - c) + c = k updates:
no token older than train.max_staleness enters a loss, by construction (nothing is dropped or redrawn).

Exactness and resume. A segment is a function of the pool, its prompts, its seed and its version (the stop is read
at host checks, never timed), so a run with partial rollouts is reproducible. The pool after each step travels to
the trainer with the step's batch; a checkpoint at step t holds the pool after step t - 1 (ids, log-probs, versions
as safetensors; each group's prompt by its row index), and the resumed worker continues from it: redrawing by seed
would need every earlier segment (a pool's groups descend from all of them).

Shapes: G members per group, S_i a member's tokens so far, P a prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from turbogrpo.batch import Groups
from turbogrpo.data import PromptExample
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.types import RolloutStats


@dataclass
class PendingGroup:
    """One prompt's G members as far as they have been drawn."""

    example: PromptExample
    started: int
    """The segment (step) whose rollout started it."""
    tokens: list[torch.Tensor]
    """G ``[S_i]`` int64: the ids drawn so far."""
    logps: list[torch.Tensor]
    """G ``[S_i]``: the sampler's log-prob of each (the behaviour policy's, per token)."""
    versions: list[torch.Tensor]
    """G ``[S_i]`` int64: the policy version (optimizer steps) that drew each."""
    reasons: list[str | None]
    """G finish reasons: "stop" / "length" once finished, None while still running."""
    prompt_routes: torch.Tensor | None = None
    """With routes recorded (algo.routing_replay): ``[P, L, k]``, the prompt's MoE routes at its first prefill."""
    routes: list[torch.Tensor] | None = None
    """With routes recorded: G ``[R_i, L, k]``, R_i = S_i - 1 (the newest id is run by the next segment): the MoE
    routes each token ran with when drawn."""

    @staticmethod
    def start(example: PromptExample, segment: int, num_members: int) -> PendingGroup:
        empty = torch.zeros(0, dtype=torch.long)
        return PendingGroup(example, segment, [empty] * num_members, [empty.float()] * num_members,
                            [empty] * num_members, [None] * num_members)

    @property
    def whole(self) -> bool:
        return all(reason is not None for reason in self.reasons)

    def prefix_routes(self, member: int) -> torch.Tensor | None:
        """``[P + R_i, L, k]``: the routes member ``member``'s prefix (prompt + tokens) ran with, but its newest
        token's (None before the group's first segment, or without routes)."""
        if self.prompt_routes is None:
            return None
        return torch.cat([self.prompt_routes, self.routes[member]])

    def add_routes(self, member: int, prefix_routes: torch.Tensor, new_routes: torch.Tensor) -> None:
        """A segment's routes of member ``member``: its prefix's (``[P + S_i, L, k]``, the carried ones replayed,
        the newest carried token's run now) and its new tokens' but the last (``[S_new - 1, L, k]``)."""
        prompt_length = self.example.token_ids.numel()
        if self.prompt_routes is None:  # the group's first segment: its prompt's routes, as its prefill ran them
            self.prompt_routes = prefix_routes[:prompt_length].cpu()
            self.routes = [prefix_routes[:0].cpu()] * len(self.reasons)
        self.routes[member] = torch.cat([prefix_routes[prompt_length:], new_routes]).cpu()


@dataclass
class PartialRollouts:
    """The worker's pool, and the segment that advances it by one step."""

    num_members: int
    """G: rollout.num_generations."""
    max_new_tokens: int
    """A member's limit over all its segments (rollout.max_new_tokens)."""
    max_carries: int
    """c: train.partial_rollouts."""
    pool: list[PendingGroup] = field(default_factory=list)
    """Oldest first."""

    def segment(self, engine, policy: nn.Module, sampling: SamplingConfig, *, index: int,
                examples: Sequence[PromptExample], num_groups: int, seed: int, version: int, draft: object | None = None
                ) -> tuple[Rollout, list[PromptExample]]:
        """Step ``index``'s rollout: start ``examples``' groups, decode the pool with weights ``version``
        (optimizer steps; speculatively with ``draft``, that version's) until the module docstring's stop, and
        take the batch out of the pool. Returns the batch (``num_groups`` whole groups; stats of this segment's
        decoding) and its groups' examples."""
        self.pool += [PendingGroup.start(e, index, self.num_members) for e in examples]
        must_go = [index - group.started >= self.max_carries for group in self.pool]
        rows = [(g, m) for g, group in enumerate(self.pool) for m, reason in enumerate(group.reasons) if reason is None]
        device = next(policy.parameters()).device
        if rows:
            prefixes = [torch.cat([self.pool[g].example.token_ids, self.pool[g].tokens[m]]).to(device) for g, m in rows]
            limits = [self.max_new_tokens - len(self.pool[g].tokens[m]) for g, m in rows]
            until = _BatchComplete(self.pool, rows, must_go, num_groups)
            prefix_routes = [self.pool[g].prefix_routes(m) for g, m in rows]
            rollout = engine.sample_partial(policy, prefixes, limits=limits, sampling=sampling, seed=seed, until=until,
                                            draft=draft, prefix_routes=None if all(r is None for r in prefix_routes)
                                            else prefix_routes)
            self._extend(rows, rollout.groups, limits, version)
            stats = rollout.stats
        else:  # every group of the pool already whole: nothing to decode
            stats = RolloutStats()
        taken = _oldest_whole(self.pool, num_groups)
        assert all(g in taken for g, must in enumerate(must_go) if must), "a group would lag past max_staleness"
        batch = [self.pool[g] for g in taken]
        self.pool = [group for g, group in enumerate(self.pool) if g not in taken]
        return Rollout(_as_groups(batch, device), stats), [group.example for group in batch]

    def _extend(self, rows: list[tuple[int, int]], drawn: Groups, limits: list[int], version: int) -> None:
        """Append each row's new tokens (drawn by ``version``) to its member; finished where it stopped or reached
        its limit, still running where the segment stopped it (with its routes, where the engine recorded them)."""
        for row, ((g, m), tokens, logps, reason, limit) in enumerate(zip(rows, drawn.completions, drawn.sampler_logps,
                                                                         drawn.finish_reasons, limits)):
            group = self.pool[g]
            if drawn.routes is not None:
                group.add_routes(m, drawn.prompt_routes[row], drawn.routes[row])
            group.tokens[m] = torch.cat([group.tokens[m], tokens.cpu()])
            group.logps[m] = torch.cat([group.logps[m].to(logps.dtype), logps.cpu()])
            group.versions[m] = torch.cat([group.versions[m], torch.full((len(tokens),), version, dtype=torch.long)])
            group.reasons[m] = "stop" if reason == "stop" else "length" if len(tokens) >= limit else None

    # --- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """The pool as tensors (``carried/<group>/<member>/{tokens,logps,versions}``) and per group its prompt's
        row index (``PromptExample.index``), start segment and finish reasons."""
        return pool_state(self.pool)

    def load_state_dict(self, pool: list[PendingGroup]) -> None:
        self.pool = list(pool)


def pool_state(pool: Sequence[PendingGroup]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``PartialRollouts.state_dict`` of ``pool`` (with routes: ``carried/<group>/prompt_routes`` and
    ``carried/<group>/<member>/routes`` too)."""
    tensors = {f"carried/{g}/{m}/{name}": getattr(group, name)[m].contiguous()
               for g, group in enumerate(pool) for m in range(len(group.reasons))
               for name in ("tokens", "logps", "versions", "routes") if getattr(group, name) is not None}
    tensors.update({f"carried/{g}/prompt_routes": group.prompt_routes.contiguous()
                    for g, group in enumerate(pool) if group.prompt_routes is not None})
    scalars = [{"index": group.example.index, "started": group.started, "reasons": list(group.reasons)}
               for group in pool]
    return tensors, scalars


def restore_pool(tensors: dict[str, torch.Tensor], scalars: list[dict],
                 examples: Sequence[PromptExample]) -> list[PendingGroup]:
    """``pool_state``'s pool again, each group's example looked up by its row index among ``examples``.

    A pool that lacks one of the tensors or fields ``pool_state`` writes (a checkpoint cut by hand, a worker of
    another version) is refused with a ValueError naming what is missing, before any group is rebuilt."""
    by_index = {e.index: e for e in examples}
    pool = []
    for g, saved in enumerate(scalars):
        missing = [k for k in ("index", "started", "reasons") if k not in saved]
        if missing:
            raise ValueError(f"the carried generations' group {g} lacks {', '.join(missing)}: the checkpoint or "
                             "worker pool is not one this version of turbogrpo wrote")
        if saved["index"] not in by_index:
            raise ValueError(f"the checkpoint's carried generations name prompt row {saved['index']}, which this "
                             "run's data does not have; resume with the data the run started with")
        members = range(len(saved["reasons"]))
        routed = f"carried/{g}/prompt_routes" in tensors

        def carried(name: str) -> list[torch.Tensor]:
            keys = [f"carried/{g}/{m}/{name}" for m in members]
            absent = [k for k in keys if k not in tensors]
            if absent:
                raise ValueError(f"the carried generations lack {', '.join(absent)}: the checkpoint or worker pool "
                                 "is incomplete")
            return [tensors[k] for k in keys]

        pool.append(PendingGroup(by_index[saved["index"]], saved["started"],
                                 *(carried(name) for name in ("tokens", "logps", "versions")), list(saved["reasons"]),
                                 tensors.get(f"carried/{g}/prompt_routes"), carried("routes") if routed else None))
    return pool


class _BatchComplete:
    """The segment's stop, read at each host check: enough whole groups, and every group that must go whole."""

    def __init__(self, pool: list[PendingGroup], rows: list[tuple[int, int]], must_go: list[bool], num_groups: int):
        self.num_groups, self.must_go = num_groups, must_go
        self.group_of_row = [g for g, _ in rows]
        # Members still running at the segment's start, per group (a group with none is whole already).
        self.running = [0] * len(pool)
        for g in self.group_of_row:
            self.running[g] += 1

    def __call__(self, finished_rows: list[bool]) -> bool:
        left = list(self.running)
        for g, finished in zip(self.group_of_row, finished_rows):
            left[g] -= finished
        whole = [n == 0 for n in left]
        return sum(whole) >= self.num_groups and all(w for w, must in zip(whole, self.must_go) if must)


def _oldest_whole(pool: list[PendingGroup], num_groups: int) -> list[int]:
    return [g for g, group in enumerate(pool) if group.whole][:num_groups]


def _as_groups(batch: list[PendingGroup], device: torch.device) -> Groups:
    """The batch's groups as the loop takes them, on ``device`` as a rollout gives them (the pool stays on the host,
    what a checkpoint saves): every member's ids, sampler log-probs and per-token versions (host, as ever)."""
    on = lambda tensors: [t.to(device) for t in tensors]  # noqa: E731
    routed = all(group.prompt_routes is not None for group in batch) and bool(batch)
    return Groups.from_nested([group.example.token_ids.to(device) for group in batch],
                              [on(group.tokens) for group in batch], finish_reasons=[group.reasons for group in batch],
                              sampler_logps=[on(group.logps) for group in batch],
                              versions=[group.versions for group in batch],
                              routes=[group.routes for group in batch] if routed else None,
                              prompt_routes=[group.prompt_routes for group in batch] if routed else None)
