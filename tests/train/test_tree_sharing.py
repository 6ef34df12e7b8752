"""train.sharing = "tree" in the update: the same loss, metrics and every parameter gradient as the prompt
path (float64 1e-9, float32 1e-5 relative), for single-turn siblings that begin alike and multi-turn
conversations sharing turns; environment ids never reach the loss; micro-batches count trie tokens."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from tests.prefix.conftest import VOCAB, build_model
from tests.train.test_multiturn_run import SpoiledEnvTokens
from tests.train.test_multiturn_training import with_garbage_on_env_tokens
from turbogrpo.algo import LossNormalizer, build_loss
from turbogrpo.batch import Groups
from turbogrpo.config import AlgoConfig
from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import LogprobModule
from turbogrpo.sharing import SHARINGS
from turbogrpo.train.update import score, update_policy
from turbogrpo.tree import trie_of_groups
from turbogrpo.tree.completions import compute_auto_logprobs, saves_enough
from turbogrpo.tree.trie import common_prefix_lengths

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}   # float64 absolute, float32 relative to the largest


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps a copy of every gradient (update_policy clears them after its step)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def ids(gen, n):
    return torch.randint(0, VOCAB, (n,), generator=gen)


def single_turn_batch(seed: int) -> Groups:
    """Two groups whose completions begin alike: a shared start, a completion that is a prefix of
    another, a duplicate, and one that shares nothing."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [ids(gen, 9), ids(gen, 5)], []
    for _ in prompts:
        a, b, c = ids(gen, 6), ids(gen, 4), ids(gen, 3)
        completions.append([torch.cat([a, b]), torch.cat([a, c]), a.clone(), torch.cat([a, b]), ids(gen, 7),
                            torch.cat([a[:2], c])])
    return with_step_fields(Groups.from_nested(prompts, completions), gen)


def multi_turn_batch(seed: int) -> Groups:
    """Two groups of conversations (model turn, environment reply, model turn ...) that share their
    first turn and reply, some their second turn too, then part; environment ids have model_mask 0."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions, masks = [ids(gen, 7), ids(gen, 4)], [], []
    for _ in prompts:
        turn, reply, turn2, reply2 = ids(gen, 5), ids(gen, 3), ids(gen, 4), ids(gen, 2)
        segments = [[turn, reply, turn2, reply2, ids(gen, 3)], [turn, reply, turn2, reply2, ids(gen, 5)],
                    [turn, reply, ids(gen, 6)], [turn[:3], ids(gen, 2)], [ids(gen, 4), ids(gen, 3), ids(gen, 2)]]
        completions.append([torch.cat(s) for s in segments])
        masks.append([torch.cat([torch.full((len(x),), j % 2 == 0) for j, x in enumerate(s)]) for s in segments])
    batch = Groups.from_nested(prompts, completions, model_mask=masks)
    return with_step_fields(batch, gen)


def with_step_fields(batch: Groups, gen) -> Groups:
    """Random advantages and old / reference / sampler log-probs (float64), as the loss reads them."""
    def logps():
        return [-torch.rand(n, generator=gen, dtype=torch.float64) * 3 for n in batch.lengths]
    return replace(batch, advantages=torch.randn(batch.num_completions, generator=gen, dtype=torch.float64),
                   old_logps=logps(), ref_logps=logps(), sampler_logps=logps())


BATCHES = {"single-turn": single_turn_batch, "multi-turn": multi_turn_batch}
SETTINGS = AlgoConfig(loss="grpo", beta=0.04, tis_cap=2.0)


def one_update(model, batch: Groups, sharing: str, budget: int, module_wrapper=None):
    """(loss and metrics, every parameter's gradient) of one update_policy step with ``sharing``."""
    module = LogprobModule(model, partial(SHARINGS[sharing].forward, backend="auto"))
    plan = SHARINGS[sharing].micro_batches(batch, budget)
    if module_wrapper is not None:
        module = module_wrapper(module, plan)
    optimizer = GradRecorder(model.parameters())
    normalizer = LossNormalizer.for_batch(batch.mask(torch.device("cpu")), max_completion_length=32)
    out = update_policy(module, plan, build_loss(SETTINGS), normalizer, optimizer, max_grad_norm=0.0, dist=SINGLE)
    return out.metrics, optimizer.grads, out.logps


def assert_same_update(expected, got, dtype):
    (metrics_a, grads_a, logps_a), (metrics_b, grads_b, logps_b) = expected, got
    tolerance = TOLERANCE[dtype]
    assert metrics_a.keys() == metrics_b.keys()
    for name in metrics_a:
        assert metrics_b[name] == pytest.approx(metrics_a[name], rel=tolerance, abs=tolerance), name
    for a, b in zip(logps_a, logps_b):
        torch.testing.assert_close(b, a, rtol=0, atol=tolerance)
    for a, b in zip(grads_a, grads_b, strict=True):
        scale = 1.0 if dtype == torch.float64 else a.abs().max().clamp_min(1e-6).item()
        assert (a - b).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_tree_update_equals_prompt_update(kind, dtype):
    """Loss, KL/TIS metrics, entropy, log-probs and every gradient; the tree in one micro-batch and cut
    into several by its trie-token budget, against the prompt path in one."""
    batch = BATCHES[kind](seed=1)
    assert trie_of_groups(batch.prompts, batch.nested()).num_tokens < sum(batch.prompt_lengths) + sum(batch.lengths)
    model = build_model("llama", dtype=dtype)
    expected = one_update(model, batch, "prompt", budget=10_000)
    assert_same_update(expected, one_update(model, batch, "tree", budget=10_000), dtype)
    assert len(SHARINGS["tree"].micro_batches(batch, 24)) > 2   # groups cut into runs
    assert_same_update(expected, one_update(model, batch, "tree", budget=24), dtype)
    assert_same_update(expected, one_update(model, batch, "auto", budget=10_000), dtype)


def test_scoring_with_the_tree_equals_the_prompt_path():
    batch = multi_turn_batch(seed=2)
    model = build_model("llama", dtype=torch.float64)
    plain, tree = ([score(LogprobModule(model, partial(SHARINGS[s].forward, backend="auto")),
                          SHARINGS[s].micro_batches(batch, 10_000), "old_logps")] for s in ("prompt", "tree"))
    for a, b in zip(plain[0], tree[0], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)


def test_environment_tokens_never_reach_the_tree_loss():
    """Garbage on the environment ids' log-probs and entropies (from the tree forward, no gradient through
    them) and on their old / reference / sampler log-probs leaves loss, KL, entropy and gradients
    bit for bit the same."""
    batch = multi_turn_batch(seed=3)
    model = build_model("llama", dtype=torch.float64)
    plain = one_update(model, batch, "tree", budget=40)
    spoiled = one_update(model, with_garbage_on_env_tokens(batch, seed=4), "tree", budget=40,
                         module_wrapper=SpoiledEnvTokens)
    assert plain[0] == spoiled[0] and "kl" in plain[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], spoiled[1], strict=True))


def test_common_prefix_lengths_match_a_direct_count():
    gen = torch.Generator().manual_seed(0)
    base = ids(gen, 6)
    sequences = [base, base[:3], torch.cat([base, ids(gen, 2)]), ids(gen, 4), base.clone(), torch.cat([base[:4], ids(gen, 3)])]
    table = common_prefix_lengths(sequences)
    for i, a in enumerate(sequences):
        for j, b in enumerate(sequences):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            assert table[i][j] == n, (i, j)


@pytest.mark.parametrize("budget", [14, 20, 33, 60, 10_000])
def test_tree_micro_batches_count_trie_tokens(budget):
    """Each micro-batch's trie fits the budget (a lone path over it runs alone), every completion is
    planned once in flat order, and a budget too small for the prompt path's count fits under the tree's."""
    batch = multi_turn_batch(seed=5)
    plan = SHARINGS["tree"].micro_batches(batch, budget)
    assert [c.tolist() for mb in plan for c in mb.completions] == [c.tolist() for c in batch.completions]
    for mb in plan:
        trie = trie_of_groups(mb.prompts, mb.nested())
        assert trie.num_tokens <= budget or mb.num_completions == 1
    whole = trie_of_groups(batch.prompts, batch.nested()).num_tokens
    if budget >= whole:
        assert len(plan) == 1
    assert len(batch.micro_batches(whole)) > 1   # the prompt path's count of the same batch does not fit


def test_auto_takes_the_tree_only_where_its_trie_saves_enough(monkeypatch):
    model = build_model("llama", dtype=torch.float64)
    shares = multi_turn_batch(seed=6)
    gen = torch.Generator().manual_seed(7)
    distinct = Groups.from_nested([ids(gen, 5)], [[torch.tensor([i, *ids(gen, 6).tolist()]) for i in range(4)]])
    assert saves_enough(trie_of_groups(shares.prompts, shares.nested()), shares.prompts, shares.nested())
    assert not saves_enough(trie_of_groups(distinct.prompts, distinct.nested()), distinct.prompts, distinct.nested())
    taken = []
    from turbogrpo.tree import completions
    trie_logprobs, compute_logprobs = completions.trie_logprobs, completions.compute_logprobs
    monkeypatch.setattr(completions, "trie_logprobs", lambda *a: taken.append("tree") or trie_logprobs(*a))
    monkeypatch.setattr(completions, "compute_logprobs",
                        lambda *a, **k: taken.append("prompt") or compute_logprobs(*a, **k))
    for batch in (shares, distinct):
        compute_auto_logprobs(model, batch.prompts, batch.nested())
    assert taken == ["tree", "prompt"]


def test_a_multiturn_run_with_tree_sharing_logs_the_prompt_runs_first_step(tmp_path, monkeypatch):
    """`turbogrpo train` on the multi-turn demo config (cut small): with train.sharing = "tree" the first
    step's rollout, loss and gradient norm are the prompt path's (float32), and the run finishes."""
    from tests.train.test_multiturn_run import CONFIG, small
    from turbogrpo.config import load_config
    from turbogrpo.train import loop
    from turbogrpo.train.metrics import read_metrics

    from turbogrpo.tree import completions
    tries, trie_logprobs = [], completions.trie_logprobs
    monkeypatch.setattr(completions, "trie_logprobs", lambda model, trie, *a: tries.append(trie) or trie_logprobs(
        model, trie, *a))
    threads = torch.get_num_threads()
    try:
        first = {}
        for sharing in ("prompt", "tree"):
            run_dir = tmp_path / sharing
            loop.train(load_config(CONFIG, small(run_dir, **{"train.sharing": f'"{sharing}"', "train.num_steps": 1,
                                                             "train.save_final_model": "false"})))
            first[sharing] = next(r for r in read_metrics(run_dir) if "reward" in r)
    finally:
        torch.set_num_threads(threads)  # the config's train.num_threads = 1
    plain, tree = first["prompt"], first["tree"]
    assert plain["step"] == tree["step"] == 1 and plain["reward"] == tree["reward"]
    assert plain["env/env_tokens"] == tree["env/env_tokens"] > 0   # the same conversations, with replies
    for name in ("loss", "grad_norm", "entropy"):
        assert tree[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name
    assert tree["logprob_gap"] < 1e-4
    assert tries and all(t.num_tokens <= 16384 for t in tries)   # the tree forward ran the trainer's steps


def test_an_unknown_sharing_is_refused_in_one_line():
    from turbogrpo.config import ConfigError, load_config
    from tests.train.test_multiturn_run import CONFIG
    with pytest.raises(ConfigError, match="config key 'train.sharing': 'trie' is not allowed; expected one of "
                                          "prompt, tree, auto"):
        load_config(CONFIG, ['train.sharing="trie"'])
