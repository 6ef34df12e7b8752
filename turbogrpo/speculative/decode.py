"""The speculative rollout: the plain engine's loop with a draft tree per step.

    prefill the prompts once per group; every sample draws its first token
    loop over steps, for all live sequences at once:
      shape = sizing.choose(B)                 (None: a plain step, the tree is the root alone)
      draft: catch up on the pairs committed since it last ran (at the first tree: its prompt pass
             too), then grow the tree level by level
      policy: one forward over every tree (tree mask, tree positions), LM head at every node
      accept with "sample, then match" (verify.py); emit the path and the bonus token
      one host transfer: finished rows, accepted counts, the sizing policy's statistics
      commit the accepted path's K/V, drop finished sequences

Emission, stop tokens/strings and the output buffers are the plain engine's own (``emit``), so a stop
token inside an accepted path and max_new_tokens reached mid-path end a completion exactly as in
plain decoding. The sampler's log-prob of each emitted token is taken from the policy's logits at
the node that drew it, as in plain sampling.

The draft lags behind lazily: pending pairs (policy feature, token) are read back from the output
buffers when the draft next runs, so plain steps (speculation off at high B) pay nothing for it.

Legend: G groups, B live sequences, N tree nodes, D = L + 1 path slots, P longest prompt, V
vocabulary, Hd hidden size.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from turbogrpo.hook import lm_head_of
from turbogrpo.rollout.engine import generate
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.outputs import LiveRows, OutputBuffers, collect_rollout, emit
from turbogrpo.rollout.plans import forward_new_tokens, prefill_all_positions
from turbogrpo.rollout.sampling import SamplingConfig, sample_with_logprobs, token_logprobs
from turbogrpo.rollout.stopping import StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.drafting import DraftKVCache, TreeDrafter, catch_up, prefill_draft
from turbogrpo.speculative.policy import SizingPolicy, make_sizing
from turbogrpo.speculative.profiler import LatencyProfile, cached_profile, synchronize
from turbogrpo.speculative.tree import DraftTree, TreeShape, build_tree
from turbogrpo.speculative.verify import verify_tree


@dataclass
class Speculation:
    """How ``generate(draft=...)`` speculates; a bare ``DraftHead`` means ``Speculation(draft)``."""

    draft: DraftHead
    sizing: SizingPolicy | str = "cost"
    """A sizing policy object (it keeps its acceptance statistics across rollouts) or a registered
    name (``off``, ``fixed``, ``fastgrpo``, ``cost``), built afresh for each rollout."""
    profile: LatencyProfile | None = None
    """Latency curves for ``fastgrpo``/``cost``; None reads the profile cache or measures on first use."""


@dataclass
class SpeculativeStats(RolloutStats):
    """``RolloutStats`` plus what speculation did at each decoding step (same order as
    ``live_batch_sizes``)."""

    tree_sizes: list[int] = field(default_factory=list)
    """Nodes verified per live sequence (root included; 1 = a plain step)."""
    accepted_lengths: list[float] = field(default_factory=list)
    """Tokens emitted per live sequence, averaged over the live batch (accepted draft tokens + 1)."""
    num_draft_forwards: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per policy forward over the speculative steps (1.0 when none speculated)."""
        pairs = [(b, a) for b, a, n in zip(self.live_batch_sizes, self.accepted_lengths, self.tree_sizes) if n > 1]
        total = sum(b for b, _ in pairs)
        return sum(b * a for b, a in pairs) / total if total else 1.0


def generate_speculative(model: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
                         sampling: SamplingConfig, draft: DraftHead | Speculation, seed: int | None = None,
                         return_hidden: bool = False,
                         max_new_tokens_per_completion: Sequence[int] | None = None) -> Rollout:
    """``turbogrpo.rollout.generate(..., draft=draft)``: the same inputs, checks and outputs."""
    return generate(model, prompts, num_samples=num_samples, sampling=sampling, seed=seed,
                    return_hidden=return_hidden, draft=draft,
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
    return make_sizing(speculation.sizing, profile=profile)


@dataclass
class _VerifiedStep:
    """A decoding step whose K/V commit waits for the step's host transfer."""

    path_nodes_BD: torch.Tensor | None
    """Accepted path (None for a plain step: its one new token is kept)."""
    num_accepted_B: torch.Tensor | None
    num_nodes: int
    feedback: torch.Tensor | None


@dataclass
class _Decoder:
    """What every step of one rollout uses."""

    model: nn.Module
    lm_head: nn.Module
    draft: DraftHead
    sizing: SizingPolicy
    cache: GroupedKVCache
    draft_cache: DraftKVCache
    outputs: OutputBuffers
    criteria: StopCriteria
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_new: int

    def plain_step(self, live: LiveRows, root_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _VerifiedStep]:
        """The plain engine's step (speculation off): one token per sequence, no tree bookkeeping."""
        hidden_B1H = forward_new_tokens(self.model, self.cache, root_B[:, None])
        logits_BV = self.lm_head(hidden_B1H[:, 0]).float()
        next_B, logprobs_B = sample_with_logprobs(logits_BV, self.sampling, self.generator)
        finished_B = emit(self.outputs, live, next_B[:, None], logprobs_B[:, None], hidden_B1H,
                      torch.ones_like(next_B), self.criteria)
        return finished_B, next_B, _VerifiedStep(None, None, 1, None)

    def tree_step(self, live: LiveRows, root_B: torch.Tensor, root_features_BH: torch.Tensor,
                  shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, _VerifiedStep]:
        """Draft a tree per sequence, verify all of them in one policy forward, emit the accepted paths."""
        root_logprobs_BV = self.draft.logits(root_features_BH).float().log_softmax(-1)
        tree = build_tree(root_B, root_logprobs_BV, TreeDrafter(self.draft, self.draft_cache, root_features_BH), shape)
        hidden_BNH = forward_new_tokens(self.model, self.cache, tree.tokens, tree.depths, tree.ancestors)
        logits_BNV = self.lm_head(hidden_BNH).float()
        verdict = verify_tree(tree, logits_BNV, self.sampling, self.generator)
        emitted_BD, logprobs_BD, hidden_BDH = _path_outputs(tree, verdict, logits_BNV, hidden_BNH, self.sampling)
        finished_B = emit(self.outputs, live, emitted_BD, logprobs_BD, hidden_BDH, verdict.num_accepted + 1,
                      self.criteria)
        step = _VerifiedStep(verdict.path_nodes, verdict.num_accepted, shape.num_nodes,
                             self.sizing.feedback(tree, verdict))
        return finished_B, verdict.next_token, step


def speculative_rollout(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
                        generator: torch.Generator | None, return_hidden: bool,
                        draft: DraftHead | Speculation, limits_N: torch.Tensor) -> Rollout:
    """The loop of the module docstring (inputs already checked and on the model's device)."""
    start = time.perf_counter()
    if not isinstance(draft, (DraftHead, Speculation)):
        raise ValueError(f"draft must be a turbogrpo.speculative DraftHead or Speculation (or None for plain "
                         f"sampling), got {type(draft).__name__}")
    speculation = draft if isinstance(draft, Speculation) else Speculation(draft)
    _check_draft(speculation.draft, model)
    sizing = resolve_sizing(speculation, model, prompts, sampling)
    max_nodes, max_draft_slots = sizing.bounds()
    device = prompts[0].device
    num_completions, max_new = len(prompts) * num_samples, sampling.max_new_tokens
    prompt_lengths = [len(p) for p in prompts]
    cache = GroupedKVCache(prompt_lengths, num_samples, capacity=max_new + max_nodes, device=device)
    # A catch-up pass pads every row to the longest backlog, so rows may write up to 2 * max_new slots.
    draft_cache = DraftKVCache(prompt_lengths, num_samples, capacity=2 * max_new + max_draft_slots, device=device)
    stats = SpeculativeStats()

    prompt_hidden_GPH = prefill_all_positions(model, cache, prompts)
    stats.num_forwards += 1
    last_GH = prompt_hidden_GPH[torch.arange(len(prompts), device=device),
                                torch.tensor(prompt_lengths, device=device) - 1]
    # Hidden states are always kept: the draft reads its pending pairs from them. emit writes all D
    # slots of a step's path (slots past a row's count are leftovers), hence the spare columns.
    decoder = _Decoder(model, lm_head_of(model), speculation.draft, sizing, cache, draft_cache,
                       OutputBuffers.allocate(num_completions, max_new + max_nodes, device, last_GH),
                       StopCriteria(sampling, device), sampling, generator, max_new)
    live = LiveRows.start(limits_N)
    logits_BV = decoder.lm_head(last_GH).float().repeat_interleave(num_samples, dim=0)
    root_B, root_logprobs_B = sample_with_logprobs(logits_BV, sampling, generator)
    finished_B = emit(decoder.outputs, live, root_B[:, None], root_logprobs_B[:, None],
                      last_GH.repeat_interleave(num_samples, dim=0)[:, None], torch.ones_like(root_B),
                      decoder.criteria)
    step: _VerifiedStep | None = None
    # Per live row, on the host: tokens emitted, and how many of them the draft has seen. Exact for
    # live rows (a row whose emission was cut short has finished), they give the caches' exact
    # "longest sequence" bounds, so attention reads no slot beyond the longest live sequence.
    emitted_host = [1] * num_completions
    draft_seen_host = [0] * num_completions
    step_shape: TreeShape | None = None
    draft_prefilled = False
    step_start, catch_up_tokens = 0.0, 0
    while True:
        finished, accepted, feedback = _host_view(finished_B, step)
        now = time.perf_counter()
        if step is not None:
            # The transfer above waited for the step's device work, so this is the step's real time.
            sizing.observe_time(cache.num_live, step_shape, now - step_start, catch_up_tokens)
        step_start = now
        if step is not None:
            if step.path_nodes_BD is None:
                cache.commit_all(1)
            else:
                cache.commit(step.path_nodes_BD, step.num_accepted_B + 1)
            if feedback is not None:
                sizing.observe(feedback)
            stats.tree_sizes.append(step.num_nodes)
            stats.accepted_lengths.append(sum(accepted) / len(accepted) + 1)
            emitted_host = [e + a + 1 for e, a in zip(emitted_host, accepted)]
        if any(finished):
            rows = [row for row, done in enumerate(finished) if not done]
            if not rows:
                break
            rows_device = torch.tensor(rows, dtype=torch.long, device=device)
            cache.keep(rows)
            draft_cache.keep(rows)
            live = live.keep(rows_device)
            root_B = root_B[rows_device]
            emitted_host = [emitted_host[r] for r in rows]
            draft_seen_host = [draft_seen_host[r] for r in rows]
        cache.max_length = max(emitted_host) - 1  # the root token is not committed yet
        draft_cache.max_length = max(draft_seen_host)
        stats.live_batch_sizes.append(cache.num_live)
        stats.num_forwards += 1

        shape = step_shape = sizing.choose(cache.num_live, draft_ready=draft_prefilled, position=max(emitted_host))
        if shape is None:
            finished_B, root_B, step = decoder.plain_step(live, root_B)
            continue
        if not draft_prefilled:
            # The draft's prompt pass waits for the first tree, so rollouts that never speculate
            # (high B throughout) cost the plain engine's time. It is timed on its own (two device
            # syncs, once per rollout) and left out of the step's time: the policy weighs it once.
            seconds = _timed(device, lambda: prefill_draft(speculation.draft, draft_cache, prompts, prompt_hidden_GPH))
            sizing.observe_startup(seconds)
            step_start += seconds
            draft_prefilled = True
            stats.num_draft_forwards += 1
        pending_width = max(e - s for e, s in zip(emitted_host, draft_seen_host))
        catch_up_tokens = pending_width * cache.num_live
        root_features_BH = _catch_up_draft(decoder, live, pending_width)
        draft_seen_host = list(emitted_host)
        draft_cache.max_length = max(draft_seen_host)
        stats.num_draft_forwards += shape.depth
        finished_B, root_B, step = decoder.tree_step(live, root_B, root_features_BH, shape)
    outputs = decoder.outputs if return_hidden else dataclasses.replace(decoder.outputs, hidden_NTH=None)
    rollout = collect_rollout(prompts, num_samples, outputs, stats, start)
    sizing.observe_lengths([len(tokens) for tokens in rollout.tokens])
    return rollout


def _timed(device: torch.device, work) -> float:
    """Wall seconds of ``work()``, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - start


def _check_draft(draft: object, model: nn.Module) -> None:
    if not isinstance(draft, DraftHead):
        raise ValueError(f"draft must be a DraftHead or a Speculation holding one, got {type(draft).__name__}")
    if draft.policy.lm_head is not lm_head_of(model):
        raise ValueError("draft was built for another model object: it reuses its policy's embeddings and LM "
                         "head, so build or load it with this model (DraftHead(model) / DraftHead.load(path, model))")


def _host_view(finished_B: torch.Tensor, step: _VerifiedStep | None):
    """Host sync, once per step: which rows finished, accepted counts, sizing statistics."""
    parts = [finished_B.float()]
    if step is not None and step.num_accepted_B is not None:
        parts.append(step.num_accepted_B.float())
        if step.feedback is not None:
            parts.append(step.feedback.float())
    values = torch.cat(parts).tolist()
    num_rows = finished_B.shape[0]
    finished = [v > 0 for v in values[:num_rows]]
    if step is None:
        return finished, None, None
    if step.num_accepted_B is None:
        return finished, [0] * num_rows, None
    accepted = [int(v) for v in values[num_rows:2 * num_rows]]
    return finished, accepted, (values[2 * num_rows:] if step.feedback is not None else None)


def _path_outputs(tree: DraftTree, verdict, logits_BNV: torch.Tensor, hidden_BNH: torch.Tensor,
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


def _catch_up_draft(decoder: _Decoder, live: LiveRows, pending_width: int) -> torch.Tensor:
    """Feed the draft every pair (feature that predicted token j, token j) it has not seen; return the
    root's predicted feature ``[B, Hd]``."""
    seen_B = decoder.draft_cache.lengths_B
    columns_Bm = (seen_B[:, None] + torch.arange(pending_width, device=seen_B.device)).clamp(max=decoder.max_new - 1)
    rows_Bm = live.completion_B[:, None].expand_as(columns_Bm)
    outputs = decoder.outputs
    # Columns past a row's pending count are padding (possibly "no token" markers): any valid id does.
    tokens_Bm = outputs.tokens_NT[rows_Bm, columns_Bm].clamp(min=0)
    return catch_up(decoder.draft, decoder.draft_cache, outputs.hidden_NTH[rows_Bm, columns_Bm], tokens_Bm,
                    live.emitted_B - seen_B)
