"""The packed oneDNN product inside a compiled graph (``turbogrpo.graph_linears``): the opaque op is F.linear of the
stacked weights in and out of a rollout's scope, the pass stacks exactly the products that read one input, the
scope is chosen by this machine's measurement and falls back to F.linear where oneDNN cannot pack, and a rollout of
the compiled step on it gives the eager step's tokens and log-probs."""

import json

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import turbogrpo.cache
from tests.capability import ANSWERS, cpu_answer  # noqa: F401 (fixture)
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo import graph_linears, linears
from turbogrpo.graph_linears import (GRAPH_LINEAR_KERNELS, STACKED_LINEAR_PASS, PackedProducts,
                                     packed_graph_linears, stacked_linear)
from turbogrpo.linears import KernelUnavailable
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.compiled import _compiled
from turbogrpo.rollout.decode import DecodeSchedule

pytestmark = pytest.mark.skipif(not linears.onednn_available(), reason="this torch build has no oneDNN")


def weights_and_input(rows: int, dtype: torch.dtype = torch.float32, bias: bool = False):
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, 24, generator=generator).to(dtype) for out in (16, 8, 8)]
    biases = [torch.randn(w.shape[0], generator=generator).to(dtype) for w in weights] if bias else []
    return torch.randn(rows, 24, generator=generator).to(dtype), weights, biases


def truth(x, weights, biases) -> torch.Tensor:
    stacked_bias = torch.cat(biases).double() if biases else None
    return F.linear(x.double(), torch.cat(weights).double(), stacked_bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scoped", [False, True])
def test_the_op_is_f_linear_of_the_stacked_weights_in_and_out_of_a_scope(bias, scoped, monkeypatch):
    packs = []
    monkeypatch.setattr(graph_linears, "pack_weight", lambda w: packs.append(w.shape) or linears.pack_weight(w))
    x, weights, biases = weights_and_input(3, bias=bias)
    with packed_graph_linears([]) if scoped else torch.no_grad():
        for _ in range(2):  # the second call reuses the scope's packed copy
            ours = stacked_linear(x, weights, biases)
            torch.testing.assert_close(ours.double(), truth(x, weights, biases), atol=2e-5, rtol=1e-5)
    assert packs == ([(32, 24)] if scoped else [])  # one packed copy of the three stacked, made once


@pytest.mark.skipif(not linears.cpu_capability().packs(torch.bfloat16), reason="no oneDNN bf16 kernels here")
def test_in_bf16_the_packed_op_is_within_bf16_rounding_of_float64():
    x, weights, biases = weights_and_input(2, torch.bfloat16, bias=True)
    with packed_graph_linears([]):
        ours = stacked_linear(x, weights, biases)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), truth(x, weights, biases), atol=3e-2, rtol=2e-2)


def test_a_scope_runs_f_linear_below_its_rows_and_where_onednn_cannot_pack(monkeypatch):
    products = []
    monkeypatch.setattr(graph_linears, "onednn_product", lambda *a: products.append(1) or linears.onednn_product(*a))
    x, weights, _ = weights_and_input(2)
    scope = PackedProducts(min_rows=4)
    torch.testing.assert_close(scope.product(x, weights, []).double(), truth(x, weights, []), atol=2e-5, rtol=1e-5)
    assert not products and not scope.packed  # 2 rows < 4: unpacked, nothing packed
    with_rows = weights_and_input(4)[0]
    scope.product(with_rows, weights, [])
    assert products and scope.packed


@pytest.mark.parametrize("cpu_answer", ["none", "avx2"], indirect=True)
def test_where_onednn_cannot_pack_the_dtype_auto_and_the_op_fall_back_to_f_linear(cpu_answer, monkeypatch):  # noqa: F811
    """"auto" opens no scope, "onednn" is refused in one line naming the setting, and the op itself, even in a
    scope, computes F.linear."""
    monkeypatch.setattr(graph_linears, "onednn_product", lambda *a: pytest.fail("oneDNN ran where it cannot"))
    dtypes = [torch.float32, torch.bfloat16] if not cpu_answer.onednn else [torch.bfloat16]
    for dtype in dtypes:
        layer = nn.Linear(24, 8).to(dtype)
        with GRAPH_LINEAR_KERNELS["auto"]([layer]):
            assert graph_linears._ACTIVE_SCOPE.get() is None
        with pytest.raises(KernelUnavailable, match="linear_kernel"):
            with GRAPH_LINEAR_KERNELS["onednn"]([layer]):
                pass
        x, weights, _ = weights_and_input(2, dtype)
        with packed_graph_linears([]):
            ours = stacked_linear(x, weights, [])
        torch.testing.assert_close(ours, torch.cat([F.linear(x, w) for w in weights], dim=-1))


def test_auto_packs_from_the_rows_this_machine_measured_and_not_where_it_measured_no_gain(monkeypatch):
    asked = []
    model = build_model("llama", num_hidden_layers=1)
    monkeypatch.setattr(linears, "measured_once", lambda name, key, measure: measure())
    for measured in (4, None):
        monkeypatch.setattr(linears, "_timed_min_rows", lambda dtype, threads, margin: asked.append(dtype) or measured)
        with GRAPH_LINEAR_KERNELS["auto"]([model]):
            scope = graph_linears._ACTIVE_SCOPE.get()
            assert (scope.min_rows if scope else None) == measured
    assert asked == [torch.float32, torch.float32]
    assert graph_linears._ACTIVE_SCOPE.get() is None  # every scope ends with its block


def test_the_pass_stacks_the_products_of_one_input_and_leaves_the_rest():
    """q/k/v of one input become one call; a product of another input, and a product whose weight is not a graph
    input (computed inside), stay as they are; the rewritten graph computes what the original did."""
    def layer(x, wq, wk, wv, wo, bo):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        inner = F.linear(q, wo, bo) + F.linear(q, wo * 2)  # wo * 2: computed in the graph, not an input
        return inner, k, v

    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*shape, generator=generator) for shape in ((3, 24), (16, 24), (8, 24), (8, 24), (24, 16), (24,))]
    graph_module = make_fx(layer, tracing_mode="fake")(*inputs)
    STACKED_LINEAR_PASS(graph_module.graph)
    graph_module.recompile()
    calls = [n for n in graph_module.graph.nodes if n.target is torch.ops.turbogrpo.stacked_linear.default]
    assert [len(n.args[1]) for n in calls] == [3, 1]  # q/k/v stacked; o (biased) alone; wo * 2 left to aten
    assert sum(n.target is torch.ops.aten.mm.default for n in graph_module.graph.nodes) == 1
    with packed_graph_linears([]):
        ours = graph_module(*inputs)
    for a, b in zip(ours, layer(*inputs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_pass_stacks_the_products_of_a_graph_with_dynamic_sizes(monkeypatch):
    """The tree step's parts compile with dynamic sizes: products of views of one input, whose sizes are symbolic, are
    still stacked into one call, a product of a symbolic row count is never inductor's one-row loop, and the graph
    computes what the layer did at another row count than the one traced."""
    monkeypatch.setattr(graph_linears, "reduction_is_faster", lambda dtype, threads, **kwargs: True)

    def layer(x, wq, wk, wv):
        for w, rows in zip((wq, wk, wv), (16, 8, 8)):  # a module's weights keep their sizes (dynamo: static)
            torch._check(w.shape[0] == rows)
            torch._check(w.shape[1] == 24)
        return tuple(F.linear(x.view(-1, x.shape[-1]), w) for w in (wq, wk, wv))

    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(rows, 24, generator=generator) for rows in (16, 8, 8)]
    graph_module = make_fx(layer, tracing_mode="symbolic")(torch.randn(3, 4, 24, generator=generator), *weights)
    STACKED_LINEAR_PASS(graph_module.graph)
    graph_module.recompile()
    targets = [n.target for n in graph_module.graph.nodes]
    assert targets.count(torch.ops.turbogrpo.stacked_linear.default) == 1 and torch.ops.aten.sum.dim_IntList not in targets
    x = torch.randn(5, 2, 24, generator=generator)
    with packed_graph_linears([]):
        ours = graph_module(x, *weights)
    for a, b in zip(ours, layer(x, *weights)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("faster", [True, False])
def test_a_one_row_product_runs_as_inductors_own_loop_only_where_that_measured_faster(faster, monkeypatch):
    monkeypatch.setattr(graph_linears, "reduction_is_faster", lambda dtype, threads, **kwargs: faster)
    x, weights, biases = weights_and_input(1, bias=True)
    layer = lambda x, wq, wk, bq, bk: (F.linear(x, wq, bq), F.linear(x, wk, bk))  # noqa: E731
    inputs = (x, *weights[:2], *biases[:2])
    graph_module = make_fx(layer, tracing_mode="fake")(*inputs)
    STACKED_LINEAR_PASS(graph_module.graph)
    graph_module.recompile()
    targets = [n.target for n in graph_module.graph.nodes]
    assert targets.count(torch.ops.turbogrpo.stacked_linear.default) == (0 if faster else 1)
    assert targets.count(torch.ops.aten.sum.dim_IntList) == (2 if faster else 0)
    assert torch.ops.aten.mm.default not in targets and torch.ops.aten.addmm.default not in targets
    for ours, theirs in zip(graph_module(*inputs), layer(*inputs)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_reduction_is_faster_is_measured_once_here_kept_and_false_where_onednn_cannot_pack(tmp_path, monkeypatch):
    """Measured once per machine, dtype and threads and kept on disk; the pass (``measure=False``) only reads it."""
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(turbogrpo.cache, "_MEASURED", {})
    monkeypatch.setattr(graph_linears, "NUM_TIMED_LAYERS", 1)  # two weights: the timing runs, quickly
    assert graph_linears.reduction_is_faster(torch.float32, 2, margin=0.0, measure=False) is False  # not measured
    assert graph_linears.reduction_is_faster(torch.float32, 2, margin=0.0) is True  # any time beats 0 x it
    monkeypatch.setattr(turbogrpo.cache, "_MEASURED", {})  # another process: reads the stored answer
    assert graph_linears.reduction_is_faster(torch.float32, 2, margin=0.0, measure=False) is True
    [stored] = (tmp_path / "measured" / graph_linears.REDUCTION_CHOICE).glob("*.json")
    key = json.loads(stored.read_text())["key"]
    assert key["dtype"] == "torch.float32" and key["num_threads"] == 2 and key["cpu"]
    monkeypatch.setattr(graph_linears, "cpu_capability", lambda: ANSWERS["none"])
    assert graph_linears.reduction_is_faster(torch.float32, 2, margin=0.0) is False


def test_the_compiled_step_at_one_row_on_inductors_loop_gives_the_eager_tokens(monkeypatch):
    """One live row, every weight product as inductor's own loop (``reduction_product``): sampled at T = 1, the eager
    step's tokens, and its log-probs within float32 rounding."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    monkeypatch.setattr(graph_linears, "reduction_is_faster", lambda dtype, threads, **kwargs: True)
    monkeypatch.setattr(PackedProducts, "product", lambda *a: pytest.fail("a one-row product ran as stacked_linear"))
    model = build_model("llama", num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    kwargs = dict(num_samples=1, sampling=SamplingConfig(max_new_tokens=5), seed=5)
    eager = generate(model, random_prompts([6]), schedule=DecodeSchedule(1, "pow2", linears="onednn"), **kwargs)
    compiled = generate(model, random_prompts([6]), schedule=DecodeSchedule(1, "pow2", "compiled-onednn"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_compiled_onednn_step_gives_the_eager_tokens_and_log_probs(monkeypatch):
    """Inductor with the pass: sampled at T = 1, the same tokens as the eager step (on its own packed kernel) and the
    sampler's log-probs within float32 rounding; the graph's products ran packed, q/k/v and gate/up one call each."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    products = []
    # Every bucket packed, decided here: this machine's one-row timing (``reduction_is_faster``, SmolLM2-shaped
    # products through the same ``onednn_product``) would otherwise land in ``products`` wherever it is not cached yet.
    monkeypatch.setattr(graph_linears, "reduction_is_faster", lambda dtype, threads, **kwargs: False)
    monkeypatch.setattr(graph_linears, "onednn_product", lambda *a: products.append(a[1].shape) or linears.onednn_product(*a))
    model = build_model("llama", num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=5), seed=3)
    eager = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2", linears="onednn"), **kwargs)
    compiled = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2", "compiled-onednn",
                                                                               linears="onednn"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    config = model.config
    kv_rows = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    stacked_rows = {config.hidden_size + 2 * kv_rows, 2 * config.intermediate_size}  # q/k/v, gate/up: one product each
    assert {shape[0] for shape in products} == {*stacked_rows, config.hidden_size, config.vocab_size}  # o, down; head


# slow: one inductor compile of a bf16 step (~50 s on 2 loaded cores); the float32 test above covers the path.
@pytest.mark.slow
@pytest.mark.skipif(not linears.cpu_capability().packs(torch.bfloat16), reason="no oneDNN bf16 kernels here")
def test_the_compiled_onednn_step_matches_eager_greedy_and_log_probs_in_bfloat16():
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("llama", num_hidden_layers=1).to(torch.bfloat16)
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=5, temperature=0.0), seed=4)
    eager = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2", linears="onednn"), **kwargs)
    compiled = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2", "compiled-onednn",
                                                                               linears="onednn"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.02)


# slow: one more inductor compile of a bf16 step; the float32 one-row test above covers the path.
@pytest.mark.slow
@pytest.mark.skipif(not linears.cpu_capability().packs(torch.bfloat16), reason="no oneDNN bf16 kernels here")
def test_the_one_row_bf16_step_on_inductors_loop_matches_eager_greedy_and_log_probs(monkeypatch):
    torch._dynamo.reset()
    _compiled.cache_clear()
    monkeypatch.setattr(graph_linears, "reduction_is_faster", lambda dtype, threads, **kwargs: True)
    model = build_model("llama", num_hidden_layers=1).to(torch.bfloat16)
    kwargs = dict(num_samples=1, sampling=SamplingConfig(max_new_tokens=5, temperature=0.0), seed=4)
    eager = generate(model, random_prompts([7]), schedule=DecodeSchedule(1, "pow2", linears="onednn"), **kwargs)
    compiled = generate(model, random_prompts([7]), schedule=DecodeSchedule(1, "pow2", "compiled-onednn"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.02)
