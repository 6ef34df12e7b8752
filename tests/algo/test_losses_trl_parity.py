"""Our advantages and losses equal what TRL's GRPOTrainer computes with its own code.

A real GRPOTrainer is built on a tiny saved model. Its completions come from a fixed `rollout_func` (TRL's
public hook for custom generation), its rewards from a fixed reward function, and its one model call,
`_get_per_token_logps_and_entropies`, is replaced by a table of per-token log-probs: the current policy's
when gradients are on (the loss), the old policy's under no_grad (TRL computes those when
num_iterations > 1), the reference's when called with `trainer.ref_model`. Everything else, from padding
and masks to advantages, loss normalisation and clip metrics, is TRL's code: `_generate_and_score_completions`
then `_compute_loss`.
"""

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

from turbogrpo.algo import LOSSES, LossNormalizer, group_advantages  # noqa: E402
from turbogrpo.config import AlgoConfig  # noqa: E402

PAD, EOS = 0, 1
PROMPTS = ["t0 t1", "t2 t3"]
G = 3  # completions per prompt
COMPLETIONS = [[2, 3, EOS], [4, EOS], [5, 6, 7, 8], [9, EOS], [10, 11, 12], [13]]
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, 0.0]
MAX_COMPLETION_LENGTH = 5  # above the longest completion (4): dr_grpo must use the configured limit
B, L = len(COMPLETIONS), max(map(len, COMPLETIONS))
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28  # clip-higher

# gspo is TRL's grpo loss with sequence-level importance sampling.
TRL_CONFIG = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}
assert set(TRL_CONFIG) == set(LOSSES)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 and a word-level tokenizer, saved: TRL builds its reference model from the path."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i + 2 for i in range(30)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    config = Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def log_prob_tables(seed=0):
    """Per-token log-probs [B, L] of the current (a leaf), old and reference policies; the old policy is far
    enough off for some ratios to be clipped, per token and per sequence."""
    g = torch.Generator().manual_seed(seed)
    current = -torch.rand(B, L, generator=g) - 0.1
    old = current + 0.5 * torch.randn(B, L, generator=g)
    ref = current + 0.3 * torch.randn(B, L, generator=g)
    return current.requires_grad_(), old, ref


class LogProbTable:
    """Stands in for TRL's one model call: the per-token log-probs of each completion, looked up by its tokens."""

    def __init__(self, trainer, current, old, ref):
        self.trainer, self.current, self.old, self.ref = trainer, current, old, ref
        self.row_of = {tuple(ids + [PAD] * (L - len(ids))): row for row, ids in enumerate(COMPLETIONS)}

    def __call__(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        rows = [self.row_of[tuple(ids)] for ids in input_ids[:, -logits_to_keep:].tolist()]
        if model is self.trainer.ref_model:
            table = self.ref
        else:  # TRL computes old log-probs under no_grad, the loss's log-probs with gradients on
            table = self.current if torch.is_grad_enabled() else self.old
        logps = table[rows]
        return logps, torch.zeros_like(logps) if compute_entropy else None, None


def trl_trainer(model_dir, tmp_path, tables, **config):
    def fixed_rollout(prompts, trainer):
        return {"prompt_ids": [[2, 3]] * len(prompts), "completion_ids": COMPLETIONS, "logprobs": None}

    def fixed_rewards(completions, **_):
        return REWARDS

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH,
        epsilon=EPSILON_LOW, epsilon_high=EPSILON_HIGH,
        num_iterations=2,  # several updates per rollout: TRL then computes old log-probs
        **{"per_device_train_batch_size": B, **config},
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model_dir, reward_funcs=[fixed_rewards], args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=fixed_rollout,
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = LogProbTable(trainer, *tables)
    trainer.model.train()
    # Set by Trainer's training loop for each optimizer step: the number of micro-batches in it.
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def trl_generation_batch(trainer):
    """TRL's sampler repeats each prompt G times in a row."""
    return trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])


def our_mask():
    lengths = torch.tensor([len(ids) for ids in COMPLETIONS])
    return (torch.arange(L)[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(model_dir, tmp_path, scale):
    trainer = trl_trainer(model_dir, tmp_path, log_prob_tables(), scale_rewards=scale)
    expected = trl_generation_batch(trainer)["advantages"]
    ours = group_advantages(torch.tensor(REWARDS), [G] * len(PROMPTS), scale)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("beta", "kl_bias_correction"), [(0.0, False), (0.04, False), (0.04, True)])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_gradient_and_metrics_match_trl(model_dir, tmp_path, name, beta, kl_bias_correction):
    current, old, ref = tables = log_prob_tables()
    trainer = trl_trainer(
        model_dir, tmp_path, tables, beta=beta, use_bias_correction_kl=kl_bias_correction, **TRL_CONFIG[name]
    )
    batch = trl_generation_batch(trainer)
    assert "old_per_token_logps" in batch and ("ref_per_token_logps" in batch) == (beta != 0)
    trl_loss = trainer._compute_loss(trainer.model, batch)
    (trl_grad,) = torch.autograd.grad(trl_loss, current)
    trl_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    mask = our_mask()
    assert torch.equal(mask, batch["completion_mask"])
    advantages = group_advantages(torch.tensor(REWARDS), [G] * len(PROMPTS), "group")
    settings = AlgoConfig(epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, beta=beta,
                          kl_bias_correction=kl_bias_correction)
    loss, metrics = LOSSES[name](
        current, old, ref if beta else None, advantages, mask,
        LossNormalizer.for_batch(mask, MAX_COMPLETION_LENGTH), settings,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, current)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-5, atol=1e-7)
    assert trl_metrics["clip_ratio/region_mean"] > 0  # the case exercises clipping
    for ours_key, trl_key in [
        ("clip_ratio/low", "clip_ratio/low_mean"),
        ("clip_ratio/high", "clip_ratio/high_mean"),
        ("clip_ratio/region", "clip_ratio/region_mean"),
    ] + ([("kl", "kl")] if beta else []):
        assert metrics[ours_key].item() == pytest.approx(trl_metrics[trl_key], rel=1e-5, abs=1e-7), ours_key


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_match_trl_gradient_accumulation(model_dir, tmp_path, name):
    """TRL splits the rollout into 2 micro-batches of 3 sequences (gradient_accumulation_steps=2); the sum of
    its micro-batch losses equals our loss of the whole batch."""
    if name == "bnpo":
        pytest.skip(
            "TRL's bnpo divides each micro-batch by its own token count, so its value depends on the split; "
            "ours is the token mean over the whole step by design (equal to TRL's with one micro-batch, "
            "checked in test_loss_gradient_and_metrics_match_trl)"
        )
    current, old, ref = tables = log_prob_tables(seed=1)
    beta = 0.04
    trainer = trl_trainer(
        model_dir, tmp_path, tables, beta=beta, use_bias_correction_kl=True,  # TRL's default
        per_device_train_batch_size=B // 2, gradient_accumulation_steps=2, **TRL_CONFIG[name],
    )  # fmt: skip
    batch = trl_generation_batch(trainer)
    trl_loss = sum(trainer._compute_loss(trainer.model, micro) for micro in split_tensor_dict(batch, 2))
    (trl_grad,) = torch.autograd.grad(trl_loss, current)

    mask = our_mask()
    advantages = group_advantages(torch.tensor(REWARDS), [G] * len(PROMPTS), "group")
    settings = AlgoConfig(epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, beta=beta, kl_bias_correction=True)
    loss, _ = LOSSES[name](
        current, old, ref, advantages, mask, LossNormalizer.for_batch(mask, MAX_COMPLETION_LENGTH), settings
    )
    (grad,) = torch.autograd.grad(loss, current)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-5, atol=1e-7)
