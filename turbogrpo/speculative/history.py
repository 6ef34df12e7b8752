"""History and sibling drafts: candidate tokens that cost no neural forward.

A GRPO group samples G completions of one prompt, and prompts recur across epochs, so the text a
sequence is about to write has often been written already: by a sibling earlier in this rollout, by
an earlier rollout of the same prompt, or in the prompt itself (numbers and names copied from the
question). Like prompt-lookup decoding, SPEC-RL and verl's HistoSpec, we look the sequence's suffix
up in that text and propose what followed it:

* the *corpus* of a group is its prompt followed, for every source, by one completion: the group's
  siblings as they stand (the rollout's own output buffers, every step) and the completions of earlier
  rollouts of that prompt (``HistoryStore``, keyed by prompt tokens, bounded, kept by the caller across
  rollouts);
* ``suffix_matches``: for every live sequence, the positions of the corpus where the longest run of
  tokens equal to the sequence's last ``match_length`` tokens ends (ties: the latest);
* ``continuations``: the ``depth`` tokens after the ``num_chains`` best matches: a chain each;
* ``tree_from_paths``: candidate nodes given by their token paths (history chains, and the neural
  draft's tree nodes when there is one) merged into one ``DraftTree``; equal paths are one node, so
  sibling tokens stay distinct. Candidates that are not real (a chain cut short, a repeated path) stay
  in the tree as *dead* nodes, token ``DEAD_TOKEN``, which no draw can match.

Verification is the existing "sample, then match" (``verify.py``): the tree depends only on tokens
already sampled, never on the draws it is verified with, so the output keeps plain sampling's
distribution whatever the history proposes.

Everything per step runs on the device with no host sync (the step's sizes are host ints the tree
step already keeps). The host reads the prompts and writes the store once per rollout (``start`` and
``record``), not per step.

Legend: G groups, Gs samples per group, B live sequences, S sources per group (Gs siblings + H
earlier completions), P longest prompt, J completion columns, T = P + J corpus positions, n match
length, K chains, L chain depth, M candidate nodes, D path slots (deepest candidate).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from turbogrpo.rollout.step import DecodeState
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile
from turbogrpo.speculative.sizing import MergedSizing, SizingPolicy, make_sizing
from turbogrpo.speculative.tree import DraftTree, TreeShape, ancestors_from_parents

DEAD_TOKEN = -1
"""Token of a node that is not a real candidate: no draw matches it, so it is never accepted (the
policy's forward reads it as token 0; its K/V is never committed)."""
_NO_TOKEN = -1  # corpus padding and paths past a node's depth
_NO_QUERY = -2  # query padding: never equal to a corpus token, padding included


class HistoryStore:
    """Completions of earlier rollouts, per prompt: at most ``per_prompt`` (the newest) for each of at
    most ``max_prompts`` prompts (the most recently used), on the host. Keyed by the prompt's tokens."""

    def __init__(self, max_prompts: int = 4096, per_prompt: int = 8):
        if max_prompts < 1 or per_prompt < 1:
            raise ValueError(f"HistoryStore: max_prompts and per_prompt must be >= 1, got {max_prompts}, {per_prompt}")
        self.max_prompts, self.per_prompt = max_prompts, per_prompt
        self._entries: OrderedDict[bytes, deque[torch.Tensor]] = OrderedDict()

    @staticmethod
    def key(prompt: torch.Tensor) -> bytes:
        return prompt.detach().to("cpu", torch.int64).numpy().tobytes()  # host sync: once per prompt and rollout

    def get(self, prompt: torch.Tensor) -> list[torch.Tensor]:
        entries = self._entries.get(self.key(prompt))
        return list(entries) if entries else []

    def add(self, prompt: torch.Tensor, completions: list[torch.Tensor]) -> None:
        key = self.key(prompt)
        entries = self._entries.setdefault(key, deque(maxlen=self.per_prompt))
        self._entries.move_to_end(key)
        entries.extend(c.detach().to("cpu", torch.int64) for c in completions if len(c))
        while len(self._entries) > self.max_prompts:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class HistoryDrafts:
    """Suffix-match drafts from the group's siblings and from earlier rollouts (``Speculation.history``).

    Alone (``Speculation(None, history=HistoryDrafts())``) a step's tree of shape (K, L, N) is K
    chains of ``min(L, (N - 1) // K)`` tokens; with a neural draft, ``num_chains`` chains of depth L
    are merged into the draft's tree (the verify forward grows by ``num_chains * L`` nodes per row).
    """

    store: HistoryStore | None = field(default_factory=HistoryStore)
    """Earlier rollouts' completions, filled at the end of every rollout (None: siblings only)."""
    match_length: int = 8
    """Longest suffix compared: a match of n tokens ranks above any shorter one."""
    min_match: int = 2
    """Shortest suffix match whose continuation is proposed (shorter ones propose dead nodes)."""
    num_chains: int = 1
    """Chains merged into a neural draft's tree."""

    def __post_init__(self):
        for name in ("match_length", "min_match", "num_chains"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HistoryDrafts.{name} must be an integer >= 1, got {value!r}")
        if self.min_match > self.match_length:
            raise ValueError(f"HistoryDrafts.min_match ({self.min_match}) must be <= match_length ({self.match_length})")

    def extra_nodes(self, max_depth: int) -> int:
        """Most nodes merged into a neural tree of depth <= ``max_depth``."""
        return self.num_chains * max_depth

    def start(self, prompts: list[torch.Tensor], num_samples: int) -> HistoryCorpus:
        """The rollout's fixed part of the corpus: right-aligned prompts and the stored completions."""
        device = prompts[0].device
        # At least match_length + 1 positions before the first completion column, so that every
        # sequence has a full query and the corpus a window to match from the first step on.
        width = max(max(len(p) for p in prompts), self.match_length + 1)
        prompt_GP = torch.full((len(prompts), width), _NO_TOKEN, dtype=torch.long, device=device)
        for g, prompt in enumerate(prompts):
            prompt_GP[g, width - len(prompt):] = prompt
        stored = [self.store.get(p) if self.store is not None else [] for p in prompts]
        num_stored = max(len(s) for s in stored)
        columns = max((len(c) for s in stored for c in s), default=0)
        past_GHJ = torch.full((len(prompts), num_stored, columns), _NO_TOKEN, dtype=torch.long)
        for g, completions in enumerate(stored):
            for h, completion in enumerate(completions):
                past_GHJ[g, h, :len(completion)] = completion
        return HistoryCorpus(prompt_GP, past_GHJ.to(device), num_samples)

    def record(self, prompts: list[torch.Tensor], tokens_per_group: list[list[torch.Tensor]]) -> None:
        """Keep a finished rollout's completions for later rollouts of the same prompts."""
        if self.store is not None:
            for prompt, completions in zip(prompts, tokens_per_group):
                self.store.add(prompt, completions)


class HistoryCorpus(NamedTuple):
    """One rollout's corpus parts that do not change while it decodes (device tensors)."""

    prompt_GP: torch.Tensor  # [G, P] long: each prompt right-aligned, _NO_TOKEN on the left
    past_GHJ: torch.Tensor   # [G, H, Jh] long: stored completions, _NO_TOKEN past their ends
    num_samples: int         # Gs


def chain_geometry(shape: TreeShape) -> tuple[int, int]:
    """(chains, depth) of a history-only tree of ``shape``: K chains within its N - 1 nodes."""
    chains = max(1, min(shape.top_k, shape.num_nodes - 1))
    return chains, max(1, min(shape.depth, (shape.num_nodes - 1) // chains))


def corpus_rows(corpus: HistoryCorpus, tokens_NT: torch.Tensor, lengths_N: torch.Tensor,
                completion_B: torch.Tensor, num_columns: int) -> torch.Tensor:
    """``[B, S, T]``: each live row's group corpus: the prompt, then one completion per source
    (its siblings' first ``num_columns`` output columns as they stand, then the stored ones)."""
    G, P = corpus.prompt_GP.shape
    columns = torch.arange(num_columns, device=tokens_NT.device)
    siblings_NJ = tokens_NT[:, :num_columns].masked_fill(columns >= lengths_N[:, None], _NO_TOKEN)
    siblings_GSJ = siblings_NJ.view(G, corpus.num_samples, num_columns)
    past = corpus.past_GHJ
    width = max(num_columns, past.shape[-1])
    sources_GSJ = torch.cat([_pad_right(siblings_GSJ, width), _pad_right(past, width)], 1)
    group_B = completion_B // corpus.num_samples
    prompt_BSP = corpus.prompt_GP[group_B, None, :].expand(-1, sources_GSJ.shape[1], -1)
    return torch.cat([prompt_BSP, sources_GSJ[group_B]], -1)


def _pad_right(tokens: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[-1]), value=_NO_TOKEN)


def suffix_matches(corpus_BST: torch.Tensor, query_Bn: torch.Tensor, num_matches: int,
                   min_match: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_matches`` corpus positions where the longest suffix of ``query_Bn`` ends, and the
    match lengths ``[B, K]`` (0: no usable match). A position counts only if a token follows it, so
    a sequence never matches its own end. Ties go to the latest position, then the first source.

    Returns (flat positions ``[B, K]`` into ``corpus_BST.flatten(1)`` of the first continuation
    token, match lengths ``[B, K]``).
    """
    B, S, T = corpus_BST.shape
    n = query_Bn.shape[1]
    windows_BSWn = corpus_BST.unfold(-1, n, 1)[:, :, :T - n]                      # window w ends at w + n - 1
    equal = windows_BSWn == query_Bn[:, None, None, :]
    length_BSW = equal.flip(-1).long().cumprod(-1).sum(-1)                         # trailing equal tokens
    follows = corpus_BST[:, :, n:] >= 0                                            # a token after the window
    usable = follows & (length_BSW >= min_match)
    W = T - n
    rank_BSW = torch.where(usable, length_BSW * W + torch.arange(W, device=corpus_BST.device), -1)
    flat_rank = torch.nn.functional.pad(rank_BSW.flatten(1), (0, max(0, num_matches - S * W)), value=-1)
    best, index = flat_rank.topk(num_matches, dim=-1)                                # [B, K]
    source, window = index // W, index % W
    return source * T + window + n, torch.where(best >= 0, best // W, 0)


def continuations(corpus_BST: torch.Tensor, starts_BK: torch.Tensor, lengths_BK: torch.Tensor,
                  depth: int) -> torch.Tensor:
    """``[B, K, L]``: the ``depth`` tokens from each flat start (``suffix_matches``), ``_NO_TOKEN``
    from the first missing one on (past a source's end, or no match at all)."""
    B, S, T = corpus_BST.shape
    steps_L = torch.arange(depth, device=corpus_BST.device)
    positions = starts_BK[..., None] + steps_L                                        # [B, K, L]
    inside = positions // T == starts_BK[..., None] // T                               # the match's own source
    tokens = corpus_BST.flatten(1).gather(1, positions.clamp(max=S * T - 1).flatten(1)).view_as(positions)
    real = inside & (tokens >= 0) & (lengths_BK[..., None] > 0)
    real = real.long().cumprod(-1).bool()  # a chain ends at its first missing token
    return torch.where(real, tokens, _NO_TOKEN)


def row_queries(corpus_BST: torch.Tensor, prompt_width: int, completion_B: torch.Tensor, emitted_B: torch.Tensor,
                num_samples: int, n: int) -> torch.Tensor:
    """``[B, n]``: each row's last n tokens (its newest, the tree's root, last), read from its own
    source in the corpus; ``_NO_QUERY`` before its prompt's start."""
    own_B = completion_B % num_samples
    end_B = prompt_width + emitted_B - 1
    positions_Bn = end_B[:, None] + torch.arange(1 - n, 1, device=end_B.device)
    own_BT = corpus_BST.gather(1, own_B[:, None, None].expand(-1, 1, corpus_BST.shape[-1])).squeeze(1)
    query = own_BT.gather(1, positions_Bn.clamp(min=0))
    return torch.where((positions_Bn >= 0) & (query >= 0), query, _NO_QUERY)


def history_chains(corpus: HistoryCorpus, tokens_NT: torch.Tensor, lengths_N: torch.Tensor,
                   completion_B: torch.Tensor, emitted_B: torch.Tensor, num_columns: int,
                   drafts: HistoryDrafts, num_chains: int, depth: int) -> torch.Tensor:
    """``[B, K, L]`` candidate continuations of every live row (device only; ``num_columns``: a host
    bound on the longest completion so far)."""
    corpus_BST = corpus_rows(corpus, tokens_NT, lengths_N, completion_B, num_columns)
    query = row_queries(corpus_BST, corpus.prompt_GP.shape[1], completion_B, emitted_B, corpus.num_samples,
                        drafts.match_length)
    starts, lengths = suffix_matches(corpus_BST, query, num_chains, drafts.min_match)
    return continuations(corpus_BST, starts, lengths, depth)


def chain_paths(chains_BKL: torch.Tensor) -> torch.Tensor:
    """``[B, K*L, L]``: the path (tokens at depths 1..L) of every chain node, chain-major; a node past
    its chain's end has an all-``_NO_TOKEN`` path (dead)."""
    B, K, L = chains_BKL.shape
    depth_L = torch.arange(L, device=chains_BKL.device)
    keep = depth_L[None, :] <= depth_L[:, None]                                           # [L(node), L(slot)]
    paths = torch.where(keep, chains_BKL[:, :, None, :], _NO_TOKEN)                      # [B, K, L, L]
    alive = chains_BKL >= 0                                                              # [B, K, L]
    return torch.where(alive[..., None], paths, _NO_TOKEN).flatten(1, 2)


def tree_paths(tree: DraftTree) -> torch.Tensor:
    """``[B, N - 1, L]``: the path of every non-root node of ``tree`` (``_NO_TOKEN`` past its depth)."""
    depth_L = torch.arange(1, tree.max_depth + 1, device=tree.tokens.device)
    at_depth = tree.ancestors[:, 1:, :, None] & (tree.depths[:, None, :, None] == depth_L)   # [B, N-1, N, L]
    tokens = torch.where(at_depth, tree.tokens[:, None, :, None], 0).sum(2)
    return torch.where(at_depth.any(2), tokens, _NO_TOKEN)


def tree_from_paths(root_B: torch.Tensor, paths_BMD: torch.Tensor, scores_BM: torch.Tensor) -> DraftTree:
    """One tree of ``1 + M`` nodes from M candidate paths (prefix-closed: every real candidate's
    parent path is a candidate too). A candidate whose path repeats an earlier one, or is empty, is a
    dead node (``DEAD_TOKEN``, under the root); any other is a child of the first candidate whose path
    is its own minus the last token. ``scores_BM``: the candidates' path scores (``path_logprobs``)."""
    B, M, D = paths_BMD.shape
    device = paths_BMD.device
    depth_BM = (paths_BMD >= 0).sum(-1)
    same_BMM = (paths_BMD[:, :, None, :] == paths_BMD[:, None, :, :]).all(-1)
    first_BM = same_BMM.int().argmax(-1)                                          # first equal candidate
    alive_BM = (depth_BM > 0) & (first_BM == torch.arange(M, device=device))
    last_slot = (depth_BM - 1).clamp(min=0)
    prefix_BMD = paths_BMD.scatter(2, last_slot[..., None], _NO_TOKEN)
    is_parent = (prefix_BMD[:, :, None, :] == paths_BMD[:, None, :, :]).all(-1) & alive_BM[:, None, :]
    parent_BM = torch.where(depth_BM > 1, is_parent.int().argmax(-1) + 1, 0)
    token_BM = paths_BMD.gather(2, last_slot[..., None]).squeeze(2)
    tokens = torch.cat([root_B[:, None], torch.where(alive_BM, token_BM, DEAD_TOKEN)], 1)
    parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), torch.where(alive_BM, parent_BM, 0)], 1)
    depths = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), torch.where(alive_BM, depth_BM, 1)], 1)
    dead_score = torch.full_like(scores_BM, -1e4)
    path_logprobs = torch.cat([torch.zeros(B, 1, device=device), torch.where(alive_BM, scores_BM.float(), dead_score)], 1)
    return DraftTree(tokens, parents, depths, ancestors_from_parents(parents, D), path_logprobs, path_logprobs[:, 1:], D)


def chain_scores(num_chains: int, depth: int, device: torch.device) -> torch.Tensor:
    """``[K*L]`` pseudo log-probs of chain nodes: chain-major order, each node just below the one
    before (so the cost policy's sibling ranks follow the chains' match ranks)."""
    return -1e-3 * torch.arange(1, num_chains * depth + 1, dtype=torch.float32, device=device)


def history_tree(root_B: torch.Tensor, chains_BKL: torch.Tensor, neural: DraftTree | None = None) -> DraftTree:
    """The step's tree: the chains alone, or merged into the neural draft's ``neural`` tree."""
    B, K, L = chains_BKL.shape
    paths = chain_paths(chains_BKL)
    scores = chain_scores(K, L, chains_BKL.device).expand(B, -1)
    if neural is not None:
        neural_paths = tree_paths(neural)
        width = max(neural_paths.shape[-1], L)
        paths = torch.cat([_pad_right(neural_paths, width), _pad_right(paths, width)], 1)
        # History nodes rank below the neural draft's own candidates.
        scores = torch.cat([neural.path_logprobs[:, 1:], neural.path_logprobs[:, 1:].min(-1, keepdim=True).values
                            + scores], 1)
    return tree_from_paths(root_B, paths, scores)


def full_chain_or_neural(chains_B1L: torch.Tensor, neural: DraftTree) -> DraftTree:
    """One chain per row for a policy that verifies chains only (a hybrid): the history's chain ``[B, 1, L]``
    where it runs all L tokens deep, else the neural draft's chain ``neural`` (depth L, always full). Both depend
    only on tokens already sampled, so the choice keeps sampling exact (``verify.py``). A merged tree would give
    siblings, which a recurrent state cannot follow; a history chain cut short loses to the draft's, which proposes
    every level (``propose_history`` also asks the history for matches of its whole ``match_length``)."""
    full_B = (chains_B1L[:, 0] >= 0).all(-1)
    tokens_BL = torch.where(full_B[:, None], chains_B1L[:, 0], neural.tokens[:, 1:])
    return neural._replace(tokens=torch.cat([neural.tokens[:, :1], tokens_BL], 1))


def history_sizing_options(name: str) -> dict:
    """Options that make a registered sizing policy size history-only trees: chains (K = 1) up to 8 deep."""
    return {"k_max": 1, "l_max": 8} if name in ("fastgrpo", "cost") else {}


def history_profile(profile: LatencyProfile) -> LatencyProfile:
    """``profile`` with a draft curve of zero seconds: history drafts run no draft forward."""
    return replace(profile, draft=LatencyCurve((1, 2), (0.0, 0.0)))  # two points: a curve needs a segment


def speculation_sizing(name: str, profile: LatencyProfile | None, *, neural: bool, history: bool,
                       chains: bool = False) -> SizingPolicy:
    """The registered sizing policy ``name`` for speculation with a neural draft (``neural``) and/or
    history drafts (``history``): history alone sizes chains that cost no draft forward; a neural
    draft merged with history gets, for the adaptive policies, a ``MergedSizing`` that each step takes
    the better of the neural tree (history chains merged in) and the history's chains alone. ``chains``: the
    policy verifies chains only (a hybrid), so the adaptive policies size the neural draft's chains too (K = 1)."""
    def history_alone() -> SizingPolicy:
        return make_sizing(name, profile=profile and history_profile(profile), **history_sizing_options(name))

    if not neural:
        return history_alone()
    chain_options = {"k_max": 1} if chains and name in ("fastgrpo", "cost") else {}
    policy = make_sizing(name, profile=profile, **chain_options)
    return MergedSizing(policy, history_alone()) if history and name in ("fastgrpo", "cost") else policy


def propose_history(state: DecodeState, corpus: HistoryCorpus, drafts: HistoryDrafts, num_chains: int, depth: int,
                    num_columns: int, neural: DraftTree | None = None, chains_only: bool = False) -> DraftTree:
    """The history's part of a tree step (device only): every live row's ``num_chains`` chains of
    ``depth`` tokens, alone or merged into ``neural``; with ``chains_only`` (a hybrid), one chain per row: the
    history's where a match of its whole ``match_length`` continues ``depth`` tokens deep, else the neural draft's
    chain ``neural`` (``full_chain_or_neural``). ``num_columns``: the host's bound
    on the longest completion so far."""
    outputs, live = state.outputs, state.live
    one_chain = chains_only and neural is not None
    if one_chain:
        # Only a match of the whole compared suffix replaces the draft's chain: at T = 1 siblings share short runs
        # that a trained draft predicts better (bench/hybrid_speculation.py: 1.9 tokens per verification with
        # min_match's short matches against the draft's own 2.35 on the hybrid demo model).
        drafts, num_chains = replace(drafts, min_match=drafts.match_length), 1
    chains = history_chains(corpus, outputs.tokens_NT, outputs.lengths_N, live.completion_B, live.emitted_B,
                            num_columns, drafts, num_chains, depth)
    return full_chain_or_neural(chains, neural) if one_chain else history_tree(state.next_B, chains, neural)
