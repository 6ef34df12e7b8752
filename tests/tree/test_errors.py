"""Bad input, the per-sequence fallback, backend choice, micro-batches and memory of the tree forward."""

import warnings

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MambaConfig, MambaForCausalLM

from tests.prefix.conftest import VOCAB, build_model
from tests.tree.conftest import TRIE_SHAPES, per_sequence_truth, random_masks_and_weights, random_sequences
from tests.tree.test_parity import weighted_loss_grads
from turbogrpo.tree import build_trie, micro_batches, per_sequence_logprobs, tree_logprobs, trie_of_groups
from turbogrpo.tree.attention import cascade_parts, select_tree_backend


@pytest.fixture(scope="module")
def inputs():
    sequences = random_sequences(**TRIE_SHAPES["deep-narrow"], seed=7)
    return (sequences, *random_masks_and_weights(sequences, seed=7))


def test_per_sequence_layout_gives_the_tree_numbers(inputs):
    sequences, masks, weights = inputs
    model = build_model("qwen2", torch.float64)
    trie = build_trie(sequences, masks)
    flat_weights = torch.cat([w[m] for w, m in zip(weights, masks)])
    tree = tree_logprobs(model, trie)
    rows = per_sequence_logprobs(model, trie)
    assert (tree.layout, rows.layout) == ("tree", "per_sequence")
    torch.testing.assert_close(tree.logps, rows.logps, rtol=0, atol=1e-10)
    tree_grads = weighted_loss_grads(model, tree.logps, flat_weights)
    row_grads = weighted_loss_grads(model, per_sequence_logprobs(model, trie).logps, flat_weights)
    for name, ref in row_grads.items():
        torch.testing.assert_close(tree_grads[name], ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("make_model, reason", [
    (lambda: MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1)).double(),
     "model type 'mamba' mixes tokens with recurrent"),
    (lambda: Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=16, max_position_embeddings=256)).double(),
     "model type 'gemma2' soft-caps its attention logits"),
])
def test_a_model_the_tree_cannot_run_falls_back_to_one_row_per_sequence(inputs, make_model, reason):
    sequences, masks, _ = inputs
    torch.manual_seed(0)
    model = make_model()
    with pytest.warns(UserWarning, match=f"turbogrpo.tree: {reason}.*; falling back to one row per sequence"):
        result = tree_logprobs(model, build_trie(sequences, masks))
    assert result.layout == "per_sequence"
    # Mamba's own forward rounds its logits to float32, hence the float32-sized tolerance.
    truth = per_sequence_truth(model, sequences, masks).double()
    torch.testing.assert_close(result.logps, truth, rtol=0, atol=1e-6)


def test_a_model_the_tree_runs_gives_no_warning(inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tree_logprobs(build_model("llama"), build_trie(inputs[0], inputs[1])).layout == "tree"


def test_backend_choice_and_errors():
    cpu = torch.device("cpu")
    assert select_tree_backend("auto", cpu, requires_grad=True).name == "cascade"
    with pytest.raises(ValueError, match="unknown tree attention backend 'fast'; choose one of"):
        select_tree_backend("fast", cpu, True)
    with pytest.raises(ValueError, match="'flex' is not available on cpu with gradients; FlexAttention has no "
                                         "backward on CPU"):
        select_tree_backend("flex", cpu, True)


def test_flex_forward_matches_on_cpu(inputs):
    """FlexAttention's mask_mod (per-token vectors, no dense mask), forward only: no CPU backward."""
    sequences, masks, _ = inputs
    model = build_model("mistral", torch.float64, sliding_window=5)
    trie = build_trie(sequences, masks)
    with torch.no_grad():
        got = tree_logprobs(model, trie, backend="flex").logps
    torch.testing.assert_close(got, per_sequence_truth(model, sequences, masks).detach(), rtol=0, atol=1e-9)


@pytest.mark.parametrize("trie_kwargs, message", [
    (dict(sequences=[torch.tensor([1, VOCAB])]), r"token id 97, outside the model's vocabulary \[0, 97\)"),
    (dict(sequences=[torch.arange(300) % VOCAB]), "sequence 0 is 300 tokens, beyond the model's "
                                                  "max_position_embeddings=256"),
])
def test_bad_model_input(trie_kwargs, message):
    with pytest.raises(ValueError, match=message):
        tree_logprobs(build_model("qwen2"), build_trie(**trie_kwargs))


def test_a_sequence_with_no_loss_token_is_named_before_the_forward():
    """An empty completion (nothing to score) among others: one line naming it, from the trie the tree forward
    would take; without it the others' log-probs are what they are in a trie of their own."""
    prompts, completions = [torch.tensor([5, 6, 7])], [[torch.tensor([8, 9]), torch.tensor([], dtype=torch.long)]]
    with pytest.raises(ValueError, match=r"^sequence 1 has no loss token \(its loss mask is all False\); drop it "
                                         r"from the batch or mark the tokens to train on$"):
        trie_of_groups(prompts, completions)
    model = build_model("qwen2")
    alone = tree_logprobs(model, trie_of_groups(prompts, [completions[0][:1]])).logps
    torch.testing.assert_close(alone, per_sequence_truth(model, [torch.tensor([5, 6, 7, 8, 9])],
                                                         [torch.tensor([False] * 3 + [True] * 2)]).detach(),
                               rtol=0, atol=1e-5)  # a float32 model


def test_bad_temperature_and_trie():
    model = build_model("qwen2")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tree_logprobs(model, build_trie([torch.tensor([1, 2])]), temperature=0)
    with pytest.raises(ValueError, match="trie must be a TokenTrie"):
        tree_logprobs(model, [torch.tensor([1, 2])])


def test_micro_batches_sum_to_the_whole_trie():
    """A trie over the token budget, split between whole sequences: the micro-batches' gradients add up
    to the whole trie's."""
    sequences = random_sequences(**TRIE_SHAPES["long-shared"], seed=8)
    masks, weights = random_masks_and_weights(sequences, seed=8)
    model = build_model("qwen2", torch.float64)
    whole = tree_logprobs(model, build_trie(sequences, masks, weights))
    full_trie = build_trie(sequences, masks, weights)
    expected = weighted_loss_grads(model, whole.logps, full_trie.loss_weights)
    model.zero_grad(set_to_none=True)
    batches = micro_batches(sequences, max_tokens=250)
    assert len(batches) >= 2
    for batch in batches:
        trie = build_trie(*([x[i] for i in batch] for x in (sequences, masks, weights)))
        (tree_logprobs(model, trie).logps * trie.loss_weights).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=1e-10)


def wide_deep_trie(prompt=1024, branches=(4, 4, 2), run=40, seed=0):
    """A prompt, then branches of ``run``-token turns: 1024 + 40 * (4 + 16 + 32) = 3104 tokens."""
    g = torch.Generator().manual_seed(seed)
    paths = [torch.randint(0, VOCAB, (prompt,), generator=g)]
    for fanout in branches:
        paths = [torch.cat([p, torch.randint(0, VOCAB, (run,), generator=g)]) for p in paths for _ in range(fanout)]
    return build_trie(paths)


@pytest.mark.parametrize("window", [None, 64])
def test_cascade_index_and_mask_memory_grows_linearly(window):
    """No [N, N] mask: every index tensor and mask the cascade keeps for a ~3,000-token trie together
    hold well under N^2 / 20 elements (under a window the largest is a [rows, queries, window] band)."""
    trie = wide_deep_trie()
    n = trie.num_tokens
    assert n == 3104
    parts = cascade_parts(trie, torch.device("cpu"), torch.float32, window)
    elements = 0
    for part in parts:
        for block in part.blocks:
            tensors = [*block.queries, *block.keys, block.bias, block.hidden_rows]
            elements += sum(t.numel() for t in tensors if t is not None)
    assert elements < n * n / 20 and elements < 200 * n, f"{elements} elements for {n} tokens"


def test_cascade_runs_a_3000_token_trie():
    """Forward + backward over the 3,104-token trie agrees with one row per sequence (a spot check, 1.5 s)."""
    trie = wide_deep_trie()
    model = build_model("qwen2", torch.float32)
    model.config.max_position_embeddings = 2048   # RoPE has no table: the 256 of the test models is only a bound
    logps = tree_logprobs(model, trie).logps
    logps.sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())
    with torch.no_grad():
        rows = per_sequence_logprobs(model, trie).logps
    torch.testing.assert_close(logps.detach(), rows, rtol=0, atol=1e-4)
