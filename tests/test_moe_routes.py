"""MoE routing replay (``turbogrpo.moe_routes``): recorded routes replay exactly, every family, every layout.

In float64: replaying the routers' own routes gives the same log-probs and gradients as no replay (bit for bit:
the gates are the same ops on the same values), and a replayed expert the router would not pick still gets the
router a gradient through its gate. The training layouts (shared prefix, unshared, trie) each lay a batch's
routes out in their own token order; replaying drifted routes must give the three the same numbers.
"""

import pytest
import torch

from tests.train.conftest import single_thread  # noqa: F401 (autouse: tiny models run fastest on one thread)
from turbogrpo.models import MOE_FAMILIES, tiny_moe
from turbogrpo.moe_routes import (BatchRoutes, bytes_per_token, recording, replaying, route_disagreement,
                                  route_dtype, routers)
from turbogrpo.prefix import compute_logprobs
from turbogrpo.tree.completions import compute_tree_logprobs

VOCAB = 64


def own_forward(model, ids_BT, routes=None):
    """Logits of the model's own forward and the routes it ran; with ``routes``, replaying them (the recording
    hooks, installed after the replaying ones, see the replayed routes)."""
    if routes is None:
        with recording(model) as recorder:
            return model(ids_BT).logits, recorder.take()
    with replaying(model, routes) as counts, recording(model) as recorder:
        logits = model(ids_BT).logits
    assert int(counts.num_tokens) == int((routes >= 0).flatten(1).all(-1).sum())   # the tokens with routes
    return logits, recorder.take()


def router_weights(model):
    return [router.weight for router, _ in routers(model)]


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_replaying_the_routers_own_routes_changes_nothing(family):
    model = tiny_moe(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, routes = own_forward(model, ids)
    grads = torch.autograd.grad(logits.logsumexp(-1).sum(), list(model.parameters()))
    replayed_logits, replayed_routes = own_forward(model, ids, routes)
    replayed_grads = torch.autograd.grad(replayed_logits.logsumexp(-1).sum(), list(model.parameters()))
    assert torch.equal(replayed_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(replayed_grads, grads))
    # The experts the replayed forward ran are the recorded ones on 100% of the tokens.
    assert routes.dtype == torch.uint8 and route_disagreement(replayed_routes, routes) == 0.0
    num_layers, top_k = routes.shape[1:]
    assert bytes_per_token(model) == num_layers * top_k == 4


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_drifted_replayed_expert_still_trains_the_router(family):
    """Token 3's first layer is told to use an expert its router did not pick: the output changes and the
    router's row for that expert gets a gradient through the expert's gate."""
    model = tiny_moe(family)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    _, routes = own_forward(model, ids)
    router, kind = routers(model)[0]
    drifted = routes.long().clone()
    unpicked = next(e for e in range(kind.num_experts(router)) if e not in drifted[3, 0].tolist())
    drifted[3, 0, 0] = unpicked
    logits, ran = own_forward(model, ids, drifted)
    assert ran[3, 0, 0] == unpicked
    (weight_grad,) = torch.autograd.grad(logits[0, 3:].logsumexp(-1).sum(), [router.weight])
    assert weight_grad[unpicked].abs().max() > 0
    assert not torch.equal(logits, own_forward(model, ids)[0])


def test_a_token_without_recorded_routes_keeps_the_routers_choice():
    model = tiny_moe("qwen3_moe")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    logits, routes = own_forward(model, ids)
    unrecorded = routes.long().clone()
    unrecorded[4] = -1
    replayed, ran = own_forward(model, ids, unrecorded)
    assert torch.equal(replayed, logits) and torch.equal(ran, routes)


def sampled_batch(model, seed=4):
    """Two groups with their routes as a sampler records them: each prompt once, each completion's first
    S_i - 1 tokens (the last one is never run), from the model's own unshared forwards."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in (5, 3)]
    completions = [[torch.randint(0, VOCAB, (s,), generator=g) for s in ss] for ss in ((4, 6, 4), (2, 5))]
    prompt_routes = [own_forward(model, p[None])[1] for p in prompts]
    completion_routes = [own_forward(model, torch.cat([p, c])[None])[1][p.numel():-1]
                         for p, cs in zip(prompts, completions) for c in cs]
    return prompts, completions, BatchRoutes(prompt_routes, completion_routes)


LAYOUTS = {
    "shared": lambda model, p, c, **kw: compute_logprobs(model, p, c, share_prefix=True, backend="reference", **kw),
    "unshared": lambda model, p, c, **kw: compute_logprobs(model, p, c, share_prefix=False, **kw),
    "tree": lambda model, p, c, **kw: compute_tree_logprobs(model, p, c, backend="reference", **kw),
}


def logps_and_grads(model, layout, prompts, completions, routes=None):
    options = {} if routes is None else {"routes": routes}
    logps = LAYOUTS[layout](model, prompts, completions, with_entropy=False, **options).logps
    return logps.detach(), torch.autograd.grad(logps.sum(), list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_replays_the_sampled_routes_exactly(layout):
    model = tiny_moe("qwen3_moe")
    prompts, completions, routes = sampled_batch(model)
    logps, grads = logps_and_grads(model, layout, prompts, completions)
    replayed, replayed_grads = logps_and_grads(model, layout, prompts, completions, routes)
    torch.testing.assert_close(replayed, logps, rtol=0, atol=1e-12)
    for a, b in zip(replayed_grads, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_layouts_agree_on_drifted_routes():
    """Routes the routers would not choose (every layer of every token shifted by one expert) move the
    log-probs, by the same amount in every layout: each lays the routes out at its own tokens. The gradients
    agree to float32 rounding: the family's gate softmax runs in float32 whatever the model's dtype, and each
    layout sums a shared prompt token's gradient through it in its own order."""
    model = tiny_moe("qwen3_moe")
    prompts, completions, routes = sampled_batch(model)
    shift = lambda r: (r.long() + 1) % 6  # noqa: E731
    drifted = BatchRoutes([shift(r) for r in routes.prompts], [shift(r) for r in routes.completions])
    results = {layout: logps_and_grads(model, layout, prompts, completions, drifted) for layout in LAYOUTS}
    own = logps_and_grads(model, "shared", prompts, completions)[0]
    assert (results["shared"][0] - own).abs().max() > 1e-3
    for layout in ("unshared", "tree"):
        torch.testing.assert_close(results[layout][0], results["shared"][0], rtol=0, atol=1e-12)
        for a, b in zip(results[layout][1], results["shared"][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_routes_are_stored_in_the_smallest_dtype():
    assert [route_dtype(n) for n in (8, 256, 257, 40000)] == [torch.uint8, torch.uint8, torch.int16, torch.int32]


def test_a_model_without_routers_is_refused_in_one_line():
    from turbogrpo.models import tiny_model
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        routers(tiny_model("qwen2", hidden=16, heads=2, kv_heads=1, layers=1))


def test_a_checkpointed_layer_replays_the_same_routes_when_recomputed():
    """model.gradient_checkpointing: the backward recomputes each decoder layer; under replay it must run the
    replayed experts again, so the gradients equal those of the replaying forward without checkpointing (drifted
    routes, which the routers would not choose: recomputed afresh, the layer would run other experts)."""
    from turbogrpo.models import enable_activation_checkpointing
    model = tiny_moe("qwen3_moe")
    prompts, completions, routes = sampled_batch(model)
    drifted = BatchRoutes([(r.long() + 1) % 6 for r in routes.prompts], [(r.long() + 1) % 6 for r in routes.completions])
    model.train()  # (transformers checkpoints in training only)
    expected = {layout: logps_and_grads(model, layout, prompts, completions, drifted) for layout in LAYOUTS}
    enable_activation_checkpointing(model)
    for layout, (logps, grads) in expected.items():
        checkpointed, checkpointed_grads = logps_and_grads(model, layout, prompts, completions, drifted)
        assert torch.equal(checkpointed, logps)
        assert all(torch.equal(a, b) for a, b in zip(checkpointed_grads, grads) if a is not None), layout


def test_a_shared_trie_token_takes_the_first_recorded_routes():
    """Sequence 0 ends on token 2 (never run by the sampler: -1); sequence 1 runs on through it: the trie runs
    token 2 once, with sequence 1's recorded routes. Token 0 takes sequence 0's (the first that recorded it)."""
    from turbogrpo.moe_routes import trie_routes
    first = torch.tensor([[[1, 2]], [[3, 4]], [[-1, -1]]])
    second = torch.tensor([[[5, 0]], [[3, 4]], [[2, 5]], [[0, 1]]])
    out = trie_routes([first, second], [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3])], 5)
    assert out.tolist() == [[[1, 2]], [[3, 4]], [[2, 5]], [[0, 1]], [[-1, -1]]]
