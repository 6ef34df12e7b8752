"""Bad input raises a ValueError that names the group/completion and what is allowed."""

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

import turbogrpo
from tests.prefix.conftest import VOCAB, build_model
from turbogrpo.prefix.auto import choose_auto, fastest_shared_backend


@pytest.fixture(scope="module")
def model():
    return build_model("qwen2")


P, C = torch.tensor([1, 2, 3]), torch.tensor([4, 5])


@pytest.mark.parametrize("prompts, completions, message", [
    ([], [], "non-empty list"),
    ([torch.tensor([], dtype=torch.long)], [[C]], "prompt of group 0 is empty"),
    ([P, P], [[C], []], "group 1 has no completions"),
    ([P], [[C, torch.tensor([], dtype=torch.long)]], "completion 1 of group 0 is empty"),
    ([P], [[torch.tensor([4, VOCAB])]], r"completion 0 of group 0 has token id 97, outside .*\[0, 97\)"),
    ([torch.tensor([-1, 2])], [[C]], "prompt of group 0 has token id -1"),
    ([P], [[torch.tensor([1.0, 2.0])]], "completion 0 of group 0 has dtype torch.float32"),
    ([P], [[torch.zeros(260, dtype=torch.long)]], "prompt \\+ completion is 263 tokens, beyond .*=256"),
    ([P], [[C], [C]], "2 groups"),
    ([P], [C], r"completions\[0\] must be the list of group 0's completions \(1-D LongTensors\), got Tensor; "
               "completions is a list of lists"),
    ([P], C, "completions must be a list of lists of 1-D LongTensors"),
])
def test_bad_input(model, prompts, completions, message):
    with pytest.raises(ValueError, match=message):
        turbogrpo.completion_logprobs(model, prompts, completions)


def test_device_mismatch_is_named(model):
    meta = torch.tensor([1, 2], device="meta")
    with pytest.raises(ValueError, match="prompt of group 0 is on meta but the model is on cpu"):
        turbogrpo.completion_logprobs(model, [meta], [[C]])


def test_unknown_backend(model):
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; choose one of"):
        turbogrpo.completion_logprobs(model, [P], [[C]], backend="fast")


def test_recurrent_model_is_refused():
    model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1))
    with pytest.raises(ValueError, match="model type 'mamba'"):
        turbogrpo.completion_logprobs(model, [P], [[C]])


def test_sliding_window_on_a_backend_without_one_is_refused():
    model = build_model("mistral", sliding_window=4)
    with pytest.raises(ValueError, match=r"sliding window of 4 tokens .* backend 'varlen' implements full causal "
                                         r"attention only; use one of \['reference', 'cascade', 'flex'\]"):
        turbogrpo.completion_logprobs(model, [P], [[C]], backend="varlen")
    # A window longer than every sequence changes nothing and is accepted.
    wide = build_model("mistral", sliding_window=64)
    turbogrpo.completion_logprobs(wide, [P], [[C]], backend="varlen")


def test_auto_shares_the_prefix_under_a_short_sliding_window():
    model = build_model("mistral", torch.float64, sliding_window=4)
    prompt, completions = torch.arange(20), [torch.arange(3), torch.arange(5)]   # sharing would pay
    lengths = ([20], [[3, 5]])
    assert choose_auto(model, *lengths, torch.device("cpu"), torch.float64, requires_grad=True) == "cascade"
    assert fastest_shared_backend(torch.device("cuda"), torch.bfloat16, True) == "varlen"
    assert fastest_shared_backend(torch.device("cuda"), torch.bfloat16, True, sliding_window=True) == "flex"
    got = turbogrpo.completion_logprobs(model, [prompt], [completions])
    expected = turbogrpo.completion_logprobs(model, [prompt], [completions], share_prefix=False)
    for g, e in zip(got[0], expected[0]):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
