"""Micro-batch planning, and accumulated gradients equal to the single-batch gradients."""

from dataclasses import replace

import pytest
import torch

from turbogrpo.algo import LOSSES, LossNormalizer, build_loss
from turbogrpo.config import AlgoConfig
from turbogrpo.placement import DistInfo
from turbogrpo.prefix import compute_logprobs
from turbogrpo.train.distributed import LogprobModule
from turbogrpo.batch import Groups, pad_to_count
from turbogrpo.train.update import update_policy

from .conftest import exact_tiny_model, random_step_batch

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def lengths_batch(prompt_lengths, completion_lengths):
    """A batch whose token values say (group, completion): prompt k is all k, completion i of group k
    is all ``10 * k + i``."""
    return Groups.from_nested([torch.full((p,), k) for k, p in enumerate(prompt_lengths)],
                              [[torch.full((s,), 10 * k + i) for i, s in enumerate(group)]
                               for k, group in enumerate(completion_lengths)])


def runs(micro_batch):
    """Per group of a micro-batch: (its group in the batch, its completions' indices in that group)."""
    return [(int(p[0]), [int(c[0]) % 10 for c in group]) for p, group in zip(micro_batch.prompts, micro_batch.nested())]


def test_whole_groups_are_packed_while_they_fit():
    plan = lengths_batch([4, 3, 5], [[2, 2], [1, 1, 1], [2]]).micro_batches(token_budget=13)
    assert [runs(mb) for mb in plan] == [[(0, [0, 1])], [(1, [0, 1, 2]), (2, [0])]]
    assert [mb.sizes for mb in plan] == [(2,), (3, 1)]
    assert all(mb.weight == 1.0 for mb in plan)


def test_group_over_budget_is_cut_into_runs_that_each_carry_the_prompt():
    # prompt 4 + completions 3,3,3,9: runs [0,1] (10 tokens), [2] (7), [3] alone over budget (13).
    plan = lengths_batch([4, 1], [[3, 3, 3, 9], [2]]).micro_batches(token_budget=10)
    assert [runs(mb) for mb in plan] == [[(0, [0, 1])], [(0, [2])], [(0, [3])], [(1, [0])]]


def test_every_completion_is_planned_exactly_once_in_flat_order():
    gen = torch.Generator().manual_seed(0)
    for budget in (1, 7, 20, 1000):
        lengths = [[int(x) for x in torch.randint(1, 9, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                                   generator=gen)] for _ in range(5)]
        batch = lengths_batch([3, 8, 1, 5, 2], lengths)
        planned = [c for mb in batch.micro_batches(budget) for c in mb.completions]
        assert [int(c[0]) for c in planned] == [int(c[0]) for c in batch.completions]


def test_fillers_have_zero_weight():
    plan = pad_to_count(lengths_batch([2], [[1, 1]]).micro_batches(100), 3)
    assert [mb.weight for mb in plan] == [1.0, 0.0, 0.0]


def _batch(vocab: int):
    prompt_lengths, completion_lengths = [6, 3, 9], [[4, 1, 7], [5, 5], [2, 8, 3, 1]]
    batch = random_step_batch(prompt_lengths, completion_lengths, vocab=vocab, seed=1, logp_center=-2,
                              logp_spread=0.1)
    return batch, prompt_lengths, completion_lengths


def _normalizer(completion_lengths, max_len):
    tokens = float(sum(map(sum, completion_lengths)))
    return LossNormalizer(sum(map(len, completion_lengths)), tokens, max_len, tokens)


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_accumulated_update_equals_single_batch_update(loss_name):
    """Parameters after one SGD step (lr 1, no clipping: the step is the gradient) agree to 1e-12."""
    batch, prompt_lengths, completion_lengths = _batch(vocab=64)
    settings = AlgoConfig(epsilon_low=0.2, epsilon_high=0.28, beta=0.05)
    normalizer = _normalizer(completion_lengths, max_len=8)
    results = {}
    for budget in (10_000, 12, 1):
        model = exact_tiny_model()
        module = LogprobModule(model, compute_logprobs)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        plan = batch.micro_batches(budget)
        out = update_policy(module, plan, build_loss(replace(settings, loss=loss_name)), normalizer,
                            optimizer, max_grad_norm=0.0, dist=SINGLE)
        assert out.applied
        results[budget] = (torch.cat([p.detach().flatten() for p in model.parameters()]), out)
    whole, whole_out = results[10_000]
    assert len(batch.micro_batches(12)) > 3
    for budget in (12, 1):
        params, out = results[budget]
        torch.testing.assert_close(params, whole, rtol=0, atol=1e-12)
        assert out.grad_norm == pytest.approx(whole_out.grad_norm, rel=1e-12)
        for name, value in whole_out.metrics.items():
            assert out.metrics[name] == pytest.approx(value, rel=1e-10, abs=1e-14), name
        for a, b in zip(out.logps, whole_out.logps):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_update_matches_the_loss_computed_by_hand_on_the_padded_batch():
    """One micro-batch == the algo loss on the whole padded batch (gradients via autograd directly)."""
    batch, prompt_lengths, completion_lengths = _batch(vocab=64)
    settings = AlgoConfig(beta=0.0)
    normalizer = _normalizer(completion_lengths, max_len=8)
    model = exact_tiny_model()
    logps = compute_logprobs(model, batch.prompts, batch.nested()).logps
    flat_lengths = [s for g in completion_lengths for s in g]
    logps_BL = torch.nn.utils.rnn.pad_sequence(list(torch.split(logps, flat_lengths)), batch_first=True)
    mask = (torch.arange(logps_BL.shape[1])[None] < torch.tensor(flat_lengths)[:, None]).double()
    loss, _ = LOSSES["dapo"](logps_BL, None, None, batch.advantages, mask, normalizer, settings)
    expected = torch.autograd.grad(loss, list(model.parameters()))

    model2 = exact_tiny_model()
    before = [p.detach().clone() for p in model2.parameters()]
    optimizer = torch.optim.SGD(model2.parameters(), lr=1.0)
    batch.old_logps = batch.ref_logps = None
    update_policy(LogprobModule(model2, compute_logprobs), batch.micro_batches(20), build_loss(settings),
                  normalizer, optimizer, max_grad_norm=0.0, dist=SINGLE)
    for b, p, g in zip(before, model2.parameters(), expected):
        torch.testing.assert_close(b - p.detach(), g, rtol=0, atol=1e-12)


def test_nonfinite_loss_skips_the_step():
    batch, prompt_lengths, completion_lengths = _batch(vocab=64)
    batch.advantages[2] = float("nan")
    model = exact_tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = update_policy(LogprobModule(model, compute_logprobs), batch.micro_batches(20), build_loss(AlgoConfig(loss="grpo")), _normalizer(completion_lengths, 8), optimizer,
                        max_grad_norm=1.0, dist=SINGLE)
    assert not out.applied
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state == {} or all(not s for s in optimizer.state.values())


def test_skipping_zero_advantage_groups_gives_the_same_adamw_steps():
    """beta = 0: groups whose advantages are all 0 are left out; two AdamW steps (the second with every
    advantage 0, so only momentum moves the weights) end where the full updates end."""
    batch, prompt_lengths, completion_lengths = _batch(vocab=64)
    batch.old_logps = batch.ref_logps = None
    batch.advantages[3:5] = 0.0  # group 1 (completions 3, 4) has equal rewards
    all_zero = replace(batch, advantages=torch.zeros_like(batch.advantages))
    settings, normalizer = AlgoConfig(beta=0.0), _normalizer(completion_lengths, 8)
    finals = []
    for skip in (False, True):
        model = exact_tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step_batch in (batch, all_zero):
            if skip:
                moving = [g for g, s in enumerate(_group_slices(completion_lengths))
                          if step_batch.advantages[s].ne(0).any()] or [0]
                step_batch = step_batch.select(moving)
            update_policy(LogprobModule(model, compute_logprobs), step_batch.micro_batches(10_000), build_loss(settings),
                          normalizer, optimizer, max_grad_norm=1.0, dist=SINGLE)
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(finals[1], finals[0], rtol=0, atol=1e-12)


def test_trainable_groups_keeps_groups_with_any_nonzero_advantage():
    from turbogrpo.train.loop import trainable_groups

    advantages = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.5, 0.0])
    assert trainable_groups(advantages, 2, beta=0.0) == [1, 3]
    assert trainable_groups(advantages, 2, beta=0.1) == [0, 1, 2, 3]  # the KL term moves every group
    assert trainable_groups(torch.zeros(4), 2, beta=0.0) == [0]  # one group keeps every rank's collectives


def _group_slices(completion_lengths):
    start = 0
    for group in completion_lengths:
        yield slice(start, start + len(group))
        start += len(group)
