"""TRL's GRPOTrainer with the shared-prefix drop-in computes what TRL computes on its own.

Each test builds two real GRPOTrainers on the same tiny saved model (TRL loads policy and reference from
the path): TRL as it ships, and the same trainer with `turbogrpo.integrations.trl`. Completions come
from a fixed `rollout_func` (TRL's public hook for custom generation): ragged prompts (TRL left-pads
them), ragged completions, some ending in EOS (TRL right-pads them and masks after EOS). Everything from
masks and advantages to the loss is TRL's code; only the per-token log-probs differ in how they are run.
"""

import logging

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
from datasets import Dataset  # noqa: E402

from turbogrpo.integrations.trl import (SharedPrefixGRPOTrainer, check_trl_version,  # noqa: E402
                                        enable_shared_prefix, group_rows, scatter_index,
                                        split_groups)
from turbogrpo.models import demo_model_path, load_model_and_tokenizer, tiny_model  # noqa: E402

PAD, EOS = 1, 0  # the demo tokenizer's
PROMPTS = ["t0 t1 t2 t3 t4", "t5 t6", "t7 t8 t9"]   # ragged: TRL left-pads to 5 columns
G = 3
# Row i of a generation batch gets COMPLETIONS[i % 9]: EOS-ended (masked after EOS) and cut at 6 tokens.
COMPLETIONS = [[2, 3, EOS], [4, 5, 6, 7, 8, 9], [10, EOS], [11, 12, 13, 14], [15, EOS], [16, 17, 18, 19, 20, 21],
               [22, 23, 24, EOS], [25], [26, 27, 28, 29, 2, 3]]
MAX_COMPLETION_LENGTH = 6
REWARDS = [1.0, 0.0, 0.5, 2.0, 1.0, 0.0, 0.3, 1.5, 0.7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2, saved (TRL builds its reference model from the path), and the demo model's tokenizer:
    with a rollout_func TRL only decodes completions for the rewards, so any tokenizer covering the ids will do."""
    path = tmp_path_factory.mktemp("tiny_qwen2_trl")
    model = tiny_model("qwen2", vocab_size=32, hidden=32, layers=2, heads=4, kv_heads=2, seed=0)
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.save_pretrained(path)
    tokenizer = load_model_and_tokenizer(demo_model_path())[1]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (PAD, EOS)
    return str(path), tokenizer


def fixed_rollout(prompts, trainer):
    ids = [[int(word[1:]) + 2 for word in prompt.split()] for prompt in prompts]
    completions = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts))]
    return {"prompt_ids": ids, "completion_ids": completions, "logprobs": None}


def fixed_rewards(completions, **_):
    return [REWARDS[i % len(REWARDS)] for i in range(len(completions))]


def build_trainer(tiny, tmp_path, trainer_class, *, peft=False, sharing=None, **config):
    """``sharing``: the drop-in's (for SharedPrefixGRPOTrainer; None: its default)."""
    model_dir, tokenizer = tiny
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", seed=0,
        num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH, logging_steps=1,
        # num_iterations > 1: several updates per rollout, so TRL computes old-policy log-probs.
        # bf16=False: TRL's default autocasts the float32 model to bfloat16; parity is checked in float32.
        **{"per_device_train_batch_size": G * len(PROMPTS), "num_iterations": 2, "bf16": False, **config},
    )  # fmt: skip
    peft_config = None
    if peft:
        from peft import LoraConfig
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = trainer_class(model=model_dir, processing_class=tokenizer, reward_funcs=[fixed_rewards], args=args,
                            peft_config=peft_config, **({} if sharing is None else {"sharing": sharing}),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=fixed_rollout)
    # Move the policy off the reference (and LoRA off zero), the same way in both trainers, so that the
    # KL term and the ratios are not trivially at their optimum.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by Trainer.train
    return trainer


def build_pair(tiny, tmp_path, patch_existing=False, sharing=None, **config):
    ours = build_trainer(tiny, tmp_path / "ours", trl.GRPOTrainer if patch_existing else SharedPrefixGRPOTrainer,
                         sharing=None if patch_existing else sharing, **config)
    if patch_existing:
        ours = enable_shared_prefix(ours, **({} if sharing is None else {"sharing": sharing}))
    return build_trainer(tiny, tmp_path / "trl", trl.GRPOTrainer, **config), ours


def generation_batch(trainer):
    """TRL's sampler repeats each prompt G times in a row."""
    return trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])


def rows_of(batch, rows):
    """The micro-batch of ``rows`` of a generation batch (TRL's split_tensor_dict with a chosen split)."""
    index = torch.tensor(rows)
    return {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def loss_and_grads(trainer, micro_batches):
    trainer.model.zero_grad()
    loss = sum(trainer._compute_loss(trainer.model, micro) for micro in micro_batches)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same_step(trl_trainer, ours, split=None):
    """Same generation batch (old/ref log-probs, advantages), loss, gradients and logged metrics."""
    trl_batch, our_batch = generation_batch(trl_trainer), generation_batch(ours)
    for key in ("old_per_token_logps", "ref_per_token_logps", "advantages", "completion_mask"):
        assert (key in trl_batch) == (key in our_batch), key
        if key in trl_batch:
            torch.testing.assert_close(our_batch[key], trl_batch[key], rtol=1e-5, atol=1e-5, msg=key)
    split = split or [list(range(G * len(PROMPTS)))]
    trl_loss, trl_grads = loss_and_grads(trl_trainer, [rows_of(trl_batch, rows) for rows in split])
    our_loss, our_grads = loss_and_grads(ours, [rows_of(our_batch, rows) for rows in split])
    torch.testing.assert_close(our_loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert trl_grads.keys() == our_grads.keys() and len(our_grads) > 0
    for name, grad in trl_grads.items():
        assert grad.abs().max() > 0, name  # every parameter gets a real gradient to compare
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("entropy", "kl", "clip_ratio/region_mean"):
        trl_values, our_values = trl_trainer._metrics["train"].get(key), ours._metrics["train"].get(key)
        assert (trl_values is None) == (our_values is None), key
        if trl_values:
            assert our_values == pytest.approx(trl_values, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("config", [
    {"loss_type": "dapo", "beta": 0.0},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dapo", "beta": 0.04, "peft": True, "patch_existing": True},
    {"loss_type": "dapo", "beta": 0.04, "peft": True, "patch_existing": True, "sharing": "tree"},
], ids=["dapo-beta0", "grpo-beta0.04", "lora-dapo-beta0.04-patched", "lora-dapo-beta0.04-patched-tree"])
def test_training_step_matches_trl(tiny, tmp_path, config):
    trl_trainer, ours = build_pair(tiny, tmp_path, **config)
    assert_same_step(trl_trainer, ours)
    stats = ours.shared_prefix_stats
    # old policy + policy (+ reference): every call shared, 3 prompt forwards for 9 rows each time
    assert stats.num_fallback_calls == 0
    assert stats.num_shared_calls == 2 + (config["beta"] > 0)
    assert stats.num_prompt_forwards == len(PROMPTS) * stats.num_shared_calls
    assert stats.num_rows == G * len(PROMPTS) * stats.num_shared_calls
    # "auto": prompts and completions part at their first token, no trie to gain; "tree": a trie all the same
    assert stats.num_tree_calls == (stats.num_shared_calls if config.get("sharing") == "tree" else 0)


def test_groups_split_across_micro_batches(tiny, tmp_path, caplog):
    """Two micro-batches (gradient accumulation): one holds a single member of each group, so nothing can be
    shared and TRL's own code runs, with one notice; the other holds two members of each group."""
    trl_trainer, ours = build_pair(tiny, tmp_path, loss_type="grpo", beta=0.04,
                                   per_device_train_batch_size=G * len(PROMPTS) // 3, gradient_accumulation_steps=3,
                                   steps_per_generation=1)
    with caplog.at_level(logging.WARNING, logger="turbogrpo.integrations.trl"):
        assert_same_step(trl_trainer, ours, split=[[0, 3, 6], [1, 2, 4, 5, 7, 8]])
        assert_same_step(trl_trainer, ours, split=[[0, 3, 6], [1, 2, 4, 5, 7, 8]])
    stats = ours.shared_prefix_stats
    assert stats.num_fallback_calls == 2 and len(stats.fallback_reasons) == 1
    assert "no two rows of the batch share a prompt" in next(iter(stats.fallback_reasons))
    assert len([r for r in caplog.records if "TRL's own forward" in r.getMessage()]) == 1
    assert stats.num_partial_groups == 2 * len(PROMPTS)  # the 2-member groups of the second micro-batch


@pytest.mark.parametrize(("config", "num_shared", "reason"), [
    # TRL's entropy bonus differentiates the entropy; ours is a detached metric: the policy's call falls back.
    ({"entropy_coef": 0.1}, 1, "entropy bonus"),
], ids=["entropy-bonus"])
def test_calls_that_cannot_share_run_trl(tiny, tmp_path, config, num_shared, reason):
    trl_trainer, ours = build_pair(tiny, tmp_path, loss_type="dapo", beta=0.0, **config)
    assert_same_step(trl_trainer, ours)
    stats = ours.shared_prefix_stats
    assert stats.num_shared_calls == num_shared and stats.num_fallback_calls == 2 - num_shared
    assert reason in next(iter(stats.fallback_reasons))


def test_bf16_autocast_shares_and_is_as_close_to_float32_as_trl(tiny, tmp_path):
    """TRL's default mixed precision (a float32 model under bf16 autocast) shares every call. Its loss and
    gradients are compared with a float32 truth, like TRL's own bf16 path: the drop-in's error may be at most
    1.5x TRL's (flash-attention's rule for a kernel against a reference in lower precision)."""
    truth = build_trainer(tiny, tmp_path / "fp32", trl.GRPOTrainer, loss_type="dapo", beta=0.04)
    trl_bf16, ours = build_pair(tiny, tmp_path, loss_type="dapo", beta=0.04, bf16=True)
    results = [loss_and_grads(t, [generation_batch(t)]) for t in (truth, trl_bf16, ours)]
    (true_loss, true_grads), (trl_loss, trl_grads), (our_loss, our_grads) = results
    assert ours.shared_prefix_stats.num_fallback_calls == 0 and ours.shared_prefix_stats.num_shared_calls == 3

    def flat(grads):
        return torch.cat([grads[name].flatten() for name in sorted(true_grads)])

    true_flat = flat(true_grads)
    trl_error = (flat(trl_grads) - true_flat).norm() / true_flat.norm()
    our_error = (flat(our_grads) - true_flat).norm() / true_flat.norm()
    assert 0 < trl_error < 0.1  # bf16 really ran, and is close to the truth
    assert our_error <= 1.5 * trl_error, (our_error, trl_error)
    assert (our_loss - true_loss).abs() <= 1.5 * (trl_loss - true_loss).abs() + 1e-3 * true_loss.abs()


def test_whole_training_step_logs_what_trl_logs(tiny, tmp_path):
    """`trainer.train()` for one optimizer step over two shuffled micro-batches (steps_per_generation=2):
    TRL's logged loss and entropy, and the updated weights, are the same with the drop-in."""
    config = dict(loss_type="dapo", beta=0.04, num_iterations=1, max_steps=1, optim="sgd", learning_rate=0.1,
                  per_device_train_batch_size=G, gradient_accumulation_steps=2)
    trainers = build_pair(tiny, tmp_path, **config)
    logs = []
    for trainer in trainers:
        trainer.train()
        logs.append(trainer.state.log_history[0])
    trl_log, our_log = logs
    for key in ("loss", "entropy", "kl", "reward"):
        assert our_log[key] == pytest.approx(trl_log[key], rel=1e-5, abs=1e-6), key
    for (name, ours), (_, theirs) in zip(trainers[1].model.named_parameters(), trainers[0].model.named_parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert trainers[1].shared_prefix_stats.num_shared_calls >= 1


def test_group_rows_reads_groups_from_the_tokens():
    """Members of a group need not be adjacent; left padding is stripped; an empty completion joins no group."""
    prompt_ids = torch.tensor([[0, 7, 8], [5, 6, 9], [0, 7, 8], [5, 6, 9], [0, 7, 8]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    completion_ids = torch.tensor([[3, 4, 0], [3, 0, 0], [2, 2, 2], [4, 4, 0], [0, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    groups, rows = group_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    by_prompt = {tuple(p.tolist()): (members, [c.tolist() for c in cs])
                 for p, cs, members in zip(groups.prompts, groups.nested(), groups.split(rows))}
    assert by_prompt == {(7, 8): ([0, 2], [[3, 4], [2, 2, 2]]), (5, 6, 9): ([1, 3], [[3], [4, 4]])}
    chunks = split_groups(groups, rows, max_rows=3)
    assert [chunk_rows for _, chunk_rows in chunks] == groups.split(rows)
    assert [chunk.sizes for chunk, _ in chunks] == [(2,), (2,)]
    [(whole, whole_rows)] = split_groups(groups, rows, max_rows=4)
    assert whole.sizes == groups.sizes and whole_rows == rows
    assert scatter_index(groups, rows, 3).tolist() == [
        3 * r + j for r, n in zip(rows, groups.lengths) for j in range(n)]


@pytest.mark.parametrize("version", ["0.19.1", "1.15.2", "2.0.0"])
def test_unsupported_trl_versions_are_refused(version):
    with pytest.raises(ValueError, match=r"supports TRL <2,>=1.16|supports TRL >=1.16,<2"):
        check_trl_version(version)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, tiny):
    """A tiny GPT-2 (absolute position embeddings), saved like ``tiny``, with the same tokenizer."""
    from tests.prefix.conftest import build_gpt2
    path = tmp_path_factory.mktemp("tiny_gpt2_trl")
    model = build_gpt2(vocab=32)
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.save_pretrained(path)
    return str(path), tiny[1]


def assert_trls_own_forward_with_a_notice(trl_trainer, ours, caplog, why: str) -> None:
    """One step of each equal, every forward of ours TRL's own (no call shared), for the one reason ``why``."""
    with caplog.at_level(logging.WARNING, logger="turbogrpo.integrations.trl"):
        assert_same_step(trl_trainer, ours)
    stats = ours.shared_prefix_stats
    assert stats.num_shared_calls == 0 and stats.num_fallback_calls == 2
    (reason,) = stats.fallback_reasons
    assert why in reason


def test_an_absolute_position_model_with_left_padding_runs_trl_with_a_notice(tiny_gpt2, tmp_path, caplog):
    """TRL counts GPT-2's left padding in the positions, so only TRL's own forward gives TRL's log-probs."""
    trl_trainer, ours = build_pair(tiny_gpt2, tmp_path, loss_type="dapo", beta=0.0)
    assert_trls_own_forward_with_a_notice(trl_trainer, ours, caplog,
                                          "absolute position embeddings and the batch left-pads its prompts")
    assert len([r for r in caplog.records if "TRL's own forward" in r.getMessage()]) == 1


def saved_hybrid(tmp_path_factory, tiny, model_type, **overrides):
    from tests.mixers.conftest import build_hybrid
    path = tmp_path_factory.mktemp(f"tiny_{model_type}_trl")
    model = build_hybrid(model_type, torch.float32, vocab_size=32, **overrides)
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    model.save_pretrained(path)
    return str(path), tiny[1]


def test_a_hybrid_shares_every_call_with_trls_numbers(tiny, tmp_path_factory, tmp_path):
    """Qwen3.5 (gated DeltaNet and attention): its linear-attention layers run each prompt once too. TRL's own
    forward of a left-padded row equals the unpadded sequence's (the padding writes nothing into the state)."""
    trl_trainer, ours = build_pair(saved_hybrid(tmp_path_factory, tiny, "qwen3_5_text"), tmp_path, loss_type="dapo",
                                   beta=0.04)
    assert_same_step(trl_trainer, ours)
    stats = ours.shared_prefix_stats
    assert stats.num_fallback_calls == 0 and stats.num_shared_calls == 3


@pytest.mark.parametrize("sharing", ["prompt", "tree"])
def test_trainer_train_updates_a_hybrid_as_trl_does(tiny, tmp_path_factory, tmp_path, sharing):
    """`trainer.train()` for one optimizer step on a tiny Qwen3.5 with the drop-in, each prompt run once through its
    gated DeltaNet layers (as a trie's root with "tree"): TRL's logged loss and the updated weights."""
    config = dict(loss_type="dapo", beta=0.04, num_iterations=1, max_steps=1, optim="sgd", learning_rate=0.1)
    trainers = build_pair(saved_hybrid(tmp_path_factory, tiny, "qwen3_5_text"), tmp_path, sharing=sharing, **config)
    logs = []
    for trainer in trainers:
        trainer.train()
        logs.append(trainer.state.log_history[0])
    for key in ("loss", "kl", "reward"):
        assert logs[1][key] == pytest.approx(logs[0][key], rel=1e-5, abs=1e-6), key
    for (name, ours), (_, theirs) in zip(trainers[1].model.named_parameters(), trainers[0].model.named_parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    stats = trainers[1].shared_prefix_stats
    assert stats.num_fallback_calls == 0 and stats.num_shared_calls == 2   # the reference and the policy
    assert stats.num_prompt_forwards == len(PROMPTS) * stats.num_shared_calls
    assert stats.num_tree_calls == (stats.num_shared_calls if sharing == "tree" else 0)


def test_a_hybrid_whose_padding_reaches_its_state_runs_trl_with_a_notice(tiny, tmp_path_factory, tmp_path, caplog):
    """LFM2 with biased input projections: a left pad's B * x is bias * bias, in the next tokens' convolution window,
    so TRL's forward of a left-padded row differs from the sequence's own; only TRL's forward gives TRL's numbers."""
    trl_trainer, ours = build_pair(saved_hybrid(tmp_path_factory, tiny, "lfm2"), tmp_path, loss_type="dapo",
                                   beta=0.0)
    assert_trls_own_forward_with_a_notice(trl_trainer, ours, caplog,
                                          "carry the left padding of the batch's prompts into their state")
