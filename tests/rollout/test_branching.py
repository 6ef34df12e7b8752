"""Branching multi-turn rollouts: conversations fork at a turn boundary, share everything before it exactly,
draw independently after it, and each branch's handler (environment) is its own from the fork on."""

import threading

import pytest
import torch

from turbogrpo.rollout import SamplingConfig
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.multiturn import ForkError, TurnLimits, generate_multiturn

from .conftest import random_prompts
from .test_multiturn import plain_logprobs

STOPS = tuple(range(0, 64, 3))  # about 1 draw in 3 ends a turn: turns end long before max_turn_tokens
SAMPLING = SamplingConfig(max_new_tokens=12, stop_token_ids=STOPS)
LIMITS = TurnLimits(max_turn_tokens=12, max_conversation_tokens=48, prefill_chunk=2)


class Counter:
    """A deterministic environment with state: reply t is ``[40 + t, 50 + len(turn)]``; the episode ends after
    ``num_turns`` turns. ``turns`` records what this conversation's environment saw."""

    def __init__(self, num_turns=3, end_at_first=False):
        self.num_turns, self.end_at_first, self.turns = num_turns, end_at_first, []

    def __call__(self, turn_ids):
        self.turns.append(list(turn_ids))
        if self.end_at_first or len(self.turns) >= self.num_turns:
            return None
        return [40 + len(self.turns), 50 + len(turn_ids)]


def branched(model, prompts, handlers, branching, seed=0, **kwargs):
    return generate_multiturn(model, prompts, handlers, num_samples=4, sampling=SAMPLING, limits=LIMITS, seed=seed,
                              reply_timing="next_step", branching=branching, **kwargs)


def test_branches_share_the_first_turn_and_reply_exactly_and_diverge_after(qwen2):
    prompts = random_prompts([5, 9])
    handlers = [Counter() for _ in range(4)]  # 2 prompts x 2 first conversations
    out = branched(qwen2, prompts, handlers, [2, 2])
    groups, forks = out.groups, out.handlers
    assert len(groups.completions) == 8 and groups.sizes == (4, 4)
    diverged = 0
    for first in range(0, 8, 2):  # slots first, first + 1: the two branches of one first conversation
        a, b = groups.completions[first], groups.completions[first + 1]
        turn = forks[first].turns[0]
        shared = len(turn) + 2  # the first turn, then the 2-id reply, both prefilled once
        assert forks[first + 1].turns[0] == turn and a[:shared].tolist() == b[:shared].tolist()
        assert a[len(turn):shared].tolist() == [41, 50 + len(turn)]
        torch.testing.assert_close(groups.sampler_logps[first][:shared], groups.sampler_logps[first + 1][:shared],
                                   rtol=0, atol=0)
        diverged += a[shared:].tolist() != b[shared:].tolist()
    assert diverged >= 3  # each branch draws its own tokens after the fork
    # The two first conversations of a prompt are independent samples (their first turns differ here).
    assert groups.completions[0][:3].tolist() != groups.completions[2][:3].tolist()
    for i, (ids, mask, logps) in enumerate(zip(groups.completions, groups.model_mask, groups.sampler_logps)):
        # Teacher-forced on the recorded ids: the sampler's log-prob of every model token after the copied
        # KV rows is the model's own; environment ids are masked with log-prob 0.
        reference = plain_logprobs(qwen2, prompts[i // 4], ids)
        torch.testing.assert_close(logps[mask], reference[mask], rtol=0, atol=1e-5)
        assert (logps[~mask] == 0).all() and mask.sum() > 0
    # Each branch's environment saw exactly its own conversation: its turns then its replies rebuild the ids.
    for i, fork in enumerate(forks):
        rebuilt = []
        for t, turn in enumerate(fork.turns):
            rebuilt += turn + ([40 + t + 1, 50 + len(turn)] if t + 1 < 3 else [])
        assert groups.completions[i].tolist()[:len(rebuilt)] == rebuilt


def test_forked_environments_are_independent(qwen2):
    handlers = [Counter() for _ in range(2)]
    out = branched(qwen2, random_prompts([6]), handlers, [2, 2])
    left, right = out.handlers[0], out.handlers[1]
    assert left is handlers[0] and right is not left and right.turns is not left.turns
    before = [list(t) for t in left.turns]
    right.turns.append([1, 2, 3])  # a fork's state change ...
    assert left.turns == before   # ... does not reach its sibling
    assert len(out.groups.completions[0]) != len(out.groups.completions[1]) or \
        out.groups.completions[0].tolist() != out.groups.completions[1].tolist()


def test_fork_method_is_used_where_the_handler_defines_one(qwen2):
    class Forking(Counter):
        forks = 0

        def fork(self):
            Forking.forks += 1
            child = Counter()
            child.turns = [list(t) for t in self.turns]
            return child

    out = branched(qwen2, random_prompts([6]), [Forking(), Forking()], [2, 2])
    assert Forking.forks == 2 + 2  # the probe before the rollout, then one fork per first conversation
    assert type(out.handlers[1]) is Counter and type(out.handlers[0]) is Forking


def test_a_conversation_ending_before_its_fork_fills_its_branches(qwen2):
    handlers = [Counter(end_at_first=True), Counter()]
    out = branched(qwen2, random_prompts([6]), handlers, [2, 2])
    ids = out.groups.completions
    assert ids[0].tolist() == ids[1].tolist() == out.handlers[0].turns[0]
    assert out.handlers[1] is not out.handlers[0] and out.groups.finish_reasons[0] == out.groups.finish_reasons[1]
    total = sum(int(m.sum()) for m in out.groups.model_mask)
    shared = len(ids[0]) + len(out.handlers[2].turns[0])  # the copy's tokens, and the forked pair's first turn
    assert out.stats.num_generated_tokens == total - shared


def test_seeded_branching_rollouts_are_reproducible(qwen2):
    prompts = random_prompts([5, 7])
    runs = [branched(qwen2, prompts, [Counter() for _ in range(4)], [2, 2], seed=3) for _ in range(2)]
    for a, b in zip(runs[0].groups.completions, runs[1].groups.completions):
        assert a.tolist() == b.tolist()
    for a, b in zip(runs[0].groups.sampler_logps, runs[1].groups.sampler_logps):
        assert torch.equal(a, b)


def test_three_level_branching_orders_conversations_lexicographically(qwen2):
    """[1, 2, 2]: one first conversation per prompt, forked after turns 1 and 2; slot 2 c1 + c2."""
    out = generate_multiturn(qwen2, random_prompts([5]), [Counter(num_turns=4)], num_samples=4, sampling=SAMPLING,
                             limits=TurnLimits(12, 60, prefill_chunk=3), seed=1, reply_timing="next_step",
                             branching=[1, 2, 2])
    turns = [h.turns for h in out.handlers]
    assert all(t[0] == turns[0][0] for t in turns)          # turn 1 is shared by all four
    assert turns[0][1] == turns[1][1] and turns[2][1] == turns[3][1]  # turn 2 by each pair
    assert turns[0][1] != turns[2][1]


def test_bad_branching_and_unforkable_handlers_are_refused_in_one_line(qwen2):
    prompts = random_prompts([4])
    with pytest.raises(ValueError, match=r"branching \[2, 3\] must be integers >= 1 whose product is num_samples=4"):
        branched(qwen2, prompts, [Counter()] * 2, [2, 3])
    with pytest.raises(ValueError, match="got 4 handlers for 1 prompts x 2 first conversations"):
        branched(qwen2, prompts, [Counter()] * 4, [2, 2])

    class Locked(Counter):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(ForkError, match=r"handler, but Locked cannot be forked \(TypeError.*give Locked a fork\(\)"):
        branched(qwen2, prompts, [Locked(), Locked()], [2, 2])


def test_cache_fork_copies_rows_in_group_order():
    cache = GroupedKVCache([3, 2], 2, capacity=4, device=torch.device("cpu"), row_capacity=6)
    cache.store_prompt(0, torch.zeros(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))
    new = torch.arange(4.0).view(4, 1, 1, 1)
    cache.write(0, new, -new, torch.zeros(4, 1, dtype=torch.long))
    cache.commit_all(1)
    cache.fork([1, 2, 1, 2])
    keys, values = cache.generated(0, 1)
    assert keys.flatten().tolist() == [0, 1, 1, 2, 3, 3] and values.flatten().tolist() == [0, -1, -1, -2, -3, -3]
    assert cache.layout.group_B.tolist() == [0, 0, 0, 1, 1, 1] and cache.lengths_B.tolist() == [1] * 6
    with pytest.raises(ValueError, match="row_capacity=6"):
        cache.fork([2] * 6)
