"""Multi-turn rollouts on an engine that samples a whole turn per request and keeps its own KV cache (vLLM):
the conversations, handlers, limits, reply timing, failures and forks of ``rollout.multiturn``, with the
engine's part reduced to "sample the next turn of these conversations" (a ``TurnSampler``).

    loop, one round per engine call:
      take the replies that are due (``multiturn._collect_replies``: failures, limits, the reply timing);
      fork each conversation whose reply to turn t is in and has a fork left (``branching``);
      every conversation ready to go on is one request: its prompt and all its ids so far (sampled turns and
        environment replies, as recorded: nothing decoded and re-encoded), at most the turn's and the
        conversation's remaining tokens; all of them in ONE ``sample_turns`` call;
      each turn's tokens go through ``multiturn.take_token`` (a stop id calls the handler, a limit ends it).

A request continues from ids the engine has mostly seen: the prompt and the earlier turns come from its prefix
cache, and each later turn's computed ids (``SampledTurn.num_prefilled``) go to
``MultiTurnStats.turn_prefill_tokens``, the metric the native engine reports for its own prefills. A fork is
just several requests on the same ids. Each request is seeded from (rollout seed, conversation slot, turn), so
a rerun with the same seed repeats the rollout (with reply_timing "next_step": every round's requests then
follow from the seed alone; "arrival" lets a round start with whichever replies are in, as in the native loop).
The round counter stands in for ``num_forwards`` in the reply timing (one round = one engine call).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn

from turbogrpo.rollout.env_calls import EnvCalls
from turbogrpo.rollout.multiturn import (_DONE, _FEED, REPLY_TIMINGS, MultiTurnRollout, MultiTurnStats, ReplyTiming,
                                         TurnHandler, TurnLimits, _collect_replies, _Conversation, _fill_unforked,
                                         check_conversations, conversations_rollout, fork_conversation, fork_count,
                                         start_conversations, take_token, vocabulary_size, wait_for_replies)
from turbogrpo.rollout.sampling import SamplingConfig


class TurnRequest(NamedTuple):
    """One conversation's next turn, for the engine."""

    ids: list[int]
    """The prompt's ids, then every id of the conversation so far."""
    max_tokens: int
    """Most tokens to sample (the turn's and the conversation's limits)."""
    conversation: int
    """The conversation's slot (group-major): with ``turn``, what seeds the request."""
    turn: int
    """Turns the conversation has had (0: its first)."""


class SampledTurn(NamedTuple):
    """What the engine sampled for a ``TurnRequest``."""

    token_ids: list[int]
    """The turn, ending on a stop id or at ``max_tokens``."""
    logprobs: list[float]
    """The sampler's log-prob of each of ``token_ids``."""
    num_prefilled: int
    """Ids of ``TurnRequest.ids`` the engine computed (the rest came from its prefix cache)."""


class TurnSampler(Protocol):
    def __call__(self, requests: list[TurnRequest]) -> list[SampledTurn]:
        """One turn for each request, in order (one engine call: the requests are batched)."""


def generate_multiturn_turnwise(model: nn.Module, prompts: list[torch.Tensor], handlers: Sequence[TurnHandler],
                                sample_turns: TurnSampler, *, num_samples: int, sampling: SamplingConfig,
                                limits: TurnLimits, reply_timing: str = "arrival", branching: Sequence[int] = (),
                                max_env_workers: int = 16, call_timeout_s: float | None = None,
                                env_calls: EnvCalls | None = None) -> MultiTurnRollout:
    """``generate_multiturn``'s rollout (same arguments, checks and ``MultiTurnRollout``) with each turn sampled
    by ``sample_turns`` (module docstring); ``model`` is only checked (positions, vocabulary), never run.
    ``prompts``: K 1-D int64 tensors."""
    factors = check_conversations(model, prompts, handlers, num_samples=num_samples, sampling=sampling, limits=limits,
                                  reply_timing=reply_timing, branching=branching)
    device = next(model.parameters()).device  # the rollout's prompts on the policy's device, as the native one's
    prompts = [p.to(device=device, dtype=torch.long) for p in prompts]
    conversations = start_conversations(handlers, len(prompts), num_samples, factors)
    pool = env_calls if env_calls is not None else EnvCalls(max_env_workers, call_timeout_s)
    stats = _run_rounds(prompts, num_samples, conversations, sample_turns, sampling, limits, pool,
                        REPLY_TIMINGS[reply_timing], factors, vocabulary_size(model))
    return conversations_rollout(prompts, num_samples, conversations, stats)


def _run_rounds(prompts: list[torch.Tensor], num_samples: int, conversations: list[_Conversation | None],
                sample_turns: TurnSampler, sampling: SamplingConfig, limits: TurnLimits, pool: EnvCalls,
                timing: ReplyTiming, branching: tuple[int, ...], vocab_size: int | None) -> MultiTurnStats:
    """The loop of the module docstring; fills ``conversations`` in place (as ``multiturn._run``)."""
    start = time.perf_counter()
    stats = MultiTurnStats()
    stop_ids = frozenset(sampling.stop_token_ids)
    prompt_ids = [p.tolist() for p in prompts]  # host ids: the engine takes lists
    live = [i for i, c in enumerate(conversations) if c is not None]
    while True:
        _collect_replies(conversations, live, limits, stats, timing.due, pool, vocab_size, count_prefill=False)
        live = [i for i in live if conversations[i].phase != _DONE]
        if not live:
            break
        if not any(conversations[i].phase == _FEED for i in live):  # every live conversation waits for its environment
            wait_for_replies(conversations, live, timing, stats, pool)
            continue
        forked = []
        for i in live:  # a conversation whose reply to turn t is in forks before its next turn (as multiturn._fork)
            count = fork_count(conversations[i], branching) if conversations[i].phase == _FEED else 1
            forked.extend(fork_conversation(conversations, i, count, branching))
        live = forked
        ready = [i for i in live if conversations[i].phase == _FEED]
        requests = [_request(prompt_ids[i // num_samples], conversations[i], i, limits) for i in ready]
        turns = sample_turns(requests)
        stats.num_forwards += 1
        stats.live_batch_sizes.append(len(ready))
        for i, request, turn in zip(ready, requests, turns):
            if conversations[i].num_turns:  # a later turn: what the engine's prefix cache did not hold
                stats.turn_prefill_tokens.append(turn.num_prefilled)
            _take_turn(conversations[i], turn, request, stop_ids, limits, pool, stats)
    _fill_unforked(conversations)
    stats.num_generated_tokens = sum(sum(c.model_mask) - c.inherited_model_tokens for c in conversations)
    stats.wall_time_s = time.perf_counter() - start
    return stats


def _request(prompt_ids: list[int], conversation: _Conversation, slot: int, limits: TurnLimits) -> TurnRequest:
    """``conversation``'s next turn: at most the turn's tokens and what is left of the conversation's."""
    max_tokens = min(limits.max_turn_tokens, limits.max_conversation_tokens - len(conversation.ids))
    return TurnRequest(prompt_ids + conversation.ids, max_tokens, slot, conversation.num_turns)


def _take_turn(conversation: _Conversation, turn: SampledTurn, request: TurnRequest, stop_ids: frozenset[int],
               limits: TurnLimits, pool: EnvCalls, stats: MultiTurnStats) -> None:
    """The engine's ``turn`` into ``conversation`` token by token (``multiturn.take_token``: its handler is called
    at a stop id, a limit ends it), which must end the turn exactly at its last token."""
    taken = 0
    while conversation.phase == _FEED and taken < len(turn.token_ids):
        take_token(conversation, turn.token_ids[taken], turn.logprobs[taken], stop_ids, limits, pool, stats)
        taken += 1
    if conversation.phase == _FEED or taken < len(turn.token_ids):  # stopped early, or went on past the end
        raise RuntimeError(f"the engine sampled {len(turn.token_ids)} tokens for conversation {request.conversation}'s "
                           f"turn of at most {request.max_tokens}, not ending where its stop ids and limits end it")
