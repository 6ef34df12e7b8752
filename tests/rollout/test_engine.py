"""The plain rollout engine end to end: greedy parity with HF generate, stopping, stats, bad input."""

import functools
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from tests.rollout.conftest import VOCAB, build_model, random_prompts
from turbogrpo import completion_logprobs
from turbogrpo.rollout import SamplingConfig, generate, logprob_gap

PROMPT_LENGTHS = [3, 8, 13]


@functools.cache
def hf_greedy(model, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """HF generate's greedy completion (cached: several tests compare against the same runs)."""
    prompt = torch.tensor(prompt)
    out = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_greedy_equals_hf_generate_token_for_token(arch, num_samples, request):
    model = request.getfixturevalue(arch)
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    rollout = generate(model, prompts, num_samples=num_samples,
                       sampling=SamplingConfig(max_new_tokens=12, temperature=0))
    for prompt, completions in zip(prompts, rollout.tokens_per_group()):
        expected = hf_greedy(model, tuple(prompt.tolist()), 12)
        assert [c.tolist() for c in completions] == [expected] * num_samples
    assert rollout.finish_reasons == ["length"] * len(prompts) * num_samples
    assert rollout.stats.num_forwards == 12  # one prefill + 11 decoding steps (the 12th token needs none)
    assert rollout.stats.live_batch_sizes == [len(prompts) * num_samples] * 11
    assert rollout.stats.num_generated_tokens == 12 * len(prompts) * num_samples


def test_stop_tokens_end_each_completion_at_its_first_stop(qwen2):
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    free = generate(qwen2, prompts, num_samples=1, sampling=SamplingConfig(max_new_tokens=12, temperature=0))
    stop_id = free.tokens[0][4].item()
    stopped = generate(qwen2, prompts, num_samples=1,
                       sampling=SamplingConfig(max_new_tokens=12, temperature=0, stop_token_ids=[stop_id]))
    for unstopped, tokens, reason in zip(free.tokens, stopped.tokens, stopped.finish_reasons):
        hits = (unstopped == stop_id).nonzero().flatten().tolist()
        expected = unstopped[:hits[0] + 1] if hits else unstopped
        assert tokens.tolist() == expected.tolist()
        assert reason == ("stop" if hits else "length")
    assert stopped.finish_reasons[0] == "stop" and len(stopped.tokens[0]) <= 5


def test_sampled_completions_stop_where_they_should_and_finished_ones_leave_the_batch(qwen2):
    stop_ids = list(range(8))  # an eighth of the vocabulary: lengths vary a lot
    sampling = SamplingConfig(max_new_tokens=16, stop_token_ids=stop_ids)
    rollout = generate(qwen2, random_prompts([5, 9]), num_samples=6, sampling=sampling, seed=3, return_hidden=True)
    for tokens, logprobs, hidden, reason in zip(rollout.tokens, rollout.logprobs, rollout.hidden,
                                                rollout.finish_reasons):
        assert len(tokens) == len(logprobs) == len(hidden) >= 1
        assert not torch.isin(tokens[:-1], torch.tensor(stop_ids)).any()
        if reason == "stop":
            assert tokens[-1].item() in stop_ids
        else:
            assert len(tokens) == 16
        assert (logprobs <= 0).all()
    lengths = sorted(len(t) for t in rollout.tokens)
    # After the first token, step s runs exactly the completions longer than s tokens.
    assert rollout.stats.live_batch_sizes == [sum(n > s for n in lengths) for s in range(1, max(lengths))]
    assert rollout.stats.num_forwards == max(lengths)
    assert len(set(lengths)) > 3, "the test needs varied lengths"


def test_seeded_rollouts_are_reproducible_and_samples_differ(qwen2):
    prompts = random_prompts([4, 6])
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    first = generate(qwen2, prompts, num_samples=4, sampling=sampling, seed=11)
    second = generate(qwen2, prompts, num_samples=4, sampling=sampling, seed=11)
    assert [t.tolist() for t in first.tokens] == [t.tolist() for t in second.tokens]
    torch.testing.assert_close(torch.cat(first.logprobs), torch.cat(second.logprobs), rtol=0, atol=0)
    assert len({tuple(t.tolist()) for t in first.tokens}) == len(first.tokens)


def test_max_new_tokens_one_needs_only_the_prefill(qwen2):
    rollout = generate(qwen2, random_prompts([5]), num_samples=3, sampling=SamplingConfig(max_new_tokens=1), seed=0)
    assert [len(t) for t in rollout.tokens] == [1, 1, 1]
    assert rollout.stats.num_forwards == 1 and rollout.stats.live_batch_sizes == []


def test_per_completion_limits_cut_each_completion_where_asked(qwen2):
    prompts = random_prompts([5, 9])
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    full = generate(qwen2, prompts, num_samples=2, sampling=sampling)
    limits = [12, 1, 7, 3]
    cut = generate(qwen2, prompts, num_samples=2, sampling=sampling, max_new_tokens_per_completion=limits)
    assert [len(t) for t in cut.tokens] == limits
    for whole, part, n in zip(full.tokens, cut.tokens, limits):
        assert part.tolist() == whole[:n].tolist()  # greedy: a shorter limit gives a prefix
    assert cut.finish_reasons == ["length"] * 4
    assert cut.stats.live_batch_sizes == sorted(cut.stats.live_batch_sizes, reverse=True)


def piece_tokenizer() -> tuple[PreTrainedTokenizerFast, list[str]]:
    """A 63-piece tokenizer (one short string per id; the model's vocabulary is larger)."""
    pieces = list(string.ascii_lowercase) + [a + b for a in "abcde" for b in "xyz"] + \
        ["<", ">", "/", "</", "an", "er>", " ", "\n", ".", ",", "!", "?", "the", "ing"] + list("12345678")
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="a"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend), pieces


def test_stop_strings_across_token_boundaries(qwen2):
    tokenizer, pieces = piece_tokenizer()
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    free = generate(qwen2, prompts, num_samples=1, sampling=SamplingConfig(max_new_tokens=12, temperature=0))
    texts = [[pieces[t] if t < len(pieces) else "" for t in c.tolist()] for c in free.tokens]
    # A stop string spanning tokens 3-5 of the first completion (not just one token's text).
    span = "".join(texts[0][3:6])
    stop = span[len(texts[0][3]) - 1: len(texts[0][3]) + len(texts[0][4]) + 1]
    sampling = SamplingConfig(max_new_tokens=12, temperature=0, stop_strings=[stop], tokenizer=tokenizer)
    stopped = generate(qwen2, prompts, num_samples=1, sampling=sampling)
    for pieces_of, tokens, reason in zip(texts, stopped.tokens, stopped.finish_reasons):
        first_end = next((j for j in range(len(pieces_of)) if stop in "".join(pieces_of[:j + 1])), None)
        assert len(tokens) == (first_end + 1 if first_end is not None else 12)
        assert reason == ("stop" if first_end is not None else "length")
    assert stopped.finish_reasons[0] == "stop" and len(stopped.tokens[0]) <= 6


VALID_CALL = dict(prompts=[torch.tensor([1, 2])], num_samples=2, sampling=SamplingConfig(max_new_tokens=10))
BAD_INPUTS = {  # case: (arguments replacing VALID_CALL's, expected message)
    "no prompts": (dict(prompts=[]), "prompts must be a non-empty list"),
    "empty prompt": (dict(prompts=[torch.tensor([], dtype=torch.long)]), r"prompts\[0\] is empty"),
    "2-D prompt": (dict(prompts=[torch.tensor([1]), torch.ones(2, 2, dtype=torch.long)]),
                   r"prompts\[1\] must be a 1-D integer tensor"),
    "float prompt": (dict(prompts=[torch.tensor([1.0])]), r"prompts\[0\] must be a 1-D integer tensor"),
    "token outside vocabulary": (dict(prompts=[torch.tensor([1, VOCAB])]), r"allowed is \[0, 64\)"),
    "num_samples 0": (dict(num_samples=0), "num_samples must be an integer >= 1"),
    "beyond max positions": (dict(prompts=[torch.arange(120) % VOCAB]), "max_position_embeddings=128"),
    "draft": (dict(draft=object()), "draft"),
    "limits of the wrong length": (dict(max_new_tokens_per_completion=[2]), "one per completion"),
    "limit above max_new_tokens": (dict(max_new_tokens_per_completion=[2, 99]), r"\[1, sampling.max_new_tokens"),
    "sampling not a config": (dict(sampling={"max_new_tokens": 3}), "sampling must be a SamplingConfig"),
    "stop token outside vocabulary": (dict(sampling=SamplingConfig(max_new_tokens=2, stop_token_ids=[VOCAB])),
                                      "stop_token_ids"),
    "seed a string": (dict(seed="abc"), r"seed must be None or an integer in \[0, 2\*\*63\), got 'abc'"),
    "seed negative": (dict(seed=-1), "seed must be None or an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_field(qwen2, case):
    replaced, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        generate(qwen2, **{**VALID_CALL, **replaced})


def test_a_model_on_the_meta_device_is_refused_in_one_line():
    with torch.device("meta"):
        model = build_model("qwen2")
    with pytest.raises(ValueError, match="the model's weights are on the meta device"):
        generate(model, **VALID_CALL)
    with pytest.raises(ValueError, match="the model's weights are on the meta device"):
        completion_logprobs(model, [torch.tensor([1, 2])], [[torch.tensor([3])]])


def test_absolute_position_models_sample_with_their_own_logprobs():
    """GPT-2 (learnt absolute positions): the engine's log-probs are the model's own forward's."""
    from tests.prefix.conftest import build_gpt2
    model = build_gpt2(vocab=VOCAB)
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    rollout = generate(model, prompts, num_samples=2, sampling=SamplingConfig(max_new_tokens=5), seed=0)
    with torch.no_grad():
        for g, prompt in enumerate(prompts):
            for tokens, logps in zip(rollout.tokens_per_group()[g], rollout.logprobs_per_group()[g]):
                logits = model(torch.cat([prompt, tokens])[None]).logits[0]
                expected = torch.log_softmax(logits.float(), -1)[torch.arange(prompt.numel() - 1, logits.shape[0] - 1),
                                                                 tokens]
                torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_models_run_with_float32_logprobs():
    model = build_model("qwen2").to(torch.bfloat16)
    rollout = generate(model, random_prompts([3, 9]), num_samples=2, sampling=SamplingConfig(max_new_tokens=6),
                       seed=0, return_hidden=True)
    assert all(lp.dtype == torch.float32 and torch.isfinite(lp).all() for lp in rollout.logprobs)
    assert all(h.dtype == torch.bfloat16 for h in rollout.hidden)
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompts, rollout.tokens_per_group())
    assert logprob_gap(rollout, trainer) < 0.05  # bfloat16 rounding, not a mismatch


def test_bad_sampling_values_are_refused_before_any_rollout():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(max_new_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=0)


def test_until_stops_at_a_host_check_and_a_continued_completion_equals_one_drawn_in_one_go(qwen2):
    prompts = random_prompts([5, 9])
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    whole = generate(qwen2, prompts, num_samples=2, sampling=greedy)
    checks = []
    cut = generate(qwen2, prompts, num_samples=2, sampling=greedy, until=lambda done: checks.append(done) or
                   len(checks) == 4)
    assert [len(t) for t in cut.tokens] == [4] * 4 and cut.finish_reasons == ["length"] * 4  # cut, not at its limit
    prefixes = [torch.cat([prompts[i // 2], t]) for i, t in enumerate(cut.tokens)]
    rest = generate(qwen2, prefixes, num_samples=1, sampling=greedy, max_new_tokens_per_completion=[8] * 4)
    for one_go, head, tail, head_logps, tail_logps, logps in zip(whole.tokens, cut.tokens, rest.tokens, cut.logprobs,
                                                                 rest.logprobs, whole.logprobs):
        assert torch.cat([head, tail]).tolist() == one_go.tolist()
        torch.testing.assert_close(torch.cat([head_logps, tail_logps]), logps, atol=1e-5, rtol=0)


def test_an_until_that_never_fires_changes_nothing(qwen2):
    prompts, sampling = random_prompts([5, 9]), SamplingConfig(max_new_tokens=12, stop_token_ids=list(range(8)))
    plain = generate(qwen2, prompts, num_samples=3, sampling=sampling, seed=7)
    watched = generate(qwen2, prompts, num_samples=3, sampling=sampling, seed=7, until=lambda done: False)
    assert [t.tolist() for t in plain.tokens] == [t.tolist() for t in watched.tokens]
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, watched.logprobs))


def test_per_completion_limits_need_room_for_their_own_limit_only(qwen2):
    """A carried generation continues from a longer prefix with the length it has left (partial rollouts): the
    positions check counts that limit, not sampling.max_new_tokens."""
    prompt, sampling = torch.arange(120) % VOCAB, SamplingConfig(max_new_tokens=12, temperature=0.0)
    assert len(generate(qwen2, [prompt], num_samples=1, sampling=sampling, max_new_tokens_per_completion=[8])
               .tokens[0]) == 8
    with pytest.raises(ValueError, match="with its completions' limit=9 it needs 129 positions"):
        generate(qwen2, [prompt], num_samples=1, sampling=sampling, max_new_tokens_per_completion=[9])
