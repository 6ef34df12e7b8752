"""TRL's multi-turn rollouts (``tools=``, ``environment_factory=``, a ``rollout_func`` with ``env_mask``)
train the same with the drop-in.

TRL 1.16 builds a multi-turn row as the prompt, then one completion holding every turn: the model's tokens,
each tool reply as the chat template renders it, the model's next turn, and so on, with ``tool_mask`` (1 on
model tokens, 0 on tool-reply tokens) multiplied into the loss mask. The rows of a group share their prompt
(after it, each member's turns are its own), and the drop-in runs each prompt once.

The model's turns are scripted (a tiny random model never writes a tool call): row i of a generation batch
plays ``scripts[i % 9]`` through TRL's generation hook ``_generate_single_turn``, so TRL's whole tool loop runs
as shipped (parsing the calls, calling the tools or the environment, rendering and masking the replies). The
tokenizer is the demo model's byte-level BPE with TRL's Qwen2.5 chat template (which renders tools) and
``<|im_end|>`` ending each turn.
"""

import itertools
import json

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

from turbogrpo.integrations.trl import SharedPrefixGRPOTrainer  # noqa: E402
from turbogrpo.models import demo_model_path, tiny_model  # noqa: E402

G = 3
QUESTIONS = ["What is 3 + 4?", "What is 12 times 5?", "Add 8 and 9, then double it."]
END = "<|im_end|>"


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# Assistant turns of row i % 9 (rows 3g..3g+2 are group g). Every turn but the last calls a tool (TRL goes on
# only after a call). Some rows answer at once, some call twice, one calls an unknown tool and one passes a
# wrong argument (TRL replies with the error), one makes two calls in one turn (two tool replies in a row).
TOOL_SCRIPTS = [
    ["#### 7" + END],
    [call("add", a=3, b=4) + END, "#### 7" + END],
    [call("add", a=3, b=3) + END, call("add", a=6, b=1) + END, "It is 7.\n#### 7" + END],
    [call("multiply", a=12, b=5) + END, "#### 60" + END],
    ["#### 17" + END],
    [call("divide", a=60, b=1) + END, "#### 60" + END],
    [call("add", a=8, b=9) + call("multiply", a=17, b=2) + END, "#### 34" + END],
    [call("add", a=8, b=9) + END, call("multiply", a=17, c=2) + END, "#### 34" + END],
    ["#### 35" + END],
]
TOOL_REWARDS = [1.0, 0.0, 0.2, 2.0, 1.5, 0.0, 0.3, 1.5, 0.7]
# The environment's rows; row 5's last turn never ends (no end-of-turn token): TRL counts it truncated and,
# with mask_truncated_completions, masks the whole row.
ENV_SCRIPTS = [
    [call("add_to_total", amount=2) + END, "Done." + END],
    ["Done." + END],
    [call("add_to_total", amount=1) + END, call("add_to_total", amount=3) + END, "Done." + END],
    [call("add_to_total", amount=-4) + END, "Done." + END],
    [call("add_to_total", amount=5) + END, "Done." + END],
    [call("add_to_total", amount=1) + END, "Still counti"],
    [call("add_to_total", amount=10) + END, "Done." + END],
    [call("add_to_total", step=1) + END, "Done." + END],
    [call("add_to_total", amount=3) + call("add_to_total", amount=4) + END, "Done." + END],
]

# Rows of a feedback game played in a rollout_func (TRL's hook for custom multi-turn rollouts, whose
# ``env_mask`` TRL takes as ``tool_mask``): FEEDBACK follows every turn but the last.
FEEDBACK_SCRIPTS = [
    ["#### 6" + END, "#### 7" + END],
    ["#### 7" + END],
    ["#### 5" + END, "#### 8" + END, "#### 7" + END],
    ["#### 60" + END],
    ["#### 50" + END, "#### 60" + END],
    ["#### 6" + END, "#### 16" + END, "#### 26" + END],
    ["#### 34" + END],
    ["#### 17" + END, "#### 34" + END],
    ["#### 35" + END, "#### 34" + END],
]
FEEDBACK = "\n<|im_start|>user\nNot yet, try again.<|im_end|>\n<|im_start|>assistant\n"


def feedback_rollout(prompts, trainer):
    """Row i plays FEEDBACK_SCRIPTS[i % 9]: the model's turns with FEEDBACK between them, masked in env_mask."""
    tokenizer = trainer.processing_class

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for p in prompts]
    completion_ids, env_mask = [], []
    for i in range(len(prompts)):
        ids, mask = [], []
        for turn, text in enumerate(FEEDBACK_SCRIPTS[i % len(FEEDBACK_SCRIPTS)]):
            for segment, in_loss in ([(FEEDBACK, 0)] if turn else []) + [(text, 1)]:
                ids += encode(segment)
                mask += [in_loss] * len(encode(segment))
        completion_ids.append(ids)
        env_mask.append(mask)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class RunningTotal:
    """A TRL environment: ``reset`` starts a total from the row, ``add_to_total`` is its tool, and the reward
    is how close the total ends to the row's target."""

    def reset(self, start: int, target: int, **row) -> str:
        self.total, self.target = start, target
        return f" Start from {start}."

    def add_to_total(self, amount: int) -> str:
        """Add an amount to the running total.

        Args:
            amount: The integer to add.
        """
        self.total += amount
        return f"total = {self.total}"

    def get_reward(self) -> float:
        return -abs(self.total - self.target)


class NumberedEpisode(RunningTotal):
    """A RunningTotal whose ``reset`` also names its instance, so that no two rollouts have the same prompt."""

    def __init__(self, number: int):
        self.number = number

    def reset(self, **row) -> str:
        return super().reset(**row) + f" Episode {self.number}."


def numbered_episodes():
    """A factory numbering the instances it makes (one per trainer, so both trainers see the same prompts)."""
    numbers = itertools.count()
    return lambda: NumberedEpisode(next(numbers))


def fixed_rewards(completions, **_):
    return [TOOL_REWARDS[i % len(TOOL_REWARDS)] for i in range(len(completions))]


ENV_COLUMNS = {"start": [1, 5, 0], "target": [4, 2, 10]}
# How each variant is built: the trainer's tool arguments (made per trainer), its scripts, its dataset columns
# besides the prompt, GRPOConfig settings, and a text that its masked replies hold.
VARIANTS = {
    "tools": dict(kwargs=lambda: dict(tools=[add, multiply], reward_funcs=[fixed_rewards]), scripts=TOOL_SCRIPTS,
                  columns={}, reply="<tool_response>"),
    "environment": dict(kwargs=lambda: dict(environment_factory=RunningTotal), scripts=ENV_SCRIPTS,
                        columns=ENV_COLUMNS, config={"mask_truncated_completions": True}, reply="<tool_response>"),
    "rollout-env-mask": dict(kwargs=lambda: dict(rollout_func=feedback_rollout, reward_funcs=[fixed_rewards]),
                             scripts=FEEDBACK_SCRIPTS, columns={}, reply="try again"),
    "numbered-episodes": dict(kwargs=lambda: dict(environment_factory=numbered_episodes()), scripts=ENV_SCRIPTS,
                              columns=ENV_COLUMNS),
}


class ScriptedTurns:
    """Stands in for ``GRPOTrainer._generate_single_turn``: its first call (TRL's ``_generate``, which asks
    for G completions per prompt) starts row i on ``scripts[i % len(scripts)]``; each later call (TRL's tool
    loop: one completion for each row that called a tool, in row order) plays the next turn of those rows."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.live: list[list[str]] = []
        self.turn = 0

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations != 1:
            self.live, self.turn = [self.scripts[i % len(self.scripts)] for i in range(len(prompt_ids))], 0
        else:
            self.turn += 1
            self.live = [script for script in self.live if len(script) > self.turn]
        assert len(self.live) == len(prompt_ids), "TRL continued other rows than those whose turn calls a tool"
        return [self.tokenizer(script[self.turn], add_special_tokens=False)["input_ids"] for script in self.live], None


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny Qwen2, saved (TRL loads policy and reference from the path), and a tool-calling tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", END]})
    tokenizer.eos_token, tokenizer.chat_template, tokenizer.model_max_length = END, qwen2_5_chat_template, 4096
    path = tmp_path_factory.mktemp("tiny_qwen2_tools")
    model = tiny_model("qwen2", vocab_size=len(tokenizer), hidden=32, layers=2, heads=4, kv_heads=2, seed=0)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(path)
    return str(path), tokenizer


def build_trainer(chat, tmp_path, trainer_class, variant, **trainer_kwargs):
    """``variant``: a VARIANTS name or a spec of that form; ``trainer_kwargs`` go to ``trainer_class``."""
    model_dir, tokenizer = chat
    spec = VARIANTS[variant] if isinstance(variant, str) else variant
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=False,
        num_generations=G, per_device_train_batch_size=G * len(QUESTIONS), max_completion_length=512,
        num_iterations=2, loss_type="dapo", beta=0.04, logging_steps=1,
        **spec.get("config", {}))  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS], **spec["columns"]})
    trainer = trainer_class(model=model_dir, processing_class=tokenizer, args=args, train_dataset=dataset,
                            **spec["kwargs"](), **trainer_kwargs)
    trainer._generate_single_turn = ScriptedTurns(tokenizer, spec["scripts"])
    # Move the policy off the reference, the same way in both trainers (a KL term not at its optimum).
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by Trainer.train
    return trainer


def generation_batch(trainer):
    """The rows TRL's sampler makes: each dataset row G times in a row."""
    dataset = trainer.train_dataset
    return trainer._generate_and_score_completions([dataset[i] for i in range(len(dataset)) for _ in range(G)])


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def model_token_texts(tokenizer, batch):
    """Per row: the text of its tokens that the loss counts, and of the rest of its completion."""
    texts = []
    for ids, in_completion, in_loss in zip(batch["completion_ids"], batch["completion_mask"].bool(),
                                           (batch["completion_mask"] * batch["tool_mask"]).bool()):
        texts.append((tokenizer.decode(ids[in_loss]), tokenizer.decode(ids[in_completion & ~in_loss])))
    return texts


@pytest.mark.parametrize("variant", ["tools", "environment", "rollout-env-mask"])
def test_tool_rows_train_as_trl(chat, tmp_path, variant):
    """Same masks, old/reference log-probs, advantages, loss, gradients and logged metrics as TRL's
    GRPOTrainer on multi-turn rows, with every call sharing its prompts. Float32 only, as the single-turn
    parity: TRL's fused LM head returns float32 log-probs whatever the model's dtype."""
    trl_trainer = build_trainer(chat, tmp_path / "trl", trl.GRPOTrainer, variant)
    ours = build_trainer(chat, tmp_path / "ours", SharedPrefixGRPOTrainer, variant, sharing="prompt")
    trl_batch, our_batch = generation_batch(trl_trainer), generation_batch(ours)
    # The rows are multi-turn: TRL masked the replies between the model's turns of most rows.
    scripts, reply = VARIANTS[variant]["scripts"], VARIANTS[variant]["reply"]
    masked_rows = [i for i, s in enumerate(scripts) if s[-1].endswith(END)]
    for i, (in_loss, tool_text) in enumerate(model_token_texts(chat[1], our_batch)):
        assert in_loss == ("".join(scripts[i]) if i in masked_rows else ""), i
        assert (reply in tool_text) == (len(scripts[i]) > 1 and i in masked_rows), i
    assert trl_batch["advantages"].abs().min() > 0
    tool_metrics = ("tools/call_frequency", "tools/failure_frequency") if reply == "<tool_response>" else ()
    assert_trains_as_trl(trl_trainer, ours, trl_batch, our_batch, tool_metrics)
    if tool_metrics:
        assert trl_trainer._metrics["train"]["tools/failure_frequency"][-1] > 0  # the bad calls were answered
    stats = ours.shared_prefix_stats
    # old policy, reference, policy: every call shared, one prompt forward per question
    assert stats.num_fallback_calls == 0 and stats.num_shared_calls == 3
    assert stats.num_prompt_forwards == len(QUESTIONS) * 3


def assert_trains_as_trl(trl_trainer, ours, trl_batch, our_batch, metrics=()):
    """Same masks, old/reference log-probs, loss, gradients and logged ``metrics`` (with entropy, KL, clip
    ratio) as TRL, within the single-turn parity's tolerances."""
    for key in ("completion_mask", "tool_mask", "advantages", "old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(our_batch[key], trl_batch[key], rtol=1e-5, atol=1e-5, msg=key)
    trl_loss, trl_grads = loss_and_grads(trl_trainer, trl_batch)
    our_loss, our_grads = loss_and_grads(ours, our_batch)
    torch.testing.assert_close(our_loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert trl_grads.keys() == our_grads.keys() and len(our_grads) > 0
    for name, grad in trl_grads.items():
        assert grad.abs().max() > 0, name  # every parameter gets a real gradient to compare
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("entropy", "kl", "clip_ratio/region_mean", *metrics):
        trl_values, our_values = trl_trainer._metrics["train"].get(key), ours._metrics["train"].get(key)
        assert trl_values is not None and our_values == pytest.approx(trl_values, rel=1e-5, abs=1e-6), key


def test_environments_that_make_every_prompt_different_run_trl(chat, tmp_path):
    """TRL appends each rollout's ``reset`` observation to its prompt; when every one differs, no two rows
    share a prompt, and TRL's own forward runs (same loss and gradients), for a reason that says so."""
    trl_trainer = build_trainer(chat, tmp_path / "trl", trl.GRPOTrainer, "numbered-episodes")
    ours = build_trainer(chat, tmp_path / "ours", SharedPrefixGRPOTrainer, "numbered-episodes")
    trl_batch, our_batch = generation_batch(trl_trainer), generation_batch(ours)
    assert len({tuple(row.tolist()) for row in our_batch["prompt_ids"]}) == G * len(QUESTIONS)
    torch.testing.assert_close(our_batch["old_per_token_logps"], trl_batch["old_per_token_logps"])
    (trl_loss, trl_grads), (our_loss, our_grads) = loss_and_grads(trl_trainer, trl_batch), loss_and_grads(ours, our_batch)
    torch.testing.assert_close(our_loss, trl_loss)
    for name, grad in trl_grads.items():
        torch.testing.assert_close(our_grads[name], grad, msg=name)
    stats = ours.shared_prefix_stats
    assert stats.num_shared_calls == 0 and stats.num_fallback_calls == 3
    (reason,) = stats.fallback_reasons
    assert reason.startswith("no two rows of the batch share a prompt") and "environment observations" in reason


def test_tool_reply_tokens_stay_out_of_our_loss(chat, tmp_path):
    """The loss's gradient with respect to the drop-in's per-token log-probs is zero exactly on tool-reply
    tokens (and padding), and not zero on the model's tokens: a tool token that leaked into the policy loss
    or its KL term would get a gradient."""
    ours = build_trainer(chat, tmp_path, SharedPrefixGRPOTrainer, "tools")
    batch = generation_batch(ours)
    scored = {}
    shared_logps = ours._get_per_token_logps_and_entropies

    def keep_logps(*args, **kwargs):
        logps, entropies, aux = shared_logps(*args, **kwargs)
        logps.retain_grad()
        scored["logps"] = logps
        return logps, entropies, aux

    ours._get_per_token_logps_and_entropies = keep_logps
    ours._compute_loss(ours.model, batch).backward()
    grad = scored["logps"].grad
    in_completion = batch["completion_mask"].bool()
    model_token, tool_token = in_completion & batch["tool_mask"].bool(), in_completion & ~batch["tool_mask"].bool()
    assert tool_token.sum() > 50 and model_token.sum() > 50
    assert torch.equal(grad[tool_token], torch.zeros_like(grad[tool_token]))
    assert torch.equal(grad[~in_completion], torch.zeros_like(grad[~in_completion]))
    assert (grad[model_token] != 0).all()
    # and the tool tokens were really scored: the forward saw them (they condition the model's later turns)
    assert (scored["logps"].detach()[tool_token] < 0).all()
