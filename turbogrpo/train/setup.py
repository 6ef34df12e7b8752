"""Building a run's components once, each from its own config section (or the few settings it reads):
policy, reference, training forward, sampling, and the limits a run's prompts share (the prompts
themselves are the data layer's, ``data.prompt_sets``).

Each builder does one thing and is called by ``run.build_policy`` (a run's and ``turbogrpo eval``'s
policy and sampling, with the precision of ``precision.run_precision``), ``run.build_run`` (the rest of a
run) or ``turbogrpo eval`` (its prompts' limits); none knows about the others, and none sees the whole
``Config``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from turbogrpo.config import LoraConfig, ModelConfig, RolloutConfig
from turbogrpo.hook import check_supported
from turbogrpo.models import enable_activation_checkpointing, load_model_and_tokenizer
from turbogrpo.output_head import check_logits_head
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train.distributed import LogprobModule
from turbogrpo.train.precision import Precision
from turbogrpo.sharing import SHARINGS, Sharing


def load_policy(model: ModelConfig, lora: LoraConfig, device: torch.device, precision: Precision):
    """The trainable policy (full model, or base + LoRA adapters) and its tokenizer, on ``device``, its
    parameters in the run's storage dtype (float32 masters unless model.pure_bf16)."""
    policy, tokenizer = load_model_and_tokenizer(model.path, dtype=precision.param_dtype, device=device)
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model
        policy = get_peft_model(policy, PeftLoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    if model.gradient_checkpointing:  # (it recomputes in training only: the probe below runs without grad)
        enable_activation_checkpointing(policy)
        if lora.enabled:
            policy.enable_input_require_grads()
    check_logits_head(policy)   # a logits transform turbogrpo does not know stops the run here, not in step 1
    check_supported(policy, training=True)   # so does a model neither the trainer nor the native engine runs
    return policy, tokenizer


def logprob_fn(backend: str, temperature: float, precision: Precision, sharing: Sharing = SHARINGS["prompt"]):
    """``fn(model, prompts, completions) -> CompletionLogprobs``: the training forward sharing tokens as
    ``sharing`` (train.sharing's, ``sharing.SHARINGS``) does, with attention ``backend`` (model.logprob_backend)
    at the sampling ``temperature`` (the loss uses the distribution the completions were sampled from), under
    the run's compute precision (the rollout's too)."""
    return precision.computing(partial(sharing.forward, backend=backend, temperature=temperature))


class AdapterlessScorer(nn.Module):
    """The reference policy of a LoRA run: the policy's own base weights, adapters switched off."""

    def __init__(self, peft_model: nn.Module, fn):
        super().__init__()
        self.peft_model = peft_model
        self.fn = fn

    def forward(self, prompts, completions, **options):
        with self.peft_model.disable_adapter():
            return self.fn(self.peft_model, prompts, completions, **options)


def build_reference(beta: float, model_path: str, lora: bool, policy: nn.Module, device: torch.device,
                    precision: Precision, fn) -> nn.Module | None:
    """``scorer(prompts, completions) -> CompletionLogprobs`` under the reference policy, with the
    policy's log-prob ``fn``; None when ``beta`` (algo.beta) is 0: the KL term is dropped, so no
    reference model is loaded at all. With ``lora`` the reference is the policy without its adapters,
    else a frozen copy of ``model_path`` (model.path)."""
    if beta == 0:
        return None
    if lora:
        return AdapterlessScorer(policy, fn)
    # Stored like the policy, so that at step 0 it computes exactly the policy's log-probs; frozen, scored by
    # the same forward.
    reference, _ = load_model_and_tokenizer(model_path, dtype=precision.param_dtype, device=device)
    return LogprobModule(reference.requires_grad_(False).eval(), fn)


# --- prompts ----------------------------------------------------------------------------------------


def position_limit(model: nn.Module) -> int | None:
    """How many positions (prompt + completion) the model can attend over; None if it does not say."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


class PromptLimits(NamedTuple):
    """What bounds a prompt's length, the same for a run's training and held-out prompts (the keyword
    arguments of ``data.prompt_sets.load_train_prompts`` and ``load_eval_prompts``)."""

    max_new_tokens: int
    """The ids a completion may add: rollout.max_new_tokens, or a whole conversation's after its prompt."""
    max_positions: int | None
    """The model's positions (``position_limit``); None where it does not say."""
    limit_key: str
    """The setting that gave ``max_new_tokens``, named when it leaves no room for a prompt."""

    @classmethod
    def of(cls, sampling: SamplingConfig, episodes, model: nn.Module) -> PromptLimits:
        """The limits of a run's prompts for ``model``: ``sampling``'s max_new_tokens, or with an environment
        (``episodes``, the [env] section's ``EpisodeSampler``; None: single completions) a whole conversation's
        ids after its prompt (env.max_conversation_tokens)."""
        if episodes is None:
            return cls(sampling.max_new_tokens, position_limit(model), "rollout.max_new_tokens")
        return cls(episodes.max_completion_tokens, position_limit(model), "env.max_conversation_tokens")


# --- sampling ---------------------------------------------------------------------------------------


def rollout_sampling(rollout: RolloutConfig, model: nn.Module, tokenizer) -> SamplingConfig:
    """How the run samples: the [rollout] section with the model's stop ids and its tokenizer."""
    return SamplingConfig.from_rollout(rollout, stop_token_ids(model, tokenizer), tokenizer)


def stop_token_ids(model: nn.Module, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids of the tokenizer and the model's generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if generation_eos is not None:
        ids.update(int(i) for i in (generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos]))
    return tuple(sorted(ids))
