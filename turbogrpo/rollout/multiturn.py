"""Multi-turn rollouts: conversations whose turns alternate between the policy and an environment, each
conversation keeping its KV cache from turn to turn.

    prefill every distinct prompt once -> each conversation draws its own first token
      -> loop, one forward per step over every conversation that has tokens to feed:
           a decoding conversation feeds its newest sampled token (1 token),
           a conversation whose environment has answered feeds its turn-end token and the reply's ids
             (a chunk of at most ``prefill_chunk`` of them per step; a long reply takes a few steps),
           both in the same batch, padded to the step's width (padding is written past each row's
             committed slots and never read); the width is ``feed_width``'s (``FEED_WIDTHS``): on a CPU
             every row costs the width, so "bounded" narrows it while padding would be most of the batch
             and a reply longer than the width goes in over a few steps;
         rows whose feed ended this step draw their next token (one host read per step: the tokens);
         a token in ``stop_token_ids`` ends the turn: the turn's ids go to that conversation's
           ``TurnHandler`` in a thread pool, and the row waits (masked, in the batch) while the others
           decode; the handler returns the reply's ids to prefill, or None to end the conversation.

Environments run on daemon threads (``env_calls.EnvCalls``: at most ``max_env_workers`` at once, each call
limited to ``call_timeout_s``, a stuck one abandoned and never waited for at exit, an exit or interrupt raised
by environment code its conversation's failure): the model's forward releases the GIL in its kernels, so
Python environment code runs while others decode.
When a reply rejoins the batch is ``reply_timing`` (``REPLY_TIMINGS``):

* "arrival": at the first step after it arrived; an environment that blocks (I/O, a subprocess) holds up
  only its own conversation, but which step a conversation resumes in depends on the threads' timing, so
  the seeded draws are not reproducible;
* "next_step": after exactly one forward of the other conversations (waited for if it is late), or at once
  when no conversation has ids to feed: every step's batch, and so every draw, follows from the seed alone
  (what a training run needs to resume exactly), at the cost of waiting for a slow environment.

What comes back is the training data, nothing re-tokenised: each conversation's completion is every id
after the prompt in the order the model saw it, sampled ids (``model_mask`` 1, with the sampler's log-prob)
and prefilled environment ids (``model_mask`` 0, log-prob 0) interleaved.

Limits: ``max_turn_tokens`` model tokens per turn and ``max_conversation_tokens`` ids after the prompt in
all; a conversation that would pass either stops, finish reason "length". An environment reply that does
not fit is dropped whole (never cut mid-reply or mid-token) and the conversation stops there.

The host reads the drawn tokens once per step (a turn's end is a host decision, since its text goes to
Python code); on the CPU that read is free (the work already ran when the op returned), on a GPU it is the
cost of this engine over the windowed plain one. The weight matmuls run under the schedule's linear kernel
(``engine.rollout_linear_kernel``), as ``generate`` runs them. With ``draft`` (a
``turbogrpo.speculative.Speculation``) the loop is ``turbogrpo.speculative.multiturn``'s: decoding rows
verify draft trees, replies are prefilled the same way, and the same conversations come back.

Branching (``branching=(b_0, b_1, ...)``, G = their product): each prompt starts ``b_0`` conversations; when
the environment's reply to turn t (t = 1, 2, ...) of a conversation has been decided and prefilled once, the
conversation forks into ``b_t`` branches, which share everything so far (ids, masks, log-probs, and a copy of
the handler: ``fork_copy``) and each draw their own next token, as the G samples of a prompt draw their own
first token. The prompt's K/V is held once per group, as always; the KV rows of a fork are copied
(``GroupedKVCache.fork``): exact, and the shared turn is computed once, but its K/V is stored once per branch
(holding it once per fork would need a cache of nested prefixes). The cache is allocated for all G rows up
front, as an unbranched rollout of G conversations is. A conversation that ends before a fork (a ``None``
reply, a limit, a failure) is copied into each of its would-be branches at the end, so the output always has G
conversations per prompt, in branch order: conversation ``k * G + sum_t c_t * prod(b_{t+1:})`` of group k took
branch ``c_t`` at level t (lexicographic; ``branching=()`` is the unbranched rollout, ``(G,)``).

Training each leaf as its own conversation (per-conversation advantages) is then unchanged; a token of turn 1
appears in ``prod(b_1:)`` leaves. The Tree Training paper's weighting keeps the tree's loss equal to training
the leaves: the mean over branches is the per-token loss weighted by the share of branches through each token,
so a tree forward (``turbogrpo.tree``) that holds each shared token once weights it by its leaf count over G.

An engine that samples whole turns and keeps its own KV (vLLM) runs the same conversations through
``rollout.turnwise``, which shares this module's pieces (``check_conversations``, ``start_conversations``,
``take_token``, ``_collect_replies``, ``fork_conversation``, ``conversations_rollout``): only the sampling of a
turn differs.

Legend: ``K`` prompts, ``N`` conversations (K x G, group-major), ``B`` rows of the decoding batch, ``n``
ids fed per row in a step, ``V`` vocabulary, ``Hd`` hidden size.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch
from torch import nn

from turbogrpo.batch import Groups
from turbogrpo.hook import check_materialized
from turbogrpo.moe_routes import RouteRecorder, maybe_recording, prefill_routes
from turbogrpo.output_head import logits_head
from turbogrpo.rollout.decode import DecodeSchedule, default_schedule, rollout_linear_kernel
from turbogrpo.rollout.env_calls import EnvCalls
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.plans import forward_new_tokens, prefill
from turbogrpo.rollout.sampling import SamplingConfig, sample_with_logprobs
from turbogrpo.rollout.types import RolloutStats


class TurnHandler(Protocol):
    """A conversation's other side, called (in a worker thread) when the model's turn ends on a stop token.

    ``turn_ids``: the model's ids of the turn that just ended, its stop token last. Returns the ids of the
    reply to prefill (the chat template's rendering of the environment's message and of the next
    assistant header), or None when the conversation is over. An exception ends the conversation and is
    recorded as its failure (``MultiTurnRollout.errors``); other conversations go on."""

    def __call__(self, turn_ids: list[int]) -> list[int] | None: ...


@dataclass(frozen=True)
class TurnLimits:
    """How long a multi-turn conversation may grow (``sampling.max_new_tokens`` is not read here)."""

    max_turn_tokens: int
    """Most model tokens in one turn; a turn cut here ends the conversation ("length")."""
    max_conversation_tokens: int
    """Most ids after the prompt, model and environment together ("length" when reached)."""
    prefill_chunk: int = 64
    """Most reply ids one row feeds per step (bounds a step's width, and the KV slots kept spare)."""
    feed_width: str = "bounded"
    """How a step's width follows the rows' feeds: a name in ``FEED_WIDTHS``."""

    def __post_init__(self):
        for name in ("max_turn_tokens", "max_conversation_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TurnLimits.{name} must be an integer >= 1, got {value!r}")
        if self.feed_width not in FEED_WIDTHS:
            raise ValueError(f"TurnLimits.feed_width must be one of {sorted(FEED_WIDTHS)}, got {self.feed_width!r}")


def widest_feed(counts: list[int]) -> int:
    """The width of the widest feed: every reply goes in at once, whatever the other rows pay (a GPU's
    forward costs about the same at width 1 and at a few dozen)."""
    return max(counts)


def bounded_feed(counts: list[int]) -> int:
    """The widest width at which padding is at most half of the step's slots (at least 1). ``counts``: [B]
    the ids each row has to feed (1 for a decoding row, 0 for a waiting one). A 9-id reply among 63
    decoding rows goes in 2 ids a step rather than making all 64 rows compute 9 wide, which on a CPU costs
    each of those steps about 9 decode steps."""
    for width in range(max(counts), 1, -1):
        if len(counts) * width <= 2 * sum(min(c, width) for c in counts):
            return width
    return 1


FEED_WIDTHS: dict[str, Callable[[list[int]], int]] = {"widest": widest_feed, "bounded": bounded_feed}
"""Feed width policies: ``counts`` [B] (ids each row has to feed, at most ``prefill_chunk``) -> the step's width."""


@dataclass
class MultiTurnStats(RolloutStats):
    """Cost of one multi-turn rollout (``num_generated_tokens`` counts model tokens only)."""

    num_env_tokens: int = 0
    """Environment ids prefilled into the conversations' caches."""
    num_turns: int = 0
    """Model turns over all conversations."""
    env_wait_s: float = 0.0
    """Time the loop sat idle because every live conversation was waiting for its environment."""
    turn_prefill_tokens: list[int] = field(default_factory=list)
    """Ids computed before each later turn's (turn 2 on) first draw, one entry per turn started, in order: the
    native engines feed the turn-end token and the reply (a fork's branches share that one prefill); an engine
    with a prefix cache (``rollout.turnwise``) reports what its cache did not hold."""


@dataclass
class MultiTurnRollout:
    """``groups``: K groups of G conversations (``Groups``; completions are the ids after the prompt, with
    ``model_mask`` [S_i] (1 sampled, 0 environment), ``sampler_logps`` [S_i] (0 at environment ids) and
    ``finish_reasons``)."""

    groups: Groups
    stats: MultiTurnStats
    num_turns: list[int]
    """[N] model turns of each conversation."""
    errors: list[str | None]
    """[N] the handler's failure that ended a conversation, or None."""
    handlers: list = field(default_factory=list)
    """[N] each conversation's handler (under branching, the forks: a branch's environment state)."""


_FEED, _WAIT, _DONE = "feed", "wait", "done"


@dataclass
class _Conversation:
    """Host bookkeeping of one conversation (its ids, mask and log-probs grow as it runs)."""

    handler: TurnHandler
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    """Ids to feed next: the newest sampled token, or the turn-end token and the reply's ids."""
    phase: str = _FEED
    turn_start: int = 0
    num_turns: int = 0
    finish: str = "stop"
    error: str | None = None
    future: Future | None = None
    due_after: int = 0
    """Under "next_step" timing: the reply is taken once this many forwards have run."""
    depth: int = 0
    """Forks this conversation has been through (branching): it forks next after turn ``depth + 1``."""
    inherited_model_tokens: int = 0
    """Model tokens copied from the conversation it forked from (sampled once, counted there)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """With routes recorded: the MoE routes ``[n, L, k]`` of each chunk of its ids fed, in order."""


class ForkError(ValueError):
    """A handler or environment that rollout branching cannot fork."""


def fork_copy(obj: object, role: str) -> object:
    """An independent copy of ``obj`` (a conversation's handler or environment) for a branch: ``obj.fork()``
    where it defines one, else ``copy.deepcopy``; ``ForkError`` in one line naming its class otherwise. A plain
    function is its own copy (``deepcopy`` keeps functions): a handler with state should be an object."""
    fork = getattr(obj, "fork", None)
    name = type(obj).__name__
    try:
        copied = fork() if callable(fork) else copy.deepcopy(obj)
    except ForkError:
        raise
    except (Exception, SystemExit) as err:  # (sys.exit in a fork() is its failure; a real Ctrl-C goes on up)
        raise ForkError(f"rollout.branching forks each conversation's {role}, but {name} cannot be forked "
                        f"({type(err).__name__}: {err}); give {name} a fork() method returning an independent "
                        "copy") from None
    if callable(fork) and (copied is None or copied is obj):  # branches would share one environment, or have none
        raise ForkError(f"rollout.branching forks each conversation's {role}, but {name}.fork() returned "
                        f"{'None' if copied is None else 'the same object'}; it must return an independent copy "
                        "(a new object in the same state)")
    return copied


def check_branching(branching: Sequence[int], num_samples: int) -> tuple[int, ...]:
    """``branching`` as a tuple, ``(num_samples,)`` when empty; ValueError unless its factors are integers
    >= 1 whose product is ``num_samples``."""
    factors = tuple(branching) or (num_samples,)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in factors) or \
            math.prod(factors) != num_samples:
        raise ValueError(f"branching {list(branching)} must be integers >= 1 whose product is num_samples="
                         f"{num_samples} (e.g. [4, 2] for 8: 4 first turns, each continued 2 ways)")
    return factors


def _arrived(conversation: _Conversation, num_forwards: int) -> bool:
    return conversation.future.done()


def _one_step_later(conversation: _Conversation, num_forwards: int) -> bool:
    return num_forwards >= conversation.due_after


class ReplyTiming(NamedTuple):
    """When a waiting conversation's reply is taken (module docstring)."""

    due: Callable[[_Conversation, int], bool]
    """``due(conversation, forwards run so far)``: take its reply now (waiting for it if it is late)."""
    idle_wait: str
    """What to wait for when no conversation has ids to feed (``concurrent.futures.wait``'s return_when)."""


REPLY_TIMINGS: dict[str, ReplyTiming] = {"arrival": ReplyTiming(_arrived, FIRST_COMPLETED),
                                         "next_step": ReplyTiming(_one_step_later, ALL_COMPLETED)}


def generate_multiturn(model: nn.Module, prompts: list[torch.Tensor], handlers: Sequence[TurnHandler], *,
                       num_samples: int, sampling: SamplingConfig, limits: TurnLimits, seed: int | None = None,
                       draft: object | None = None, max_env_workers: int = 16, schedule: DecodeSchedule | None = None,
                       reply_timing: str = "arrival", branching: Sequence[int] = (), call_timeout_s: float | None = None,
                       env_calls: EnvCalls | None = None, record_routes: bool = False) -> MultiTurnRollout:
    """Run ``len(prompts) x num_samples`` conversations (``handlers[i]`` answers conversation i, group-major)
    with ``model``'s current weights; see the module docstring.

    ``branching``: fork factors whose product is ``num_samples`` (module docstring); then ``handlers`` are the
    ``len(prompts) x branching[0]`` first conversations' (group-major), each probed with ``fork_copy`` before
    the rollout (``ForkError`` if it cannot be forked), and ``MultiTurnRollout.handlers`` holds the forks.

    ``prompts``: K 1-D int64 tensors, each rendered up to the first assistant turn's header.
    ``sampling.stop_token_ids`` end a turn (the chat template's end-of-turn ids); stop strings are refused.
    ``schedule``: its ``linears`` kernel runs the weight matmuls (None: the device's default schedule); the
    loop itself is always eager and reads the host every step. ``reply_timing``: a ``REPLY_TIMINGS`` key.
    ``draft``: a ``turbogrpo.speculative.Speculation`` for lossless speculative decoding of the model's turns.
    ``max_env_workers``: most handler calls at once (1: one at a time); ``call_timeout_s``: each call's time
    limit in seconds (None: none), past which its conversation fails; ``env_calls``: an ``EnvCalls`` to run the
    handlers on instead (its own workers and limit). ``record_routes``: keep the MoE routes of every id the model
    ran (``Groups.routes`` / ``prompt_routes``, ``turbogrpo.moe_routes``; a speculative rollout keeps the accepted
    paths' and the replies' routes).
    """
    if draft is not None and not callable(getattr(draft, "run_multiturn", None)):
        raise ValueError(f"draft must be a turbogrpo.speculative.Speculation (or None for plain sampling), got "
                         f"{type(draft).__name__}; wrap a DraftHead as Speculation(draft_head)")
    if schedule is not None and not isinstance(schedule, DecodeSchedule):
        raise ValueError(f"schedule must be a DecodeSchedule or None, got {type(schedule).__name__}")
    factors = check_conversations(model, prompts, handlers, num_samples=num_samples, sampling=sampling, limits=limits,
                                  reply_timing=reply_timing, branching=branching)
    if draft is not None and len(factors) > 1:
        raise ValueError(f"branching {list(branching)} with a draft: speculative multi-turn rollouts do not fork "
                         "conversations yet (branch with plain sampling, or speculate without branching)")
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    prompts = [p.to(device=device, dtype=torch.long) for p in prompts]
    conversations = start_conversations(handlers, len(prompts), num_samples, factors)
    # The loop is eager whatever the schedule's runner, so "auto" may pick the packed kernel here.
    linears = rollout_linear_kernel(replace(schedule or default_schedule(device), runner="eager"), draft)
    pool = env_calls if env_calls is not None else EnvCalls(max_env_workers, call_timeout_s)
    # Outside inference mode even when the caller is in it, as generate() runs (engine.py says why).
    # The pool is never joined: a stuck environment call must not keep the run from ending.
    with torch.inference_mode(False), torch.no_grad(), linears([model, *getattr(draft, "rollout_modules", list)()]), \
            maybe_recording(model, record_routes) as recorder:
        if draft is None:
            stats, prompt_routes = _run(model, prompts, num_samples, conversations, sampling, limits, generator, pool,
                                        REPLY_TIMINGS[reply_timing], factors, recorder)
        else:  # the speculative loop (turbogrpo.speculative.multiturn) comes with the draft: never imported here
            stats, prompt_routes = draft.run_multiturn(model, prompts, num_samples, conversations, sampling, limits,
                                                       generator, pool, REPLY_TIMINGS[reply_timing], recorder)
    return conversations_rollout(prompts, num_samples, conversations, stats, prompt_routes)


def check_conversations(model: nn.Module, prompts: list[torch.Tensor], handlers: Sequence[TurnHandler], *,
                        num_samples: int, sampling: SamplingConfig, limits: TurnLimits, reply_timing: str,
                        branching: Sequence[int]) -> tuple[int, ...]:
    """The checks every engine's multi-turn rollout makes before it starts (``generate_multiturn``'s arguments);
    returns the fork factors (``check_branching``)."""
    if sampling.stop_strings:
        raise ValueError(f"multi-turn rollouts end turns on stop_token_ids only; got stop_strings "
                         f"{list(sampling.stop_strings)} (use the chat template's end-of-turn token id)")
    if not sampling.stop_token_ids:
        raise ValueError("multi-turn rollouts need sampling.stop_token_ids (the end-of-turn token ids)")
    if not isinstance(limits, TurnLimits):
        raise ValueError(f"limits must be a TurnLimits, got {type(limits).__name__}")
    if reply_timing not in REPLY_TIMINGS:
        raise ValueError(f"reply_timing must be one of {sorted(REPLY_TIMINGS)}, got {reply_timing!r}")
    check_materialized(model)
    factors = check_branching(branching, num_samples)
    if len(handlers) != len(prompts) * factors[0]:
        raise ValueError(f"got {len(handlers)} handlers for {len(prompts)} prompts x {factors[0]} "
                         f"{'first conversations' if branching else 'samples'}")
    if len(factors) > 1:
        for handler in handlers:  # refuse a handler that cannot fork now, not at its first fork
            fork_copy(handler, "handler")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    longest = max(p.numel() for p in prompts) + limits.max_conversation_tokens
    if max_positions is not None and longest > max_positions:
        raise ValueError(f"the longest prompt plus max_conversation_tokens={limits.max_conversation_tokens} needs "
                         f"{longest} positions, more than the model's max_position_embeddings={max_positions}")
    return factors


def start_conversations(handlers: Sequence[TurnHandler], num_prompts: int, num_samples: int,
                        factors: tuple[int, ...]) -> list[_Conversation | None]:
    """``[K * num_samples]`` conversation slots: one per output conversation, each first conversation (one per
    handler, group-major) in the first slot of its subtree, the others None until a fork fills them."""
    stride = num_samples // factors[0]
    conversations: list[_Conversation | None] = [None] * (num_prompts * num_samples)
    for j, handler in enumerate(handlers):
        conversations[j * stride] = _Conversation(handler)
    return conversations


def conversations_rollout(prompts: list[torch.Tensor], num_samples: int, conversations: list[_Conversation],
                          stats: MultiTurnStats, prompt_routes: list[torch.Tensor] | None = None) -> MultiTurnRollout:
    """The finished ``conversations`` (``[K * num_samples]``, group-major) as a ``MultiTurnRollout``; with
    ``prompt_routes`` (per prompt ``[P, L, k]``), the conversations' recorded routes too (every id but the last ran
    in order, so each conversation's chunks laid end to end are its first ids' routes)."""
    routes = None
    if prompt_routes is not None:
        routes = [torch.cat([prompt_routes[0][:0], *c.routes]) for c in conversations]
    groups = Groups(prompts, [torch.tensor(c.ids, dtype=torch.long) for c in conversations],
                    [num_samples] * len(prompts), finish_reasons=[c.finish for c in conversations],
                    sampler_logps=[torch.tensor(c.logps, dtype=torch.float32) for c in conversations],
                    model_mask=[torch.tensor(c.model_mask, dtype=torch.bool) for c in conversations],
                    routes=routes, prompt_routes=prompt_routes)
    return MultiTurnRollout(groups, stats, [c.num_turns for c in conversations], [c.error for c in conversations],
                            [c.handler for c in conversations])


def _run(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, conversations: list[_Conversation],
         sampling: SamplingConfig, limits: TurnLimits, generator: torch.Generator | None,
         pool: EnvCalls, timing: ReplyTiming, branching: tuple[int, ...] = (), recorder: RouteRecorder | None = None
         ) -> tuple[MultiTurnStats, list[torch.Tensor] | None]:
    """The loop of the module docstring; fills ``conversations`` in place (``[K * num_samples]``; under
    ``branching``, the slots of the first conversations are set and the forks fill the others). With ``recorder``
    (the routers' recording hooks) each conversation keeps the routes of the ids it fed, and the prompts' routes
    are returned beside the stats (per prompt ``[P, L, k]``; else None)."""
    start = time.perf_counter()
    branching = branching or (num_samples,)
    device = prompts[0].device
    stats = MultiTurnStats()
    stop_ids = frozenset(sampling.stop_token_ids)
    # Committed ids stay below max_conversation_tokens; a step writes at most prefill_chunk past them.
    cache = GroupedKVCache([len(p) for p in prompts], branching[0],
                           capacity=limits.max_conversation_tokens + limits.prefill_chunk, device=device,
                           row_capacity=len(conversations))
    lm_head = logits_head(model)
    last_GH = prefill(model, cache, prompts)
    prompt_routes = None if recorder is None else prefill_routes(recorder, [len(p) for p in prompts])
    stats.num_forwards += 1
    # One row per conversation, so that each draws its own first token from its prompt's logits.
    rows = [i for i, c in enumerate(conversations) if c is not None]  # cache row -> conversation
    _draw(lm_head(last_GH).repeat_interleave(branching[0], dim=0), rows, conversations, sampling, generator,
          stop_ids, limits, pool, stats)
    while True:
        _collect_replies(conversations, rows, limits, stats, timing.due, pool, vocabulary_size(model))
        keep = [b for b, i in enumerate(rows) if conversations[i].phase != _DONE]
        if len(keep) < len(rows):
            if not keep:
                break
            cache.keep(keep)
            rows = [rows[b] for b in keep]
        feeding = [b for b, i in enumerate(rows) if conversations[i].phase == _FEED]
        if not feeding:  # every live conversation waits for its environment
            wait_for_replies(conversations, rows, timing, stats, pool)
            continue
        drawn_rows, hidden_BH = _feed(model, cache, rows, feeding, conversations, limits, recorder)
        stats.num_forwards += 1
        stats.live_batch_sizes.append(len(feeding))
        if len(branching) > 1:
            rows, drawn_rows, hidden_BH = _fork(cache, rows, drawn_rows, hidden_BH, conversations, branching)
        _draw(lm_head(hidden_BH[drawn_rows]), [rows[b] for b in drawn_rows], conversations, sampling, generator,
              stop_ids, limits, pool, stats)
    _fill_unforked(conversations)
    stats.num_generated_tokens = sum(sum(c.model_mask) - c.inherited_model_tokens for c in conversations)
    stats.wall_time_s = time.perf_counter() - start
    return stats, prompt_routes


def wait_for_replies(conversations: list[_Conversation], rows: list[int], timing: ReplyTiming,
                     stats: MultiTurnStats, pool: EnvCalls) -> None:
    """Block while every live conversation (``rows``) waits for its environment, as ``timing`` says (a call
    past ``pool``'s time limit counts as answered: it failed)."""
    waited = time.perf_counter()
    pool.wait([conversations[i].future for i in rows], timing.idle_wait)
    for i in rows:  # no forward to overlap with: the replies waited for are due now
        conversations[i].due_after = 0
    stats.env_wait_s += time.perf_counter() - waited


def _feed(model: nn.Module, cache: GroupedKVCache, rows: list[int], feeding: list[int],
          conversations: list[_Conversation], limits: TurnLimits, recorder: RouteRecorder | None = None
          ) -> tuple[list[int], torch.Tensor]:
    """One forward of every feeding row's next ids (at most ``limits.prefill_chunk``, and the step's width),
    committed in the cache (and, with ``recorder``, their MoE routes kept by their conversations). Returns the rows
    whose feed is complete (they draw next) and the hidden state ``[B, Hd]`` at each row's last fed id."""
    counts = [0] * len(rows)
    for b in feeding:
        counts[b] = min(len(conversations[rows[b]].pending), limits.prefill_chunk)
    width = FEED_WIDTHS[limits.feed_width](counts)
    counts = [min(c, width) for c in counts]
    ids_Bn = torch.zeros(len(rows), width, dtype=torch.long)
    for b in feeding:
        conversation = conversations[rows[b]]
        ids_Bn[b, :counts[b]] = torch.tensor(conversation.pending[:counts[b]])
        del conversation.pending[:counts[b]]
    counts_B = torch.tensor(counts, device=cache.device)
    hidden_BnH = forward_new_tokens(model, cache, ids_Bn.to(cache.device), num_valid_B=counts_B)
    if recorder is not None:
        routes_TLK = recorder.take()
        routes_BnLK = routes_TLK.view(len(rows), width, *routes_TLK.shape[1:])
        for b in feeding:
            conversations[rows[b]].routes.append(routes_BnLK[b, :counts[b]].clone())  # not a view of the batch
    cache.commit_first(counts_B, width)
    last_BH = hidden_BnH[torch.arange(len(rows), device=cache.device), (counts_B - 1).clamp(min=0)]
    drawn = [b for b in feeding if not conversations[rows[b]].pending]
    return drawn, last_BH


def _fork(cache: GroupedKVCache, rows: list[int], drawn: list[int], hidden_BH: torch.Tensor,
          conversations: list[_Conversation | None], branching: tuple[int, ...]
          ) -> tuple[list[int], list[int], torch.Tensor]:
    """Fork every row of ``drawn`` whose conversation has just prefilled its reply to turn ``depth + 1`` (and
    has a fork left) into ``branching[depth + 1]`` rows: the conversation keeps its slot, each new branch
    (handler forked) takes its own ``conversations`` slot, the cache copies the row. Returns the new rows,
    drawn rows and hidden states ``[B', Hd]``; each branch draws its own next token from them."""
    copies = [1] * len(rows)
    for b in drawn:
        copies[b] = fork_count(conversations[rows[b]], branching)
    if max(copies) == 1:
        return rows, drawn, hidden_BH
    new_rows, new_drawn, drawn_set = [], [], set(drawn)
    for b, (i, count) in enumerate(zip(rows, copies)):
        slots = fork_conversation(conversations, i, count, branching)
        if b in drawn_set:
            new_drawn.extend(range(len(new_rows), len(new_rows) + count))
        new_rows.extend(slots)
    cache.fork(copies)
    source = torch.repeat_interleave(torch.arange(len(rows), device=hidden_BH.device),
                                     torch.tensor(copies, device=hidden_BH.device))
    return new_rows, new_drawn, hidden_BH[source]


def fork_count(conversation: _Conversation, branching: tuple[int, ...]) -> int:
    """How many branches ``conversation`` becomes now: ``branching[t]`` once the reply to its turn t (its
    ``depth + 1``-th) is in and it has a fork left, else 1."""
    level = conversation.depth + 1
    return branching[level] if conversation.num_turns == level and level < len(branching) else 1


def fork_conversation(conversations: list[_Conversation | None], i: int, count: int,
                      branching: tuple[int, ...]) -> list[int]:
    """Fork conversation ``i`` into ``count`` branches (``fork_count``; 1: no fork): it keeps its slot, each new
    branch (handler forked) takes the first slot of its own subtree. Returns the branches' slots, ``i`` first."""
    if count == 1:
        return [i]
    parent = conversations[i]
    parent.depth += 1
    stride = math.prod(branching[parent.depth + 1:])  # leaves under each of the new branches
    slots = [i + c * stride for c in range(count)]
    for slot in slots[1:]:
        conversations[slot] = _branch(parent)
    return slots


def _branch(parent: _Conversation) -> _Conversation:
    """A copy of ``parent`` that shares its history and goes on independently (its handler forked)."""
    return replace(parent, handler=fork_copy(parent.handler, "handler"), ids=list(parent.ids),
                   model_mask=list(parent.model_mask), logps=list(parent.logps), pending=list(parent.pending),
                   future=None, inherited_model_tokens=sum(parent.model_mask), routes=list(parent.routes))


def _fill_unforked(conversations: list[_Conversation | None]) -> None:
    """Give each slot a conversation that ended before reaching it a copy of that conversation: the nearest
    set slot before it (its subtree's root; slots between them belong to forks that never happened)."""
    for i, conversation in enumerate(conversations):
        if conversation is None:
            conversations[i] = _branch(conversations[i - 1])


def _draw(logits_BV: torch.Tensor, members: list[int], conversations: list[_Conversation],
          sampling: SamplingConfig, generator: torch.Generator | None, stop_ids: frozenset[int],
          limits: TurnLimits, pool: EnvCalls, stats: MultiTurnStats) -> None:
    """Draw one token for each of ``members`` (conversation indices, one per logits row) and act on it."""
    if not members:
        return
    tokens_B, logps_B = sample_with_logprobs(logits_BV, sampling, generator)
    host = torch.stack([tokens_B.double(), logps_B.double()]).tolist()  # host sync: one per step
    for i, token, logp in zip(members, host[0], host[1]):
        take_token(conversations[i], int(token), logp, stop_ids, limits, pool, stats)


def take_token(conversation: _Conversation, token: int, logp: float, stop_ids: frozenset[int], limits: TurnLimits,
               pool: EnvCalls, stats: MultiTurnStats) -> None:
    """Append the sampled ``token`` (its sampler log-prob ``logp``) to ``conversation`` and act on it: a stop id
    ends the turn (its handler is called on ``pool``), a limit ends the conversation ("length")."""
    if not math.isfinite(logp):
        raise ValueError("the model's logits are not finite (NaN or inf) for some sequence: check the model's "
                         "weights (a diverged update, a bad checkpoint or a dtype overflow)")
    conversation.ids.append(token)
    conversation.model_mask.append(1)
    conversation.logps.append(logp)
    conversation.pending = [token]
    turn_length = len(conversation.ids) - conversation.turn_start
    if token in stop_ids:
        conversation.num_turns += 1
        stats.num_turns += 1
        conversation.phase = _WAIT
        conversation.future = pool.submit(_call_handler, conversation.handler,
                                          conversation.ids[conversation.turn_start:])
        conversation.due_after = stats.num_forwards + 1
    elif turn_length >= limits.max_turn_tokens or len(conversation.ids) >= limits.max_conversation_tokens:
        conversation.num_turns += 1
        stats.num_turns += 1
        conversation.phase, conversation.finish = _DONE, "length"


def _call_handler(handler: TurnHandler, turn_ids: list[int]) -> list[int] | None:
    reply = handler(turn_ids)
    if reply is not None and (not isinstance(reply, (list, tuple)) or
                              not all(isinstance(t, int) and not isinstance(t, bool) for t in reply)):
        raise ValueError(f"a TurnHandler must return a list of token ids or None, got {type(reply).__name__}")
    return None if reply is None else list(reply)


def vocabulary_size(model: nn.Module) -> int | None:
    """How many token ids ``model``'s input embedding takes (None if it does not say)."""
    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    return getattr(getattr(embedding, "base_layer", embedding), "num_embeddings", None)


def _collect_replies(conversations: list[_Conversation], rows: list[int], limits: TurnLimits,
                     stats: MultiTurnStats, due: Callable[[_Conversation, int], bool], pool: EnvCalls,
                     vocab_size: int | None = None, count_prefill: bool = True) -> None:
    """Move every waiting conversation whose reply is ``due`` back to feeding (or to done), waiting (within
    ``pool``'s time limit) for a reply that is due but not yet there. A reply with an id outside
    ``[0, vocab_size)`` fails its conversation (the embedding lookup would abort the whole rollout).
    ``count_prefill``: record the ids the next turn prefills (``pending``: the turn-end token and the reply) in
    ``stats.turn_prefill_tokens``, as the native engines feed them (an engine that counts its own: False)."""
    pool.expire()  # a call past its time limit is done (failed), so "arrival" timing takes it now
    for i in rows:
        conversation = conversations[i]
        if conversation.phase != _WAIT or not due(conversation, stats.num_forwards):
            continue
        try:
            reply = pool.result(conversation.future)
        except Exception as err:  # an environment's failure ends its own conversation only
            conversation.phase, conversation.finish = _DONE, "stop"
            conversation.error = f"{type(err).__name__}: {err}"
            continue
        conversation.future = None
        outside = [t for t in reply or () if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if outside:
            conversation.phase, conversation.finish = _DONE, "stop"
            conversation.error = (f"ValueError: the TurnHandler returned token id {outside[0]}, outside the model's "
                                  f"vocabulary [0, {vocab_size})")
            continue
        if reply is None:
            conversation.phase = _DONE
        elif not reply or len(conversation.ids) + len(reply) + 1 > limits.max_conversation_tokens:
            # An empty reply would make the model answer itself; one that does not fit (with room for one
            # more model token) is dropped whole: the conversation ends truncated.
            conversation.phase, conversation.finish = _DONE, "stop" if not reply else "length"
        else:
            conversation.ids.extend(reply)
            conversation.model_mask.extend([0] * len(reply))
            conversation.logps.extend([0.0] * len(reply))
            conversation.pending.extend(reply)
            conversation.turn_start = len(conversation.ids)
            conversation.phase = _FEED
            stats.num_env_tokens += len(reply)
            if count_prefill:
                stats.turn_prefill_tokens.append(len(conversation.pending))
