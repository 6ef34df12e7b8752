"""Speculative decoding inside multi-turn rollouts: lossless across turns, exact at stops and limits, and the
drafts see the environment's replies."""

import pytest
import torch

from turbogrpo.rollout import SamplingConfig
from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
from turbogrpo.speculative import history as history_module
from turbogrpo.speculative import DraftHead, HistoryDrafts, HistoryStore, Speculation
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile

from tests.rollout.test_multiturn import Scripted
from tests.speculative.speculative_helpers import homogeneity_pvalue, trained_pair

# The trained pair's greedy text loops through "... 43, 9" and "... 43, 5": turns end inside long accepted runs.
STOPS = (5, 9)


def replies(num_conversations: int) -> list[list[list[int]]]:
    """Each conversation's environment: three replies of 1-4 ids (differing between conversations), then the end."""
    return [[[30 + i % 4, 31, 32][:1 + i % 3], [44 + i % 5] * (1 + i % 4), [50, 51]] for i in range(num_conversations)]


def run(policy, prompts, num_samples, *, draft=None, temperature=0.0, limits=TurnLimits(12, 80, prefill_chunk=3),
        seed=0, handlers=None, reply_timing="arrival"):
    handlers = handlers or [Scripted(r) for r in replies(len(prompts) * num_samples)]
    return generate_multiturn(policy, prompts, handlers, num_samples=num_samples, limits=limits, seed=seed,
                              sampling=SamplingConfig(max_new_tokens=12, temperature=temperature, stop_token_ids=STOPS),
                              draft=draft, reply_timing=reply_timing)


# The cost sizing's latency curves, fixed: measured ones make the chosen trees (and whether a stop falls inside
# an accepted run) depend on the machine's load while the test runs.
FIXED_PROFILE = LatencyProfile("test", LatencyCurve((1, 128), (1e-4, 1.2e-4)), LatencyCurve((1, 128), (2e-5, 3e-5)))


def speculations(draft):
    return {"history": lambda store: Speculation(None, sizing="fixed", history=HistoryDrafts(store=store)),
            "neural": lambda store: Speculation(draft, sizing="fixed"),
            "merged": lambda store: Speculation(draft, sizing="cost", history=HistoryDrafts(store=store),
                                                profile=FIXED_PROFILE)}


@pytest.mark.parametrize("kind, min_accepted", [("history", 3.0), ("neural", 1.5), ("merged", 3.0)])
def test_greedy_speculative_conversations_are_the_plain_ones(kind, min_accepted):
    """At temperature 0 every conversation (model turns, replies, masks, finish reasons) is the plain multi-turn
    rollout's, over several turns, with stop tokens inside accepted runs: KV committed past a stop would shift
    every later turn. A second rollout with the first one's history accepts long runs (measured: history 3.5,
    neural 1.8, merged 3.9 tokens per forward)."""
    policy, draft, prompts = trained_pair()
    limits = TurnLimits(12, 80, prefill_chunk=3)
    # Replies enter at the next step (not on arrival), so the forward counts compared below do not depend on
    # when the environment threads answer (under load a reply arriving later made both runs take 21 forwards).
    plain = run(policy, prompts, 2, limits=limits, reply_timing="next_step")
    assert max(plain.num_turns) >= 3 and min(plain.num_turns) >= 1
    store = HistoryStore()
    for repeat in range(2):
        out = run(policy, prompts, 2, draft=speculations(draft)[kind](store), limits=limits, reply_timing="next_step")
        for got, expected in zip(out.groups.completions, plain.groups.completions):
            assert got.tolist() == expected.tolist()
        for got, expected in zip(out.groups.model_mask, plain.groups.model_mask):
            assert torch.equal(got, expected)
        assert out.groups.finish_reasons == plain.groups.finish_reasons and out.num_turns == plain.num_turns
        assert out.stats.num_turns == plain.stats.num_turns and out.stats.num_env_tokens == plain.stats.num_env_tokens
        assert out.stats.num_cut_paths > 0  # stops (and limits) inside accepted runs
    assert out.stats.mean_accepted_length > min_accepted
    assert out.stats.num_forwards < plain.stats.num_forwards


def test_turn_and_conversation_limits_hold_exactly_mid_path():
    """Limits reached inside an accepted run cut it there, as plain decoding stops there."""
    policy, draft, prompts = trained_pair()
    store = HistoryStore()
    limits = TurnLimits(5, 23, prefill_chunk=2)
    plain = run(policy, prompts, 2, limits=limits)
    for _ in range(2):
        out = run(policy, prompts, 2, draft=speculations(draft)["merged"](store), limits=limits)
    assert [c.tolist() for c in out.groups.completions] == [c.tolist() for c in plain.groups.completions]
    assert out.groups.finish_reasons == plain.groups.finish_reasons
    assert "length" in out.groups.finish_reasons
    for ids, mask in zip(out.groups.completions, out.groups.model_mask):
        assert len(ids) <= limits.max_conversation_tokens
        runs = "".join("m" if m else "e" for m in mask.tolist()).split("e")
        assert max(len(r) for r in runs) <= limits.max_turn_tokens


def test_sampler_logprobs_are_the_teacher_forced_ones():
    """Sampled at T = 0.7 with drafts: every model token's log-prob is log_softmax(logits / T) of a plain forward
    over the whole conversation (replies included); environment ids have 0."""
    policy, draft, prompts = trained_pair()
    out = run(policy, prompts, 2, draft=speculations(draft)["merged"](HistoryStore()), temperature=0.7, seed=3)
    assert out.stats.num_env_tokens > 0 and out.stats.mean_accepted_length > 1.0
    for i, (ids, mask, logps) in enumerate(zip(out.groups.completions, out.groups.model_mask,
                                               out.groups.sampler_logps)):
        prompt = prompts[i // 2]
        with torch.no_grad():
            logits = policy(torch.cat([prompt, ids])[None]).logits[0, len(prompt) - 1:-1].float()
        reference = (logits / 0.7).log_softmax(-1).gather(-1, ids[:, None])[:, 0]
        torch.testing.assert_close(logps[mask], reference[mask], rtol=0, atol=2e-5)
        assert (logps[~mask] == 0).all()


def later_turn_openings(policy, prompt, draft, *, num_rollouts: int, num_samples: int) -> torch.Tensor:
    """``[M, 2]``: the first two model tokens of every conversation's second turn (after one reply)."""
    openings = []
    for seed in range(num_rollouts):
        out = run(policy, [prompt], num_samples, draft=draft, temperature=1.0, seed=seed, reply_timing="next_step",
                  handlers=[Scripted([[30, 31, 32]]) for _ in range(num_samples)])
        for ids, mask in zip(out.groups.completions, out.groups.model_mask):
            mask = mask.tolist()
            start = mask.index(False) + 3 if False in mask else len(mask)
            if len(ids) >= start + 2:
                openings.append(ids[start:start + 2])
    return torch.stack(openings)


def test_a_later_turn_has_plain_sampling_distribution():
    """Two-sample chi-square of the joint of the second turn's first two tokens (after an environment reply),
    speculative (neural + history drafts, siblings' replies in the corpus) against plain, at temperature 1:
    p > 1e-3, so a correct engine fails with probability 1e-3 (fixed seeds and "next_step" replies: the outcome
    is deterministic; p = 0.15 here, over 5 degrees of freedom)."""
    policy, draft, prompts = trained_pair()
    speculative = later_turn_openings(policy, prompts[2], Speculation(draft, sizing="fixed",
                                                                      history=HistoryDrafts(store=None)),
                                      num_rollouts=4, num_samples=100)
    plain = later_turn_openings(policy, prompts[2], None, num_rollouts=4, num_samples=100)
    assert len(speculative) > 250 and len(plain) > 250
    vocab = policy.config.vocab_size
    p_value = homogeneity_pvalue(*(torch.bincount(o[:, 0] * vocab + o[:, 1], minlength=vocab * vocab)
                                   for o in (speculative, plain)))
    assert p_value > 1e-3, f"speculative and plain later turns differ (chi-square p = {p_value:.2e})"


def test_history_drafts_see_the_replies(monkeypatch):
    """The corpus every history lookup reads holds each conversation's ids as recorded, replies included."""
    policy, draft, prompts = trained_pair()
    seen = []
    real = history_module.history_chains

    def watched(corpus, tokens_NT, lengths_N, *args, **kwargs):
        seen.append((tokens_NT.clone(), lengths_N.clone()))
        return real(corpus, tokens_NT, lengths_N, *args, **kwargs)

    monkeypatch.setattr(history_module, "history_chains", watched)
    out = run(policy, prompts, 2, draft=Speculation(None, sizing="fixed", history=HistoryDrafts(store=None)))
    checked = 0
    for i, (ids, mask) in enumerate(zip(out.groups.completions, out.groups.model_mask)):
        mask = mask.tolist()
        first_reply = mask.index(False) if False in mask else len(mask)
        first_reply_end = first_reply + mask[first_reply:].index(True) if True in mask[first_reply:] else 0
        for tokens_NT, lengths_N in seen:
            length = int(lengths_N[i])
            assert tokens_NT[i, :length].tolist() == ids[:length].tolist()
            checked += length >= first_reply_end > 0
    assert checked > 0  # lookups after a reply, whose corpus held it


def test_a_bare_draft_head_is_refused_in_one_line():
    policy, draft, prompts = trained_pair()
    with pytest.raises(ValueError, match="wrap a DraftHead as Speculation"):
        run(policy, prompts, 1, draft=DraftHead(policy))


def test_the_draft_reads_the_policys_features_of_the_replies(monkeypatch):
    """The output buffers the neural draft catches up from hold every conversation's ids, replies included,
    each with the policy's final hidden state at the id before it (a plain forward's, no cache)."""
    from turbogrpo.speculative import multiturn as speculative_multiturn

    policy, draft, prompts = trained_pair()
    states = []
    real = speculative_multiturn.first_draw

    def watched(*args, **kwargs):
        states.append(real(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(speculative_multiturn, "first_draw", watched)
    out = run(policy, prompts, 2, draft=Speculation(draft, sizing="fixed"), temperature=0.7, seed=1)
    outputs = states[0].outputs
    assert out.stats.num_env_tokens > 0
    for i, ids in enumerate(out.groups.completions):
        prompt = prompts[i // 2]
        assert outputs.tokens_NT[i, :len(ids)].tolist() == ids.tolist()
        with torch.no_grad():
            features = policy.model(torch.cat([prompt, ids])[None]).last_hidden_state[0, len(prompt) - 1:-1]
        torch.testing.assert_close(outputs.hidden_NTH[i, :len(ids)], features, rtol=0, atol=1e-4)


def test_an_eagle3_draft_is_refused_in_one_line():
    """Multi-turn feeds keep the final features only, not the policy layers an "eagle3" draft reads."""
    policy, _, prompts = trained_pair()
    with pytest.raises(ValueError, match="eagle3") as err:
        run(policy, prompts[:1], 1, draft=Speculation(DraftHead(policy, layout="eagle3"), sizing="fixed"))
    assert "\n" not in str(err.value)
