"""What a compiled runner does around its graph costs once per rollout or per tensor, not once per step: the
threads of "compiled-pinned" are pinned once around the rollout, the prompt width is marked dynamic once per
tensor, and dynamo checks all its guards once per rollout, bucket and dynamic size, not at every step."""

import contextlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import turbogrpo.rollout.compiled as compiled_module
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.compiled import _compiled, mark_dynamic_sizes
from turbogrpo.rollout.decode import DecodeSchedule, first_draw
from turbogrpo.rollout.step import plain_step


def test_compiled_pinned_enters_its_scope_once_around_the_whole_rollout(monkeypatch):
    entered, steps = [], []

    @contextlib.contextmanager
    def counting_scope():
        entered.append("enter")
        yield
        entered.append("exit")

    def counted_step(state):
        assert entered == ["enter"]  # every step runs inside the one scope
        steps.append(1)
        plain_step(state)

    # The compiled graph itself is not what this test is about: the runner's step runs eagerly here.
    monkeypatch.setitem(compiled_module.PLAIN_RUNNERS, "compiled-pinned", lambda function: counted_step)
    monkeypatch.setitem(compiled_module.RUNNER_SCOPES, "compiled-pinned", counting_scope)
    model = build_model("qwen2", num_hidden_layers=1)
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.0)
    pinned = generate(model, random_prompts([5, 4]), num_samples=2, sampling=sampling,
                      schedule=DecodeSchedule(runner="compiled-pinned"))
    eager = generate(model, random_prompts([5, 4]), num_samples=2, sampling=sampling,
                     schedule=DecodeSchedule(runner="eager"))
    assert entered == ["enter", "exit"] and len(steps) >= 6
    assert [t.tolist() for t in pinned.tokens] == [t.tolist() for t in eager.tokens]


def test_the_prompt_width_is_marked_dynamic_once_per_tensor(monkeypatch):
    model = build_model("qwen2", num_hidden_layers=2)
    sampling = SamplingConfig(max_new_tokens=4)
    with torch.no_grad():
        state = first_draw(model, random_prompts([5, 3]), 2, sampling, None, False, [4] * 4, 0, static_slots=True)
    marked = []
    real_mark = torch._dynamo.mark_dynamic
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda tensor, dim: (marked.append(id(tensor)),
                                                                            real_mark(tensor, dim)))
    dims = state.cache.dynamic_dims()
    mark_dynamic_sizes(state)
    assert sorted(marked) == sorted(id(tensor) for tensor, _ in dims)
    assert all(dim in tensor._dynamo_dynamic_indices for tensor, dim in dims)
    mark_dynamic_sizes(state)
    assert len(marked) == len(dims)  # the second step marks nothing


def guard_checks(monkeypatch) -> list[tuple[tuple, bool]]:
    """Each compiled static call's (signature, whether dynamo checked only the differing guards), in order."""
    checks = []
    real = compiled_module.CompiledStep.guards_for

    def recorded(step, state, signature):
        context = real(step, state, signature)
        checks.append((signature, not isinstance(context, contextlib.nullcontext)))
        return context
    monkeypatch.setattr(compiled_module.CompiledStep, "guards_for", recorded)
    return checks


def test_a_rollout_checks_every_guard_once_per_bucket_and_size_then_only_the_differing_ones(monkeypatch):
    """Rows retiring through buckets 8, 4, 2 and the slots read growing past a block: the first call of each (bucket,
    sizes) checks every guard, the later ones only those that told the graphs apart, and the tokens and log-probs
    are eager's. The next rollout (new prompt widths) checks in full again."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("qwen2", num_hidden_layers=1)
    checks = guard_checks(monkeypatch)
    for lengths in ([5, 5], [9, 9]):
        kwargs = dict(num_samples=4, sampling=SamplingConfig(max_new_tokens=20), seed=3,
                      max_new_tokens_per_completion=[2, 3, 5, 6, 9, 20, 20, 3])
        eager = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2"), **kwargs)
        checks.clear()
        ours = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2", "dynamo"), **kwargs)
        assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in eager.tokens]
        for mine, theirs in zip(ours.logprobs, eager.logprobs):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
        full = [signature for signature, skipped in checks if not skipped]
        assert len(full) == len(set(full)) == len({signature for signature, _ in checks})
        assert {signature[0][0] for signature in full} == {8, 4, 2}  # the buckets met
        assert {signature[1][-1] for signature in full} == {16, 20}  # the slots read: a block, then all 20
        assert sum(skipped for _, skipped in checks) >= len(checks) - 6


def test_a_lora_merge_between_rollouts_is_seen_by_the_first_full_check(monkeypatch):
    """Merging a LoRA adapter into the weights changes what the step computes without changing any tensor's shape: the
    next rollout's first call checks every guard, so dynamo compiles the step again instead of running the graph
    traced through the unmerged adapter (which would add the adapter twice), and the tokens are eager's each time."""
    peft = pytest.importorskip("peft")
    torch._dynamo.reset()
    _compiled.cache_clear()
    torch.manual_seed(0)
    model = peft.get_peft_model(build_model("qwen2", num_hidden_layers=1),
                                peft.LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "down_proj"],
                                                init_lora_weights=False))
    kwargs = dict(num_samples=4, sampling=SamplingConfig(max_new_tokens=10, temperature=0.0), seed=3)
    tokens = []
    for change in (lambda: None, model.merge_adapter, model.unmerge_adapter):
        change()
        eager = generate(model, random_prompts([5, 6]), schedule=DecodeSchedule(1, "pow2"), **kwargs)
        counters.clear()
        ours = generate(model, random_prompts([5, 6]), schedule=DecodeSchedule(1, "pow2", "dynamo"), **kwargs)
        assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in eager.tokens]
        tokens.append([t.tolist() for t in eager.tokens])
    assert tokens[0] == tokens[2]
