"""The turn-at-a-time multi-turn driver (``rollout.turnwise``, what the vLLM engine runs conversations with),
without vLLM: a ``TurnSampler`` that decodes each request greedily with ``rollout.generate`` from its whole
context gives the native engine's greedy conversations, limits, forks and failures exactly (float64)."""

import pytest
import torch

from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
from turbogrpo.rollout.turnwise import SampledTurn, generate_multiturn_turnwise

from .conftest import build_model, random_prompts
from .test_branching import Counter

STOPS = tuple(range(0, 64, 3))  # about 1 draw in 3 ends a turn
GREEDY = SamplingConfig(max_new_tokens=12, temperature=0.0, stop_token_ids=STOPS)
LIMITS = TurnLimits(max_turn_tokens=6, max_conversation_tokens=30)  # turns and conversations are cut too


@pytest.fixture(scope="module")
def model():
    return build_model("qwen2").double()


def native_sampler(model, requests_seen):
    """A ``TurnSampler`` recomputing each request's context (no cache: every id is prefilled)."""
    def sample_turns(requests):
        requests_seen.append(requests)
        turns = []
        for r in requests:
            sampling = SamplingConfig(max_new_tokens=r.max_tokens, temperature=0.0, stop_token_ids=STOPS)
            out = generate(model, [torch.tensor(r.ids)], num_samples=1, sampling=sampling, seed=0)
            turns.append(SampledTurn(out.tokens[0].tolist(), out.logprobs[0].tolist(), len(r.ids)))
        return turns
    return sample_turns


class Failing(Counter):
    def __call__(self, turn_ids):
        raise RuntimeError("environment down")


@pytest.mark.parametrize("branching", [(), (2, 2)], ids=["unbranched", "forked"])
def test_turnwise_conversations_equal_the_native_engines(model, branching):
    prompts = random_prompts([5, 9, 7])
    first = 4 if not branching else 2

    def handlers():  # conversation 1 of each prompt's first ones fails; the others answer as Counter
        return [Failing() if j % first == 1 else Counter() for j in range(3 * first)]
    seen = []
    ours = generate_multiturn_turnwise(model, prompts, handlers(), native_sampler(model, seen), num_samples=4,
                                       sampling=GREEDY, limits=LIMITS, reply_timing="next_step", branching=branching)
    native = generate_multiturn(model, prompts, handlers(), num_samples=4, sampling=GREEDY, limits=LIMITS, seed=0,
                                reply_timing="next_step", branching=branching)
    a, b = ours.groups, native.groups
    assert [c.tolist() for c in a.completions] == [c.tolist() for c in b.completions]
    assert a.finish_reasons == b.finish_reasons and {"stop", "length"} <= set(a.finish_reasons)
    assert ours.num_turns == native.num_turns and max(ours.num_turns) >= 3
    assert ours.errors == native.errors and "RuntimeError: environment down" in ours.errors
    for x, y, mx, my in zip(a.sampler_logps, b.sampler_logps, a.model_mask, b.model_mask):
        assert torch.equal(mx, my) and (x[~mx] == 0).all()
        torch.testing.assert_close(x, y, rtol=0, atol=1e-10)
    assert ours.stats.num_generated_tokens == native.stats.num_generated_tokens
    assert ours.stats.num_env_tokens == native.stats.num_env_tokens > 0
    # One engine call per round, each conversation's request carrying its whole recorded context.
    assert ours.stats.num_forwards == len(seen) and ours.stats.live_batch_sizes == [len(r) for r in seen]
    assert len(seen[0]) == 3 * first and all(r.ids[:len(prompts[r.conversation // 4])] ==
                                             prompts[r.conversation // 4].tolist() for rs in seen for r in rs)
    later = [r for rs in seen for r in rs if r.turn > 0]
    assert ours.stats.turn_prefill_tokens == [len(r.ids) for r in later]  # this sampler caches nothing
    assert sum(native.stats.turn_prefill_tokens) == native.stats.num_env_tokens + len(native.stats.turn_prefill_tokens)
    if branching:  # a fork's branches each send a request; natively they share one prefill
        assert len(later) > len(native.stats.turn_prefill_tokens)
        assert any(r.conversation % 2 for r in later)  # (odd slots: the forked branches)
