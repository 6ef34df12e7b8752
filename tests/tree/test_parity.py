"""Tree forward vs. one row per sequence: log-probs and every parameter gradient must agree, and
known-wrong tree implementations must fail the same check."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.prefix.conftest import PACKS, arch, build_gpt2, build_model, random_groups  # noqa: F401 (fixture)
from tests.tree.conftest import TRIE_SHAPES, per_sequence_truth, random_masks_and_weights, random_sequences
from turbogrpo.prefix import compute_logprobs, kernels
from turbogrpo.models import enable_activation_checkpointing
from turbogrpo.tree import TREE_BACKENDS, build_trie, per_sequence_logprobs, tree_logprobs, trie_of_groups
from turbogrpo.tree import attention
from turbogrpo.tree.attention import TreeAttention

TOLERANCES = {torch.float64: dict(logp=1e-9, grad=1e-9, relative=False),
              torch.float32: dict(logp=1e-5, grad=1e-5, relative=True)}
WINDOWED = {"mistral": {}, "gemma3": {"layer_types": ["sliding_attention", "full_attention"]}}


def weighted_loss_grads(model, logps, weights):
    """Gradients of ``sum(weights * logps)`` for every parameter (uneven weights, so that a wrong routing
    of any single token's gradient shows)."""
    model.zero_grad(set_to_none=True)
    (logps * weights.to(logps.dtype)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def tree_errors(model, sequences, masks, weights, dtype, **kwargs):
    """(max |logp error|, max over parameters of the gradient error), absolute in float64 and relative to
    the parameter's largest gradient in float32, of the tree forward against the per-sequence truth."""
    truth = per_sequence_truth(model, sequences, masks)
    flat_weights = torch.cat([w[m] for w, m in zip(weights, masks)])
    truth_grads = weighted_loss_grads(model, truth, flat_weights)
    result = tree_logprobs(model, build_trie(sequences, masks, weights), **kwargs)
    assert result.layout == ("per_sequence" if kwargs.get("backend") == "per_sequence" else "tree")
    assert result.logps.shape == truth.shape and result.logps.isfinite().all()
    grads = weighted_loss_grads(model, result.logps, flat_weights)
    relative = TOLERANCES[dtype]["relative"]
    grad_error = max(((grads[n] - ref).abs().max() / (ref.abs().max().clamp_min(1e-6) if relative else 1)).item()
                     for n, ref in truth_grads.items())
    return (result.logps - truth).abs().max().item(), grad_error


def assert_exact(errors, dtype):
    logp_error, grad_error = errors
    assert logp_error <= TOLERANCES[dtype]["logp"], f"log-prob error {logp_error:.3g}"
    assert grad_error <= TOLERANCES[dtype]["grad"], f"gradient error {grad_error:.3g}"


def trie_inputs(shape, seed):
    sequences = random_sequences(**TRIE_SHAPES[shape], seed=seed)
    return (sequences, *random_masks_and_weights(sequences, seed))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", ["cascade", "reference"])
@pytest.mark.parametrize("shape", sorted(TRIE_SHAPES))
def test_tree_matches_one_row_per_sequence(arch, backend, dtype, shape):
    model = build_model(arch, dtype)
    assert_exact(tree_errors(model, *trie_inputs(shape, seed=0), dtype, backend=backend), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", ["cascade", "cascade-math", "cascade-short-runs", "reference"])
@pytest.mark.parametrize("window", [3, 7])
@pytest.mark.parametrize("windowed_arch", sorted(WINDOWED))
@pytest.mark.parametrize("shape", ["deep-narrow", "long-shared"])
def test_tree_under_a_sliding_window_matches_one_row_per_sequence(monkeypatch, windowed_arch, window, backend,
                                                                   dtype, shape):
    """Windows shorter than a path: a token far below a run sees none of it (that part drops out of the
    merge). "cascade-math": the matmul kernels of devices without CPU flash (the -inf row path);
    "cascade-short-runs": nodes cut into runs of 4 tokens, so windows straddle runs and levels."""
    if backend == "cascade-math":
        monkeypatch.setattr(kernels, "_use_cpu_flash", lambda q: False)
    if backend == "cascade-short-runs":
        monkeypatch.setattr(attention, "MAX_RUN", 4)
    model = build_model(windowed_arch, dtype, sliding_window=window, **WINDOWED[windowed_arch])
    errors = tree_errors(model, *trie_inputs(shape, seed=1), dtype, backend=backend.split("-")[0])
    assert_exact(errors, dtype)


def test_short_runs_match_without_a_window(monkeypatch):
    monkeypatch.setattr(attention, "MAX_RUN", 3)
    model = build_model("qwen3", torch.float64)
    assert_exact(tree_errors(model, *trie_inputs("long-shared", seed=2), torch.float64, backend="cascade"),
                 torch.float64)


def test_temperature_and_entropy():
    model = build_model("llama", torch.float64)
    sequences, masks, weights = trie_inputs("wide", seed=3)
    result = tree_logprobs(model, build_trie(sequences, masks), temperature=0.7, with_entropy=True)
    torch.testing.assert_close(result.logps, per_sequence_truth(model, sequences, masks, temperature=0.7),
                               rtol=0, atol=1e-10)
    expected_entropy = []
    for s, m in zip(sequences, masks):
        logp = torch.log_softmax(model(s[None]).logits[0] / 0.7, -1)[torch.nonzero(m).squeeze(1) - 1]
        expected_entropy.append(-(logp.exp() * logp).sum(-1))
    torch.testing.assert_close(result.entropy, torch.cat(expected_entropy).detach(), rtol=0, atol=1e-10)


def test_one_level_trie_equals_the_shared_prefix_forward():
    """Single-turn groups: the trie path gives the prefix path's numbers (and sibling completions that
    begin alike are shared too)."""
    model = build_model("qwen2", torch.float64)
    prompts, completions = random_groups(*PACKS["mixed"])
    completions[0][1] = torch.cat([completions[0][0][:2], completions[0][1]])   # siblings sharing 2 tokens
    expected = compute_logprobs(model, prompts, completions, backend="cascade", with_entropy=False).logps
    got = tree_logprobs(model, trie_of_groups(prompts, completions)).logps
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_gradients_of_a_shared_token_sum_over_the_sequences_through_it():
    """The Tree Training identity: a loss over sequences equals a per-trie-token loss weighted by the sum
    of the weights of the sequences through each token."""
    model = build_model("mistral", torch.float64)
    sequences, masks, weights = trie_inputs("deep-narrow", seed=4)
    trie = build_trie(sequences, masks, weights)
    logps = tree_logprobs(model, trie).logps
    scored_weights = torch.zeros(trie.scored_tokens.numel(), dtype=torch.float64).index_add_(
        0, trie.loss_token_index, trie.loss_weights)
    scored_logps = torch.zeros_like(scored_weights).index_put_((trie.loss_token_index,), logps.detach())
    torch.testing.assert_close((logps * trie.loss_weights).sum(), (scored_logps * scored_weights).sum(),
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- known-wrong implementations fail

class ZeroOneMaskAttention(TreeAttention):
    """The eager-attention pitfall: the boolean ancestor mask added to the scores as 0/1."""

    def attend(self, plan, query, key, value, scaling, sliding_window):
        mask = plan.trie.dense_mask(sliding_window).to(query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


class WindowLostAttention(TreeAttention):
    """One custom mask for every layer, built without the window: sliding layers attend too far up."""

    def attend(self, plan, query, key, value, scaling, sliding_window):
        return TREE_BACKENDS["reference"].attend(plan, query, key, value, scaling, None)


@pytest.mark.parametrize("wrong", ["zero-one-mask", "packed-positions", "window-lost"])
def test_known_wrong_tree_implementations_fail_the_parity_check(monkeypatch, wrong):
    dtype = torch.float64
    model = build_model("gemma3", dtype, sliding_window=5, **WINDOWED["gemma3"])
    inputs = trie_inputs("deep-narrow", seed=5)
    assert_exact(tree_errors(model, *inputs, dtype, backend="cascade"), dtype)   # the right one passes
    backend = "cascade"
    if wrong == "zero-one-mask":
        monkeypatch.setitem(TREE_BACKENDS, "wrong", ZeroOneMaskAttention())
        backend = "wrong"
    elif wrong == "window-lost":
        monkeypatch.setitem(TREE_BACKENDS, "wrong", WindowLostAttention())
        backend = "wrong"
    else:   # positions taken from the packed (flat) index instead of the depth
        from turbogrpo.tree import trie as trie_module
        real_layout = trie_module._layout

        def packed_positions(*args):
            trie = real_layout(*args)
            return dataclasses.replace(trie, position_ids=torch.arange(trie.num_tokens))
        monkeypatch.setattr(trie_module, "_layout", packed_positions)
    logp_error, grad_error = tree_errors(model, *inputs, dtype, backend=backend)
    assert logp_error > 1e-4 and grad_error > 1e-4


def test_duplicate_and_prefix_sequences():
    """The same conversation twice and one that stops inside another: each is scored on its own."""
    model = build_model("qwen2", torch.float64)
    sequences, masks, weights = trie_inputs("wide", seed=6)
    a = sequences[0]
    sequences = [*sequences, a.clone(), a[:a.numel() - 2].clone()]
    masks = [*masks, masks[0].clone(), torch.cat([masks[0][:a.numel() - 3], torch.tensor([True])])]
    weights = [*weights, weights[0] * 2, weights[0][:a.numel() - 2]]
    assert_exact(tree_errors(model, sequences, masks, weights, torch.float64, backend="cascade"), torch.float64)


def test_absolute_position_model_runs_exactly():
    """GPT-2 adds a learnt embedding of the position: the depth is the position it saw in training."""
    model = build_gpt2(torch.float64)
    assert_exact(tree_errors(model, *trie_inputs("deep-narrow", seed=7), torch.float64), torch.float64)


def test_gradient_checkpointing():
    model = build_model("gemma3", torch.float64, sliding_window=4, **WINDOWED["gemma3"])
    enable_activation_checkpointing(model)
    model.train()
    assert_exact(tree_errors(model, *trie_inputs("deep-narrow", seed=8), torch.float64), torch.float64)


def test_bfloat16_error_within_ratio_of_one_row_per_sequence():
    """Half precision against a float32 truth (as tests/prefix/test_precision.py): the tree path's error
    may be at most 1.5x the one-row-per-sequence path's error at the same precision."""
    low = build_model("qwen2", torch.bfloat16)
    truth_model = copy.deepcopy(low).float()
    sequences, masks, weights = trie_inputs("deep-narrow", seed=9)
    trie = build_trie(sequences, masks, weights)
    truth = per_sequence_truth(truth_model, sequences, masks).double()
    truth_grads = {n: g.double() for n, g in weighted_loss_grads(truth_model, truth.float(), trie.loss_weights).items()}

    def errors(logps):
        grads = weighted_loss_grads(low, logps, trie.loss_weights)
        return ((logps.double() - truth).abs().max().item(),
                max(((grads[n].double() - ref).abs().max() / ref.abs().max()).item() for n, ref in truth_grads.items()))
    rows = errors(per_sequence_logprobs(low, trie).logps)
    tree = errors(tree_logprobs(low, trie).logps)
    assert rows[0] > 0 and rows[1] > 0
    print(f"bf16 errors (logp, grad): tree {tree}, rows {rows}")
    assert tree[0] <= 1.5 * rows[0] and tree[1] <= 1.5 * rows[1], (tree, rows)
