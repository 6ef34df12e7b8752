"""A decoding step: the protocol the engine's one loop runs, its state, and the plain step.

The engine (``engine.py``) owns the loop: prefill, first draw, then windows of steps with one host
check between windows (finished rows, compaction). What a step does between two host checks is a
``DecodeStep``: the plain step below (one token per live sequence), or a speculative tree step
(``turbogrpo.speculative``, which supplies it through ``draft.make_step(...)``; the engine never
imports it).

A step must not sync with the host (no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``): the
engine runs ``host_check_every`` of them back to back and reads every result at once. Finished rows
stay in the batch until the next compaction; ``emit`` gives them nothing, the cache does not commit
their tokens, so their extra draws are dropped.

Legend: ``N`` completions, ``B`` rows of the decoding batch (live or finished, not yet retired),
``V`` vocabulary, ``Hd`` hidden size, ``S`` most decoding steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from turbogrpo.moe_routes import RouteLog
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.outputs import LiveRows, OutputBuffers, emit
from turbogrpo.rollout.plans import forward_new_tokens
from turbogrpo.rollout.sampling import SamplingConfig, at_least_float32, sample_with_logprobs
from turbogrpo.rollout.stopping import StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats


@dataclass
class DecodeState:
    """Everything a step reads and writes, on the device; rows are those of the decoding batch."""

    model: nn.Module
    lm_head: nn.Module
    """The policy's logits head (``turbogrpo.output_head.logits_head``): hidden ``[B, Hd]`` -> its own logits ``[B, V]``."""
    sampling: SamplingConfig
    generator: torch.Generator | None
    criteria: StopCriteria
    cache: GroupedKVCache
    outputs: OutputBuffers
    live: LiveRows
    next_B: torch.Tensor
    """[B] int64: each row's newest emitted token, not yet run through the policy."""
    prompts: list[torch.Tensor]
    num_samples: int
    prompt_hidden_GPH: torch.Tensor
    """The policy's final hidden state at every prompt position (read by a draft's prompt pass)."""
    live_counts_S: torch.Tensor
    """[S] int64: live rows entering each decoding step, written on the device, read at host checks."""
    step_index: torch.Tensor
    """[1] int64: the next decoding step's index into ``live_counts_S`` (a device counter)."""
    uniform_N: torch.Tensor
    """[N] float32: the uniform numbers of the next draw, one per completion."""
    route_log: RouteLog | None = None
    """The MoE routes of the tokens run so far, when the rollout records them (``turbogrpo.moe_routes``)."""

    @property
    def num_completions(self) -> int:
        return self.outputs.lengths_N.shape[0]

    def refill_uniforms(self) -> None:
        """Draw the next step's uniform numbers, one per completion, into ``uniform_N`` (outside the
        step: a ``torch.Generator`` cannot be traced by ``torch.compile``; no-op when greedy)."""
        if not self.sampling.greedy:
            torch.rand(self.uniform_N.shape, generator=self.generator, device=self.uniform_N.device,
                       out=self.uniform_N)

    def draw(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token and its sampler log-prob per row, from ``uniform_N`` (``refill_uniforms``). The
        numbers are drawn per completion and picked by row, so a row's draw does not depend on which
        rows share its batch: retiring finished rows early, late or by buckets gives the same tokens."""
        uniform_B = None if self.sampling.greedy else self.uniform_N[self.live.completion_B]
        return sample_with_logprobs(logits_BV, self.sampling, self.generator, uniform_B)

    def record_live(self) -> None:
        """Note the live rows entering the next step (device only)."""
        self.live_counts_S.index_copy_(0, self.step_index, (~self.live.done_B).sum().view(1))
        self.step_index += 1

    def keep(self, rows: list[int]) -> None:
        """Retire every row but ``rows`` (host list, increasing) from the batch and its cache."""
        rows_device = torch.tensor(rows, dtype=torch.long, device=self.next_B.device)
        self.cache.keep(rows)
        self.live = self.live.keep(rows_device)
        self.next_B = self.next_B[rows_device]


class DecodeStep(Protocol):
    """One decoding step of every row in the batch, as the engine's loop runs it.

    The engine builds the step before the prefill (``extra_slots`` sizes the buffers), calls ``start``
    after the first draw, then repeatedly: ``host_check_every`` calls of the step, one host read of
    ``host_values()`` with the engine's own flags, ``after_host_check``, ``keep`` when rows retire.
    """

    extra_slots: int
    """KV slots and output columns a step may write past ``max_new_tokens`` (a tree's nodes; 0 plain)."""
    host_check_every: int | None
    """Steps between host checks; None lets the engine's schedule decide (the step never needs the host)."""
    exact_compaction: bool
    """Retire finished rows at every host check instead of at bucket boundaries."""
    keeps_hidden: bool
    """The step reads the policy's hidden states back from the output buffers."""

    def make_stats(self) -> RolloutStats: ...

    def start(self, state: DecodeState) -> None: ...

    def __call__(self, state: DecodeState) -> None: ...

    def host_values(self) -> torch.Tensor | None:
        """[M] float32 values the step wants on the host at the next check (None: nothing)."""

    def after_host_check(self, state: DecodeState, values: list[float]) -> None: ...

    def keep(self, rows: list[int]) -> None: ...

    def finish(self, rollout: Rollout) -> None: ...


def plain_step(state: DecodeState) -> None:
    """Forward each row's newest token, commit it (live rows only), draw and emit the next one.

    Free of host syncs and of untraceable objects, so ``torch.compile(plain_step, fullgraph=True)``
    captures it whole; the uniform numbers are drawn before it (``DecodeState.refill_uniforms``)."""
    active_B = ~state.live.done_B
    hidden_BH = forward_new_tokens(state.model, state.cache, state.next_B[:, None])[:, 0]
    state.cache.commit_live(active_B)
    if state.route_log is not None:  # the forward ran each row's newest token: column emitted - 1
        state.route_log.write(state.live.completion_B, state.live.emitted_B[:, None] - 1, active_B[:, None])
    tokens_B, logprobs_B = state.draw(at_least_float32(state.lm_head(hidden_BH)))
    emit(state.outputs, state.live, tokens_B[:, None], logprobs_B[:, None], hidden_BH[:, None],
         torch.ones_like(tokens_B), state.criteria)
    state.next_B.copy_(tokens_B)


class PlainStep:
    """The plain step as a ``DecodeStep``: no extra buffers, nothing for the host but the engine's flags.

    ``run``: the function that runs ``plain_step`` (itself, or a compiled/captured version of it).
    """

    extra_slots = 0
    host_check_every = None
    exact_compaction = False
    keeps_hidden = False

    def __init__(self, run: Callable[[DecodeState], None] = plain_step):
        self.run = run

    def make_stats(self) -> RolloutStats:
        return RolloutStats()

    def start(self, state: DecodeState) -> None:
        pass

    def __call__(self, state: DecodeState) -> None:
        state.refill_uniforms()
        self.run(state)
        state.cache.max_length = min(state.cache.max_length + 1, state.cache.capacity)

    def host_values(self) -> torch.Tensor | None:
        return None

    def after_host_check(self, state: DecodeState, values: list[float]) -> None:
        pass

    def keep(self, rows: list[int]) -> None:
        pass

    def finish(self, rollout: Rollout) -> None:
        pass
