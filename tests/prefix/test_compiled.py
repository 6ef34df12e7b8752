"""Compiled paths: the flex backend keeps its kernels and one graph serves packs of any length; the
optional compiled decoder layers change no value and no gradient."""

import pytest
import torch

import turbogrpo
from tests.prefix.conftest import PACKS, build_model, random_groups
from turbogrpo.prefix import backends


class CountingCompiler:
    """A torch.compile backend that runs graphs eagerly and counts how many it was handed."""

    def __init__(self):
        self.num_graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.num_graphs += 1
        return graph_module.forward


@pytest.fixture
def counting_flex(monkeypatch):
    """The registered flex backend replaced by one that compiles on the CPU with a counting compiler."""
    torch._dynamo.reset()
    compiler = CountingCompiler()
    flex = backends.FlexAttention(compiler=compiler, compile_devices=("cpu",))
    monkeypatch.setitem(backends.BACKENDS, "flex", flex)
    yield flex, compiler
    torch._dynamo.reset()


# ~30 s: dynamo traces flex_attention and create_block_mask once
def test_packs_of_other_lengths_reuse_the_compiled_graphs_and_one_mask_per_pack(counting_flex, monkeypatch):
    flex, compiler = counting_flex
    plans = []
    original_plan = flex.plan
    monkeypatch.setattr(flex, "plan", lambda layout: plans.append(layout) or original_plan(layout))
    model = build_model("qwen2", torch.float64)
    packs = ["mixed", "single", "g5-equal-prompts"]
    with torch.no_grad():
        for i, pack in enumerate(packs):
            prompts, completions = random_groups(*PACKS[pack])
            ref = turbogrpo.completion_logprobs(model, prompts, completions, share_prefix=False)
            got = turbogrpo.completion_logprobs(model, prompts, completions, backend="flex")
            torch.testing.assert_close(torch.cat(sum(got, [])), torch.cat(sum(ref, [])), rtol=0, atol=1e-10)
            if i == 0:
                graphs_after_first_pack = compiler.num_graphs
    # flex_attention and create_block_mask, each compiled once, held by the backend ...
    assert graphs_after_first_pack == 2 and list(flex._kernels) == ["cpu"]
    # ... and packs of 48, 14 and 32 tokens add no graph.
    assert compiler.num_graphs == graphs_after_first_pack
    # One block mask per pack, shared by the model's 2 layers.
    assert len(plans) == len(packs)


# ~20 s: dynamo traces one decoder layer
def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients_without_recompiling():
    from tests.prefix.test_parity import logps_and_grads
    from turbogrpo.prefix import compile_decoder_layers
    torch._dynamo.reset()
    compiler = CountingCompiler()
    eager = build_model("qwen2", torch.float64)
    compiled = compile_decoder_layers(build_model("qwen2", torch.float64), compiler=compiler)
    for i, pack in enumerate(["mixed", "g5-equal-prompts"]):
        prompts, completions = random_groups(*PACKS[pack])
        ref_logps, ref_grads = logps_and_grads(eager, prompts, completions, backend="cascade")
        logps, grads = logps_and_grads(compiled, prompts, completions, backend="cascade")
        torch.testing.assert_close(logps, ref_logps, rtol=0, atol=1e-12)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=0, atol=1e-12)
        if i == 0:
            graphs_after_first_pack = compiler.num_graphs
    # The plan is a graph break: regions before and after attention, shared by both layers ...
    assert graphs_after_first_pack > 0
    # ... and a pack of another length (48 -> 32 tokens) compiles nothing new.
    assert compiler.num_graphs == graphs_after_first_pack
    torch._dynamo.reset()
