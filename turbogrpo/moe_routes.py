"""MoE routing replay (R3): record the experts the sampler's routers chose, replay them in the training forward.

A mixture-of-experts layer's router picks the top-k experts of each token. Two forwards that round differently
(the sampler in bf16, the trainer in float32; another engine's kernels; a batched decode against a packed
training pack) pick other experts for some tokens, and then the trainer scores another function than the one
that sampled. Replay makes the trainer use the sampler's experts:

* **recording** (``recording(model)``): forward hooks on every router keep the indices it returned; the rollout
  engine takes them after each forward (``RouteRecorder.take``: ``[T, L, k]`` for the forward's T tokens);
* **replaying** (``replaying(model, routes_TLK)``): forward hooks replace each router's indices by the recorded
  ones and recompute the gate weights *from the router's current logits at the replayed indices*, so the router
  still gets a gradient through the experts it is told to use (Megatron-LM fork PR #79 lost exactly that).
  A token whose recorded row is -1 keeps the router's own choice (padding, or a token the sampler never ran).

Each family says how its router turns logits into gate weights (``ROUTER_KINDS``, by router class): softmax
over all experts then the top-k's share (qwen3_moe, qwen2_moe, olmoe, mixtral, qwen3_5_moe), softmax over the
top-k logits (granitemoe), sigmoid scores with a bias used only to choose (deepseek_v3, shared experts beside).
Replaying the router's own indices gives bit for bit its own output (the same ops on the same values).

Routes are stored compactly (``route_dtype``: uint8 for at most 256 experts) and laid out for each training
layout by ``packed_routes`` (the shared-prefix pack), ``padded_routes`` (one row per sequence) and
``trie_routes`` (the trie forward), from ``BatchRoutes``: per prompt ``[P_k, L, k]`` once, per completion
``[R_i, L, k]`` for its first R_i <= S_i tokens (the last token of a completion is never run by the sampler).

Legend: T tokens of one forward, L MoE layers, k experts per token, E experts, P_k prompt k's length, S_i
completion i's length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence


# --- the families ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterKind:
    """How one family's router module returns its choice, and how it weighs replayed experts."""

    indices: Callable[[tuple], Tensor]
    """The router's output -> its chosen experts ``[T, k]``."""
    replay: Callable[[nn.Module, tuple, tuple, Tensor], tuple]
    """``(router, inputs, output, indices_Tk) -> output``: the router's output with ``indices_Tk`` chosen, the
    gates computed from the output's logits at them (so they stay differentiable in the router's weights)."""
    num_experts: Callable[[nn.Module], int] = lambda router: router.num_experts
    top_k: Callable[[nn.Module], int] = lambda router: router.top_k


def _softmax_share(router: nn.Module, inputs: tuple, output: tuple, indices_Tk: Tensor) -> tuple:
    """qwen3_moe, qwen2_moe, olmoe, qwen3_5_moe, mixtral: ``(logits, gates, indices)``; the gates are the chosen
    experts' softmax probabilities (float32), renormalised over the k where the family does."""
    logits_TE = output[0]
    gates_Tk = torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, indices_Tk)
    if getattr(router, "norm_topk_prob", True):  # mixtral and qwen3_5_moe always renormalise
        gates_Tk = gates_Tk / gates_Tk.sum(dim=-1, keepdim=True)
    if type(router).__name__ != "MixtralTopKRouter":  # mixtral keeps its gates in float32
        gates_Tk = gates_Tk.to(logits_TE.dtype)
    return logits_TE, gates_Tk, indices_Tk


def _softmax_of_top(router: nn.Module, inputs: tuple, output: tuple, indices_Tk: Tensor) -> tuple:
    """granitemoe: ``(indices, gates, logits)``; the gates are a softmax over the chosen experts' logits."""
    logits_TE = output[2]
    return indices_Tk, torch.softmax(logits_TE.gather(1, indices_Tk), dim=-1).type_as(inputs[0]), logits_TE


def _sigmoid_share(router: nn.Module, inputs: tuple, output: tuple, indices_Tk: Tensor) -> tuple:
    """deepseek_v3 (shared experts run beside, unrouted): ``(logits, gates, indices)``; the gates are the chosen
    experts' sigmoid scores (the score-correction bias only chooses), renormalised, times the scaling factor."""
    logits_TE = output[0]
    gates_Tk = logits_TE.sigmoid().gather(1, indices_Tk)
    if router.norm_topk_prob:
        gates_Tk = gates_Tk / (gates_Tk.sum(dim=-1, keepdim=True) + 1e-20)
    return logits_TE, gates_Tk * router.routed_scaling_factor, indices_Tk


_LAST = RouterKind(indices=lambda output: output[2], replay=_softmax_share)
ROUTER_KINDS: dict[str, RouterKind] = {
    "Qwen3MoeTopKRouter": _LAST,
    "Qwen2MoeTopKRouter": _LAST,
    "OlmoeTopKRouter": _LAST,
    "MixtralTopKRouter": _LAST,
    "Qwen3_5MoeTopKRouter": _LAST,
    "GraniteMoeTopKRouter": RouterKind(indices=lambda output: output[0], replay=_softmax_of_top),
    "DeepseekV3TopkRouter": RouterKind(indices=lambda output: output[2], replay=_sigmoid_share),
}
"""Router class name (transformers 5.x) -> its ``RouterKind``. A model whose MoE routers are not here cannot
record or replay routes (``routers`` says so)."""


def routers(model: nn.Module) -> list[tuple[nn.Module, RouterKind]]:
    """The model's MoE routers in layer order, each with its kind; a ValueError for a model with none, or with a
    router class this module does not know (one line naming it)."""
    found = [(module, ROUTER_KINDS.get(type(module).__name__)) for module in model.modules()
             if type(module).__name__.endswith(("TopKRouter", "TopkRouter"))]
    unknown = sorted({type(m).__name__ for m, kind in found if kind is None})
    if unknown:
        raise ValueError(f"algo.routing_replay: the router {unknown[0]} is not supported (known: "
                         f"{', '.join(sorted(ROUTER_KINDS))})")
    if not found:
        raise ValueError(f"algo.routing_replay = \"replay\" needs a mixture-of-experts model; "
                         f"{type(model).__name__} has no MoE router")
    return found


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert indices ``0..num_experts - 1``."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


def route_shape(model: nn.Module) -> tuple[int, int, torch.dtype]:
    """``(L, k, dtype)``: MoE layers, experts per token and the stored dtype of ``model``'s routes."""
    found = routers(model)
    kinds = {kind.top_k(router) for router, kind in found}
    if len(kinds) != 1:
        raise ValueError(f"algo.routing_replay: the MoE layers choose different numbers of experts {sorted(kinds)}")
    return len(found), kinds.pop(), route_dtype(max(kind.num_experts(router) for router, kind in found))


def bytes_per_token(model: nn.Module) -> int:
    """Bytes one token's routes take (L x k x the dtype's size)."""
    num_layers, top_k, dtype = route_shape(model)
    return num_layers * top_k * dtype.itemsize


# --- recording ---------------------------------------------------------------------------------------------


class RouteRecorder:
    """The experts each router chose in the latest forward (written by the hooks ``recording`` installs)."""

    def __init__(self, num_layers: int, dtype: torch.dtype):
        self.dtype = dtype
        self.latest: list[Tensor | None] = [None] * num_layers

    def take(self) -> Tensor:
        """``[T, L, k]`` (the stored dtype): the latest forward's routes, token by token in the order the
        forward flattened its inputs (``[B, T']`` row-major); forgets them."""
        if any(t is None for t in self.latest):
            raise RuntimeError("RouteRecorder.take: a router did not run in the latest forward")
        routes = torch.stack(self.latest, dim=1).to(self.dtype)
        self.latest = [None] * len(self.latest)
        return routes


class RouteLog:
    """A rollout's routes as the sampler runs its tokens: each prompt's at its prefill, and each completion token's
    in the decoding forward that runs it (the step after the token was drawn), by (completion, column).

    Made right after the prefill forward, whose routes (the prompts right-padded ``[G, P]``) become ``prompts``.
    ``routes_NCLK`` has one spare column past ``num_columns`` where rows that run no token of their own (finished,
    waiting to be retired) write, so a step writes every row without a host sync.
    """

    def __init__(self, recorder: RouteRecorder, model: nn.Module, prompt_lengths: Sequence[int],
                 num_completions: int, num_columns: int, device: torch.device):
        num_layers, top_k, dtype = route_shape(model)
        self.recorder = recorder
        self.prompts = prefill_routes(recorder, prompt_lengths)
        """Per prompt ``[P_g, L, k]``."""
        self.routes_NCLK = torch.zeros(num_completions, num_columns + 1, num_layers, top_k, dtype=dtype,
                                       device=device)

    def write(self, completion_B: Tensor, column_Bn: Tensor, runs_Bn: Tensor, nodes_Bn: Tensor | None = None) -> None:
        """The decoding forward just run: row b's n tokens are completion ``completion_B[b]``'s columns
        ``column_Bn[b]``; only tokens with ``runs_Bn`` (a live row's own committed tokens) are kept. ``nodes_Bn``:
        where they were among the forward's tokens of their row (a speculative tree's accepted path), else the
        forward ran exactly these."""
        routes_BNLK = self.recorder.take().view(column_Bn.shape[0], -1, *self.routes_NCLK.shape[2:])
        routes_BnLK = routes_BNLK if nodes_Bn is None else routes_BNLK[
            torch.arange(nodes_Bn.shape[0], device=nodes_Bn.device)[:, None], nodes_Bn]
        spare = self.routes_NCLK.shape[1] - 1
        columns_Bn = torch.where(runs_Bn, column_Bn, spare)
        self.routes_NCLK[completion_B[:, None].expand_as(columns_Bn), columns_Bn] = routes_BnLK

    def completion_routes(self, lengths: Sequence[int]) -> list[Tensor]:
        """Per completion ``[S_i - 1, L, k]``: every token but the last (which no forward ran)."""
        return [self.routes_NCLK[i, :max(n - 1, 0)] for i, n in enumerate(lengths)]


def prefill_routes(recorder: RouteRecorder, prompt_lengths: Sequence[int]) -> list[Tensor]:
    """Per prompt ``[P_g, L, k]``, from the prefill forward just run (the prompts right-padded ``[G, P]``)."""
    routes_TLK = recorder.take()
    routes_GPLK = routes_TLK.view(len(prompt_lengths), max(prompt_lengths), *routes_TLK.shape[1:])
    return [routes_GPLK[g, :length] for g, length in enumerate(prompt_lengths)]


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[RouteRecorder]:
    """Within the block every router of ``model`` reports its chosen experts to the recorder yielded."""
    found = routers(model)
    num_layers, _, dtype = route_shape(model)
    recorder = RouteRecorder(num_layers, dtype)

    def hook_of(layer: int, kind: RouterKind):
        def hook(module, inputs, output):
            recorder.latest[layer] = kind.indices(output).detach()
        return hook

    with _hooked(found, hook_of):
        yield recorder


@contextlib.contextmanager
def _hooked(found: list[tuple[nn.Module, RouterKind]], hook_of: Callable, first: bool = False) -> Iterator[None]:
    """Within the block, ``hook_of(layer, kind)`` is a forward hook of each router of ``found`` (``routers``);
    ``first``: it runs before the router's other hooks (a replaying hook, so that a recorder sees the replay)."""
    handles = [router.register_forward_hook(hook_of(layer, kind), prepend=first)
               for layer, (router, kind) in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --- replaying ---------------------------------------------------------------------------------------------


class ReplayCounts:
    """Over the forwards that replayed into it: the tokens replayed and those whose own routes (the routers'
    choice without replay) differ from the replayed ones in some layer (0-d device tensors once a forward has
    added; no host sync)."""

    def __init__(self):
        self.num_tokens: Tensor | int = 0
        self.num_differing: Tensor | int = 0

    def add(self, num_tokens: Tensor, num_differing: Tensor) -> None:
        self.num_tokens = self.num_tokens + num_tokens
        self.num_differing = self.num_differing + num_differing


_REPLAY_IN_FORCE: ContextVar[tuple[nn.Module, Tensor] | None] = ContextVar("replay_in_force", default=None)
"""The ``(model, routes_TLK)`` of the ``replaying`` block the current forward runs in (None: none), read by
``recomputation_contexts`` when an activation checkpoint is taken."""


@contextlib.contextmanager
def replaying(model: nn.Module, routes_TLK: Tensor, counts: ReplayCounts | None = None) -> Iterator[ReplayCounts]:
    """Within the block, each forward of ``model`` over T tokens uses the experts ``routes_TLK`` (int, -1: the
    router's own choice) at every MoE layer. The forward's tokens are in the order ``routes_TLK`` lists them
    (its inputs flattened row-major). Adds to ``counts`` (yielded; a new one if None) how many tokens were replayed
    and how many of them the routers would have routed otherwise. The replaying hooks run before any other hook of
    the routers (a ``recording`` block sees the replayed routes), and a layer checkpointed in the block
    (model.gradient_checkpointing) replays the same routes when the backward recomputes it
    (``recomputation_contexts``)."""
    found = routers(model)
    if routes_TLK.dim() != 3 or routes_TLK.shape[1] != len(found):
        raise ValueError(f"replaying: routes must be [T, {len(found)}, k] (one row per MoE layer), got "
                         f"{tuple(routes_TLK.shape)}")
    routes_TLK = routes_TLK.long()
    recorded_TL = (routes_TLK >= 0).all(dim=-1)
    counts = ReplayCounts() if counts is None else counts
    differs_T = torch.zeros(routes_TLK.shape[0], dtype=torch.bool, device=routes_TLK.device)
    in_force = _REPLAY_IN_FORCE.set((model, routes_TLK))
    try:
        with _hooked(found, _replay_hook_maker(routes_TLK, recorded_TL, differs_T), first=True):
            yield counts
    finally:
        _REPLAY_IN_FORCE.reset(in_force)
    counts.add(recorded_TL.all(dim=-1).sum(), differs_T.sum())


def _replay_hook_maker(routes_TLK: Tensor, recorded_TL: Tensor, differs_T: Tensor) -> Callable:
    """``hook_of(layer, kind)`` for ``_hooked``: the router's output with the recorded experts where the token has
    them (``recorded_TL``), each token whose own choice differs marked in ``differs_T`` (``[T]`` bool, in place)."""
    def hook_of(layer: int, kind: RouterKind):
        def hook(module, inputs, output):
            own_Tk = kind.indices(output)
            if own_Tk.shape[0] != routes_TLK.shape[0]:
                raise ValueError(f"replaying: the forward runs {own_Tk.shape[0]} tokens, the routes hold "
                                 f"{routes_TLK.shape[0]}")
            keep_T = recorded_TL[:, layer]
            indices_Tk = torch.where(keep_T[:, None], routes_TLK[:, layer], own_Tk)
            differs_T.logical_or_(keep_T & (own_Tk.sort(-1).values != indices_Tk.sort(-1).values).any(-1))
            return kind.replay(module, inputs, output, indices_Tk)
        return hook
    return hook_of


def recomputation_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn`` (``models.enable_activation_checkpointing``): called as a layer's
    checkpoint is taken, it returns the contexts of its forward (nothing) and of its recomputation in the backward:
    the ``replaying`` block the forward ran in, again (its counts dropped: the forward counted), so the recomputed
    layer runs the experts the forward ran. Outside a replaying block, nothing for either (the checkpoint as
    without this function)."""
    in_force = _REPLAY_IN_FORCE.get()
    if in_force is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), replaying(*in_force)


def maybe_recording(model: nn.Module, on: bool):
    """``recording`` when ``on`` (yields the recorder), else nothing (yields None)."""
    return recording(model) if on else contextlib.nullcontext()


def maybe_replaying(model: nn.Module, routes_TLK: Tensor | None, counts: ReplayCounts | None = None):
    """``replaying`` when there are routes, else nothing (the forward exactly as without replay)."""
    return contextlib.nullcontext() if routes_TLK is None else replaying(model, routes_TLK, counts)


# --- a batch's routes, laid out per training layout ------------------------------------------------------


class BatchRoutes(NamedTuple):
    """The sampler's routes of a batch (``turbogrpo.batch.Groups.routes`` / ``prompt_routes``)."""

    prompts: Sequence[Tensor]
    """Per group ``[P_k, L, k]`` (the prompt's routes, recorded once at its prefill)."""
    completions: Sequence[Tensor]
    """Per completion (flat, group-major) ``[R_i, L, k]``, R_i <= S_i: its first R_i tokens' routes."""
    counts: ReplayCounts | None = None
    """Where the forwards that replay these routes add their counts (None: nowhere)."""


def _ragged(routes: Sequence[Tensor], lengths: Sequence[int]) -> Tensor:
    """``[sum lengths, L, k]`` int64: each ``[R_i, L, k]`` (R_i <= lengths[i]) at the start of its own span of
    ``lengths[i]`` rows, -1 (the router's own choice) after it."""
    first = routes[0]
    out = first.new_full((sum(lengths), *first.shape[1:]), -1, dtype=torch.long)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    recorded = torch.tensor([r.shape[0] for r in routes])
    rows = torch.repeat_interleave(starts - torch.cat([torch.zeros(1, dtype=torch.long), recorded.cumsum(0)[:-1]]),
                                   recorded) + torch.arange(int(recorded.sum()))
    out[rows.to(out.device)] = torch.cat(list(routes)).long()
    return out


def sequence_routes(routes: BatchRoutes, group_sizes: Sequence[int], completion_lengths: Sequence[int]
                    ) -> list[Tensor]:
    """Per completion, the routes of its whole sequence ``[P_k + S_i, L, k]`` (int64; -1 where not recorded)."""
    completions = _ragged(routes.completions, completion_lengths).split(list(completion_lengths))
    prompt_of = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    return [torch.cat([routes.prompts[g].long(), c]) for g, c in zip(prompt_of, completions)]


def packed_routes(routes: BatchRoutes, completion_lengths: Sequence[int]) -> Tensor:
    """``[T, L, k]`` in the shared-prefix pack's order (``prefix.layout.pack_groups``): every prompt once, then
    every completion."""
    return torch.cat([*(p.long() for p in routes.prompts), _ragged(routes.completions, completion_lengths)])


def padded_routes(per_sequence: Sequence[Tensor], width: int) -> Tensor:
    """``[B * width, L, k]``: one right-padded row per sequence (``[<= width, L, k]`` each; -1 past its end),
    flattened row-major."""
    rows_BWLK = pad_sequence([s.long() for s in per_sequence], batch_first=True, padding_value=-1)
    if rows_BWLK.shape[1] < width:
        rows_BWLK = torch.cat([rows_BWLK, rows_BWLK.new_full((rows_BWLK.shape[0], width - rows_BWLK.shape[1],
                                                              *rows_BWLK.shape[2:]), -1)], dim=1)
    return rows_BWLK.flatten(0, 1)


def trie_routes(per_sequence: Sequence[Tensor], sequence_tokens: Sequence[Tensor], num_tokens: int) -> Tensor:
    """``[N, L, k]`` over a trie's N flat tokens (``tree.trie.TokenTrie.sequence_tokens``: each sequence's flat
    token index): a token several sequences share takes the routes of the first sequence that recorded them (one
    sequence's last token, never run by the sampler, may be another's recorded one: branches of a conversation)."""
    routes_MLK = torch.cat([s.long() for s in per_sequence])
    tokens_M = torch.cat([t.to(routes_MLK.device) for t in sequence_tokens])
    num_entries = routes_MLK.shape[0]
    order_M = torch.arange(num_entries, device=routes_MLK.device)
    # An entry without routes ranks past every recorded one; the first recorded entry of each token wins.
    rank_M = torch.where((routes_MLK >= 0).flatten(1).all(-1), order_M, num_entries)
    first_N = torch.full((num_tokens,), num_entries, device=routes_MLK.device).scatter_reduce(
        0, tokens_M, rank_M, "amin")
    out = routes_MLK.new_full((num_tokens, *routes_MLK.shape[1:]), -1)
    has_N = first_N < num_entries
    out[has_N] = routes_MLK[first_N[has_N]]
    return out


def route_disagreement(a_TLK: Tensor, b_TLK: Tensor) -> float:
    """Share of tokens whose experts differ in at least one layer (as sets: the order within k is free)."""
    differs_T = (a_TLK.long().sort(-1).values != b_TLK.long().sort(-1).values).flatten(1).any(-1)
    return float(differs_T.float().mean())  # host sync: a reported number
