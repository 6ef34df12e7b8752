"""SamplingConfig validation, logit warping against Hugging Face's warpers, draws and log-probs."""

import re

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from turbogrpo.rollout import (SamplingConfig, draw_from_probs, sample_tokens, sample_with_logprobs, token_logprobs,
                              warp_logits)


@pytest.mark.parametrize("field, value, allowed", [
    ("max_new_tokens", 0, ">= 1"), ("max_new_tokens", 2.0, ">= 1"),
    ("temperature", -0.1, ">= 0"), ("temperature", float("nan"), ">= 0"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_k", -1, ">= 0"),
    ("stop_token_ids", (3, -2), "non-negative"),
    ("stop_strings", ("",), "non-empty"),
])
def test_bad_config_names_the_field(field, value, allowed):
    settings = {"max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(allowed)}"):
        SamplingConfig(**settings)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop_strings needs `tokenizer`"):
        SamplingConfig(max_new_tokens=4, stop_strings=["</answer>"])


def test_config_freezes_lists_and_stays_hashable():
    config = SamplingConfig(max_new_tokens=4, stop_token_ids=[1, 2])
    assert config.stop_token_ids == (1, 2)
    assert hash(config) == hash(SamplingConfig(max_new_tokens=4, stop_token_ids=(1, 2)))


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 7, 0.5), (0.5, 1, 1.0), (1.0, 0, 0.01)])
def test_warp_logits_matches_hugging_face_order_and_rules(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :4] = logits[0, 4]  # ties at the top-k boundary are kept, as in HF
    hf = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        hf.append(TopPLogitsWarper(top_p))
    expected = hf(None, logits.clone())
    ours = warp_logits(logits, SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_greedy_takes_the_argmax_and_stores_temperature_one_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]])
    greedy = SamplingConfig(max_new_tokens=1, temperature=0, top_k=1)
    tokens = sample_tokens(logits, greedy)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(token_logprobs(logits, tokens, greedy), logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_logprobs_use_the_full_vocabulary_at_the_temperature():
    """top-k/top-p pick the token; the stored log-prob is the trainer's full-vocab one."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    config = SamplingConfig(max_new_tokens=1, temperature=0.5, top_k=2, top_p=0.8)
    tokens = sample_tokens(logits, config, torch.Generator().manual_seed(0))
    expected = (logits / 0.5).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens, config), expected)


def test_draws_follow_the_warped_distribution_and_never_pick_removed_tokens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    config = SamplingConfig(max_new_tokens=1, temperature=0.8, top_k=4, top_p=0.9)
    probs = warp_logits(logits, config).softmax(-1)
    num_draws = 40_000
    draws = sample_tokens(logits.expand(num_draws, -1), config, torch.Generator().manual_seed(3))
    frequencies = torch.bincount(draws, minlength=6).double() / num_draws
    assert frequencies[probs == 0].sum() == 0
    # 5 standard errors of a binomial frequency at this sample size.
    tolerance = 5 * (probs.double() * (1 - probs.double()) / num_draws).sqrt() + 1e-9
    assert ((frequencies - probs.double()).abs() <= tolerance).all(), (frequencies, probs)


def test_seeded_draws_are_reproducible():
    logits = torch.randn(8, 30)
    config = SamplingConfig(max_new_tokens=1)
    first = sample_tokens(logits, config, torch.Generator().manual_seed(5))
    assert torch.equal(first, sample_tokens(logits, config, torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("config", [
    SamplingConfig(max_new_tokens=1), SamplingConfig(max_new_tokens=1, temperature=0.6, top_k=3),
    SamplingConfig(max_new_tokens=1, temperature=1.4, top_p=0.7), SamplingConfig(max_new_tokens=1, temperature=0)])
def test_fused_draw_matches_separate_draw_and_logprobs(config):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    num_draws = 40_000
    tokens, logprobs = sample_with_logprobs(logits.expand(num_draws, -1), config, torch.Generator().manual_seed(4))
    torch.testing.assert_close(logprobs, token_logprobs(logits.expand(num_draws, -1), tokens, config))
    probs = warp_logits(logits, config).softmax(-1) if not config.greedy else torch.nn.functional.one_hot(
        logits.argmax(), 6).float()
    frequencies = torch.bincount(tokens, minlength=6).double() / num_draws
    tolerance = 5 * (probs.double() * (1 - probs.double()) / num_draws).sqrt() + 1e-9
    assert ((frequencies - probs.double()).abs() <= tolerance).all(), (frequencies, probs)


def test_draw_from_probs_never_lands_on_zero_probability_tokens():
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    draws = draw_from_probs(probs.repeat(2000, 1), torch.Generator().manual_seed(0)).view(2000, 3)
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {4} and set(draws[:, 2].tolist()) == {0}
    assert abs((draws[:, 0] == 1).float().mean().item() - 2 / 3) < 0.05


def test_the_rollout_section_builds_the_sampling_and_shares_its_rules():
    from turbogrpo.config import ConfigError, RolloutConfig, load_config
    rollout = RolloutConfig(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5)
    assert SamplingConfig.from_rollout(rollout, (2,), None) == SamplingConfig(7, 0.7, 0.9, 5, (2,))
    assert SamplingConfig.from_rollout(rollout, (2,), None, greedy=True).greedy
    # One rule set: the config names its key, SamplingConfig its field, with the same allowed values.
    for key, value in [("top_k", -1), ("top_p", 1.5), ("max_new_tokens", 0)]:
        with pytest.raises(ConfigError, match=rf"config key 'rollout.{key}'.*expected (an integer|a number)"):
            load_config(None, [f"rollout.{key}={value}"])
        with pytest.raises(ValueError, match=rf"^{key} must be (an integer|a number)"):
            SamplingConfig(**{"max_new_tokens": 4, key: value})
    with pytest.raises(ConfigError, match="config key 'rollout.stop_strings'.*non-empty strings"):
        load_config(None, ['rollout.stop_strings=[""]'])


def test_large_vocabulary_draws_search_in_blocks_and_match_one_cumsum():
    """Vocabularies of 4096+ entries are searched block by block (49,152 = 48 x 1024): the draws equal
    one cumsum's, never land on a zero-probability entry (a sparse top-k row, uniforms at 0 and just
    below 1, a block whose tail is zero), and follow the distribution."""
    from turbogrpo.rollout.sampling import _cdf_block, _invert_cdf
    assert _cdf_block(49_152) == 1024 and _cdf_block(151_936) == 128 and _cdf_block(50_257) is None
    generator = torch.Generator().manual_seed(0)
    probs = torch.randn(64, 49_152, generator=generator).mul(3).softmax(-1)
    uniform = torch.rand(64, generator=generator)
    one_cumsum = _invert_cdf(probs, uniform=uniform.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(draw_from_probs(probs, uniform=uniform), one_cumsum)
    # A top-k-like row: mass on a few entries, each the last positive one of its block or followed by zeros.
    sparse = torch.zeros(49_152)
    support = torch.tensor([5, 1023, 1024, 30_000, 49_151])
    sparse[support] = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    edges = torch.tensor([0.0, 1 - 2 ** -24, 0.1, 0.1 + 1e-7, 0.4, 0.4 - 1e-7, 0.6, 0.85, 0.85 + 1e-7])
    uniforms = torch.cat([edges, torch.rand(20_000, generator=generator)])
    draws = draw_from_probs(sparse.expand(len(uniforms), -1), uniform=uniforms)
    assert set(draws.tolist()) <= set(support.tolist())
    frequencies = torch.bincount(draws, minlength=49_152)[support].double() / len(uniforms)
    expected = sparse[support].double()
    assert ((frequencies - expected).abs() <= 5 * (expected * (1 - expected) / len(uniforms)).sqrt()).all()
    # Leading dims are kept ([B, n, V], as trees ask), and NaN rows still give an id in the vocabulary.
    assert draw_from_probs(probs.view(8, 8, -1), uniform=uniform.view(8, 8)).shape == (8, 8)
    assert 0 <= int(draw_from_probs(torch.full((1, 49_152), float("nan")), uniform=torch.rand(1))) < 49_152
