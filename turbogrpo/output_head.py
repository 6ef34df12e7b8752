"""The model's logits head: final hidden states ``[N, Hd]`` -> logits ``[N, V]`` exactly as its own forward
makes them, and the check that it does.

Some families change the logits after ``lm_head`` inside their own ``forward``: Granite divides them by
``config.logits_scaling``, Cohere multiplies them by ``config.logit_scale``, Gemma 2/3 soft-cap them with
``final_logit_softcapping``. Everything in turbogrpo that turns hidden states into logits (the shared-prefix and
tree log-probs, the sampler, the speculative verifier and draft, the TRL drop-in) takes its head from
:func:`logits_head`, so each of them applies the same transforms.

A transform is a small registered unit (:func:`register_logit_transform`): the config field holding its
parameter, the model types whose forward applies it, and an elementwise function. Elementwise, so it applies
to any subset of the vocabulary's logits as well (the draft's vocabulary).

The unknown is guarded: the first time :func:`logits_head` (or :func:`check_logits_head`) meets a model, it
runs a few probe tokens through both the model's own forward and decoder + logits head, and refuses the model
in one line when they differ beyond its dtype's rounding (a transform turbogrpo does not know). Once per model
object: later calls are a dictionary lookup.

Shape legend: N rows (tokens), Hd hidden size, V vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from turbogrpo.hook import decoder_of, embedding_table, lm_head_of


@dataclass(frozen=True)
class LogitTransform:
    """One transform some families' forward applies to the LM head's output."""

    field: str                          # the text config's field holding its parameter (unset / None: not applied)
    model_types: frozenset[str] | None  # families whose forward applies it; None: every model whose config sets it
    apply: Callable[[torch.Tensor, float], torch.Tensor]   # (logits [..., V], parameter) -> logits, elementwise
    description: str                    # what it does, for the docs ("divided by logits_scaling")

    def parameter(self, config) -> float | None:
        """The transform's parameter for a model with (text) ``config``; None where it does not apply."""
        if self.model_types is not None and config.model_type not in self.model_types:
            return None
        return getattr(config, self.field, None)


LOGIT_TRANSFORMS: list[LogitTransform] = []
"""Every known transform, in the order a forward applies them (scales before the soft-cap)."""


def register_logit_transform(field: str, *, model_types: frozenset[str] | set[str] | None = None,
                             description: str) -> Callable:
    """Decorator: register ``apply(logits, parameter) -> logits`` (elementwise) as the transform read from the
    config's ``field`` for ``model_types`` (None: any model whose config sets ``field``). Transforms run in
    registration order."""
    def register(apply: Callable[[torch.Tensor, float], torch.Tensor]) -> Callable:
        types = None if model_types is None else frozenset(model_types)
        LOGIT_TRANSFORMS.append(LogitTransform(field, types, apply, description))
        return apply
    return register


# The operations are written as the families' modeling files write them, so that the values are bit-identical
# (MiniCPM3 divides the hidden states before its bias-free LM head instead: the same up to rounding).
DIVIDED_BY_LOGITS_SCALING = {"granite", "granitemoe", "granitemoeshared", "granite_swa", "granitemoe_swa",
                             "granitemoehybrid", "granite4_vision_text", "granite_docling_text", "minicpm3"}


@register_logit_transform("logits_scaling", model_types=DIVIDED_BY_LOGITS_SCALING,
                          description="divided by `logits_scaling`")
def _divide(logits: torch.Tensor, value: float) -> torch.Tensor:
    return logits / value


@register_logit_transform("logits_scaling", model_types={"hyperclovax"}, description="multiplied by `logits_scaling`")
@register_logit_transform("logit_scale", model_types={"cohere", "cohere2", "cohere2_moe", "cohere_compass_text"},
                          description="multiplied by `logit_scale`")
@register_logit_transform("output_multiplier", model_types={"muse_glimmer_text", "muse_spark_text"},
                          description="multiplied by `output_multiplier`")
@register_logit_transform("lm_head_multiplier", model_types={"falcon_h1"}, description="multiplied by `lm_head_multiplier`")
def _multiply(logits: torch.Tensor, value: float) -> torch.Tensor:
    return logits * value


@register_logit_transform("final_logit_softcapping", description="soft-capped: `cap * tanh(logits / cap)`")
def _soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


class LogitsHead(nn.Module):
    """``hidden [..., Hd] -> logits [..., V]``: the LM head, then the transforms the model's forward applies."""

    def __init__(self, lm_head: nn.Module, transforms: tuple[tuple[LogitTransform, float], ...]):
        super().__init__()
        self.lm_head = lm_head
        self.transforms = transforms

    @property
    def weight(self) -> torch.Tensor:   # lm_head_logprobs sizes its chunks from the head's weight
        return self.lm_head.weight

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's transforms on logits ``[..., V']`` of the LM head (any subset of the vocabulary)."""
        for transform, value in self.transforms:
            logits = transform.apply(logits, value)
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(self.lm_head(hidden))


def unchecked_logits_head(model: nn.Module) -> LogitsHead:
    """The logits head of ``model`` from its config, without the probe (for :func:`check_logits_head` itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    transforms = tuple((t, value) for t in LOGIT_TRANSFORMS if (value := t.parameter(config)) is not None)
    return LogitsHead(lm_head_of(model), transforms)


def logits_head(model: nn.Module) -> LogitsHead:
    """The module that turns ``model``'s final hidden states into its logits, checked once per model
    (:func:`check_logits_head`)."""
    check_logits_head(model)
    return unchecked_logits_head(model)


PROBE_TOKENS = 6
# Rounding allowed between the two paths, in units of the logits dtype's eps times the largest logit (at
# least 1). The known transforms run the forward's own operations, so they agree to the bit; an unknown
# rescaling or soft-cap moves logits by far more than this, bf16 included (4 eps = 3%).
PROBE_ULPS = 4.0
_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def check_logits_head(model: nn.Module) -> None:
    """ValueError when ``model``'s own ``forward(input_ids).logits`` differs from its logits head applied to its
    decoder's last hidden state on a few probe tokens (a logits transform turbogrpo does not know). Runs once per
    model object (no grad, eval mode), then remembers the model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base in _CHECKED:
        return
    difference, allowed = probe_difference(model)
    if not difference <= allowed:
        model_type = base.config.get_text_config().model_type
        raise ValueError(
            f"model type '{model_type}' transforms its logits after the LM head in a way turbogrpo does not know "
            f"(max |diff| {difference:.3g} on a probe, allowed {allowed:.2g}); every log-prob and sample would be "
            "wrong: register the transform with turbogrpo.output_head.register_logit_transform, or use a model "
            "whose forward returns the LM head's logits (Llama, Qwen2, Qwen3, Mistral)")
    _CHECKED[base] = True


def probe_difference(model: nn.Module) -> tuple[float, float]:
    """``(max |own logits - head logits|, allowed)`` on :data:`PROBE_TOKENS` tokens; host sync (once per model).

    One forward of the model itself; the head's logits are computed from its decoder's output inside that
    forward (a hook), so that both see the same context: a forward wrapped in autocast (accelerate's mixed
    precision, TRL's bf16) rounds both alike."""
    head, ours = unchecked_logits_head(model), []
    embeddings = embedding_table(model)
    ids = (torch.arange(PROBE_TOKENS, device=embeddings.weight.device) * 7 + 3) % embeddings.num_embeddings

    def score(module, args, output):
        ours.append(head(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]))

    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    handle = decoder_of(model).register_forward_hook(score)
    try:
        with torch.no_grad():
            own = model(input_ids=ids[None], use_cache=False).logits
    finally:
        handle.remove()
        for module, training in modes:
            module.training = training
    if len(ours) != 1:
        raise ValueError(f"model type '{model.config.model_type}' ran its decoder {len(ours)} times in one forward; "
                         "turbogrpo cannot check that its logits come from its LM head")
    own64, ours64 = own.double(), ours[0].double()
    # Non-finite logits (broken weights) are named by the callers' own checks; here they agree where both have them.
    both_broken = ~own64.isfinite() & ~ours64.isfinite()
    difference = (own64 - ours64).abs().masked_fill(both_broken, 0.0).nan_to_num(nan=float("inf"))
    eps = max(torch.finfo(own.dtype).eps, torch.finfo(ours[0].dtype).eps)   # a forward may upcast its logits
    allowed = PROBE_ULPS * eps * max(1.0, own64.masked_fill(both_broken, 0.0).abs().max().item())
    return difference.max().item(), allowed
