"""The speculative tree step: what ``generate(draft=...)`` runs inside the rollout engine's loop.

    the engine prefills the prompts once per group; every sample draws its first token
    per step, for all live sequences at once (``TreeStep.__call__``, on the host):
      shape = sizing.choose(B)                 (None: the engine's plain step)
      at the first tree: the draft's prompt pass; the uniform numbers of the policy's draws
      draft_tree (device only): catch up on the pairs committed since the draft last ran, then grow
             the tree of ``shape`` level by level
      verify_step (device only): one policy forward over every tree (tree mask, tree positions), LM
             head at every node; accept with "sample, then match" (verify.py); emit the path and the
             bonus token; commit the accepted path's K/V
    at the engine's host check, every step: accepted counts and the sizing policy's statistics
    travel with the engine's finished flags

The host chooses every size (the tree's shape, the catch-up width, the caches' slot bounds) from
host ints it keeps up to date at the host checks, outside the step; ``draft_tree`` and
``verify_step`` read only device tensors and those static sizes, with no host sync and no
``torch.Generator``, so ``torch.compile(fullgraph=True)`` captures each whole (``Speculation.runner``).
They are two functions, not one, so that the draft's share of the time can be measured between them.

The loop itself is the engine's (``turbogrpo.rollout.decode``); this module supplies the step through
``Speculation.make_step`` and never is imported by the engine. Emission, stop tokens/strings and the
output buffers are the plain engine's own (``emit``), so a stop token inside an accepted path and
max_new_tokens reached mid-path end a completion exactly as in plain decoding. The sampler's log-prob
of each emitted token is taken from the policy's logits at the node that drew it.

The tree step needs the host every step (its sizing policy reads the live count and acceptance
statistics), so it checks every step and retires finished rows at once.

History drafts (``history.py``, ``Speculation.history``) add suffix-match chains from the group's
siblings and earlier rollouts to the draft's tree, or make the tree alone when there is no draft
(``Speculation(None, history=...)``: no prompt pass, no catch-up, no draft forward).

A hybrid policy (``TreeStep.chains_only``) verifies one chain per row: its recurrent states are kept after every
length of the chain and the accepted one committed (``rollout.states``), which a tree's branches would not give.
The neural draft then proposes its top path (a tree of width 1), and history drafts replace it where their chain
runs as deep.

The draft lags behind lazily: pending pairs (policy feature, token) are read back from the output
buffers when the draft next runs, so plain steps (speculation off at high B) pay nothing for it.

Legend: G groups, B live sequences, N tree nodes, D = L + 1 path slots, P longest prompt, V
vocabulary, Hd hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from turbogrpo.hook import lm_head_of
from turbogrpo.rollout.compiled import RUNNERS
from turbogrpo.rollout.outputs import emit
from turbogrpo.rollout.plans import forward_new_tokens
from turbogrpo.rollout.sampling import SamplingConfig, at_least_float32, token_logprobs
from turbogrpo.rollout.step import DecodeState, PlainStep, plain_step
from turbogrpo.rollout.types import Rollout, RolloutStats
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.draft_decoding import (DraftKVCache, TappedFeatures, TreeDrafter, catch_up,
                                                   draft_prompt_lengths, prefill_draft)
from turbogrpo.speculative.history import HistoryDrafts, chain_geometry, propose_history
from turbogrpo.speculative.profiler import DeviceStopwatch
from turbogrpo.speculative.sizing import MergedSizing, SizingPolicy
from turbogrpo.speculative.tree import DraftTree, TreeShape, build_tree, chain_shape
from turbogrpo.speculative.verify import TreeVerdict, verify_tree

@dataclass
class SpeculativeStats(RolloutStats):
    """``RolloutStats`` plus what speculation did at each decoding step (same order as
    ``live_batch_sizes``)."""

    tree_sizes: list[int] = field(default_factory=list)
    """Nodes verified per live sequence (root included; 1 = a plain step)."""
    accepted_lengths: list[float] = field(default_factory=list)
    """Tokens emitted per live sequence, averaged over the live batch (accepted draft tokens + 1)."""
    num_draft_forwards: int = 0
    draft_seconds: float = 0.0
    """Time spent in the draft's own work: its prompt pass, catch-up passes and tree levels."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per policy forward over the speculative steps (1.0 when none speculated)."""
        pairs = [(b, a) for b, a, n in zip(self.live_batch_sizes, self.accepted_lengths, self.tree_sizes) if n > 1]
        total = sum(b for b, _ in pairs)
        return sum(b * a for b, a in pairs) / total if total else 1.0

@dataclass
class _VerifiedStep:
    """A decoding step whose accepted counts and statistics wait for the step's host transfer."""

    num_accepted_B: torch.Tensor | None
    """[B] draft tokens accepted (None for a plain step)."""
    shape: TreeShape | None
    feedback: torch.Tensor | None
    catch_up_tokens: int = 0
    num_nodes: int = 1

class TreeStep:
    """The speculative ``DecodeStep`` (protocol in ``turbogrpo.rollout.step``)."""

    host_check_every = 1
    exact_compaction = True
    keeps_hidden = True  # the draft reads its pending pairs from the policy's hidden states (not history)

    def __init__(self, draft: DraftHead | None, sizing: SizingPolicy, runner: str = "eager",
                 history: HistoryDrafts | None = None, chains_only: bool = False):
        self.draft = draft
        self.sizing = sizing
        self.history = history
        self.chains_only = chains_only
        """One chain per row, whatever the shape's K (a hybrid: its recurrent states follow a chain,
        ``rollout.states``): the neural draft's top path (``tree.chain_shape``), or the history's chain where it
        runs as deep from a full-length match (``history.propose_history``), or the history's alone."""
        self.keeps_hidden = draft is not None  # history drafts read tokens only
        # Looked up here, not bound at import, so that the functions can be watched in tests.
        self.draft_tree, self.verify_step = RUNNERS[runner](draft_tree), RUNNERS[runner](verify_step)
        # The steps the sizing leaves plain run the same way (under "compiled-onednn" the rollout's weight products are
        # the graphs' packed ones, which an eager step would not use).
        self.plain_step = PlainStep(RUNNERS[runner](plain_step))
        # An "eagle3" draft's tap goes on before the engine's prefill, whose forward gives the prompts' features.
        self.tap = None if draft is None else draft.feature_tap()
        if self.tap is not None and runner != "eager":
            self.tap.close()
            raise ValueError(f"an \"eagle3\" draft reads the policy's layers through forward hooks, which the "
                             f"{runner!r} runner does not run; use runner \"eager\"")
        max_nodes, self.max_draft_slots = sizing.bounds()
        merged = history.extra_nodes(max_nodes - 1) if history is not None and draft is not None else 0
        self.extra_slots = max_nodes + merged

    def make_stats(self) -> SpeculativeStats:
        self.stats = SpeculativeStats()
        return self.stats

    def start(self, state: DecodeState) -> None:
        num_completions = state.num_completions
        self.max_new = state.sampling.max_new_tokens
        # A catch-up pass pads every row to the longest backlog, so rows may write up to 2 * max_new slots.
        self.draft_cache = None if self.draft is None else DraftKVCache(
            draft_prompt_lengths(self.draft, state.prompts), state.num_samples,
            capacity=2 * self.max_new + self.max_draft_slots, device=state.next_B.device)
        self.corpus = None if self.history is None else self.history.start(state.prompts, state.num_samples)
        self.tapped = None if self.tap is None else TappedFeatures(
            self.tap, [len(p) for p in state.prompts], state.num_samples, state.outputs.tokens_NT.shape[1],
            state.prompt_hidden_GPH)
        self.draft_prefilled = self.draft is None  # nothing to prefill without a neural draft
        self.pending: _VerifiedStep | None = None
        self.stopwatch = DeviceStopwatch(state.next_B.device)
        # Per live row, on the host: tokens emitted, and how many of them the draft has seen. Exact for
        # live rows (a row whose emission was cut short has finished), they give the caches' exact
        # "longest sequence" bounds, so attention reads no slot beyond the longest live sequence.
        self.emitted_host = [1] * num_completions
        self.draft_seen_host = [0] * num_completions
        self.step_start = time.perf_counter()

    def __call__(self, state: DecodeState) -> None:
        cache, draft_cache = state.cache, self.draft_cache
        cache.max_length = max(self.emitted_host) - 1  # the root token is not committed yet
        if draft_cache is not None:
            draft_cache.max_length = max(self.draft_seen_host)
        shape = self.sizing.choose(cache.num_live, draft_ready=self.draft_prefilled, position=max(self.emitted_host))
        if shape is None:
            first_column_B = state.live.emitted_B.clone()  # the column the step's token goes to
            self.plain_step(state)
            if self.tapped is not None:
                self.tapped.write_latest(state.live.completion_B, first_column_B)
            self.pending = _VerifiedStep(None, None, None)
            return
        tree, uniform_BN, catch_up_tokens = self.propose(state, shape)
        self._verify(state, tree, uniform_BN, shape, catch_up_tokens)

    def propose(self, state: DecodeState, shape: TreeShape) -> tuple[DraftTree, torch.Tensor | None, int]:
        """Every row's tree for a step of ``shape`` (the sizing policy's choice), the uniform numbers of its
        verification ``[B, N]`` (None when greedy) and the pairs the draft caught up on first. History chains
        alone when there is no neural draft or the merged sizing chose them (no draft forward, nothing to
        catch up: the draft catches up on these tokens when it next runs); otherwise the neural tree, its
        prompt pass first at the first tree, the history's chains merged in."""
        cache, draft_cache = state.cache, self.draft_cache
        if self.draft is None or (isinstance(self.sizing, MergedSizing) and self.sizing.history_alone):
            num_chains, depth = chain_geometry(shape)
            if self.chains_only:
                num_chains, depth = 1, chain_shape(shape).depth
            uniform_BN = self.draw_uniforms(state, 1 + num_chains * depth)
            with self.stopwatch:
                tree = propose_history(state, self.corpus, self.history, num_chains, depth, max(self.emitted_host))
            return tree, uniform_BN, 0
        if not self.draft_prefilled:
            # The draft's prompt pass waits for the first tree, so rollouts that never speculate
            # (high B throughout) cost the plain engine's time. It is timed on its own (two device
            # syncs, once per rollout) and left out of the step's time: the policy weighs it once.
            prompt_features = state.prompt_hidden_GPH if self.tapped is None else \
                self.tapped.prompt_features(state.prompt_hidden_GPH)
            seconds = self.stopwatch.timed(
                lambda: prefill_draft(self.draft, draft_cache, state.prompts, prompt_features))
            self.sizing.observe_startup(seconds)
            self.step_start += seconds
            self.draft_prefilled = True
            self.stats.num_draft_forwards += 1
        pending_width = max(e - s for e, s in zip(self.emitted_host, self.draft_seen_host))
        catch_up_tokens = pending_width * cache.num_live
        num_chains = 0 if self.history is None else self.history.num_chains
        if self.chains_only:   # the draft's top path; history's chain instead where it runs as deep
            shape, num_chains = chain_shape(shape), 1
        merged_nodes = 0 if self.chains_only else num_chains * shape.depth
        uniform_BN = self.draw_uniforms(state, shape.num_nodes + merged_nodes)
        with self.stopwatch:
            tree = self.draft_tree(state, self.draft, draft_cache, shape, pending_width, self.tapped)
            if self.history is not None:  # merged: the neural tree plus the history's chains (or one chain)
                tree = propose_history(state, self.corpus, self.history, num_chains, shape.depth,
                                       max(self.emitted_host), tree, self.chains_only)
        self.draft_seen_host = list(self.emitted_host)
        draft_cache.max_length = max(self.draft_seen_host)
        self.stats.num_draft_forwards += shape.depth
        return tree, uniform_BN, catch_up_tokens

    @staticmethod
    def draw_uniforms(state: DecodeState, num_nodes: int) -> torch.Tensor | None:
        """``[B, num_nodes]`` uniform numbers of a verification's draws (None when greedy)."""
        # Drawn before the step: a torch.Generator cannot be traced. The same numbers, in the same
        # order, as drawing them at the acceptance (the draft draws none).
        return None if state.sampling.greedy else torch.rand(
            (state.cache.num_live, num_nodes), generator=state.generator, device=state.next_B.device)

    def _verify(self, state: DecodeState, tree: DraftTree, uniform_BN: torch.Tensor | None, shape: TreeShape,
                catch_up_tokens: int) -> None:
        verdict = self.verify_step(state, tree, uniform_BN, self.tapped)
        self.pending = _VerifiedStep(verdict.num_accepted, shape, self.sizing.feedback(tree, verdict),
                                     catch_up_tokens, tree.tokens.shape[1])

    def host_values(self) -> torch.Tensor | None:
        step = self.pending
        if step is None or step.num_accepted_B is None:
            return None
        parts = [step.num_accepted_B.float()]
        if step.feedback is not None:
            parts.append(step.feedback.float())
        return torch.cat(parts)

    def after_host_check(self, state: DecodeState, values: list[float]) -> None:
        """The step's results reached the host: time it, commit its accepted path, feed the sizing policy."""
        step, self.pending = self.pending, None
        now = time.perf_counter()
        if step is None:  # the check after the first draw
            self.step_start = now
            return
        # The host transfer waited for the step's device work, so this is the step's real time.
        self.sizing.observe_time(state.cache.num_live, step.shape, now - self.step_start, step.catch_up_tokens)
        self.step_start = now
        num_rows = state.cache.num_live
        accepted = [0] * num_rows
        if step.num_accepted_B is not None:
            accepted = [int(v) for v in values[:num_rows]]
            if step.feedback is not None:
                self.sizing.observe(values[num_rows:])
        self.stats.tree_sizes.append(step.num_nodes)
        self.stats.accepted_lengths.append(sum(accepted) / num_rows + 1)
        self.emitted_host = [e + a + 1 for e, a in zip(self.emitted_host, accepted)]

    def keep(self, rows: list[int]) -> None:
        if self.draft_cache is not None:
            self.draft_cache.keep(rows)
        self.emitted_host = [self.emitted_host[r] for r in rows]
        self.draft_seen_host = [self.draft_seen_host[r] for r in rows]

    def finish(self, rollout: Rollout) -> None:
        if self.tap is not None:
            self.tap.close()
        self.stats.draft_seconds = self.stopwatch.seconds
        self.sizing.observe_lengths([len(tokens) for tokens in rollout.tokens])
        if self.history is not None:
            self.history.record(rollout.prompts, rollout.tokens_per_group())

def check_draft(draft: object, model: nn.Module) -> None:
    if not isinstance(draft, DraftHead):
        raise ValueError(f"draft must be a DraftHead or a Speculation holding one, got {type(draft).__name__}")
    if draft.policy.lm_head is not lm_head_of(model):
        raise ValueError("draft was built for another model object: it reuses its policy's embeddings and LM "
                         "head, so build or load it with this model (DraftHead(model) / DraftHead.load(path, model))")

def draft_tree(state: DecodeState, draft: DraftHead, draft_cache: DraftKVCache, shape: TreeShape,
               pending_width: int, tapped: TappedFeatures | None = None) -> DraftTree:
    """The draft's part of a tree step (device only): feed it the ``pending_width`` (host int, the
    longest backlog) pairs each row committed since it last ran, then grow every row's tree of ``shape``.
    ``tapped``: the tapped layers' outputs an "eagle3" draft reads beside the final features."""
    root_features_BH = _catch_up_draft(draft, draft_cache, state, pending_width, state.sampling.max_new_tokens,
                                       tapped)
    return build_tree(state.next_B, draft.proposals(root_features_BH), TreeDrafter(draft, draft_cache, root_features_BH),
                      shape)

def verify_step(state: DecodeState, tree: DraftTree, uniform_BN: torch.Tensor | None,
                tapped: TappedFeatures | None = None) -> TreeVerdict:
    """The policy's part of a tree step (device only): one forward over every row's tree ``[B, N]``,
    acceptance with the uniform numbers ``uniform_BN`` (None when greedy), emission of the accepted
    path and the bonus token, and the commit of the path's K/V (finished rows' too: they are retired
    at the next host check, so nothing reads them). ``tapped``: where an "eagle3" draft's layers are kept
    for the accepted path, from this same forward."""
    # Dead nodes (history.DEAD_TOKEN, never accepted) go through the forward as token 0.
    # A hybrid's trees are chains (TreeStep.chains_only): its recurrent states are kept per length until the commit.
    hidden_BNH = forward_new_tokens(state.model, state.cache, tree.tokens.clamp(min=0), tree.depths, tree.ancestors,
                                    states_per_length=True)
    logits_BNV = at_least_float32(state.lm_head(hidden_BNH))
    verdict = verify_tree(tree, logits_BNV, state.sampling, uniform_BN=uniform_BN)
    if state.route_log is not None:  # MoE routes of the accepted path: the root (column emitted - 1), then its nodes
        path_BD = verdict.path_nodes
        offsets_D = torch.arange(path_BD.shape[1], device=path_BD.device)
        state.route_log.write(state.live.completion_B, state.live.emitted_B[:, None] - 1 + offsets_D,
                              ~state.live.done_B[:, None] & (offsets_D <= verdict.num_accepted[:, None]), path_BD)
    emitted_BD, logprobs_BD, hidden_BDH = path_outputs(tree, verdict, logits_BNV, hidden_BNH, state.sampling)
    if tapped is not None:  # before emit moves the columns on: node d predicted the token at emitted + d
        tapped.write_latest(state.live.completion_B, state.live.emitted_B, verdict.path_nodes)
    emit(state.outputs, state.live, emitted_BD, logprobs_BD, hidden_BDH, verdict.num_accepted + 1,
         state.criteria)
    state.next_B.copy_(verdict.next_token)
    state.cache.commit(verdict.path_nodes, verdict.num_accepted + 1)
    return verdict

def path_outputs(tree: DraftTree, verdict: TreeVerdict, logits_BNV: torch.Tensor, hidden_BNH: torch.Tensor,
                  sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[B, D]`` a step emits (accepted draft tokens, then the bonus token at slot
    num_accepted; later slots are unused), their sampler log-probs and the hidden states that
    predicted them (those of the path's nodes: node i's logits drew token i + 1)."""
    path_BD = verdict.path_nodes
    emitted_BD = torch.cat([tree.tokens.gather(1, path_BD[:, 1:]), verdict.next_token[:, None]], 1)
    emitted_BD.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])
    path_logits = logits_BNV.gather(1, path_BD[:, :, None].expand(-1, -1, logits_BNV.shape[-1]))
    path_hidden = hidden_BNH.gather(1, path_BD[:, :, None].expand(-1, -1, hidden_BNH.shape[-1]))
    return emitted_BD, token_logprobs(path_logits, emitted_BD, sampling), path_hidden

def _catch_up_draft(draft: DraftHead, draft_cache: DraftKVCache, state: DecodeState, pending_width: int,
                    max_new: int, tapped: TappedFeatures | None = None) -> torch.Tensor:
    """Feed the draft every pair (feature that predicted token j, token j) it has not seen; return the
    root's predicted feature ``[B, Hd]``."""
    seen_B = draft_cache.lengths_B
    columns_Bm = (seen_B[:, None] + torch.arange(pending_width, device=seen_B.device)).clamp(max=max_new - 1)
    rows_Bm = state.live.completion_B[:, None].expand_as(columns_Bm)
    outputs = state.outputs
    # Columns past a row's pending count are padding (possibly "no token" markers): any valid id does.
    tokens_Bm = outputs.tokens_NT[rows_Bm, columns_Bm].clamp(min=0)
    features_BmX = outputs.hidden_NTH[rows_Bm, columns_Bm]
    if tapped is not None:
        features_BmX = tapped.read(rows_Bm, columns_Bm, features_BmX)
    return catch_up(draft, draft_cache, features_BmX, tokens_Bm, state.live.emitted_B - seen_B)
