"""algo.routing_replay's target: the trainer runs the sampler's experts on 100% of the tokens, across partial rollouts
(a weight update in the middle of a generation), speculative conversations, branching and prefix sharing.

Each case samples a tiny float64 qwen3_moe with the native engine recording its routes, then runs the trainer's
forwards replaying them with the routers' recording hooks on: the experts the trainer ran must be the recorded ones
on every token, and the trainer's log-probs must be the sampler's (so the recorded routes are the ones the sampler
ran: a token routed otherwise would move them by far more than float64 rounding).
"""

import torch

from tests.train.conftest import single_thread  # noqa: F401 (autouse: tiny models run fastest on one thread)
from turbogrpo.data import PromptExample
from turbogrpo.engines.native import NativeEngine
from turbogrpo.models import tiny_moe
from turbogrpo.moe_routes import recording, route_disagreement
from turbogrpo.prefix import compute_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
from turbogrpo.train.worker.partial_rollouts import PartialRollouts, pool_state, restore_pool
from turbogrpo.tree.completions import compute_tree_logprobs

STOPS = tuple(range(8))
"""Stop ids of the tiny MoE (vocabulary 64): lengths spread up to the limit."""
SAME = dict(atol=1e-5, rtol=0, check_dtype=False)
"""Sampler and trainer log-probs of the same weights and routes (float64, but transformers' RMSNorm rounds to
float32, as do a conversation's stored log-probs; a token routed to other experts moves its log-prob by orders of
magnitude more)."""


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 60, (n,), generator=g) for n in lengths]


def trainer_ran(model, batch):
    """The experts the shared-prefix training forward ran, replaying ``batch``'s routes: per prompt ``[P, L, k]``
    (each once) and per completion ``[S_i, L, k]``."""
    with recording(model) as recorder:
        compute_logprobs(model, batch.prompts, batch.nested(), share_prefix=True, backend="reference",
                         routes=batch.batch_routes)
    parts = recorder.take().split([*batch.prompt_lengths, *batch.lengths])
    return parts[:batch.num_groups], parts[batch.num_groups:]


def assert_trainer_runs_the_sampled_routes(model, batch):
    """100% of the recorded tokens: the shared-prefix forward ran the sampler's experts."""
    prompts, completions = trainer_ran(model, batch)
    for sampled, ran in zip(batch.prompt_routes, prompts):
        assert torch.equal(ran, sampled)
    for sampled, ran in zip(batch.routes, completions):
        assert torch.equal(ran[:sampled.shape[0]], sampled)


def replayed_logps(model, batch, layout="shared", replay=True):
    """The trainer's log-probs of ``batch`` (flat, completion after completion), replaying its routes."""
    routes = {"routes": batch.batch_routes} if replay else {}
    if layout == "tree":
        return compute_tree_logprobs(model, batch.prompts, batch.nested(), backend="reference", with_entropy=False,
                                     **routes).logps
    return compute_logprobs(model, batch.prompts, batch.nested(), share_prefix=layout == "shared",
                            backend="reference", with_entropy=False, **routes).logps


def sampled_tokens(batch):
    """``[Nq]`` bool: the completion ids the model sampled (not an environment's)."""
    if batch.model_mask is None:
        return torch.ones(sum(batch.lengths), dtype=torch.bool)
    return torch.cat(batch.model_mask)


# --- partial rollouts --------------------------------------------------------------------------------------


def perturb(model, seed=1, scale=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=p.dtype) * scale)


def carried_segments():
    """Two segments of partial rollouts (3 members per group, 2 groups per step, c = 1), the weights perturbed
    between them: (version-0 model, version-1 model, the second segment's batch, the pool)."""
    model = tiny_moe("qwen3_moe")
    before = tiny_moe("qwen3_moe")
    sampling = SamplingConfig(max_new_tokens=14, stop_token_ids=STOPS)
    pool = PartialRollouts(num_members=3, max_new_tokens=14, max_carries=1)
    engine = NativeEngine(None, record_routes=True)
    examples = [PromptExample(f"p{i}", p, index=i) for i, p in enumerate(prompts_of([5, 7, 4, 6, 5, 3]))]
    pool.segment(engine, model, sampling, index=0, examples=examples[:4], num_groups=2, seed=10, version=0)
    perturb(model)
    second, _ = pool.segment(engine, model, sampling, index=1, examples=examples[4:], num_groups=2, seed=11, version=1)
    return before, model, second.groups, pool


def test_a_carried_generation_keeps_each_tokens_routes_across_a_weight_update():
    """A generation drawn partly by version 0 and partly by version 1: its version-0 tokens keep the routes version
    0 ran them with (version 1's routers would route some of them otherwise), the new tokens were drawn over them,
    and the trainer replays exactly those: each token's sampler log-prob is the trainer's, under the weights that
    drew it, with the batch's routes replayed."""
    before, after, batch, _ = carried_segments()
    versions = torch.cat(batch.versions)
    assert any(v.min() == 0 and v.max() == 1 for v in batch.versions), "no generation crossed the weight update"
    assert_trainer_runs_the_sampled_routes(after, batch)
    sampler = torch.cat(batch.sampler_logps)
    for version, model in ((0, before), (1, after)):
        drawn = versions == version
        torch.testing.assert_close(replayed_logps(model, batch)[drawn], sampler[drawn], **SAME)
    # Version 1's own routes of the carried tokens differ from the recorded ones on some tokens: a prefix
    # prefilled afresh would have run (and the trainer replayed) other experts than those that drew the tokens.
    with recording(after) as recorder:
        compute_logprobs(after, batch.prompts, batch.nested(), share_prefix=True, backend="reference")
    own = recorder.take().split([*batch.prompt_lengths, *batch.lengths])[batch.num_groups:]
    carried = [(routes[:int((v == 0).sum()) - 1], ran[:int((v == 0).sum()) - 1])
               for routes, ran, v in zip(batch.routes, own, batch.versions) if v.min() == 0 and v.max() == 1]
    assert any(route_disagreement(a, b) > 0 for a, b in carried)
    drawn = versions == 1
    assert (replayed_logps(after, batch, replay=False)[drawn] - sampler[drawn]).abs().max() > 1e-4


def test_the_pool_keeps_its_routes_through_a_checkpoint():
    _, _, _, pool = carried_segments()
    assert pool.pool and all(group.prompt_routes is not None for group in pool.pool)
    tensors, scalars = pool_state(pool.pool)
    restored = restore_pool(tensors, scalars, [group.example for group in pool.pool])
    for a, b in zip(restored, pool.pool):
        assert torch.equal(a.prompt_routes, b.prompt_routes)
        assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes))


# --- conversations: speculative, branched ----------------------------------------------------------------


def conversations(draft=None, branching=(), sampling=None, seed=0):
    """Two prompts x 4 conversations of the tiny MoE with scripted replies (two turns each, prefilled in chunks of
    3), their routes recorded."""
    from tests.train.test_routing_replay import Scripted
    first = 2 if branching else 4
    return generate_multiturn(tiny_moe("qwen3_moe"), prompts_of([5, 3]),
                              [Scripted([30 + i, 31, 32, 33]) for i in range(2 * first)], num_samples=4,
                              sampling=sampling or SamplingConfig(max_new_tokens=6, stop_token_ids=tuple(range(12))),
                              limits=TurnLimits(6, 30, prefill_chunk=3), seed=seed, branching=branching,
                              reply_timing="next_step", draft=draft, record_routes=True)


def assert_replayed_conversations(rollout, layouts=("shared",)):
    """The trainer runs the recorded routes on every token, and its log-probs of the sampled ids are the sampler's."""
    model, batch = tiny_moe("qwen3_moe"), rollout.groups
    assert any(not bool(m.all()) for m in batch.model_mask)  # replies were prefilled between the turns
    assert all(r.shape[0] == n - 1 for r, n in zip(batch.routes, batch.lengths))
    assert_trainer_runs_the_sampled_routes(model, batch)
    sampled = sampled_tokens(batch)
    for layout in layouts:
        torch.testing.assert_close(replayed_logps(model, batch, layout)[sampled], torch.cat(batch.sampler_logps)[sampled],
                                   **SAME)


def test_a_speculative_conversation_records_the_accepted_paths_and_the_replies_routes():
    """Greedy, with the first rollout's text as history drafts: the second accepts whole chains, and each id's
    routes are those of the tree node (or reply chunk) that ran it, as plain sampling records them."""
    from turbogrpo.speculative.history import HistoryDrafts
    from turbogrpo.speculative.sizing import FixedSizing
    from turbogrpo.speculative.speculation import Speculation
    from turbogrpo.speculative.tree import TreeShape
    greedy = SamplingConfig(max_new_tokens=6, stop_token_ids=(11,), temperature=0.0)  # (the greedy turns reach 11)
    plain = conversations(sampling=greedy)
    speculation = Speculation(None, FixedSizing(TreeShape(2, 4, 9)), history=HistoryDrafts(min_match=1))
    runs = [conversations(speculation, sampling=greedy) for _ in range(2)]
    assert runs[1].stats.num_forwards < plain.stats.num_forwards   # chains were accepted
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run.groups.completions, plain.groups.completions))
        assert all(torch.equal(a, b) for a, b in zip(run.groups.routes, plain.groups.routes))
        assert_replayed_conversations(run)


def test_branched_conversations_replay_their_shared_history_in_the_tree_forward():
    """Conversations forked after their first reply share that history: the trie forward runs it once, with the
    routes the sampler ran it with (a branch's last id, never run, takes its sibling's recorded routes)."""
    assert_replayed_conversations(conversations(branching=(2, 2)), layouts=("shared", "tree"))


# --- prefix sharing --------------------------------------------------------------------------------------


def test_samples_sharing_a_prompts_prefill_replay_its_routes_once():
    """The native engine prefills each prompt once for its G samples (their first tokens and every later one read
    that K/V, a prefix-cache hit); the shared-prefix forward runs the prompt once too, with those routes."""
    model = tiny_moe("qwen3_moe")
    batch = generate(model, prompts_of([6, 4, 5]), num_samples=4, seed=3, record_routes=True,
                     sampling=SamplingConfig(max_new_tokens=10, stop_token_ids=STOPS)).groups
    assert len(set(batch.lengths)) > 1
    assert [r.shape[0] for r in batch.prompt_routes] == batch.prompt_lengths   # one per prompt, not per sample
    assert_trainer_runs_the_sampled_routes(model, batch)
    for layout in ("shared", "unshared", "tree"):
        torch.testing.assert_close(replayed_logps(model, batch, layout), torch.cat(batch.sampler_logps), **SAME)
