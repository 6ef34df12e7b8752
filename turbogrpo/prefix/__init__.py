"""Shared-prefix training forward: each GRPO group's prompt runs through the model once."""

from turbogrpo.prefix.backends import BACKENDS, backend_names, register_backend, select_backend
from turbogrpo.prefix.compile import compile_decoder_layers
from turbogrpo.prefix.layout import PackedGroups, pack_groups
from turbogrpo.prefix.lm_head import lm_head_logprobs
from turbogrpo.prefix.logprobs import CompletionLogprobs, completion_logprobs, compute_logprobs, validate_inputs

__all__ = ["BACKENDS", "CompletionLogprobs", "PackedGroups", "backend_names", "compile_decoder_layers",
           "completion_logprobs", "compute_logprobs", "lm_head_logprobs", "pack_groups", "register_backend",
           "select_backend", "validate_inputs"]


def __getattr__(name: str):
    if name == "token_logprobs":  # deprecated in 0.2: the sampler's token_logprobs (turbogrpo.rollout) kept the name
        import warnings
        warnings.warn("turbogrpo.prefix.token_logprobs is deprecated; use turbogrpo.prefix.lm_head_logprobs",
                      DeprecationWarning, stacklevel=2)
        return lm_head_logprobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
