"""Shared-prefix training forward: each GRPO group's prompt runs through the model once."""

from turbogrpo.prefix.backends import BACKENDS, backend_names, register_backend, select_backend
from turbogrpo.prefix.compile import compile_decoder_layers
from turbogrpo.prefix.layout import PackedGroups, pack_groups
from turbogrpo.prefix.logprobs import (CompletionLogprobs, completion_logprobs, compute_logprobs,
                                       token_logprobs, validate_inputs)

__all__ = ["BACKENDS", "CompletionLogprobs", "PackedGroups", "backend_names", "compile_decoder_layers",
           "completion_logprobs", "compute_logprobs", "pack_groups", "register_backend", "select_backend",
           "token_logprobs", "validate_inputs"]
