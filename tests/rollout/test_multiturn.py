"""The multi-turn engine: replies prefilled into each conversation's cache, masks, limits, failures."""

import threading

import pytest
import torch

from turbogrpo.rollout import SamplingConfig
from turbogrpo.rollout.multiturn import FEED_WIDTHS, TurnLimits, bounded_feed, generate_multiturn

from .conftest import build_model, random_prompts

STOPS = (5, 6, 7, 8)  # end-of-turn ids: about 1 draw in 16 ends a turn with the 64-token vocabulary


class Scripted:
    """Answers turn t with ``replies[t]`` (ids), then ends the conversation; records the turns it saw."""

    def __init__(self, replies):
        self.replies, self.turns = list(replies), []

    def __call__(self, turn_ids):
        self.turns.append(list(turn_ids))
        return self.replies[len(self.turns) - 1] if len(self.turns) <= len(self.replies) else None


def plain_logprobs(model, prompt, completion):
    """log_softmax of a plain forward over prompt + completion (no cache): what the sampler must match."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]


def run(model, prompts, handlers, num_samples, limits=TurnLimits(12, 60, prefill_chunk=3), **kwargs):
    return generate_multiturn(model, prompts, handlers, num_samples=num_samples,
                              sampling=SamplingConfig(max_new_tokens=12, stop_token_ids=STOPS), limits=limits,
                              seed=0, **kwargs)


@pytest.mark.parametrize("feed_width", sorted(FEED_WIDTHS))
def test_replies_are_recorded_masked_and_the_model_tokens_match_a_plain_forward(qwen2, feed_width):
    """Env ids sit between model turns with mask 0; every model token's sampler log-prob equals a plain
    forward of the whole conversation, so the cache after a reply (chunked prefill, batched with rows that
    decode, at either width policy) is exactly that conversation's."""
    prompts = random_prompts([5, 9])
    replies = [[[30 + i, 31, 32, 33, 34][:1 + i % 5], [40 + i] * (1 + i % 3)] for i in range(6)]
    handlers = [Scripted(r) for r in replies]
    out = run(qwen2, prompts, handlers, num_samples=3,
              limits=TurnLimits(12, 60, prefill_chunk=3, feed_width=feed_width))
    groups = out.groups
    assert out.stats.num_env_tokens == sum(int((~m).sum()) for m in groups.model_mask) > 0
    for i, (handler, ids, mask, logps) in enumerate(zip(handlers, groups.completions, groups.model_mask,
                                                        groups.sampler_logps)):
        # Rebuild the conversation from what the handler saw and answered: model turns and replies alternate.
        expected_ids, expected_mask = [], []
        for t, turn in enumerate(handler.turns):
            expected_ids += turn
            expected_mask += [True] * len(turn)
            if t < len(replies[i]):
                expected_ids += replies[i][t]
                expected_mask += [False] * len(replies[i][t])
        n = len(expected_ids)
        assert ids[:n].tolist() == expected_ids and mask[:n].tolist() == expected_mask
        assert mask[n:].all()  # a last turn cut by a limit has no handler call
        assert (logps[~mask] == 0).all()
        reference = plain_logprobs(qwen2, prompts[i // 3], ids)
        torch.testing.assert_close(logps[mask], reference[mask], rtol=0, atol=1e-5)
    assert sum(out.num_turns) == out.stats.num_turns


def test_bounded_feed_width_keeps_padding_at_most_half_of_a_step():
    assert bounded_feed([1] * 63 + [9]) == 2         # 64 rows: 128 slots for 65 ids, not 576 for 72
    assert bounded_feed([1] * 8 + [9] * 8) == 9      # half the rows feed replies: they go in at once
    assert bounded_feed([0] * 7 + [5]) == 1          # one row feeds among waiting ones: no width pays
    assert bounded_feed([4, 4, 0]) == 4 and bounded_feed([1]) == 1
    for counts in ([1] * 63 + [9], [3, 0, 0, 7, 1], [2] * 5):
        width = bounded_feed(counts)
        assert width == 1 or len(counts) * width <= 2 * sum(min(c, width) for c in counts)
        assert width == max(counts) or len(counts) * (width + 1) > 2 * sum(min(c, width + 1) for c in counts)


def test_handler_failures_end_only_their_conversation(qwen2):
    def raising(turn_ids):
        raise RuntimeError("tool server down")

    handlers = [Scripted([[20, 21]]), raising, lambda ids: "not ids", Scripted([[22]])]
    # Every id ends a turn, so each handler is called after the first draw.
    out = generate_multiturn(qwen2, random_prompts([6, 7]), handlers, num_samples=2,
                             sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=tuple(range(64))),
                             limits=TurnLimits(4, 20), seed=0)
    assert out.errors[1] == "RuntimeError: tool server down"
    assert "must return a list of token ids or None" in out.errors[2]
    assert out.errors[0] is None and out.errors[3] is None
    assert [len(c) for c in out.groups.completions[1:3]] == [1, 1]  # what they had is kept
    assert out.groups.model_mask[0].tolist() == [True, False, False, True]
    assert out.groups.model_mask[3].tolist() == [True, False, True]


@pytest.mark.parametrize("bad_id", [64, 10_000, -1])
def test_a_reply_id_outside_the_vocabulary_fails_its_conversation_in_one_line(qwen2, bad_id):
    """(The embedding lookup would otherwise abort the whole rollout with a bare IndexError.)"""
    handlers = [Scripted([[20, 21]]), Scripted([[20, bad_id]]), Scripted([[22]]), Scripted([[23]])]
    out = generate_multiturn(qwen2, random_prompts([6, 7]), handlers, num_samples=2,
                             sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=tuple(range(64))),
                             limits=TurnLimits(4, 20), seed=0)
    assert out.errors == [None, f"ValueError: the TurnHandler returned token id {bad_id}, outside the model's "
                                "vocabulary [0, 64)", None, None]
    assert len(out.groups.completions[1]) == 1 and out.groups.model_mask[0].tolist() == [True, False, False, True]


def test_a_never_ending_environment_is_stopped_by_the_conversation_limit(qwen2):
    limits = TurnLimits(max_turn_tokens=12, max_conversation_tokens=40, prefill_chunk=4)
    out = run(qwen2, random_prompts([4]), [lambda ids: [50, 51, 52]] * 4, num_samples=4, limits=limits)
    for ids, mask, reason in zip(out.groups.completions, out.groups.model_mask, out.groups.finish_reasons):
        assert reason == "length" and len(ids) <= 40


def test_a_reply_that_does_not_fit_is_dropped_whole(qwen2):
    """Never cut mid-reply: the conversation ends right after the model's end-of-turn token."""
    limits = TurnLimits(max_turn_tokens=30, max_conversation_tokens=34, prefill_chunk=8)
    handlers = [Scripted([[60] * 30]) for _ in range(8)]
    out = run(qwen2, random_prompts([4]), handlers, num_samples=8, limits=limits)
    assert any(h.turns and len(h.turns[0]) > 3 for h in handlers)  # the case under test happened
    for handler, ids, mask, reason in zip(handlers, out.groups.completions, out.groups.model_mask,
                                          out.groups.finish_reasons):
        if handler.turns and len(handler.turns[0]) + 30 + 1 > 34:  # no room for the reply and one more token
            assert reason == "length" and mask.all() and ids.tolist() == handler.turns[0]
            assert ids[-1].item() in STOPS
        elif handler.turns:  # it fits: taken whole
            assert ids.tolist()[len(handler.turns[0]):][:30] == [60] * 30


def test_turn_limit_truncates_the_conversation(qwen2):
    limits = TurnLimits(max_turn_tokens=3, max_conversation_tokens=50)
    out = generate_multiturn(qwen2, random_prompts([5]), [Scripted([[9, 9]])] * 6, num_samples=6,
                             sampling=SamplingConfig(max_new_tokens=3, stop_token_ids=(63,)), limits=limits, seed=1)
    for ids, reason in zip(out.groups.completions, out.groups.finish_reasons):
        assert (reason == "length") == (ids[-1].item() != 63)
        assert len(ids) <= 3 + 2 + 3


def test_environments_run_while_other_conversations_decode(qwen2):
    """Conversation 0's environment blocks until conversation 1 has had two replies: a loop that ran
    handlers one at a time, in its own thread, would never get there."""
    released = threading.Event()
    seen = []

    def blocking(ids):
        seen.append("0")
        return [20] if released.wait(timeout=20) else None

    def counting(ids):
        seen.append("1")
        if seen.count("1") == 2:
            released.set()
        return [21] if seen.count("1") <= 4 else None

    out = generate_multiturn(qwen2, random_prompts([5]), [blocking, counting], num_samples=2,
                             sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=tuple(range(64))),
                             limits=TurnLimits(4, 60), seed=0)
    assert released.is_set() and seen[0] == "0"
    assert out.groups.completions[0].tolist()[1] == 20  # the blocked conversation got its reply in the end


def test_bad_settings_are_refused_in_one_line(qwen2):
    prompts, sampling = random_prompts([4]), SamplingConfig(max_new_tokens=4, stop_token_ids=STOPS)
    with pytest.raises(ValueError, match="draft must be a turbogrpo.speculative.Speculation"):
        generate_multiturn(qwen2, prompts, [None] * 2, num_samples=2, sampling=sampling, limits=TurnLimits(4, 8),
                           draft=object())
    with pytest.raises(ValueError, match="stop_token_ids"):
        generate_multiturn(qwen2, prompts, [None] * 2, num_samples=2, sampling=SamplingConfig(max_new_tokens=4),
                           limits=TurnLimits(4, 8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate_multiturn(qwen2, prompts, [None] * 2, num_samples=2, sampling=sampling, limits=TurnLimits(4, 500))
    with pytest.raises(ValueError, match="TurnLimits.prefill_chunk"):
        TurnLimits(4, 8, prefill_chunk=0)
    with pytest.raises(ValueError, match="TurnLimits.feed_width must be one of \\['bounded', 'widest'\\]"):
        TurnLimits(4, 8, feed_width="narrow")


def test_the_rollout_runs_under_the_schedules_linear_kernel(qwen2, monkeypatch):
    """The weight matmuls run inside the schedule's LINEAR_KERNELS entry, entered once over the model (as
    generate() runs them), whatever the schedule's runner."""
    import contextlib

    from turbogrpo.linears import LINEAR_KERNELS
    from turbogrpo.rollout.decode import DecodeSchedule

    entered, calls_inside, inside = [], [], [False]

    @contextlib.contextmanager
    def recording(roots):
        entered.append(list(roots))
        inside[0] = True
        try:
            yield 0
        finally:
            inside[0] = False

    hooks = [m.register_forward_hook(lambda *_: calls_inside.append(inside[0]))
             for m in qwen2.modules() if isinstance(m, torch.nn.Linear)]
    monkeypatch.setitem(LINEAR_KERNELS, "recording", recording)
    try:
        run(qwen2, random_prompts([5, 3]), [Scripted([[9, 9, 9]]) for _ in range(4)], 2,
            schedule=DecodeSchedule(linears="recording", runner="compiled"))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(entered) == 1 and entered[0] == [qwen2]
    assert calls_inside and all(calls_inside)


def test_next_step_replies_make_the_rollout_follow_from_the_seed(qwen2):
    """Environments that answer after random delays: with reply_timing "next_step" every reply rejoins one
    forward after its turn, so two runs draw the same ids whatever the threads' timing."""
    import random
    import time

    def delayed(seed):
        rng = random.Random(seed)

        def handler(ids):
            time.sleep(rng.random() * 0.004)
            return [9, 10] if len(ids) < 6 else None
        return handler

    outs = [run(qwen2, random_prompts([5, 3]), [delayed(i * 10 + r) for i in range(6)], 3, reply_timing="next_step")
            for r in range(2)]
    assert outs[0].stats.num_env_tokens > 0
    for a, b in zip(outs[0].groups.completions, outs[1].groups.completions):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="reply_timing must be one of"):
        run(qwen2, random_prompts([5]), [delayed(0)] * 2, 2, reply_timing="soon")

