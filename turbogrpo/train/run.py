"""A training run's components, built once from its config (``build_run``); the part that measures a
model (``build_policy``: precision, policy, tokenizer, sampling, held-out evaluation) is shared with
``turbogrpo eval``. The run's state between steps (resume, checkpoints, export, interrupt) is state.py's;
the step is loop.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from turbogrpo.algo import build_loss
from turbogrpo.config import Config
from turbogrpo.data import PromptBatches
from turbogrpo.rewards import Reward
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train import distributed, setup
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.draft_learning import OnlineDraft, build_online_draft
from turbogrpo.train.evaluate import HeldOut, build_held_out
from turbogrpo.train.optim import build_optimizer
from turbogrpo.train.precision import Precision, warn_if_pure
from turbogrpo.train.state import RunState


class PolicyParts(NamedTuple):
    """What sampling from and measuring the config's policy needs (a run and ``turbogrpo eval`` alike)."""

    precision: Precision
    """Storage and compute dtypes; rollouts and evaluation run under ``precision.autocast()`` like training."""
    policy: nn.Module
    """The Hugging Face model (or PEFT model); rollouts sample with its weights."""
    tokenizer: object
    sampling: SamplingConfig
    """How rollouts sample (the [rollout] section with the model's stop ids)."""
    held_out: HeldOut
    """Held-out evaluation: prompts, the accuracy reward, greedy and sampled settings."""


def build_policy(config: Config, dist: DistInfo, rewards: list[Reward]) -> PolicyParts:
    """The config's policy on this rank's device with its precision (built once), sampling and held-out
    evaluation."""
    torch.manual_seed(config.train.seed)  # LoRA initialisation; resumed runs load their adapters
    precision = setup.precision(config, dist.device)
    policy, tokenizer = setup.load_policy(config, dist.device, precision)
    sampling = setup.rollout_sampling(config, policy, tokenizer)
    return PolicyParts(precision, policy, tokenizer, sampling,
                       build_held_out(config, policy, tokenizer, rewards, sampling))


@dataclass
class Run:
    """The components one run's steps use, built once from the config, and the run's state (``state``,
    kept by state.py: resumed, saved, exported)."""

    config: Config
    dist: DistInfo
    policy: nn.Module
    """The Hugging Face model (or PEFT model) being trained; rollouts sample with its weights."""
    tokenizer: object
    precision: Precision
    """Storage and compute dtypes; rollouts and evaluation run under ``precision.autocast()`` like training."""
    trainer: nn.Module
    """``trainer(prompts, completions) -> CompletionLogprobs``: the policy's shared-prefix forward,
    wrapped for DDP/FSDP2 when distributed."""
    reference: nn.Module | None
    """The same for the reference policy; None when algo.beta == 0."""
    optimizer: torch.optim.Optimizer
    batches: PromptBatches
    rewards: list[Reward]
    sampling: SamplingConfig
    """How rollouts sample (the [rollout] section with the model's stop ids)."""
    held_out: HeldOut
    """Held-out evaluation: prompts, the accuracy reward, greedy and sampled settings."""
    loss: Callable
    """The policy loss with the [algo] settings bound (``algo.build_loss``)."""
    draft: OnlineDraft | None = None
    """The speculative rollouts' draft head and its online learning; None when rollout.speculation is "off"."""
    state: RunState = field(default_factory=RunState)
    """Steps done, skipped-step counters, evaluations, the metrics log (``state.start`` resumes it)."""


def build_run(config: Config, dist: DistInfo, rewards: list[Reward]) -> Run:
    """The run's components, built once from ``config``, with a fresh state (``state.start`` resumes it
    and opens its output folder)."""
    if dist.is_main:
        warn_if_pure(config.model.pure_bf16)
    parts = build_policy(config, dist, rewards)
    precision, policy = parts.precision, parts.policy
    if dist.enabled and config.distributed.strategy == "fsdp2" and config.lora.enabled and config.algo.beta > 0:
        raise ValueError("config key 'algo.beta': with distributed.strategy = \"fsdp2\" and LoRA the reference "
                         "(the base model without adapters) cannot be scored; use beta = 0 or strategy \"ddp\"")
    fn = setup.logprob_fn(config, precision)
    trainer = distributed.wrap_for_training(policy, fn, dist, config.distributed.strategy, precision)
    reference = setup.build_reference(config, policy, dist.device, precision, fn)
    optimizer = build_optimizer(policy, config.optim)
    max_positions = setup.position_limit(policy)
    prompt_set = setup.load_train_prompts(config, parts.tokenizer, max_positions)
    if dist.is_main and (prompt_set.num_too_long or prompt_set.num_empty):
        model_limit = (f" (or, with rollout.max_new_tokens={config.rollout.max_new_tokens}, over the model's "
                       f"{max_positions} positions)" if max_positions else "")
        tqdm.write(f"skipped {prompt_set.num_too_long} prompts over data.max_prompt_tokens="
                   f"{config.data.max_prompt_tokens}{model_limit} and {prompt_set.num_empty} empty prompts")
    check_prompt_count(config, prompt_set)
    batches = PromptBatches(prompt_set.examples, config.train.prompts_per_step, seed=config.train.seed,
                            shuffle=config.data.shuffle)
    if dist.enabled and config.distributed.strategy == "fsdp2" and config.rollout.speculation != "off":
        raise ValueError("config key 'rollout.speculation': the draft head shares the policy's embeddings and LM "
                         "head, which FSDP2 shards; use rollout.speculation = \"off\" or strategy \"ddp\"")
    longest_prompt = max(e.token_ids.numel() for e in prompt_set.examples)
    draft = build_online_draft(config, policy, longest_prompt + config.rollout.max_new_tokens // 2)
    return Run(config=config, dist=dist, policy=policy, tokenizer=parts.tokenizer, precision=precision,
               trainer=trainer, reference=reference, optimizer=optimizer, batches=batches, rewards=rewards,
               sampling=parts.sampling, held_out=parts.held_out, loss=build_loss(config.algo), draft=draft)


def check_prompt_count(config: Config, prompt_set) -> None:
    """ValueError naming the data and train.prompts_per_step when a step cannot be filled with distinct
    usable prompts (``prompt_set``: a PromptSet, its skipped rows counted)."""
    source = f"data.path {config.data.path!r}" if config.data.path else f"the built-in {config.data.kind} task"
    usable = len(prompt_set.examples)
    skipped = (f" ({prompt_set.num_too_long} skipped as too long for data.max_prompt_tokens="
               f"{config.data.max_prompt_tokens} or the model, {prompt_set.num_empty} as empty)"
               if prompt_set.num_too_long or prompt_set.num_empty else "")
    if not usable:
        raise ValueError(f"{source} has no usable prompts{skipped}; raise data.max_prompt_tokens, shorten the "
                         "prompts, or check data.prompt_column")
    if config.train.prompts_per_step > usable:
        raise ValueError(f"config key 'train.prompts_per_step': {config.train.prompts_per_step} is more than the "
                         f"{usable} usable prompts of {source}{skipped}; use at most {usable} or add rows")


