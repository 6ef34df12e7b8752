"""Held-out accuracy: the accuracy reward's own values, never its failures."""

import torch

from turbogrpo.data import PromptExample
from turbogrpo.models import tiny_model
from turbogrpo.placement import DistInfo
from turbogrpo.rewards import Reward
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train.evaluate import evaluate_accuracy

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class Letters:
    """A stand-in tokenizer: token i decodes to one letter."""

    def batch_decode(self, tokens, skip_special_tokens=True):
        return ["".join(chr(97 + int(t) % 26) for t in seq) for seq in tokens]


def judge(prompts, completions, verdict, **columns):
    """The row's own verdict: 1.0, 0.0, or None (the reward cannot score it)."""
    return verdict


def test_accuracy_counts_only_scored_answers_of_a_weight_zero_reward():
    model = tiny_model("qwen2", vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=1)
    verdicts = [1.0, 0.0, None, 1.0, None]  # 2 correct of 3 scored; 2 the reward failed on
    examples = [PromptExample(f"p{i}", torch.tensor([1, 2, 3 + i]), {"verdict": v}, i) for i, v in enumerate(verdicts)]
    accuracy = Reward("judge", judge, weight=0.0, fallback=0.0)  # the built-in accuracy reward has weight 0
    greedy = SamplingConfig(max_new_tokens=2, temperature=0.0)
    measured = evaluate_accuracy(model, Letters(), examples, accuracy, greedy, SINGLE)
    assert measured.accuracy == 2 / 3 and (measured.num_scored, measured.num_failed) == (3, 2)
    assert measured.first_error == "item 2: returned None"

    all_failed = [PromptExample("p", torch.tensor([1, 2]), {"verdict": None})] * 2
    measured = evaluate_accuracy(model, Letters(), all_failed, accuracy, greedy, SINGLE)
    assert measured.accuracy is None and measured.num_failed == 2
