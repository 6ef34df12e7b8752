"""The rollout attention plans against the unmodified model on the full sequences (dense reference)."""

import re

import pytest
import torch

from tests.rollout.conftest import VOCAB, build_model, random_prompts
from tests.tolerances import assert_within_bf16_rounding
from turbogrpo.rollout.kv_cache import GroupedKVCache, write_slots
from turbogrpo.rollout.plans import forward_new_tokens, prefill

ATOL = 2e-5


def reference_last_hidden(model, sequences: list[torch.Tensor], count: int = 1) -> torch.Tensor:
    """Final hidden states ``[len(sequences), count, Hd]`` of each sequence's last ``count`` tokens,
    by the model's own forward (one right-padded batch: causal attention never sees the padding)."""
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    hidden = model.model(padded).last_hidden_state
    ends = torch.tensor([len(s) for s in sequences])
    columns = ends[:, None] - count + torch.arange(count)
    return hidden[torch.arange(len(sequences))[:, None], columns]


def random_tree(num_nodes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestors [n, n] bool incl. self, depths [n]) of a random tree rooted at node 0."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]
    ancestors = torch.eye(num_nodes, dtype=torch.bool)
    depths = torch.zeros(num_nodes, dtype=torch.long)
    for node in range(1, num_nodes):
        ancestors[node] |= ancestors[parents[node]]
        depths[node] = depths[parents[node]] + 1
    return ancestors, depths


def path_to(node: int, ancestors: torch.Tensor) -> list[int]:
    """Nodes from the root to ``node`` (ancestors of a node have smaller indices)."""
    return ancestors[node].nonzero().flatten().tolist()


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_chain_decoding_and_dropping_sequences_match_full_forward(arch):
    model = build_model(arch)
    prompts = random_prompts([5, 9, 1])
    num_samples = 2
    cache = GroupedKVCache([len(p) for p in prompts], num_samples, capacity=12, device=torch.device("cpu"))
    prompt_hidden = prefill(model, cache, prompts)
    torch.testing.assert_close(prompt_hidden, reference_last_hidden(model, prompts)[:, 0], atol=ATOL, rtol=0)

    generator = torch.Generator().manual_seed(0)
    generated = [[] for _ in range(len(prompts) * num_samples)]
    live = list(range(len(generated)))
    # (tokens per sequence this step, live sequences kept afterwards): single tokens, a chain of 3,
    # then dropping sequences, including both samples of group 0 (its prompt K/V leaves the cache).
    for num_new, keep in [(1, None), (3, [1, 2, 3, 5]), (1, [1, 3]), (2, [1]), (1, None)]:
        ids = torch.randint(0, VOCAB, (len(live), num_new), generator=generator)
        hidden = forward_new_tokens(model, cache, ids)
        cache.commit_all(num_new)
        for row, sequence in enumerate(live):
            generated[sequence] += ids[row].tolist()
        full = [torch.cat([prompts[s // num_samples], torch.tensor(generated[s])]) for s in live]
        torch.testing.assert_close(hidden, reference_last_hidden(model, full, num_new), atol=ATOL, rtol=0)
        if keep is not None:
            cache.keep(keep)
            live = [live[row] for row in keep]


@torch.no_grad()
def test_token_trees_and_committing_a_path_match_full_forward(qwen2):
    """n > 1 new tokens with a per-sequence ancestor mask and tree position ids (speculative
    verification), then committing one root-to-node path per sequence."""
    model = qwen2
    prompts = random_prompts([4, 7])
    num_samples, num_nodes = 3, 6
    cache = GroupedKVCache([len(p) for p in prompts], num_samples, capacity=20, device=torch.device("cpu"))
    prefill(model, cache, prompts)
    generator = torch.Generator().manual_seed(1)
    num_sequences = len(prompts) * num_samples
    committed = [[] for _ in range(num_sequences)]
    # One ordinary step first, so that the trees sit behind committed generated tokens.
    first = torch.randint(0, VOCAB, (num_sequences, 1), generator=generator)
    forward_new_tokens(model, cache, first)
    cache.commit_all(1)
    for sequence in range(num_sequences):
        committed[sequence] = first[sequence].tolist()

    for _ in range(2):  # two rounds: the second tree follows a committed path of varied length
        trees = [random_tree(num_nodes, generator) for _ in range(num_sequences)]
        ancestors = torch.stack([a for a, _ in trees])
        depths = torch.stack([d for _, d in trees])
        ids = torch.randint(0, VOCAB, (num_sequences, num_nodes), generator=generator)
        hidden = forward_new_tokens(model, cache, ids, depths, ancestors)
        # Reference: each node as the last token of (prompt, committed tokens, its root-to-node path).
        full = [torch.cat([prompts[s // num_samples], torch.tensor(committed[s], dtype=torch.long),
                           ids[s, path_to(node, ancestors[s])]])
                for s in range(num_sequences) for node in range(num_nodes)]
        expected = reference_last_hidden(model, full)[:, 0].view(num_sequences, num_nodes, -1)
        torch.testing.assert_close(hidden, expected, atol=ATOL, rtol=0)
        # Commit the path to a random node per sequence (lengths differ across sequences).
        targets = torch.randint(0, num_nodes, (num_sequences,), generator=generator).tolist()
        paths = [path_to(t, ancestors[s]) for s, t in enumerate(targets)]
        chosen = torch.zeros(num_sequences, num_nodes, dtype=torch.long)
        for sequence, path in enumerate(paths):
            chosen[sequence, :len(path)] = torch.tensor(path)
            committed[sequence] += ids[sequence, path].tolist()
        cache.commit(chosen, torch.tensor([len(p) for p in paths]), max_chosen=max(len(p) for p in paths))

    last = torch.randint(0, VOCAB, (num_sequences, 1), generator=generator)
    hidden = forward_new_tokens(model, cache, last)
    full = [torch.cat([prompts[s // num_samples], torch.tensor(committed[s]), last[s]]) for s in range(num_sequences)]
    torch.testing.assert_close(hidden, reference_last_hidden(model, full), atol=ATOL, rtol=0)


@torch.no_grad()
def test_sliding_window_attention_matches_full_forward():
    model = build_model("mistral", sliding_window=4)
    prompts = random_prompts([6, 3])
    cache = GroupedKVCache([len(p) for p in prompts], 2, capacity=8, device=torch.device("cpu"))
    prefill(model, cache, prompts)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    for start, stop in [(0, 1), (1, 4), (4, 6)]:
        hidden = forward_new_tokens(model, cache, ids[:, start:stop])
        cache.commit_all(stop - start)
        full = [torch.cat([prompts[s // 2], ids[s, :stop]]) for s in range(4)]
        torch.testing.assert_close(hidden, reference_last_hidden(model, full, stop - start), atol=ATOL, rtol=0)


def test_a_compiled_write_into_fewer_rows_than_the_cache_holds_copies_no_slots():
    """A bucket below the cache's row capacity (rows retired) writes in place: inductor's code allocates no buffer of
    the cache's slot count (writing through a slice of the first rows had copied their every slot first)."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    cache = torch.zeros(8, 2, 37, 4)
    slots, new = torch.tensor([[3], [36], [0], [5], [9]]), torch.randn(5, 2, 1, 4)
    _, code = run_and_get_code(torch.compile(write_slots, dynamic=False), cache, slots, new)
    assert not re.search(r"empty_strided_cpu\(\([^)]*\b37\b", "\n".join(code))
    want = torch.zeros(8, 2, 37, 4)
    for row, slot in enumerate(slots[:, 0].tolist()):
        want[row, :, slot] = new[row, :, 0]
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_new", [1, 3])
def test_write_and_read_slots_match_scatter_and_gather(dtype, num_new):
    """The cache's slot writes (index_put_: CPU scatter_ of bfloat16 copies the whole cache twice) put
    each row's new K/V exactly where scatter_ along the slot dim would, into the first rows only."""
    from turbogrpo.rollout.kv_cache import read_slots, write_slots
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 2, 10, 4, generator=generator).to(dtype)
    rows = 4  # the live rows: the last two belong to retired sequences and must stay untouched
    slots = torch.stack([torch.randperm(10, generator=generator)[:num_new] for _ in range(rows)])
    new = torch.randn(rows, 2, num_new, 4, generator=generator).to(dtype)
    expected = cache.clone()
    expected[:rows].scatter_(2, slots[:, None, :, None].expand_as(new), new)
    write_slots(cache, slots, new)
    assert torch.equal(cache, expected)
    assert torch.equal(read_slots(cache[:rows], slots), new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_own_part_gives_the_same_hidden_states_by_flash_or_by_matmuls(monkeypatch, dtype):
    from turbogrpo.rollout import attention
    model = build_model("llama", seed=2).to(dtype)
    prompts, num_samples = random_prompts([6, 3, 8]), 4
    ids = torch.randint(0, VOCAB, (len(prompts) * num_samples, 1), generator=torch.Generator().manual_seed(1))

    def second_step_hidden(model, many_items: int) -> torch.Tensor:
        monkeypatch.setattr(attention, "MANY_ITEMS", many_items)
        cache = GroupedKVCache([len(p) for p in prompts], num_samples, capacity=4, device=torch.device("cpu"))
        with torch.no_grad():
            prefill(model, cache, prompts)
            forward_new_tokens(model, cache, ids)
            cache.commit_all(1)
            return forward_new_tokens(model, cache, ids).float()

    by_matmuls, by_flash = (second_step_hidden(model, many_items) for many_items in (1, 10 ** 9))
    if dtype == torch.float32:
        torch.testing.assert_close(by_matmuls, by_flash, atol=1e-5, rtol=1e-5)
    else:  # each within bf16's rounding of the float32 truth (the same bf16 weights, computed in float32)
        truth = second_step_hidden(model.float(), 1)
        assert_within_bf16_rounding(by_matmuls, truth)
        assert_within_bf16_rounding(by_flash, truth)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_reduced_partial_gives_the_matmul_partials_output_and_lse_with_hidden_keys(dtype):
    """``reduced_partial_attention`` (a compiled step's few-query parts) is ``partial_attention`` written as reduced
    broadcast products: the same output and log-sum-exp, keys hidden by the bias dropped, and a row that sees no key
    at output 0 with a hugely negative lse (it drops out of a merge), eagerly and compiled."""
    from turbogrpo.rollout.attention import merge_dtype, partial_attention, reduced_partial_attention
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(5, 2, rows, 8, generator=generator, dtype=torch.float64).to(dtype)
                         for rows in (3, 7, 7))
    visible = torch.rand(5, 1, 3, 7, generator=generator) < 0.6
    visible[1, :, 2] = False  # a row that sees no key
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    out, lse = partial_attention(query, key, value, bias, 0.35)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for reduced in (reduced_partial_attention, torch.compile(reduced_partial_attention, dynamic=False)):
        got_out, got_lse = reduced(query, key, value, bias, 0.35)
        assert got_out.dtype == merge_dtype(dtype) and got_lse.shape == (5, 2, 3, 1)
        torch.testing.assert_close(got_out, out, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(got_lse, lse, atol=tolerance, rtol=tolerance)
        assert torch.all(got_out[1, :, 2] == 0) and torch.all(got_lse[1, :, 2] < -1e30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries,head_dim", [(3, 64), (1, 128), (8, 64), (5, 256), (24, 64), (13, 128)])
def test_the_cpu_kernel_gives_the_partials_output_and_lse_with_hidden_keys(dtype, num_queries, head_dim):
    """``kernel_partial_attention`` (a compiled CPU step's few-query parts at many rows) reads keys and values out of
    a longer buffer (as the KV cache holds them) and gives the float64 partial's output and log-sum-exp of the same
    inputs to float32 rounding, bf16 inputs included (both accumulate in float32); hidden keys dropped, a row that
    sees none at output 0 with a hugely negative lse, with or without a bias, called eagerly and from a compiled
    graph."""
    from turbogrpo.rollout.attention import kernel_partial_attention, partial_attention
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(6, 2, num_queries, head_dim, generator=generator).to(dtype)
    buffers = [torch.randn(6, 2, 40, head_dim, generator=generator).to(dtype) for _ in range(2)]
    key, value = (buffer[:, :, :37] for buffer in buffers)  # 37 slots read of 40
    visible = torch.rand(6, 1, num_queries, 37, generator=generator) < 0.6
    visible[1, :, 0] = False  # a row that sees no key
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    torch._dynamo.reset()  # two graphs of this test's shapes (with and without a bias), not the other cases'
    compiled = torch.compile(kernel_partial_attention, dynamic=False, fullgraph=True)
    for mask in (bias, None):
        out, lse = partial_attention(query.double(), key.double(), value.double(),
                                     None if mask is None else mask.double(), 0.125)
        for partial in (kernel_partial_attention, compiled):
            got_out, got_lse = partial(query, key, value, mask, 0.125)
            assert got_out.dtype == got_lse.dtype == torch.float32 and got_lse.shape == (6, 2, num_queries, 1)
            torch.testing.assert_close(got_out.double(), out, atol=2e-6, rtol=2e-6)
            if mask is not None:
                assert torch.all(got_out[1, :, 0] == 0) and torch.all(got_lse[1, :, 0] < -1e30)
                seen = visible.expand(-1, 2, -1, -1).any(-1, keepdim=True)
                torch.testing.assert_close(got_lse.double()[seen], lse[seen], atol=2e-6, rtol=2e-6)
            else:
                torch.testing.assert_close(got_lse.double(), lse, atol=2e-6, rtol=2e-6)


def test_the_cpu_kernel_built_for_avx2_gives_the_same_result(monkeypatch):
    """The kernel as inductor builds it for an AVX2-only CPU (8 floats a vector, where AVX-512 has 16): the float64
    partial's result to float32 rounding, in float32 and bf16 (skipped where this CPU cannot run AVX2)."""
    from torch._inductor.cpu_vec_isa import VecAVX2, pick_vec_isa
    from turbogrpo.rollout import cpu_attention
    from turbogrpo.rollout.attention import kernel_partial_attention, partial_attention
    with torch._inductor.config.patch({"cpp.simdlen": 256}):
        if not isinstance(pick_vec_isa(), VecAVX2):
            pytest.skip("this CPU runs no AVX2")
        cpu_attention._kernel.cache_clear()
        try:
            generator = torch.Generator().manual_seed(5)
            for dtype in (torch.float32, torch.bfloat16):
                query, key, value = (torch.randn(4, 3, rows, 64, generator=generator).to(dtype) for rows in (3, 21, 21))
                out, lse = kernel_partial_attention(query, key, value, None, 0.125)
                want_out, want_lse = partial_attention(query.double(), key.double(), value.double(), None, 0.125)
                torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
                torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)
        finally:
            cpu_attention._kernel.cache_clear()  # later calls build for this CPU's own ISA again


def test_the_cpu_kernel_leaves_shapes_it_does_not_take_to_the_reduced_or_matmul_partial(monkeypatch):
    """A head dim the kernel has no loop for (8) or float64: the own part gets the reduced partial's result, the
    prompt part the matmul partial's, and the kernel's op is never called."""
    from turbogrpo.rollout import attention
    monkeypatch.setattr(torch.ops.turbogrpo, "own_attention", None, raising=False)  # any call would fail
    for shape, dtype in (((4, 2, 3, 8), torch.float32), ((4, 2, 24, 64), torch.float64)):
        query, key, value = (torch.randn(shape[:2] + (rows, shape[3]), dtype=dtype) for rows in (shape[2], 11, 11))
        for partial, fallback in ((attention.kernel_partial_attention, attention.reduced_partial_attention),
                                  (attention.kernel_prompt_attention, attention.partial_attention)):
            torch.testing.assert_close(partial(query, key, value, None, 0.3), fallback(query, key, value, None, 0.3),
                                       atol=0, rtol=0)


def test_a_compiled_step_takes_the_reduced_partial_for_few_queries_only():
    """Under inductor on the CPU the few-query parts (a plain step's r * n = 3 queries per KV head) take the CPU kernel
    from ``KERNEL_ITEMS`` (row, head) products (fewer in bf16), the reduced partial below, and the prompt part the
    kernel (sliding windows included); many queries (a tree's 48), eager decoding and other devices keep their
    choice."""
    from turbogrpo.rollout import attention
    cpu, picked = torch.device("cpu"), {}

    def choose(tensor):
        picked["few"] = attention.partial_attention_for(cpu, False, 192, 3)
        few = attention.KERNEL_ITEMS[torch.float32]
        picked["few rows"] = attention.partial_attention_for(cpu, False, few - 1, 3)
        picked["few rows, bf16"] = attention.partial_attention_for(cpu, False, few - 1, 3, torch.bfloat16)
        picked["fewer rows, bf16"] = attention.partial_attention_for(
            cpu, False, attention.KERNEL_ITEMS[torch.bfloat16] - 1, 3, torch.bfloat16)
        picked["few rows, float64"] = attention.partial_attention_for(cpu, False, few - 1, 3, torch.float64)
        picked["tree"] = attention.partial_attention_for(cpu, False, 3, 48)
        picked["prompt"] = attention.prompt_attention_for(cpu, False)
        picked["prompt, window"] = attention.prompt_attention_for(cpu, True)
        picked["cuda"] = attention.partial_attention_for(torch.device("cuda"), False, 192, 3)
        picked["cuda prompt"] = attention.prompt_attention_for(torch.device("cuda"), False)
        return tensor + 1
    torch.compile(choose, backend="eager")(torch.zeros(1))
    assert picked == {"few": attention.kernel_partial_attention, "few rows": attention.reduced_partial_attention,
                      "few rows, bf16": attention.kernel_partial_attention,
                      "fewer rows, bf16": attention.reduced_partial_attention,
                      "few rows, float64": attention.reduced_partial_attention,
                      "tree": attention.fused_partial_attention,
                      "prompt": attention.kernel_prompt_attention, "prompt, window": attention.kernel_prompt_attention,
                      "cuda": attention.partial_attention, "cuda prompt": attention.partial_attention}
    assert attention.partial_attention_for(cpu, False, 192, 3) is attention.partial_attention
    assert attention.partial_attention_for(cpu, False, 3, 3) is attention.fused_partial_attention
    assert attention.prompt_attention_for(cpu, False) is attention.fused_partial_attention
    assert attention.prompt_attention_for(cpu, True) is attention.partial_attention
