"""The tree step's device parts (``draft_tree``, ``verify_step``) as graphs: torch.compile(fullgraph=True)
captures each whole and gives the eager tokens, the next rollout reuses the graphs, and neither part
ever syncs with the host."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.rollout.conftest import forbid_host_syncs_inside
from tests.speculative.speculative_helpers import tiny_policy, trained_pair
from turbogrpo import graph_linears, linears
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.compiled import _compiled
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.speculative import decode
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.tree import TreeShape

SAMPLINGS = {"sampled": SamplingConfig(max_new_tokens=10, top_p=0.9, stop_token_ids=(3,)),
             "greedy": SamplingConfig(max_new_tokens=10, temperature=0.0)}


def speculate(policy, draft, prompts, sampling, runner="eager", num_samples=2):
    return generate_speculative(policy, prompts, num_samples=num_samples, sampling=sampling, seed=7, return_hidden=True,
                                draft=Speculation(draft, FixedSizing(TreeShape(2, 3, 5)), runner=runner))


def test_the_tree_step_compiles_whole_and_gives_the_eager_tokens():
    torch._dynamo.reset()
    _compiled.cache_clear()
    policy = tiny_policy("qwen2", seed=1, sharpness=6.0, num_layers=1)
    draft, prompts = DraftHead(policy), [torch.tensor([1, 2, 3, 4, 5])]
    sampling = SamplingConfig(max_new_tokens=6, top_p=0.9)
    eager = speculate(policy, draft, prompts, sampling)
    counters.clear()
    compiled = speculate(policy, draft, prompts, sampling, runner="dynamo")
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs + compiled.hidden, eager.logprobs + eager.hidden):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert compiled.stats.tree_sizes == eager.stats.tree_sizes and set(eager.stats.tree_sizes) == {5}
    # fullgraph=True raises at any graph break; both parts were captured (one graph per size each).
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 2
    counters.clear()
    again = speculate(policy, draft, prompts, sampling, runner="dynamo")
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in eager.tokens]
    assert not counters["stats"]["unique_graphs"]  # the next rollout of the same sizes reuses the graphs


@pytest.mark.parametrize("arch", ["qwen2-trained", "mistral-window"])
def test_the_tree_step_never_syncs_with_the_host(arch, monkeypatch):
    if arch == "qwen2-trained":
        policy, draft, prompts = trained_pair()
        prompts = prompts[:2]
    else:
        policy = tiny_policy("mistral", seed=2, sharpness=6.0, sliding_window=6)
        draft, prompts = DraftHead(policy), [torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 8])]
    forbid_host_syncs_inside(monkeypatch, (decode, "draft_tree"), (decode, "verify_step"))
    for sampling in SAMPLINGS.values():
        rollout = speculate(policy, draft, prompts, sampling)
        assert rollout.stats.tree_sizes and set(rollout.stats.tree_sizes) == {5}


def test_a_runner_the_tree_step_cannot_use_is_refused():
    policy = tiny_policy("qwen2", seed=1, num_layers=1)
    with pytest.raises(ValueError, match="Speculation.runner must be one of"):
        speculate(policy, DraftHead(policy), [torch.tensor([1, 2, 3])], SAMPLINGS["greedy"], runner="cudagraph")


class EveryOtherStep(FixedSizing):
    """A tree at every other step, a plain step between: both kinds of step in one rollout."""

    def __init__(self, shape):
        super().__init__(shape)
        self.calls = 0

    def choose(self, num_live, *, draft_ready=True, position=0):
        self.calls += 1
        return self.shape if self.calls % 2 else None


@pytest.mark.slow  # inductor compiles six graphs (2-3 min); the pass on dynamic sizes: test_graph_linears.py
def test_the_compiled_onednn_tree_step_runs_packed_products_and_gives_the_eager_tokens(monkeypatch):
    """``Speculation.runner = "compiled-onednn"``: the tree step's parts and the plain steps between them are compiled
    with the graphs' weight products packed (``graph_linears.stacked_linear``, sizes dynamic, so one-row products are
    packed too). Sampled at T = 1 the eager rollout's tokens (its products packed as well) and log-probs within float32
    rounding; the graphs' products all ran packed, the draft's with the policy's."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    products = []
    monkeypatch.setattr(graph_linears, "onednn_product",
                        lambda *args: products.append(args[1].shape) or linears.onednn_product(*args))  # graphs only
    policy = tiny_policy("qwen2", seed=1, sharpness=6.0, num_layers=1)
    draft, prompts = DraftHead(policy), [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([7, 8, 9])]
    sampling = SamplingConfig(max_new_tokens=8, top_p=0.9)
    runs = {}
    for runner in ("eager", "compiled-onednn"):
        speculation = Speculation(draft, EveryOtherStep(TreeShape(2, 3, 5)), runner=runner)
        runs[runner] = generate(policy, prompts, num_samples=2, sampling=sampling, seed=7, draft=speculation,
                                schedule=DecodeSchedule(linears="onednn"))
    eager, compiled = runs["eager"], runs["compiled-onednn"]
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert compiled.stats.tree_sizes == eager.stats.tree_sizes and set(eager.stats.tree_sizes) == {1, 5}
    config = policy.config
    assert config.vocab_size in {shape[0] for shape in products}  # the policy's head (the draft's reuses it)
    assert len({shape for shape in products}) >= 4  # q/k/v, o, gate/up, down of the policy and the draft, the head
