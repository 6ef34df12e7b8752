"""Transitional: the data-holding Groups gives exactly what today's converters give, on ragged inputs
(StepBatch.select / chunk_completions, plan_micro_batches, split_per_completion, Rollout per-group views)."""

import torch

from turbogrpo.batch import Groups, pad_to_count as new_pad_to_count
from turbogrpo.prefix.layout import split_per_completion
from turbogrpo.rollout.types import Rollout, RolloutStats
from turbogrpo.train.microbatch import pad_ragged, pad_to_count, plan_micro_batches
from turbogrpo.train.update import StepBatch, _padded

SIZES = [3, 1, 2, 4, 1]


def ragged(seed=0, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 50, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen) for _ in sizes]
    completions = [[torch.randint(0, 50, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
                    for _ in range(n)] for n in sizes]
    logps = [[torch.randn(c.numel(), generator=gen) for c in group] for group in completions]
    advantages = torch.randn(sum(sizes), generator=gen)
    return prompts, completions, logps, advantages


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_select_equals_step_batch_select():
    for seed in range(5):
        prompts, completions, logps, advantages = ragged(seed)
        old = StepBatch.from_groups(prompts, completions, advantages, old_logps=logps, rollout_logps=logps)
        new = Groups.from_nested(prompts, completions, advantages=advantages, old_logps=logps, sampler_logps=logps)
        for keep in ([4, 0, 2], [3], [1, 2, 3, 4, 0], [0]):
            o, n = old.select(keep), new.select(keep)
            assert same(o.prompts, n.prompts) and same(o.completions, n.completions)
            assert tuple(o.groups.sizes) == n.sizes and o.groups.offsets == n.offsets
            assert torch.equal(o.advantages, n.advantages)
            assert same(o.old_logps, n.old_logps) and same(o.rollout_logps, n.sampler_logps)
            assert n.ref_logps is None and o.ref_logps is None
            assert o.completion_lengths() == n.split(n.lengths)


def test_micro_batches_equal_plan_micro_batches():
    for seed in range(6):
        prompts, completions, logps, advantages = ragged(seed, sizes=[3, 1, 5, 2, 4, 1])
        old = StepBatch.from_groups(prompts, completions, advantages, old_logps=logps, ref_logps=logps)
        new = Groups.from_nested(prompts, completions, advantages=advantages, old_logps=logps, ref_logps=logps)
        for budget in (1, 5, 9, 14, 30, 10_000):
            plan = plan_micro_batches([p.numel() for p in prompts], old.completion_lengths(), budget)
            batches = new.micro_batches(budget)
            assert len(plan) == len(batches)
            assert [i for mb in plan for i in mb.index] == list(range(new.num_completions))  # flat order
            for mb, nb in zip(plan, batches):
                assert same([old.prompts[c.group] for c in mb.chunks], nb.prompts)
                assert [[t for t in run] for run in old.chunk_completions(mb.chunks)] == nb.nested()
                assert torch.equal(old.advantages[torch.tensor(mb.index)], nb.advantages)
                assert torch.equal(_padded(old.old_logps, mb), nb.padded("old_logps"))
                assert torch.equal(_padded(old.ref_logps, mb), nb.padded("ref_logps"))
                assert nb.padded("sampler_logps") is None and nb.weight == mb.weight == 1.0
            old_fill = pad_to_count(plan, len(plan) + 2)
            new_fill = new_pad_to_count(batches, len(batches) + 2)
            assert [m.weight for m in old_fill] == [b.weight for b in new_fill]
            assert same(new_fill[-1].completions, batches[-1].completions)


def test_per_completion_equals_split_per_completion():
    for seed in range(4):
        prompts, completions, _, _ = ragged(seed)
        batch = Groups.from_nested(prompts, completions)
        flat_NqH = torch.randn(sum(batch.lengths), 3)
        old = split_per_completion(flat_NqH, [[c.numel() for c in g] for g in completions])
        new = batch.split(batch.per_completion(flat_NqH))
        assert all(same(o, n) for o, n in zip(old, new)) and len(old) == len(new)
        assert torch.equal(pad_ragged([t[:, 0] for g in old for t in g]),
                           pad_ragged([t[:, 0] for t in batch.per_completion(flat_NqH)]))


def test_per_group_views_equal_the_rollouts():
    prompts, completions, logps, _ = ragged(1, sizes=[3, 3, 3])
    flat = [c for g in completions for c in g]
    rollout = Rollout(prompts, 3, flat, [lp for g in logps for lp in g], ["stop"] * 9,
                      [i // 3 for i in range(9)], None, RolloutStats())
    batch = Groups(prompts, flat, [3, 3, 3], sampler_logps=[lp for g in logps for lp in g])
    assert all(same(o, n) for o, n in zip(rollout.tokens_per_group(), batch.nested()))
    assert all(same(o, n) for o, n in zip(rollout.logprobs_per_group(), batch.split(batch.sampler_logps)))
    assert same(batch.group(1).completions, rollout.tokens_per_group()[1])
