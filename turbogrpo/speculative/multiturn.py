"""Speculative decoding inside multi-turn rollouts: ``generate_multiturn(..., draft=Speculation(...))``.

    prefill every distinct prompt once -> each conversation draws its own first token (``engine.first_draw``)
      -> loop, one policy forward per step over every row of the batch (``_step``):
           a decoding conversation feeds its tree, rooted at its newest id: the draft's tree, the history's
             chains, or the root alone when the sizing policy turns speculation off (a plain step); the
             policy verifies it ("sample, then match", ``verify.py``) and ``emit`` appends the accepted
             path and the bonus token, cut at the first stop token and at the turn's limit;
           a conversation whose environment answered feeds its newest id and the reply's ids but the last
             (at most ``prefill_chunk`` per step); the reply's ids are written into its output buffers as
             if the policy had emitted them, each with the policy's feature of the id before it, so the
             draft's catch-up and the history's corpus read them like any other id; the reply's last id
             is the root of the conversation's next tree, whose first draw is the turn's first model token;
           a conversation waiting for its environment feeds padding (never committed);
         each row commits the K/V of exactly the ids now behind its newest one, so a stop token inside an
           accepted run ends the turn there: the ids after it are dropped, its own K/V waits for the reply;
         one host read per step: emitted counts, finished rows, accepted counts, the sizing's statistics;
         a turn that ended on a stop token goes to its ``TurnHandler`` (``rollout.multiturn``'s thread
           pool, reply timings and bookkeeping); one that reached a limit ends the conversation ("length").

Every row keeps the single-turn tree step's invariant: ``live.emitted_B`` ids after the prompt are in the
output buffers, model and environment ids alike; all but the newest (``next_B``) are in the policy's cache.

Lossless: a tree depends only on ids already in the conversation (the draft's forwards over them, the
history's corpus of them), never on the draws it is verified with, so every model token is a draw from the
policy given the conversation so far, environment replies included, at any temperature; at temperature 0
the ids are the plain multi-turn rollout's. What comes back means what the plain path's does: the ids after
the prompt, ``model_mask`` 1 on sampled ids with the sampler's log-prob (``log_softmax(logits / T)`` at the
node that drew the token, T = 1 when greedy), 0 on environment ids.

Costs: the neural draft's cache is batch-wide, so its catch-up and tree levels run over every row (a
waiting row's tree is dropped); the LM head and the acceptance run over the decoding rows only. The sizing
policy sizes trees for the decoding rows and learns step times only from steps that prefill no reply.

Legend: ``N`` conversations, ``B`` rows of the batch, ``Bd`` decoding rows, ``F`` rows feeding a reply,
``n`` ids fed per row in a step, ``Nt`` tree nodes, ``D`` path slots, ``m`` reply ids written per feeding
row, ``k`` slots committed, ``Hd`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from turbogrpo.batch import Groups
from turbogrpo.moe_routes import RouteRecorder
from turbogrpo.rollout.decode import first_draw
from turbogrpo.rollout.env_calls import EnvCalls
from turbogrpo.rollout.multiturn import (_DONE, _FEED, _WAIT, MultiTurnStats, ReplyTiming, TurnLimits, _call_handler,
                                         _collect_replies, _Conversation, vocabulary_size, wait_for_replies)
from turbogrpo.rollout.outputs import LiveRows, emit
from turbogrpo.rollout.plans import forward_new_tokens
from turbogrpo.rollout.sampling import SamplingConfig, at_least_float32
from turbogrpo.rollout.step import DecodeState
from turbogrpo.rollout.types import Rollout
from turbogrpo.speculative.decode import SpeculativeStats, TreeStep, path_outputs
from turbogrpo.speculative.tree import DraftTree, TreeShape, chain_tree
from turbogrpo.speculative.verify import TreeVerdict, verify_tree


@dataclass
class MultiTurnSpeculativeStats(MultiTurnStats, SpeculativeStats):
    """``MultiTurnStats`` plus speculation's per-step lists (``SpeculativeStats``) over the steps that
    verified the decoding rows: ``live_batch_sizes`` counts each such step's decoding rows (a step that only
    prefills replies appends nothing to the lists; it is in ``num_forwards``)."""

    num_cut_paths: int = 0
    """Accepted runs cut short by a stop token or a limit (the ids after the cut dropped, never committed)."""


class _Verified(NamedTuple):
    """The decoding rows' results of one step, on the device until the step's host read."""

    rows_Bd: torch.Tensor     # [Bd] long: the decoding rows of the batch
    tree: DraftTree           # their trees
    verdict: TreeVerdict
    counts_Bd: torch.Tensor   # [Bd] long: ids emitted (accepted + 1, or fewer where a stop or a limit cut)
    shape: TreeShape | None   # None: a plain step
    feedback: torch.Tensor | None
    catch_up_tokens: int


def run_multiturn(model: nn.Module, prompts: list[torch.Tensor], num_samples: int,
                  conversations: list[_Conversation], sampling: SamplingConfig, limits: TurnLimits,
                  generator: torch.Generator | None, pool: EnvCalls, timing: ReplyTiming,
                  make_step: Callable[[nn.Module, list[torch.Tensor], SamplingConfig], TreeStep],
                  recorder: RouteRecorder | None = None) -> tuple[MultiTurnSpeculativeStats, list[torch.Tensor] | None]:
    """The loop of the module docstring; fills ``conversations`` in place (``rollout.multiturn._run``'s
    contract; ``make_step`` is ``Speculation.make_step``: its draft, history and sizing). With ``recorder`` (the
    routers' recording hooks) each conversation keeps the MoE routes of its ids as the policy ran them (a tree's
    accepted path, a reply's chunk), and the prompts' routes are returned beside the stats (else None)."""
    start = time.perf_counter()
    # A conversation's ids play a completion's part: the engine's buffers and the draft's cache hold all of
    # them, so the pieces borrowed from the single-turn engine see max_conversation_tokens as max_new_tokens.
    sampling = replace(sampling, max_new_tokens=limits.max_conversation_tokens)
    step = make_step(model, prompts, sampling)
    turn_limit = min(limits.max_turn_tokens, limits.max_conversation_tokens)
    state = first_draw(model, prompts, num_samples, sampling, generator, step.keeps_hidden,
                       [turn_limit] * len(conversations), max(step.extra_slots, limits.prefill_chunk), recorder=recorder)
    stats = MultiTurnSpeculativeStats(num_forwards=1)
    step.stats = stats  # the tree step counts its draft forwards into the rollout's stats
    step.start(state)
    stop_ids = frozenset(sampling.stop_token_ids)
    rows = list(range(len(conversations)))  # cache row -> conversation
    _read_host(state, step, rows, list(range(len(rows))), None, conversations, stop_ids, pool, stats, False)
    # A hybrid's step keeps its recurrent states after every length of every row's chain (rollout.states), a
    # reply's chunk included: its chunks are held to a tree's size, which bounds that memory.
    chunk_limit = min(limits.prefill_chunk, step.extra_slots) if step.chains_only else limits.prefill_chunk
    while True:
        _collect_replies(conversations, rows, limits, stats, timing.due, pool, vocabulary_size(model))
        rows = _retire(state, step, rows, conversations)
        if not rows:
            break
        decoding = [b for b, i in enumerate(rows) if conversations[i].phase == _FEED and not conversations[i].pending]
        chunks = {b: conversations[i].pending[:chunk_limit] for b, i in enumerate(rows)
                  if conversations[i].phase == _FEED and conversations[i].pending}
        if not decoding and not chunks:  # every live conversation waits for its environment
            wait_for_replies(conversations, rows, timing, stats, pool)
            continue
        verified = _step(state, step, decoding, chunks, stats)
        for b, chunk in chunks.items():
            del conversations[rows[b]].pending[:len(chunk)]
        _resume_fed(state, [b for b in chunks if not conversations[rows[b]].pending], rows, conversations, limits)
        _read_host(state, step, rows, decoding, verified, conversations, stop_ids, pool, stats, bool(chunks))
    stats.num_generated_tokens = sum(sum(c.model_mask) for c in conversations)
    stats.wall_time_s = time.perf_counter() - start
    if state.route_log is not None:  # every id but each conversation's last ran (rollout.multiturn's contract)
        for conversation, routes_RLK in zip(conversations, state.route_log.completion_routes(
                [len(c.ids) for c in conversations])):
            conversation.routes = [routes_RLK.clone()]
    # The draft's time, the sizing's lengths and the history store take whole conversations, replies included.
    step.finish(Rollout(Groups(prompts, [torch.tensor(c.ids, dtype=torch.long) for c in conversations],
                               [num_samples] * len(prompts)), stats))
    return stats, None if state.route_log is None else state.route_log.prompts


def _retire(state: DecodeState, step: TreeStep, rows: list[int], conversations: list[_Conversation]) -> list[int]:
    """Drop the finished conversations' rows from the batch and both caches; returns the rows left."""
    keep = [b for b, i in enumerate(rows) if conversations[i].phase != _DONE]
    if keep and len(keep) < len(rows):
        state.keep(keep)
        step.keep(keep)
    return [rows[b] for b in keep]


def _step(state: DecodeState, step: TreeStep, decoding: list[int], chunks: dict[int, list[int]],
          stats: MultiTurnSpeculativeStats) -> _Verified | None:
    """One forward of every row (module docstring): the ``decoding`` rows' trees are verified and emitted,
    ``chunks`` (row -> the reply ids it writes this step) written, and the K/V behind each newest id committed."""
    cache = state.cache
    step.step_start = time.perf_counter()  # the time since the last step went to the environments
    cache.max_length = max(step.emitted_host) - 1  # the newest id of each row is not committed yet
    if step.draft_cache is not None:
        step.draft_cache.max_length = max(step.draft_seen_host)
    shape = None
    if decoding:
        shape = step.sizing.choose(len(decoding), draft_ready=step.draft_prefilled, position=max(step.emitted_host))
    if shape is None:  # a plain step: every tree is its root alone
        tree, uniform_BN, catch_up_tokens = chain_tree(state.next_B[:, None]), step.draw_uniforms(state, 1), 0
    else:
        tree, uniform_BN, catch_up_tokens = step.propose(state, shape)
    ids_Bn, depths_Bn, ancestors_Bnn = _step_inputs(tree, chunks)
    # Where each row's newest id lies, for the routes: emitting and writing replies move it on.
    emitted_before_B = None if state.route_log is None else state.live.emitted_B.clone()
    hidden_BnH = forward_new_tokens(state.model, cache, ids_Bn, depths_Bn, ancestors_Bnn, states_per_length=True)
    stats.num_forwards += 1
    verified = None
    if decoding:
        verified = _verify_decoding(state, step, tree, hidden_BnH, uniform_BN, decoding, shape, catch_up_tokens)
    chunk_lengths_F = _write_replies(state, chunks, hidden_BnH)
    # Commit: a decoding row its path's first `emitted` nodes (root first), a feeding row its fed ids.
    num_slots = max([tree.max_depth + 1, *map(len, chunks.values())])
    chosen_Bk = torch.arange(num_slots, device=cache.device).repeat(cache.num_live, 1)
    counts_B = torch.zeros(cache.num_live, dtype=torch.long, device=cache.device)
    if verified is not None:
        chosen_Bk[verified.rows_Bd, :tree.max_depth + 1] = verified.verdict.path_nodes
        counts_B[verified.rows_Bd] = verified.counts_Bd
    if chunks:
        counts_B[torch.tensor(list(chunks), device=cache.device)] = chunk_lengths_F
    cache.commit(chosen_Bk, counts_B, num_slots)
    if state.route_log is not None:  # MoE routes of the committed nodes: the root (column emitted - 1), then on
        slots_k = torch.arange(num_slots, device=cache.device)
        state.route_log.write(state.live.completion_B, emitted_before_B[:, None] - 1 + slots_k,
                              slots_k < counts_B[:, None], chosen_Bk)
    return verified


def _step_inputs(tree: DraftTree, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids ``[B, n]``, depths ``[B, n]`` and ancestors ``[B, n, n]`` of a step's forward: every row's tree
    (its root, ``next_B``, first; padding after it sees only itself), except that a feeding row's is a chain:
    its root, then its chunk's ids but the last (the newest id after the step)."""
    num_rows, num_nodes = tree.tokens.shape
    width = max([num_nodes, *map(len, chunks.values())])
    device = tree.tokens.device
    ids_Bn = torch.zeros(num_rows, width, dtype=torch.long, device=device)
    ids_Bn[:, :num_nodes] = tree.tokens.clamp(min=0)  # dead nodes (history.DEAD_TOKEN) go through as token 0
    depths_Bn = torch.arange(width, device=device).repeat(num_rows, 1)
    depths_Bn[:, :num_nodes] = tree.depths
    ancestors_Bnn = torch.eye(width, dtype=torch.bool, device=device).repeat(num_rows, 1, 1)
    ancestors_Bnn[:, :num_nodes, :num_nodes] = tree.ancestors
    if chunks:
        feeding_F = torch.tensor(list(chunks), device=device)
        fed = [chunk[:-1] + [0] * (width - len(chunk)) for chunk in chunks.values()]
        ids_Bn[feeding_F, 1:] = torch.tensor(fed, dtype=torch.long, device=device)
        depths_Bn[feeding_F] = torch.arange(width, device=device)
        # Padding after a chunk sees the chunk, but nothing real sees the padding.
        ancestors_Bnn[feeding_F] = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return ids_Bn, depths_Bn, ancestors_Bnn


def _verify_decoding(state: DecodeState, step: TreeStep, tree: DraftTree, hidden_BnH: torch.Tensor,
                     uniform_BN: torch.Tensor | None, decoding: list[int], shape: TreeShape | None,
                     catch_up_tokens: int) -> _Verified:
    """Accept each decoding row's path and emit it (the single-turn ``verify_step`` on the rows that decode):
    ``emit`` cuts it at the first stop token and at the turn's limit; the newest emitted id becomes the row's
    root."""
    rows_Bd = torch.tensor(decoding, device=hidden_BnH.device)
    own = DraftTree(*(f[rows_Bd] if isinstance(f, torch.Tensor) else f for f in tree))
    hidden_BdNH = hidden_BnH[rows_Bd, :tree.tokens.shape[1]]
    logits_BdNV = at_least_float32(state.lm_head(hidden_BdNH))
    uniform_BdN = None if uniform_BN is None else uniform_BN[rows_Bd]
    verdict = verify_tree(own, logits_BdNV, state.sampling, uniform_BN=uniform_BdN)
    emitted_BdD, logprobs_BdD, hidden_BdDH = path_outputs(own, verdict, logits_BdNV, hidden_BdNH, state.sampling)
    live = state.live
    rows = LiveRows(live.completion_B[rows_Bd], live.emitted_B[rows_Bd], live.limit_B[rows_Bd], live.done_B[rows_Bd])
    before_Bd = rows.emitted_B.clone()
    emit(state.outputs, rows, emitted_BdD, logprobs_BdD, hidden_BdDH, verdict.num_accepted + 1, state.criteria)
    counts_Bd = rows.emitted_B - before_Bd  # >= 1: a decoding row is below its limit
    live.emitted_B[rows_Bd] = rows.emitted_B
    live.done_B[rows_Bd] = rows.done_B
    state.next_B[rows_Bd] = emitted_BdD.gather(1, (counts_Bd - 1)[:, None]).squeeze(1)
    feedback = None if shape is None else step.sizing.feedback(own, verdict)
    return _Verified(rows_Bd, own, verdict, counts_Bd, shape, feedback, catch_up_tokens)


def _write_replies(state: DecodeState, chunks: dict[int, list[int]], hidden_BnH: torch.Tensor) -> torch.Tensor | None:
    """Append each feeding row's chunk to its output buffers (log-prob 0) with the policy's feature of the id
    fed before each (``hidden_BnH`` of this step); the chunk's last id becomes the row's newest. Returns the
    chunks' lengths ``[F]`` (None without chunks)."""
    if not chunks:
        return None
    device = hidden_BnH.device
    width = max(map(len, chunks.values()))
    feeding_F = torch.tensor(list(chunks), device=device)
    chunk_Fm = torch.tensor([chunk + [0] * (width - len(chunk)) for chunk in chunks.values()], device=device)
    lengths_F = torch.tensor([len(chunk) for chunk in chunks.values()], device=device)
    live, outputs = state.live, state.outputs
    completion_F1 = live.completion_B[feeding_F][:, None]
    # Columns past a chunk's length get its padding; they lie beyond the row's length and are never read.
    columns_Fm = live.emitted_B[feeding_F][:, None] + torch.arange(width, device=device)
    outputs.tokens_NT[completion_F1, columns_Fm] = chunk_Fm
    outputs.logprobs_NT[completion_F1, columns_Fm] = 0.0
    if outputs.hidden_NTH is not None:
        outputs.hidden_NTH[completion_F1, columns_Fm] = hidden_BnH[feeding_F, :width].to(outputs.hidden_NTH.dtype)
    live.emitted_B[feeding_F] += lengths_F
    outputs.lengths_N[completion_F1[:, 0]] = live.emitted_B[feeding_F]
    state.next_B[feeding_F] = chunk_Fm.gather(1, (lengths_F - 1)[:, None]).squeeze(1)
    return lengths_F


def _resume_fed(state: DecodeState, fed: list[int], rows: list[int], conversations: list[_Conversation],
                limits: TurnLimits) -> None:
    """Rows whose reply is all in decode from the next step: their turn's limit, counted from the reply's end."""
    if not fed:
        return
    device = state.next_B.device
    rows_R = torch.tensor(fed, device=device)
    turn_limits = [min(conversations[rows[b]].turn_start + limits.max_turn_tokens, limits.max_conversation_tokens)
                   for b in fed]
    state.live.limit_B[rows_R] = torch.tensor(turn_limits, device=device)
    state.live.done_B[rows_R] = False


def _read_host(state: DecodeState, step: TreeStep, rows: list[int], decoding: list[int], verified: _Verified | None,
               conversations: list[_Conversation], stop_ids: frozenset[int], pool: EnvCalls,
               stats: MultiTurnSpeculativeStats, fed_replies: bool) -> None:
    """The step's host read (one transfer): every row's emitted count, the decoding rows' finished flags and
    the verification's counts and statistics; then the turns that ended go to their handlers."""
    num_rows = len(rows)
    parts = [state.live.emitted_B.float(), state.live.done_B.float(), state.outputs.nonfinite.float().view(1)]
    if verified is not None:
        parts += [verified.counts_Bd.float(), verified.verdict.num_accepted.float()]
        if verified.feedback is not None:
            parts.append(verified.feedback.float())
    host = torch.cat(parts).tolist()  # host sync: one per step
    if host[2 * num_rows]:
        raise ValueError("the model's logits are not finite (NaN or inf) for some sequence: check the model's "
                         "weights (a diverged update, a bad checkpoint or a dtype overflow)")
    step.emitted_host = [int(v) for v in host[:num_rows]]
    if verified is not None:
        _observe(step, verified, host[2 * num_rows + 1:], len(decoding), stats, fed_replies)
    ended = [b for b in decoding if host[num_rows + b]]
    if ended:
        _end_turns(state, step, rows, ended, conversations, stop_ids, pool, stats)


def _observe(step: TreeStep, verified: _Verified, values: list[float], num_decoding: int,
             stats: MultiTurnSpeculativeStats, fed_replies: bool) -> None:
    """The step's speculation statistics, and the sizing policy's time and acceptance observations."""
    counts, accepted = values[:num_decoding], values[num_decoding:2 * num_decoding]
    stats.live_batch_sizes.append(num_decoding)
    stats.tree_sizes.append(verified.tree.tokens.shape[1])
    stats.accepted_lengths.append(sum(counts) / num_decoding)
    stats.num_cut_paths += sum(c < a + 1 for c, a in zip(counts, accepted))
    now = time.perf_counter()
    if not fed_replies:  # a reply's prefill in the same forward would read as the tree's cost
        step.sizing.observe_time(num_decoding, verified.shape, now - step.step_start, verified.catch_up_tokens)
    if verified.feedback is not None:
        step.sizing.observe(values[2 * num_decoding:])


def _end_turns(state: DecodeState, step: TreeStep, rows: list[int], ended: list[int],
               conversations: list[_Conversation], stop_ids: frozenset[int], pool: EnvCalls,
               stats: MultiTurnSpeculativeStats) -> None:
    """Record the turns of rows ``ended`` (their model ids since the last record) in their conversations; one
    that ended on a stop token goes to its handler, one cut by a limit ends its conversation ("length")."""
    outputs = state.outputs
    device = outputs.tokens_NT.device
    starts = [len(conversations[rows[b]].ids) for b in ended]
    lengths = [step.emitted_host[b] - s for b, s in zip(ended, starts)]
    columns_Em = torch.tensor(starts, device=device)[:, None] + torch.arange(max(lengths), device=device)
    completions_E1 = torch.tensor([rows[b] for b in ended], device=device)[:, None]
    columns_Em = columns_Em.clamp(max=outputs.tokens_NT.shape[1] - 1)
    host = torch.stack([outputs.tokens_NT[completions_E1, columns_Em].double(),
                        outputs.logprobs_NT[completions_E1, columns_Em].double()]).tolist()  # host sync: turn ends
    for e, (b, length) in enumerate(zip(ended, lengths)):
        conversation = conversations[rows[b]]
        tokens = [int(t) for t in host[0][e][:length]]
        logps = host[1][e][:length]
        assert all(math.isfinite(v) for v in logps), "a non-finite log-prob passed the step's check"
        conversation.ids.extend(tokens)
        conversation.model_mask.extend([1] * length)
        conversation.logps.extend(logps)
        conversation.num_turns += 1
        stats.num_turns += 1
        if tokens[-1] in stop_ids:
            conversation.phase = _WAIT
            conversation.future = pool.submit(_call_handler, conversation.handler,
                                              conversation.ids[conversation.turn_start:])
            conversation.due_after = stats.num_forwards + 1
        else:
            conversation.phase, conversation.finish = _DONE, "length"
