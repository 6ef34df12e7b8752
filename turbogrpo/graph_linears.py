"""The rollout's packed oneDNN weight products inside an inductor-compiled decoding step.

Inductor compiles a step's weight products as aten's ``mm`` on the weights as they are (MKL's sgemm in float32),
not as the eager rollout's packed oneDNN products (``turbogrpo.linears``), which ran SmolLM2's step at live
batch 1 faster than the whole compiled step on the 2-core AMD EPYC (49.4 against 54.9 ms,
``bench/results/compiled_step_f32_b1_marked_once.json``). Two pieces put the packed product into the graph:

* ``stacked_linear``: one opaque op (a library op with a fake kernel, so inductor keeps it as one
  call): ``input [..., in]`` times the weights ``[out_i, in]`` stacked along their output rows -> ``[...,
  sum out_i]``, that is ``F.linear(input, cat(weights), cat(biases))``.
* ``StackedLinearPass``: inductor's post-grad pass (``post_grad_custom_pre_pass``) that rewrites every ``mm`` /
  ``addmm`` of a graph input's transposed weight (an ``nn.Linear``'s product) into ``stacked_linear``, the
  products that read one and the same input (a layer's q/k/v, its gate/up) into one call on their weights
  stacked, as ``linears.FUSED_SIBLINGS`` does eagerly.

* At one row (a bucket of one live sequence: a matrix-vector product), the pass writes the product instead as
  ``reduction_product``, a multiply and a sum that inductor compiles into one vectorised loop reading each weight
  row once, where that measured faster than oneDNN's packed product on this machine (``reduction_is_faster``).
  Loaded 2-core AMD EPYC, all of SmolLM2's weights at one row (``bench/gemv_kernels.py``, load average 2.5-4):
  18.5 against 33 ms in float32, 10.5 against 14.5 ms in bf16.

The graph holds the weights, not packed copies of them: a packed copy is an opaque oneDNN tensor, which the
compiler's fake tensors cannot stand in for, and a copy made at compile time would go stale at the next
optimizer step. ``packed_graph_linears`` (the rollout's scope) keeps the packed copies instead: each made at
its weights' first product in the scope (keyed by the weights' storage), all freed when it ends, as the eager
kernel's. Outside a scope, below its ``min_rows``, or in a dtype oneDNN cannot pack on this CPU, the op
computes ``F.linear`` on each weight as it is and concatenates: the same products, unpacked. The scope is found
through a context variable because the compiled graph calls the op with nothing but tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import fwd_only
from torch.fx.experimental.proxy_tensor import make_fx

from turbogrpo.cache import measured_before, measured_once
from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.linears import (NUM_TIMED_LAYERS, PACKABLE_DTYPES, machine_key, measured_kernel,
                               module_linears, num_rows, onednn_min_rows, onednn_product, pack_weight,
                               require_onednn_for, speedup)

aten = torch.ops.aten


_LIBRARY = torch.library.Library("turbogrpo", "FRAGMENT")
_LIBRARY.define("stacked_linear(Tensor input, Tensor[] weights, Tensor[] biases) -> Tensor")


def _stacked_linear(input: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    scope = _ACTIVE_SCOPE.get()
    if scope is None:
        return unpacked_product(input, weights, biases)
    return scope.product(input, weights, biases)


# A plain library op, not ``torch.library.custom_op``: the custom op's Python wrappers cost 17 us a call, 2 ms of a
# SmolLM2 step's 121 products (a third of the products' own time at four rows); this op costs 1 us over the product.
# It has no autograd formula: the rollout's graphs run without gradients.
_LIBRARY.impl("stacked_linear", _stacked_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("turbogrpo::stacked_linear")
def _stacked_linear_shape(input: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], sum(w.shape[0] for w in weights)))


def stacked_linear(input: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``input [..., in]`` by each weight ``[out_i, in]`` (plus its bias ``[out_i]``, all or none) -> ``[...,
    sum out_i]``: the active ``packed_graph_linears`` scope's packed product, else ``F.linear`` weight by weight
    (the op ``torch.ops.turbogrpo.stacked_linear``, which the graphs call)."""
    return torch.ops.turbogrpo.stacked_linear.default(input, weights, biases)


def unpacked_product(input: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``stacked_linear`` by ``F.linear`` on each weight as it is (a new tensor even for one weight)."""
    outputs = [F.linear(input, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


class PackedProducts:
    """A scope's packed copies: for each set of weights (by storage, shape and dtype) one packed copy of them
    stacked, made at its first product of at least ``min_rows`` rows."""

    def __init__(self, min_rows: int):
        self.min_rows = min_rows
        self.packed: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def product(self, input: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
        dtype = weights[0].dtype
        if num_rows(input) < self.min_rows or input.dtype != dtype or not cpu_capability().packs(dtype):
            return unpacked_product(input, weights, biases)
        key = tuple((w.data_ptr(), w.shape, w.dtype) for w in weights)
        if key not in self.packed:
            stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.packed[key] = pack_weight(stacked), (torch.cat(biases) if biases else None)
        packed, bias = self.packed[key]
        return onednn_product(input, packed, bias)


_ACTIVE_SCOPE: contextvars.ContextVar[PackedProducts | None] = contextvars.ContextVar("packed_graph_linears",
                                                                                     default=None)


@contextlib.contextmanager
def packed_graph_linears(roots: Iterable[nn.Module], min_rows: int = 1) -> Iterator[int]:
    """For the ``with`` block, ``stacked_linear`` in a compiled graph multiplies inputs of at least ``min_rows``
    rows by packed copies of its weights (made at first use, freed on exit; the block must not change the
    weights). Changes no module (yields 0): the graphs already call the op (``StackedLinearPass``); measures, once per
    machine, whether the graphs' one-row products run faster as inductor's own loop (``reduction_is_faster``). Refused
    (``linears.require_onednn``) where a linear under ``roots`` computes in a dtype oneDNN cannot pack here;
    "auto" asks first and runs unpacked there instead."""
    roots = list(roots)
    require_onednn_for(roots)
    for dtype in {p.dtype for root in roots for p in root.parameters()} & set(PACKABLE_DTYPES):
        reduction_is_faster(dtype, torch.get_num_threads())  # measured now, before any graph compiles
    token = _ACTIVE_SCOPE.set(PackedProducts(min_rows))
    try:
        yield 0
    finally:
        _ACTIVE_SCOPE.reset(token)


# --- the pass that puts the op into inductor's graph ---------------------------------------------------------

_TRANSPOSES = (aten.permute.default, aten.t.default)


def _transposed_graph_input(node: object) -> torch.fx.Node | None:
    """The graph input ``W`` that ``node`` transposes (``permute(W, [1, 0])`` or ``t(W)``), else None."""
    if not isinstance(node, torch.fx.Node) or node.target not in _TRANSPOSES:
        return None
    if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    weight = node.args[0]
    return weight if isinstance(weight, torch.fx.Node) and weight.op == "placeholder" else None


def _weight_product(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """(input, weight, bias or None) of an ``nn.Linear``'s product in the graph -- ``mm(x, W.T)`` or ``addmm(b, x,
    W.T)`` with W a packable 2-D CPU graph input in x's dtype -- else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default:
        (input, transposed), bias = node.args, None
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, input, transposed = node.args
        if not (isinstance(bias, torch.fx.Node) and bias.op == "placeholder" and _val(bias) is not None
                and _val(bias).dim() == 1):
            return None
    else:
        return None
    weight = _transposed_graph_input(transposed)
    if weight is None or not isinstance(input, torch.fx.Node):
        return None
    w, x = _val(weight), _val(input)
    if w is None or x is None or w.dim() != 2 or w.device.type != "cpu" or w.dtype not in PACKABLE_DTYPES \
            or x.dtype != w.dtype:
        return None
    return input, weight, bias


def _val(node: torch.fx.Node):
    return node.meta.get("val")


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _input_key(input: torch.fx.Node, biased: bool) -> tuple:
    """What makes two products siblings: the same input (the same node, or views of one node to one shape, as
    each of a layer's q/k/v may flatten the hidden states itself), and a bias on both or neither."""
    if input.target in _VIEWS:  # sizes as text: a symbolic size (a graph with dynamic sizes) is not hashable
        return input.args[0], tuple(str(size) for size in _val(input).shape), biased
    return input, None, biased


class StackedLinearPass(CustomGraphPass):
    """Rewrites each weight product (``_weight_product``) into ``stacked_linear``: one call for the products that
    read one input (``_input_key``), each product then a slice of its output; a product of one row instead into
    inductor's own loop (``reduction_product``) where that measured faster here (``reduction_is_faster``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        siblings: dict[tuple, list[tuple[torch.fx.Node, tuple]]] = {}
        for node in list(graph.nodes):  # graph order: the first of each set comes first
            if not (parts := _weight_product(node)):
                continue
            x = _val(parts[0])
            if one_row(x) and reduction_is_faster(x.dtype, torch.get_num_threads(), measure=False):
                _reduce(graph, node, parts)
            else:
                siblings.setdefault(_input_key(parts[0], parts[2] is not None), []).append((node, parts))
        for members in siblings.values():
            _stack(graph, members)

    def uuid(self) -> bytes:
        # inductor's cache key for the graphs: what the pass does depends on this file and on the one-row choice
        # (measured per machine, dtype and threads; read, not measured, here).
        threads = torch.get_num_threads()
        choices = [reduction_is_faster(dtype, threads, measure=False) for dtype in PACKABLE_DTYPES]
        return get_hash_for_files((__file__,)) + f"{threads}{choices}".encode()


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x [..., in]`` is one row for every shape the graph takes: a graph with dynamic sizes (the tree step's
    parts) may take several rows, and asking a symbolic size would fix it in the graph's guards."""
    return all(isinstance(size, int) for size in x.shape) and num_rows(x) == 1


def reduction_product(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``input [rows, in] @ weight [out, in].T`` as a multiply and a float32 sum over ``in`` -> ``[rows, out]`` (a
    transposed view of ``[out, rows]``): inductor writes it as one vectorised loop that reads each weight row once
    for all rows, at the memory's speed for one row, where a GEMM library's kernel spends its setup per call."""
    return (weight[:, None, :].float() * input[None, :, :].float()).sum(-1).to(input.dtype).t()


def _reduce(graph: torch.fx.Graph, node: torch.fx.Node, parts: tuple) -> None:
    """``node`` (a weight product) replaced by ``reduction_product`` of its input and weight (plus its bias)."""
    input, weight, bias = node.args[-2], parts[1], parts[2]
    example = [_val(input), _val(weight), *([_val(bias)] if bias is not None else [])]
    function = (lambda x, w, b: reduction_product(x, w) + b) if bias is not None else reduction_product
    with _val(input).fake_mode:  # traced on the graph's own fake values, with inductor's decompositions
        traced = fwd_only(function, example)
    with graph.inserting_before(node):
        output = graph.graph_copy(traced.graph, dict(zip(traced.graph.find_nodes(op="placeholder"),
                                                         [input, weight, *([bias] if bias is not None else [])])),
                                  return_output_node=False)
    transposed = node.args[-1]
    node.replace_all_uses_with(output)
    graph.erase_node(node)
    if not transposed.users:
        graph.erase_node(transposed)


def reduction_is_faster(dtype: torch.dtype, num_threads: int, margin: float = 1.1, *, measure: bool = True) -> bool:
    """Whether ``reduction_product`` compiled by inductor multiplies one row by SmolLM2's MLP weights (576 x 1536 and
    back, streamed from memory: ``linears.NUM_TIMED_LAYERS`` pairs) ``margin`` times faster than oneDNN's packed
    product here; timed once per machine, dtype and thread count (``cache.measured_once``; two small compiles and
    about a second). False where oneDNN cannot pack ``dtype`` here (the graph then keeps its products unpacked).
    ``measure=False``: the answer measured before, False where none was (the pass, which runs inside inductor's
    compile, where no other compile may start: the rollout's scope measures first, ``packed_graph_linears``)."""
    if not cpu_capability().packs(dtype):
        return False
    key = machine_key(dtype=str(dtype), num_threads=num_threads, margin=margin)
    if not measure:
        return bool(measured_before(REDUCTION_CHOICE, key))
    return measured_once(REDUCTION_CHOICE, key, functools.partial(_timed_reduction, dtype, margin))


REDUCTION_CHOICE = "graph_reduction_is_faster"
"""``cache.measured_once``'s name for ``reduction_is_faster``."""


def _timed_reduction(dtype: torch.dtype, margin: float) -> bool:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inner, generator=generator).to(dtype)
               for _ in range(NUM_TIMED_LAYERS) for out, inner in ((1536, 576), (576, 1536))]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], generator=generator).to(dtype) for w in weights[:2]}
    compiled = {tuple(w.shape): torch._inductor.compile(make_fx(reduction_product)(inputs[w.shape[1]], w),
                                                        [inputs[w.shape[1]], w]) for w in weights[:2]}
    packed = [pack_weight(w) for w in weights]
    with torch.no_grad():
        return speedup(lambda: [onednn_product(inputs[w.shape[1]], p) for w, p in zip(weights, packed)],
                       lambda: [compiled[tuple(w.shape)](inputs[w.shape[1]], w) for w in weights], 7) > margin


def _stack(graph: torch.fx.Graph, members: list[tuple[torch.fx.Node, tuple]]) -> None:
    """One ``stacked_linear`` call for ``members`` (products of one input, in graph order), placed before the first,
    each member replaced by its slice of the output; the transposes left unused are removed."""
    input = members[0][0].args[-2]  # as it is now: an earlier set's product it read is now a slice of that set's call
    weights = [parts[1] for _, parts in members]
    biases = [parts[2] for _, parts in members if parts[2] is not None]
    fake_mode = _val(input).fake_mode
    with graph.inserting_before(members[0][0]):
        stacked = graph.call_function(torch.ops.turbogrpo.stacked_linear.default, (input, weights, biases))
        with fake_mode:
            stacked.meta["val"] = stacked_linear(_val(input), [_val(w) for w in weights], [_val(b) for b in biases])
        parts, start = [], 0
        for _, (_, weight, _) in members:
            width = _val(weight).shape[0]
            part = stacked
            if len(members) > 1:
                part = graph.call_function(aten.slice.Tensor, (stacked, -1, start, start + width))
                with fake_mode:
                    part.meta["val"] = stacked.meta["val"][..., start:start + width]
            parts.append(part)
            start += width
    for (node, _), part in zip(members, parts):  # after the insertions: they are placed before the first member
        transposed = node.args[-1]
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        if not transposed.users:
            graph.erase_node(transposed)


STACKED_LINEAR_PASS = StackedLinearPass()
"""The pass a compiled step with packed products is compiled with (``compiled.PLAIN_RUNNERS``)."""


GRAPH_LINEAR_KERNELS = {
    "auto": measured_kernel(packed_graph_linears, onednn_min_rows),
    "module": module_linears,
    "onednn": packed_graph_linears,
}
"""``DecodeSchedule.linears`` -> the scope a rollout whose graphs call ``stacked_linear`` runs in: "auto" packs from
the row count where oneDNN's packed product beats ``F.linear`` on this machine (``linears.onednn_min_rows``, measured
once per machine) and leaves the products unpacked where it does not, or where oneDNN cannot run the dtype here;
"module" leaves them unpacked (``F.linear``); "onednn" packs at every row count (refused where oneDNN cannot pack
the model's dtype here, as ``linears.LINEAR_KERNELS["onednn"]`` is)."""
