"""What a compiled runner does around its graph costs once per rollout or per tensor, not once per step: the
threads of "compiled-pinned" are pinned once around the rollout, and the prompt width is marked dynamic once per
tensor."""

import contextlib

import torch
import torch._dynamo

import turbogrpo.rollout.compiled as compiled_module
from tests.rollout.conftest import build_model, random_prompts
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.compiled import mark_dynamic_sizes
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
