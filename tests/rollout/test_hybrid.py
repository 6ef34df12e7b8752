"""The native rollout engine on hybrid models (linear attention, short convolutions, Mamba-2): its state cache
(``turbogrpo.rollout.states``) against the trainer's forward, HF ``generate`` and the model's own distribution, in
single-turn, multi-turn and branching rollouts."""

import pytest
import torch

from tests.mixers.conftest import FAMILIES as ALL_FAMILIES, build_hybrid, float64_throughout  # noqa: F401 (a fixture)
from tests.rollout.conftest import forbid_host_syncs_inside, random_prompts
from tests.rollout.test_branching import Counter
from tests.rollout.test_distribution import CONFIGS as DISTRIBUTION_CONFIGS, P_VALUE_FLOOR, VOCAB as SMALL_VOCAB, \
    sampler_p_value
from tests.rollout.test_multiturn import Scripted, plain_logprobs
from turbogrpo import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.rollout.multiturn import TurnLimits, generate_multiturn
from turbogrpo.rollout.states import RECURRENT_MAX_TOKENS
from turbogrpo.rollout.step import PlainStep

VOCAB = 64
# Gated DeltaNet (dense, MoE, fused projections), short convolutions, Mamba-2 (three mixers of it).
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "nemotron_h", "granitemoehybrid", "falcon_h1"]
STOPS = list(range(0, VOCAB, 7))   # completions end at different steps: rows retire while their siblings decode
SAMPLING = SamplingConfig(max_new_tokens=10, stop_token_ids=STOPS)
# Prompts longer than RECURRENT_MAX_TOKENS (the prefill's chunked form) and than a Mamba-2 chunk (16 here).
PROMPT_LENGTHS = [3, 19, 6]


def hybrid(model_type, dtype, **overrides):
    return build_hybrid(model_type, dtype, vocab_size=VOCAB, **overrides)


def assert_sampler_matches_the_trainer(model, rollout, atol):
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompts, rollout.tokens_per_group(),
                                      temperature=SAMPLING.logprob_temperature)
    for ours, theirs in zip(rollout.logprobs_per_group(), trainer):
        torch.testing.assert_close(torch.cat(ours).double(), torch.cat(theirs).double(), rtol=0, atol=atol)


@pytest.mark.parametrize("model_type", sorted(ALL_FAMILIES))
def test_sampler_logprobs_equal_the_trainers_in_float64(model_type, float64_throughout):
    """Every kernel in float64 (as tests/mixers patches them): the prefill's chunked states, copied to each sample,
    then the recurrent decoding, equal the training forward's shared prefix to float64 rounding."""
    model = hybrid(model_type, torch.float64)
    rollout = generate(model, random_prompts(PROMPT_LENGTHS, seed=2), num_samples=3, sampling=SAMPLING, seed=7)
    assert min(map(len, rollout.tokens_per_group()[0])) < SAMPLING.max_new_tokens   # some rows retired early
    assert_sampler_matches_the_trainer(model, rollout, atol=1e-10)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_sampler_logprobs_equal_the_trainers_in_float32_as_shipped(model_type):
    """Under the CPU's schedule and a GPU's (host checks every 4 steps, finished rows kept in the batch until their
    power-of-two bucket empties: their states go on advancing, unread)."""
    model = hybrid(model_type, torch.float32)
    for schedule in (DecodeSchedule(1, "exact"), DecodeSchedule(4, "pow2")):
        rollout = generate(model, random_prompts(PROMPT_LENGTHS, seed=3), num_samples=3, sampling=SAMPLING, seed=8,
                           schedule=schedule)
        assert_sampler_matches_the_trainer(model, rollout, atol=2e-4)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "granitemoehybrid", "falcon_h1"])
def test_greedy_equals_hf_generate(model_type):
    # Without LFM2's convolution bias: HF's cached LFM2 step disagrees with HF's own forward where it has one
    # (transformers 5.19; greedy from a 6-token prompt picks a token the full forward does not), and so does its
    # cached Nemotron-H (from some 6- and 7-token prompts, by logit gaps of 0.02-0.9 in float64 as in float32). The
    # engine follows the model's own forward there (the next test, and the log-prob parity tests above).
    model = hybrid(model_type, torch.float32, **(dict(conv_bias=False) if model_type == "lfm2" else {}))
    model.generation_config.eos_token_id = None   # HF would stop (or hold back) at the config's EOS; we do not
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    rollout = generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=12, temperature=0))
    for prompt, completions in zip(prompts, rollout.tokens_per_group()):
        expected = model.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert all(c.tolist() == expected.tolist() for c in completions)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_follows_the_models_own_forward(model_type):
    """Each greedy token is the argmax of the model's own (uncached) forward over the prompt and the tokens before."""
    model = hybrid(model_type, torch.float32)
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    rollout = generate(model, prompts, num_samples=1, sampling=SamplingConfig(max_new_tokens=12, temperature=0))
    for prompt, (completion,) in zip(prompts, rollout.tokens_per_group()):
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1:-1]
        assert completion.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_first_two_tokens_follow_the_models_own_distribution(model_type):
    """tests/rollout/test_distribution.py's chi-square test (the exact joint law of the first two tokens from the
    model's own forward, HF's warpers) on a hybrid: the first draw reads the prefill, the second the first
    recurrent step from each sample's copy of its prompt's states."""
    model = build_hybrid(model_type, torch.float32, seed=3, vocab_size=SMALL_VOCAB, initializer_range=0.2)
    prompts = random_prompts([4, 7], vocab_size=SMALL_VOCAB, seed=5)
    assert sampler_p_value(model, prompts, DISTRIBUTION_CONFIGS["temperature 0.7, top-p 0.9"]) > P_VALUE_FLOOR


def test_a_sample_decoding_from_its_prompts_states_without_the_copy_fails_the_chi_square(monkeypatch):
    """The test has the power to see a state that does not reach the samples: decoding from the zero state (as if
    the prefill kept nothing) fails it."""
    from turbogrpo.rollout import states
    monkeypatch.setattr(states.RecurrentStates, "_allocate",
                        lambda self, state_G, group_B: state_G.new_zeros(self.row_capacity, *state_G.shape[1:]))
    model = build_hybrid("qwen3_5_text", torch.float32, seed=3, vocab_size=SMALL_VOCAB, initializer_range=0.2)
    prompts = random_prompts([4, 7], vocab_size=SMALL_VOCAB, seed=5)
    assert sampler_p_value(model, prompts, DISTRIBUTION_CONFIGS["temperature 1"]) < 1e-9


def test_the_plain_step_never_syncs_with_the_host_on_a_hybrid(monkeypatch):
    model = hybrid("qwen3_5_text", torch.float32)
    forbid_host_syncs_inside(monkeypatch, (PlainStep, "__call__"))
    for schedule in (DecodeSchedule(1, "exact"), DecodeSchedule(4, "pow2")):
        rollout = generate(model, random_prompts([5, 9]), num_samples=3, seed=1, sampling=SAMPLING, schedule=schedule)
        assert rollout.stats.num_forwards > 3


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_multiturn_replies_go_through_the_recurrence(model_type, float64_throughout):
    """Replies are fed in ragged chunks (rows feeding fewer ids than the step's width, rows feeding none while
    others decode; chunks longer than RECURRENT_MAX_TOKENS run the chunked form): every model token's sampler
    log-prob equals a plain forward of the whole conversation."""
    model = hybrid(model_type, torch.float64)
    prompts = random_prompts([5, 9])
    replies = [[[30 + i, 31, 32, 33, 34, 35, 36][:1 + i % 7], [40 + i] * (1 + i % 3)] for i in range(6)]
    handlers = [Scripted(r) for r in replies]
    limits = TurnLimits(12, 60, prefill_chunk=RECURRENT_MAX_TOKENS + 2)
    out = generate_multiturn(model, prompts, handlers, num_samples=3, sampling=SAMPLING, limits=limits, seed=0)
    groups = out.groups
    assert sum(bool((~mask).any()) for mask in groups.model_mask) >= 3   # conversations with replies fed
    for i, (ids, mask, logps) in enumerate(zip(groups.completions, groups.model_mask, groups.sampler_logps)):
        reference = plain_logprobs(model, prompts[i // 3], ids)
        torch.testing.assert_close(logps[mask].double(), reference[mask].double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_branches_fork_the_states_exactly(model_type, float64_throughout):
    """A fork copies each row's states: the branches share the first turn and reply, then each continues from its
    own copy, matching a plain forward of its own conversation."""
    model = hybrid(model_type, torch.float64)
    prompts = random_prompts([5, 9])
    handlers = [Counter() for _ in range(4)]
    out = generate_multiturn(model, prompts, handlers, num_samples=4, sampling=SAMPLING,
                             limits=TurnLimits(max_turn_tokens=12, max_conversation_tokens=48, prefill_chunk=2),
                             seed=0, reply_timing="next_step", branching=[2, 2])
    groups = out.groups
    assert len(groups.completions) == 8
    diverged = 0
    for first in range(0, 8, 2):
        a, b = groups.completions[first], groups.completions[first + 1]
        shared = len(out.handlers[first].turns[0]) + 2
        assert a[:shared].tolist() == b[:shared].tolist()
        diverged += a[shared:].tolist() != b[shared:].tolist()
    assert diverged >= 2
    for i, (ids, mask, logps) in enumerate(zip(groups.completions, groups.model_mask, groups.sampler_logps)):
        reference = plain_logprobs(model, prompts[i // 4], ids)
        torch.testing.assert_close(logps[mask].double(), reference[mask].double(), rtol=0, atol=1e-6)


def test_a_runner_that_traces_the_step_whole_is_refused_in_one_line():
    model = hybrid("lfm2", torch.float32)
    with pytest.raises(ValueError, match=r"^DecodeSchedule.runner='dynamo' traces the decoding step whole, but model "
                                         r"type 'lfm2' has gated short convolutions and full attention, whose units "
                                         r"run eagerly: use runner='eager'$"):
        generate(model, random_prompts([4]), num_samples=2, sampling=SAMPLING, schedule=DecodeSchedule(runner="dynamo"))
