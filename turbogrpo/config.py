"""Typed run configuration: dataclasses, loading from TOML/YAML, ``--set`` overrides, validation.

A config file has one table per section below (``[model]``, ``[data]``, ``[algo]`` ...) and a list of
``[[rewards]]``. Every key is checked before any work starts: an unknown key, a value of the wrong type
or an impossible value raises :class:`ConfigError` (a ``ValueError``) whose message names the key and
says what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from turbogrpo.config_error import ConfigError


# ---------------------------------------------------------------------------------------------------
# Sections. Every field carries a docstring-comment saying what it is and why it has its default.
# ---------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """The policy being trained."""

    path: str = "demo"
    """Local folder or Hub name of a Hugging Face causal LM; "demo" and "longform" are the shipped models
    of the two built-in tasks ("demo-hybrid": the demo's task on a Qwen3.5-shaped hybrid)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Compute dtype. bfloat16/float16: float32 master weights and AdamW state, forwards (rollout and
    training) under torch.autocast; the fast choice on GPU (float16 has no loss scaling: prefer bfloat16).
    float32: the exact choice on CPU, where bf16 matmuls without native support run several times slower.
    "auto": float32 on a CPU without AMX (exact; bf16 is emulated or no faster there), bfloat16 on AMX and on a
    GPU that has it (``turbogrpo.train.precision.AUTO_DTYPES``)."""
    pure_bf16: bool = False
    """Store the parameters and AdamW state in bfloat16 too (needs dtype = "bfloat16"): 8 bytes less per
    parameter, but updates under half of bf16's spacing round away (GRPO's small lr barely trains); warns."""
    device: str = "auto"
    """"auto" (cuda when present, else cpu), "cpu", "cuda" or "cuda:N"; under torchrun each rank uses its local GPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory for long completions, about 30% more time."""
    logprob_backend: str = "auto"
    """Attention backend of the shared-prefix forward ("auto" picks the fastest exact one)."""
    linear_kernel: str = "auto"
    """How the weight matmuls run on the CPU, in rollouts and in the training forward and backward
    (``turbogrpo.linears``): "module" (each nn.Linear as it is: MKL for float32), "onednn" (oneDNN; rollouts
    on weights packed once per rollout), "auto" (oneDNN where it measures faster on this CPU)."""

    def _runs_on_cpu(self) -> bool:
        import torch
        return self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())

    def check(self, key: str) -> None:
        from turbogrpo.prefix.backends import BACKENDS  # the backend registry is the one source of names
        _require(self.path != "", f"{key}.path", "a model folder, a Hub name or \"demo\"", self.path)
        _require(self.logprob_backend == "auto" or self.logprob_backend in BACKENDS, f"{key}.logprob_backend",
                 f"one of {', '.join(['auto', *sorted(BACKENDS)])}", self.logprob_backend)
        from turbogrpo.linears import LINEAR_KERNELS, require_onednn
        _require(self.linear_kernel in LINEAR_KERNELS, f"{key}.linear_kernel", f"one of {', '.join(LINEAR_KERNELS)}",
                 self.linear_kernel)
        if self.linear_kernel == "onednn" and self._runs_on_cpu():
            import torch
            # (bf16 under "auto" only where AMX packs it); refused here, in one line, not by oneDNN in a rollout
            try:
                require_onednn(torch.bfloat16 if self.dtype == "bfloat16" else torch.float32)
            except ValueError as err:
                raise ConfigError(f"config key '{key}.linear_kernel': {err}") from None
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                 f"{key}.device", "\"auto\", \"cpu\", \"cuda\" or \"cuda:N\"", self.device)
        _require(not self.pure_bf16 or self.dtype == "bfloat16", f"{key}.pure_bf16",
                 "false, or true only with model.dtype = \"bfloat16\"", self.pure_bf16)


@dataclass
class LoraConfig:
    """Low-rank adapters through peft: only the adapters train, the base weights stay frozen."""

    enabled: bool = False
    """Off by default: the demo model is small enough to train in full."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scale numerator (the adapter output is scaled by alpha / r); 2 r is the common choice."""
    dropout: float = 0.0
    """0 keeps the update deterministic (and exactly resumable)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters; all linear layers of Qwen2/Llama-style blocks by default."""

    def check(self, key: str) -> None:
        _require(self.r >= 1, f"{key}.r", "an integer >= 1", self.r)
        _require(self.alpha >= 1, f"{key}.alpha", "an integer >= 1", self.alpha)
        _require(0.0 <= self.dropout < 1.0, f"{key}.dropout", "a number in [0, 1)", self.dropout)
        _require(len(self.target_modules) > 0, f"{key}.target_modules", "a non-empty list of module names",
                 self.target_modules)


@dataclass
class DataConfig:
    """Where prompts come from."""

    kind: Literal["arithmetic", "arithmetic_chat", "longform", "small_arithmetic", "calculator", "guess_number", "rows",
                  "gsm8k"] = "arithmetic"
    """"arithmetic": the built-in demo task; "arithmetic_chat": the same problems as chat messages (for [env]
    with turbogrpo.env.tasks.DEMO_CHAT_TEMPLATE); "longform": built-in multi-step problems with long solutions;
    "small_arithmetic": built-in one-operation chat questions with small numbers (the SmolLM2 task);
    "calculator" / "guess_number": the built-in multi-turn SmolLM2 tasks (turbogrpo.data.tool_tasks; with [env]
    factory turbogrpo.env.tasks:Calculator / GuessNumber and chat_template "smollm2_tools"); "rows": a jsonl/parquet/`datasets` folder with a prompt column;
    "gsm8k": GSM8K-format rows (question + worked answer; the gold number goes to column "gold")."""
    path: str = ""
    """Training rows for kind "rows"/"gsm8k": a .jsonl or .parquet file or a folder saved by `datasets`."""
    eval_path: str = ""
    """Held-out rows for accuracy before/after ("" with a built-in kind: its own held-out split)."""
    split: str = "train"
    """Split to read from a saved DatasetDict folder (ignored for files)."""
    prompt_column: str = "prompt"
    """Column holding the prompt text or chat messages ("question" for gsm8k)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """Format prompts with the tokenizer's chat template: when it has one, always (error if none), never."""
    system_prompt: str = ""
    """System message put before each prompt ("" for none)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this are skipped and counted (or rejected, see `on_overlong`)."""
    on_overlong: Literal["skip", "error"] = "skip"
    """What to do with a prompt over `max_prompt_tokens` (or too long for the model with `rollout.max_new_tokens`)."""
    on_empty: Literal["error", "skip"] = "error"
    """What to do with a row whose prompt is missing or blank: stop with its row number, or skip and count it."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by train.seed, so runs stay reproducible)."""
    num_train_problems: int = 2000
    """Built-in tasks only: how many distinct training problems to generate."""
    num_eval_problems: int = 200
    """Held-out problems (or eval rows, at most) for accuracy before/after training and `turbogrpo eval`."""
    num_eval_samples: int = 4
    """Samples per held-out problem at the rollout temperature for the sampled (pass@1) accuracy (0: greedy only)."""

    def check(self, key: str) -> None:
        needs_path = self.kind in ("rows", "gsm8k")
        _require(not needs_path or self.path != "", f"{key}.path",
                 f"a .jsonl/.parquet file or saved `datasets` folder (data.kind is {self.kind!r})", self.path)
        _require(self.max_prompt_tokens >= 1, f"{key}.max_prompt_tokens", "an integer >= 1", self.max_prompt_tokens)
        _require(self.num_train_problems >= 1, f"{key}.num_train_problems", "an integer >= 1",
                 self.num_train_problems)
        _require(self.num_eval_problems >= 1, f"{key}.num_eval_problems", "an integer >= 1",
                 self.num_eval_problems)
        _require(self.num_eval_samples >= 0, f"{key}.num_eval_samples", "an integer >= 0 (0: greedy only)",
                 self.num_eval_samples)


@dataclass
class RewardConfig:
    """One reward function and its weight; the step's reward is the weighted sum."""

    function: str = "math_accuracy"
    """A built-in (math_accuracy, answer_format, overlong_penalty) or an import path "package.module:function"."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    fallback: float = 0.0
    """Reward given to an item whose function raised or returned None/NaN (counted and logged)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of a built-in (e.g. answer_column) or keyword arguments bound to an imported function."""

    def check(self, key: str) -> None:
        from turbogrpo.rewards import BUILTIN_REWARDS
        module, colon, name = self.function.partition(":")
        _require(self.function in BUILTIN_REWARDS or bool(colon and module and name), f"{key}.function",
                 f"a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))}) or an import path "
                 "\"package.module:function\"", self.function)
        _require(math.isfinite(self.weight), f"{key}.weight", "a finite number", self.weight)
        _require(math.isfinite(self.fallback), f"{key}.fallback", "a finite number", self.fallback)


@dataclass
class RolloutConfig:
    """How completions are sampled; ``rollout.SamplingConfig.from_rollout`` builds the sampler's settings
    from this section, and both are checked by the sampler's one rule set (``SAMPLING_RULES``)."""

    num_generations: int = 8
    """G: completions per prompt; advantages are relative within these G."""
    max_new_tokens: int = 256
    """Completion length cap; longer answers finish with reason "length"."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in the loss use the same temperature, as in TRL."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 keeps the full distribution (what the loss assumes)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    stop_strings: list[str] = field(default_factory=list)
    """Extra stop strings; the tokenizer's end-of-sequence token always stops."""
    speculation: str = "off"
    """Speculative rollouts with a draft head ([draft]): "off", or the tree-sizing policy "fixed",
    "fastgrpo" or "cost" (ours: trees only where they pay). Lossless: the samples' distribution is unchanged."""
    engine: str = "native"
    """What samples: "native" (turbogrpo's engine: speculation, conversations, exact sampler log-probs), "vllm"
    (a vLLM engine in the trainer's process, the policy's weights pushed after every optimizer step; needs the
    vllm package) or "auto" (per device type, CPU kind and workload, by measurement, engines.AUTO_ENGINES and
    AUTO_CPU_KINDS: for single-turn runs on an AVX-512 CPU without AMX the native engine with its compiled-onednn
    step, on other CPUs vLLM; native for [env] conversations; native wherever the run uses what only native
    runs, i.e. speculation, train.partial_rollouts or FSDP2, or vllm is not installed or fails to import)."""
    vllm_enforce_eager: bool = False
    """The vLLM engine without compilation (vLLM's ``enforce_eager``, as verl's and OpenRLHF's option): it builds
    in seconds instead of the 40-100 s its inductor compile takes on a CPU, and samples slower (docs/guide/
    engines.md has the measurement). For short runs and debugging; no effect on the native engine."""
    step_runner: str = "eager"
    """How the native engine runs its plain decoding step (``DecodeSchedule.runner``): "eager", "compiled-onednn"
    (inductor, one static graph per bucket of the live batch: multiples of 8 rows, powers of two below 8; on
    oneDNN-packed weight products),
    "compiled" (the same on aten's products), or "auto": eager or the compiled runner, whichever a short rollout
    measured faster on this CPU kind, model shape and dtype (timed once per machine and cached). Compiling costs
    about a minute per bucket the first time on a 2-core CPU; the kernels are cached across runs. Hybrid models and
    recorded MoE routes run eagerly. Left at "eager" with rollout.engine = "auto", the runner "auto" chose the
    native engine with where it did (engines.AUTO_CPU_KINDS; not for LoRA runs)."""
    branching: list[int] = field(default_factory=list)
    """Multi-turn branching ([env]): [4, 2] starts 4 conversations per prompt and forks each 2 ways after its
    first environment reply (product = num_generations); shared turns are sampled once. [] does not branch."""

    def check(self, key: str) -> None:
        from turbogrpo.rollout.sampling import sampling_problem
        from turbogrpo.speculative.sizing import SIZING_POLICIES  # the registry is the one source of names
        from turbogrpo.engines import ENGINE_NAMES
        _require(self.speculation in SIZING_POLICIES, f"{key}.speculation", f"one of {', '.join(SIZING_POLICIES)}",
                 self.speculation)
        _require(self.engine in ENGINE_NAMES, f"{key}.engine", f"one of {', '.join(ENGINE_NAMES)}", self.engine)
        from turbogrpo.rollout.compiled import RUNNER_NAMES
        _require(self.step_runner in RUNNER_NAMES, f"{key}.step_runner", f"one of {', '.join(RUNNER_NAMES)}",
                 self.step_runner)
        _require(self.num_generations >= 2, f"{key}.num_generations",
                 "an integer >= 2 (group-relative advantages need at least two completions per prompt)",
                 self.num_generations)
        _require(self.temperature > 0, f"{key}.temperature",
                 "a number > 0 (training samples; greedy decoding would give G identical completions)",
                 self.temperature)
        _require(not self.branching or (all(b >= 1 for b in self.branching) and
                                        math.prod(self.branching) == self.num_generations),
                 f"{key}.branching", f"[] or integers >= 1 whose product is num_generations={self.num_generations} "
                 "(e.g. [4, 2] for 8)", self.branching)
        problem = sampling_problem(max_new_tokens=self.max_new_tokens, top_p=self.top_p, top_k=self.top_k,
                                   stop_strings=self.stop_strings)  # the sampler's own rules
        if problem is not None:
            name, allowed, value = problem
            _require(False, f"{key}.{name}", allowed, value)


@dataclass
class DraftLearningConfig:
    """The draft head of speculative rollouts (rollout.speculation) and its online learning; draft
    training (``speculative.train_draft``, offline too) takes this section itself."""

    path: str = "scratch"
    """A draft folder saved by `turbogrpo draft train`, a built draft's name (`turbogrpo draft build`, e.g.
    "smollm2-gsm8k"), or "scratch" for a new, untrained draft."""
    history: bool = False
    """Also propose suffix matches in the group's siblings and in earlier steps' completions of the same
    prompt (history drafts: no neural forward), merged into the draft's trees; verified like any tree."""
    num_layers: int = 1
    """Decoder layers of a scratch draft (EAGLE's 1: deeper drafts cost more than they gain)."""
    layout: str = "turbogrpo"
    """Layout of a scratch draft: "turbogrpo" (the policy's final features), "eagle3" (a low, a middle and a high
    layer of the policy with the final features, EAGLE-3's; train it with ttt_steps > 1) or "eagle" (vLLM's EAGLE
    drafter exactly, so `turbogrpo draft export-vllm` can hand it to vLLM); a saved draft keeps its own."""
    init_from_policy: bool = False
    """Start a scratch draft's decoder layer as a copy of the policy's last layer (where shapes agree)."""
    ttt_steps: int = 1
    """Training-time test: train the draft on its own predictions for this many steps, as it drafts that deep
    (EAGLE-3, HASS); 1: teacher forcing on the policy's features alone. Each step costs about one more draft
    forward in training."""
    learn: bool = True
    """Train the draft after every rollout on the policy's features of all completions (false: frozen)."""
    lr: float = 1e-3
    """AdamW learning rate; above EAGLE's offline 1e-4 so a scratch draft is useful within tens of steps."""
    feature_weight: float = 1.0
    """w_v: weight of SmoothL1(predicted feature, policy feature) (EAGLE 1.0, FastGRPO's code 2.0)."""
    logit_weight: float = 0.1
    """w_p: weight of CE(draft distribution, policy distribution) (EAGLE and FastGRPO 0.1)."""
    steps: int = 1
    """Draft optimizer steps per GRPO step (the step's completions are split between them)."""
    max_tokens: int = 0
    """Token budget: the most tokens (each group's prompt once, plus its completions) the draft trains
    on per GRPO step, whole groups drawn at random (0: the whole rollout); it bounds the draft's share
    of the step time where the draft is not much smaller than the policy."""
    weight_decay: float = 0.0
    """AdamW weight decay of the draft (EAGLE uses none)."""
    max_grad_norm: float = 0.5
    """Gradient clipping of the draft (EAGLE's value); keeps early steps on random features stable."""

    def check(self, key: str) -> None:
        from turbogrpo.speculative.built_drafts import BUILT_DRAFTS, built_draft_folder, is_built
        from turbogrpo.speculative.draft import CONFIG_FILE, DRAFT_LAYOUTS, WEIGHTS_FILE
        if self.path in BUILT_DRAFTS:
            built = BUILT_DRAFTS[self.path]
            _require(is_built(built_draft_folder(built)), f"{key}.path", f"a built draft; build it once with "
                     f"`turbogrpo draft build --model {built.model}`", self.path)
        _require(self.path in ("scratch", *BUILT_DRAFTS) or
                 all((Path(self.path) / f).is_file() for f in (CONFIG_FILE, WEIGHTS_FILE)),
                 f"{key}.path", f"\"scratch\", a built draft's name ({', '.join(BUILT_DRAFTS)}) or a folder holding "
                 f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by `turbogrpo draft train`)", self.path)
        _require(self.num_layers >= 1, f"{key}.num_layers", "an integer >= 1", self.num_layers)
        _require(self.layout in DRAFT_LAYOUTS, f"{key}.layout", f"one of {', '.join(DRAFT_LAYOUTS)}", self.layout)
        _require(not self.init_from_policy or self.path == "scratch", f"{key}.init_from_policy",
                 "false for a saved or built draft (it keeps its trained weights)", self.init_from_policy)
        _require(isinstance(self.ttt_steps, int) and not isinstance(self.ttt_steps, bool) and 1 <= self.ttt_steps <= 16,
                 f"{key}.ttt_steps", "an integer in [1, 16] (1: teacher forcing alone)", self.ttt_steps)
        _require(self.lr > 0, f"{key}.lr", "a number > 0", self.lr)
        _require(self.feature_weight >= 0, f"{key}.feature_weight", "a number >= 0", self.feature_weight)
        _require(self.logit_weight >= 0, f"{key}.logit_weight", "a number >= 0", self.logit_weight)
        _require(self.feature_weight + self.logit_weight > 0, f"{key}.feature_weight",
                 "weights with a positive sum (feature_weight + logit_weight > 0)", self.feature_weight)
        _require(self.steps >= 1, f"{key}.steps", "an integer >= 1", self.steps)
        _require(self.max_tokens >= 0, f"{key}.max_tokens", "an integer >= 0 (0: every completion token)",
                 self.max_tokens)
        _require(self.weight_decay >= 0, f"{key}.weight_decay", "a number >= 0", self.weight_decay)
        _require(self.max_grad_norm > 0, f"{key}.max_grad_norm", "a number > 0", self.max_grad_norm)


@dataclass
class AlgoConfig:
    """The GRPO objective; the losses take this section itself (``turbogrpo.algo.build_loss``)."""

    loss: str = "dapo"
    """Loss variant: grpo, dr_grpo, dapo (TRL's default), bnpo or gspo (sequence-level ratio)."""
    beta: float = 0.0
    """k3 KL coefficient to the reference model; 0 (TRL's default) builds no reference model at all."""
    epsilon_low: float = 0.2
    """Lower clip: ratios below 1 - epsilon_low stop pushing down."""
    epsilon_high: float = 0.28
    """Upper clip (clip-higher, DAPO's 0.28): more room for raising unlikely good tokens."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the reward std of the group, of the whole batch, or not at all (Dr. GRPO)."""
    num_iterations: int = 1
    """Policy updates per rollout; > 1 computes old-policy log-probs before the first update."""
    tis_cap: float | Literal["auto"] = "auto"
    """The off-policy correction's cap: weight each token's policy loss by pi_prox / pi_behav (the trainer's
    log-prob at the update's start over the sampler's), capped here, correcting the sampler-vs-trainer mismatch
    (bf16 kernels, another engine) and stale rollouts (train.max_staleness); 0 turns it off (verl/slime use 2).
    "auto": 2 where the sampler is not the trainer's own forward (rollout.engine resolves to "vllm", or
    train.max_staleness > 0), 0 where it is (the native engine on-policy, where the weight is 1 up to rounding).
    geometric_mask and k3_reject read their own bounds: for them a cap > 0 only turns the correction on."""
    off_policy_correction: str = "tis"
    """What the weight becomes past its bounds (``turbogrpo.algo.OFF_POLICY_CORRECTIONS``, TRL's
    vllm_importance_sampling_mode names): per token "token_truncate" (alias "tis": clamped to [tis_cap_low,
    tis_cap], verl, slime), "token_mask" (alias "mis": 0 outside them, AReaL), "icepop" (the same mask, two-sided:
    needs tis_cap_low > 0); per sequence, on the product of its token weights, "sequence_truncate" and
    "sequence_mask" (TRL's default for vLLM); "geometric_mask" (keep a sequence whose geometric-mean weight is in
    [geometric_mask_low, geometric_mask_high], SkyRL, verl) and "k3_reject" (keep one whose mean k3 is at most
    k3_threshold, verl). Every mode is exactly the uncorrected loss where sampler and trainer agree; see
    docs/design/async.md."""
    tis_cap_low: float = 0.0
    """The weight's lower bound in the truncate, mask and icepop modes, 0 for none (TRL's
    vllm_importance_sampling_clip_min, slime's tis_clip_low; IcePop uses 0.5)."""
    geometric_mask_low: float = 0.99
    """geometric_mask keeps a sequence whose geometric-mean weight is at least this (SkyRL's recommended 0.99)."""
    geometric_mask_high: float = 1.01
    """... and at most this (SkyRL's 1.01; mixture-of-experts models may need a wider range)."""
    k3_threshold: float = 0.01
    """k3_reject keeps a sequence whose mean k3 estimate of KL(sampler || trainer) per token is at most this
    (verl's default 0.01)."""
    routing_replay: Literal["off", "replay"] = "off"
    """Mixture-of-experts models: "replay" records the experts the sampler's routers chose for every token and makes
    the training forwards use them (R3, as verl, slime and vLLM's enable_return_routed_experts), the gates still
    computed from the trainer's router logits so the routers keep learning; "off": the trainer's routers choose,
    and a router that rounds to other experts than the sampler's scores another function (Megatron-LM #4168:
    94% of tokens differ in some layer). Native engine: plain and speculative rollouts, multi-turn and branching
    conversations (speculative too), on-policy or asynchronous, partial rollouts (each token keeps the routes of
    the weights that drew it), with or without gradient checkpointing; see docs/guide/routing_replay.md."""
    kl_bias_correction: bool = False
    """Multiply each token's k3 by the (differentiable) importance ratio, which makes the KL gradient the
    unbiased reverse-KL gradient (DeepSeek-V3.2), even on-policy where the ratio is 1 in value. TRL's
    use_bias_correction_kl, on by default in TRL 1.16; off here: plain k3 as in the GRPO paper."""

    def resolved(self, *, sampler_differs: bool) -> AlgoConfig:
        """This section with tis_cap a number: "auto" becomes ``turbogrpo.algo.AUTO_TIS_CAP`` if
        ``sampler_differs`` (the rollouts come from another engine or from stale weights), else 0."""
        if self.tis_cap != "auto":
            return self
        from turbogrpo.algo import AUTO_TIS_CAP
        return dataclasses.replace(self, tis_cap=AUTO_TIS_CAP if sampler_differs else 0.0)

    def check(self, key: str) -> None:
        from turbogrpo.algo import LOSSES  # the loss registry is the one source of allowed names
        _require(self.loss in LOSSES, f"{key}.loss", f"one of {', '.join(sorted(LOSSES))}", self.loss)
        _require(self.beta >= 0, f"{key}.beta", "a number >= 0", self.beta)
        _require(0.0 <= self.epsilon_low < 1.0, f"{key}.epsilon_low", "a number in [0, 1)", self.epsilon_low)
        _require(self.epsilon_high >= 0, f"{key}.epsilon_high", "a number >= 0", self.epsilon_high)
        _require(self.num_iterations >= 1, f"{key}.num_iterations", "an integer >= 1", self.num_iterations)
        _require(self.tis_cap in ("auto", 0) or self.tis_cap >= 1, f"{key}.tis_cap",
                 "\"auto\", 0 (off) or a number >= 1, e.g. 2", self.tis_cap)
        _require(self.routing_replay in ("off", "replay"), f"{key}.routing_replay", "\"off\" or \"replay\"",
                 self.routing_replay)
        self._check_correction(key)

    def _check_correction(self, key: str) -> None:
        """The off-policy correction's mode and bounds: each bound keeps a weight of exactly 1 (sampler and
        trainer agreeing) inside, so every mode is the uncorrected loss where they agree."""
        from turbogrpo.algo.losses import OFF_POLICY_CORRECTIONS, TWO_SIDED_CORRECTIONS  # the one source of names
        _require(self.off_policy_correction in OFF_POLICY_CORRECTIONS, f"{key}.off_policy_correction",
                 f"one of {', '.join(OFF_POLICY_CORRECTIONS)}", self.off_policy_correction)
        _require(0 <= self.tis_cap_low <= 1, f"{key}.tis_cap_low", "a number in [0, 1] (0: no lower bound)",
                 self.tis_cap_low)
        _require(self.off_policy_correction not in TWO_SIDED_CORRECTIONS or self.tis_cap_low > 0,
                 f"{key}.tis_cap_low", f"a number in (0, 1] with off_policy_correction = "
                 f"{self.off_policy_correction!r} (a two-sided mask; IcePop uses 0.5)", self.tis_cap_low)
        _require(0 < self.geometric_mask_low <= 1, f"{key}.geometric_mask_low", "a number in (0, 1], e.g. 0.99",
                 self.geometric_mask_low)
        _require(self.geometric_mask_high >= 1, f"{key}.geometric_mask_high", "a number >= 1, e.g. 1.01",
                 self.geometric_mask_high)
        _require(self.k3_threshold > 0, f"{key}.k3_threshold", "a number > 0, e.g. 0.01", self.k3_threshold)


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine (or constant) decay, and grad-norm clipping."""

    lr: float = 1e-6
    """Peak learning rate (TRL's default; small models tolerate far more, see configs/demo.toml)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """Adam betas; 0.99 (not 0.999) reacts faster to the shifting RL gradient."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    schedule: Literal["cosine", "constant", "linear"] = "constant"
    """Decay after warm-up, down to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr` (cosine/linear)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""

    def check(self, key: str) -> None:
        _require(self.lr > 0, f"{key}.lr", "a number > 0", self.lr)
        _require(self.weight_decay >= 0, f"{key}.weight_decay", "a number >= 0", self.weight_decay)
        _require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), f"{key}.betas",
                 "two numbers in [0, 1), e.g. [0.9, 0.99]", self.betas)
        _require(self.eps > 0, f"{key}.eps", "a number > 0", self.eps)
        _require(self.warmup_steps >= 0, f"{key}.warmup_steps", "an integer >= 0", self.warmup_steps)
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        _require(self.max_grad_norm >= 0, f"{key}.max_grad_norm", "a number >= 0 (0 disables clipping)",
                 self.max_grad_norm)


@dataclass
class TrainConfig:
    """The run: how long, how big a step, where outputs go."""

    num_steps: int = 100
    """GRPO steps (one rollout each, followed by algo.num_iterations optimizer steps)."""
    prompts_per_step: int = 8
    """Prompts per step, across all ranks; each yields rollout.num_generations completions."""
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward (prompt once + its completions); gradients accumulate over them."""
    sharing: str = "prompt"
    """What the training forward runs once per micro-batch (``turbogrpo.sharing``): "prompt" (each
    group's prompt), "tree" (one trie: completions that begin alike, e.g. multi-turn conversations sharing
    turns, share those tokens too; the budget counts trie tokens), "auto" (the tree where its trie saves
    enough tokens, else the prompt path). Exact either way; "prompt" is the measured default."""
    seed: int = 0
    """Seeds data order, sampling and initialisation; the same seed gives the same run on CPU."""
    output_dir: str = "runs/grpo"
    """Checkpoints, metrics, report and the final model go here."""
    checkpoint_every: int = 50
    """Save a resumable checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep on disk."""
    max_nonfinite_steps: int = 5
    """Stop (with a checkpoint) after this many optimizer steps in a row skipped for NaN/inf loss or gradients."""
    eval_every: int = 0
    """Greedy accuracy on the held-out set every N steps (0: only before and after training)."""
    accuracy_reward: str = "math_accuracy"
    """Reward (a built-in or a [[rewards]] function) logged as "accuracy" and used to score held-out answers;
    "" for none (no held-out evaluation)."""
    reward_failure_limit: float = 1.0
    """Stop the run when one reward function fails on at least this fraction of a step's completions
    (1: only when it fails on every one; 0: never stop). Failures always get the fallback and are logged."""
    save_final_model: bool = True
    """Export the trained model with save_pretrained to output_dir/final."""
    final_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the exported weights; "auto" is model.dtype (a bfloat16 run exports bfloat16)."""
    num_threads: int = 0
    """CPU threads per process for torch (0: torch's default, one per core). Tiny models run fastest on 1."""
    max_staleness: int = 0
    """k: the rollouts of steps t+1..t+k are drawn while step t updates, from weights k steps old (corrected by
    algo.off_policy_correction: algo.tis_cap "auto" is on at k > 0, and 0 is refused), by a rollout worker process (docs/design/async.md).
    0 is the on-policy loop: no worker, the rollout samples with the weights being trained."""
    rollout_threads: int = 0
    """With max_staleness > 0: CPU threads of the rollout worker process (0: half the cores; the trainer then
    takes the rest unless train.num_threads says otherwise; a remote worker: 0 is torch's default on its machine).
    Unused on-policy."""
    partial_rollouts: int = 0
    """c: most steps a generation may continue into after the step it started for (APRIL-style partial rollouts,
    single-turn, native or vLLM engine; 0: off). A step's rollout stops once it has prompts_per_step whole groups, and the
    generations still running continue in the next step's rollout with newer weights, their tokens keeping the
    versions that drew them. 1 <= c <= max_staleness: the worker then draws max_staleness - c steps ahead, so no
    token lags more than max_staleness updates (docs/design/async.md, "Partial rollouts")."""
    rollout_worker: Literal["local", "remote"] = "local"
    """With max_staleness > 0: where the rollout worker runs (``turbogrpo.train.worker.rollout_worker.TRANSPORTS``).
    "local": a process this trainer starts on its machine (weights through shared memory). "remote": a worker
    started on another machine with `turbogrpo rollout-worker CONFIG --trainer HOST:PORT --rank R`, one per trainer
    rank, over one TCP connection each that admits only a peer proving the run's secret, encrypted (tensors and
    JSON, no pickles; an [env] run's environments stay on the worker's machine, the trainer gets their rewards and
    conversations; docs/guide/distributed.md says the trust model)."""
    rollout_host: str = "127.0.0.1"
    """With rollout_worker = "remote": the address the trainer listens on. Loopback by default (a worker on this
    machine); a worker on another machine needs this machine's address on their network ("0.0.0.0": every
    interface) and a secret set on both ($TURBOGRPO_ROLLOUT_SECRET or rollout_secret_file)."""
    rollout_port: int = 29600
    """With rollout_worker = "remote": trainer rank r listens for its worker on port rollout_port + r."""
    rollout_connect_timeout_s: float = 600.0
    """With rollout_worker = "remote": how long the trainer waits for its worker to connect (and a worker for its
    trainer) before it stops with one error line."""
    rollout_secret_file: str = ""
    """With rollout_worker = "remote": a file holding the secret both sides prove they hold (at least 16
    characters; $TURBOGRPO_ROLLOUT_SECRET takes precedence). "" on loopback: this user's own, made once in
    turbogrpo's cache folder. Only the path is kept in the config: the secret is never logged or checkpointed."""

    def __post_init__(self):
        # One spelling of the folder for every module that writes there: "~" expanded, "a/.." and "./" gone
        # (otherwise the lock, checkpoints and exports could land in different folders).
        if isinstance(self.output_dir, str) and self.output_dir:
            self.output_dir = os.path.normpath(os.path.expanduser(self.output_dir))

    def check(self, key: str) -> None:
        _require(self.num_steps >= 1, f"{key}.num_steps", "an integer >= 1", self.num_steps)
        _require(self.prompts_per_step >= 1, f"{key}.prompts_per_step", "an integer >= 1", self.prompts_per_step)
        _require(self.micro_batch_tokens >= 1, f"{key}.micro_batch_tokens", "an integer >= 1",
                 self.micro_batch_tokens)
        from turbogrpo.sharing import SHARINGS  # the registry is the one source of names
        _require(self.sharing in SHARINGS, f"{key}.sharing", f"one of {', '.join(SHARINGS)}", self.sharing)
        _require(self.seed >= 0, f"{key}.seed", "an integer >= 0", self.seed)
        _require(self.output_dir != "", f"{key}.output_dir", "a folder path", self.output_dir)
        _require(self.checkpoint_every >= 0, f"{key}.checkpoint_every", "an integer >= 0 (0: only at the end)",
                 self.checkpoint_every)
        _require(self.keep_checkpoints >= 1, f"{key}.keep_checkpoints", "an integer >= 1", self.keep_checkpoints)
        _require(self.max_nonfinite_steps >= 1, f"{key}.max_nonfinite_steps", "an integer >= 1",
                 self.max_nonfinite_steps)
        _require(self.eval_every >= 0, f"{key}.eval_every", "an integer >= 0", self.eval_every)
        _require(self.num_threads >= 0, f"{key}.num_threads", "an integer >= 0 (0: torch's default)",
                 self.num_threads)
        _require(self.max_staleness >= 0, f"{key}.max_staleness", "an integer >= 0 (0: on-policy)", self.max_staleness)
        _require(self.rollout_threads >= 0, f"{key}.rollout_threads", "an integer >= 0 (0: half the cores)",
                 self.rollout_threads)
        _require(1 <= self.rollout_port <= 65535, f"{key}.rollout_port", "a TCP port (1..65535)", self.rollout_port)
        _require(0 < self.rollout_connect_timeout_s <= MAX_WAIT_S, f"{key}.rollout_connect_timeout_s",
                 f"a number of seconds in (0, {MAX_WAIT_S:g}] (a week)", self.rollout_connect_timeout_s)
        _require(self.rollout_host.strip() != "", f"{key}.rollout_host", "an address to listen on (e.g. 127.0.0.1)",
                 self.rollout_host)
        _require(0 <= self.partial_rollouts <= self.max_staleness, f"{key}.partial_rollouts",
                 f"an integer in [0, train.max_staleness = {self.max_staleness}] (a carried generation's first "
                 "tokens lag one update more per step it is carried)", self.partial_rollouts)
        _require(0.0 <= self.reward_failure_limit <= 1.0, f"{key}.reward_failure_limit",
                 "a fraction in [0, 1] (0: never stop)", self.reward_failure_limit)


@dataclass
class LogConfig:
    """What is recorded besides the per-step JSONL metrics."""

    tensorboard: bool = True
    """Also write TensorBoard event files to output_dir/tensorboard."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""
    completions_every: int = 10
    """Write sample completions (prompt, completion, rewards) every N steps to completions.jsonl (0: never)."""
    num_completions: int = 4
    """How many completions each such sample holds."""
    report: bool = True
    """Draw the end-of-run report (PNG plots of rewards, accuracy and phase times)."""

    def check(self, key: str) -> None:
        _require(self.completions_every >= 0, f"{key}.completions_every", "an integer >= 0",
                 self.completions_every)
        _require(self.num_completions >= 1, f"{key}.num_completions", "an integer >= 1", self.num_completions)


@dataclass
class DistributedConfig:
    """Multi-process training under torchrun (ignored in a single process)."""

    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """ddp replicates the model and averages gradients; fsdp2 shards parameters (fully_shard) per layer."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto is nccl on CUDA and gloo on CPU."""


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment (``turbogrpo.env``); off while ``factory`` is empty."""

    factory: str = ""
    """``package.module:callable`` returning one environment per conversation (TRL's environment_factory);
    "" runs single-turn completions."""
    max_turns: int = 4
    """Most model turns per conversation; an environment that never ends the episode is cut here."""
    tool_parser: str = "hermes"
    """Key of ``turbogrpo.env.TOOL_CALL_PARSERS``: how tool calls are read from a turn."""
    max_turn_tokens: int = 128
    """Most model tokens in one turn; a turn cut here ends its conversation as truncated."""
    max_conversation_tokens: int = 512
    """Most ids after the prompt (model and environment together); a reply that would pass it is dropped."""
    end_of_turn: str = ""
    """The text of the token that ends an assistant turn; "" reads the tokenizer's eos token."""
    chat_template: str = ""
    """A Jinja chat template to use instead of the tokenizer's (e.g. one that renders tools); "" keeps it.
    The name of a template in ``turbogrpo.env.tasks.CHAT_TEMPLATES`` ("demo") stands for that template."""
    reply_timing: str = "next_step"
    """Key of ``turbogrpo.rollout.multiturn.REPLY_TIMINGS``: "next_step" makes every rollout follow from its
    seed (exact resume); "arrival" lets slow environments overlap more, but draws then depend on timing."""
    feed_width: str = "bounded"
    """Key of ``turbogrpo.rollout.multiturn.FEED_WIDTHS``: how wide a decode step is while some rows prefill an
    environment's reply. "bounded" keeps padding to at most half the step (a long reply goes in over a few
    steps; 3.22x HF generate on the calculator task against 1.99x for "widest"); each draw is from the same distribution, only which step it falls in changes.
    Speculative rollouts feed whole chunks: their steps are a draft tree wide for every row already."""
    call_timeout_s: float = 300.0
    """Seconds one environment call (the factory, reset, a turn's tools or reply, get_reward) may run; past it
    that conversation fails with the method named, and the stuck thread is abandoned (0: no limit). Long
    enough for a sandboxed program, short enough that a hung environment cannot hang the run."""
    max_workers: int = 16
    """Most environment calls running at once, on their own threads; 1 runs environment code serially (for
    environments that share state without locks)."""

    def check(self, key: str) -> None:
        from turbogrpo.env.tool_calls import TOOL_CALL_PARSERS  # the registry is the one source of names
        from turbogrpo.rollout.multiturn import FEED_WIDTHS, REPLY_TIMINGS
        _require(self.factory == "" or ":" in self.factory, f"{key}.factory",
                 "\"\" or an import path 'package.module:callable'", self.factory)
        _require(self.reply_timing in REPLY_TIMINGS, f"{key}.reply_timing", f"one of {', '.join(REPLY_TIMINGS)}",
                 self.reply_timing)
        _require(self.feed_width in FEED_WIDTHS, f"{key}.feed_width", f"one of {', '.join(FEED_WIDTHS)}",
                 self.feed_width)
        _require(self.tool_parser in TOOL_CALL_PARSERS, f"{key}.tool_parser",
                 f"one of {', '.join(TOOL_CALL_PARSERS)}", self.tool_parser)
        for name in ("max_turns", "max_turn_tokens", "max_conversation_tokens", "max_workers"):
            _require(getattr(self, name) >= 1, f"{key}.{name}", "an integer >= 1", getattr(self, name))
        _require(math.isfinite(self.call_timeout_s) and self.call_timeout_s >= 0, f"{key}.call_timeout_s",
                 "a number of seconds >= 0 (0: no limit)", self.call_timeout_s)
        _require(self.max_turn_tokens <= self.max_conversation_tokens, f"{key}.max_turn_tokens",
                 f"at most max_conversation_tokens={self.max_conversation_tokens}", self.max_turn_tokens)


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    draft: DraftLearningConfig = field(default_factory=DraftLearningConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def check(self, key: str) -> None:
        from turbogrpo.rewards import BUILTIN_REWARDS
        _require(len(self.rewards) >= 1, "rewards", "at least one [[rewards]] entry", self.rewards)
        named = [r.function.rpartition(":")[2] for r in self.rewards]
        known = sorted({*named, *BUILTIN_REWARDS})
        _require(self.train.accuracy_reward in ("", *known), "train.accuracy_reward",
                 f"a reward's name ({', '.join(known)}) or \"\" for no held-out evaluation",
                 self.train.accuracy_reward)
        _require(not self.env.factory or self.rollout.speculation == "off" or not self.draft.learn, "draft.learn",
                 "false with an [env] factory and rollout.speculation on (the draft does not yet learn online from "
                 "conversations: give a trained draft.path, or draft.history = true, and draft.learn = false)",
                 self.draft.learn)
        _require(not self.rollout.branching or self.env.factory, "rollout.branching",
                 "[] without an [env] factory (conversations fork at environment replies)", self.rollout.branching)
        _require(not self.rollout.branching or self.rollout.speculation == "off", "rollout.branching",
                 "[] with rollout.speculation on (speculative multi-turn rollouts do not fork conversations yet)",
                 self.rollout.branching)
        _require(not self.env.factory or not self.rollout.stop_strings, "rollout.stop_strings",
                 "[] with an [env] factory (a model turn ends on env.end_of_turn's token, the chat template's end of "
                 "turn; stop strings would end turns the template cannot render)", self.rollout.stop_strings)
        from turbogrpo.engines import capable_engines, missing_capability
        _require(not missing_capability(self.rollout.engine, ["sharded_weights"]) or self.distributed.strategy != "fsdp2",
                 "rollout.engine", f"{_either([*capable_engines('sharded_weights'), 'auto'])} with "
                 "distributed.strategy = \"fsdp2\" (this engine is given whole weights, which FSDP2 shards)",
                 self.rollout.engine)
        _require(not self.env.factory or self.data.chat_template != "never", "data.chat_template",
                 "\"auto\" or \"always\" with an [env] factory (multi-turn prompts are chat messages)",
                 self.data.chat_template)
        _require(not self.draft.history or self.rollout.speculation != "off", "draft.history",
                 "false while rollout.speculation = \"off\" (history drafts are candidates of speculative "
                 "rollouts: set rollout.speculation, e.g. \"cost\")", self.draft.history)
        fsdp2 = self.distributed.strategy == "fsdp2"
        _require(not (fsdp2 and self.lora.enabled) or self.algo.beta == 0, "algo.beta", "0 with distributed.strategy "
                 "= \"fsdp2\" and LoRA (the reference, the base model without adapters, cannot be scored; or use "
                 "strategy \"ddp\")", self.algo.beta)
        _require(not fsdp2 or self.rollout.speculation == "off", "rollout.speculation", "\"off\" with "
                 "distributed.strategy = \"fsdp2\" (the draft head shares the policy's embeddings and LM head, which "
                 "FSDP2 shards; or use strategy \"ddp\")", self.rollout.speculation)
        self._check_vllm_speculation()
        self._check_asynchronous()
        self._check_routing_replay()
        from turbogrpo.speculative.built_drafts import BUILT_DRAFTS, same_model
        built = BUILT_DRAFTS.get(self.draft.path)
        _require(built is None or same_model(built.model, self.model.path), "draft.path",
                 f"a draft of this run's model.path {self.model.path!r} (draft {self.draft.path!r} is "
                 f"built for {built.model if built else ''!r})", self.draft.path)

    def _check_routing_replay(self) -> None:
        """Routing replay needs an engine that records routes (a capability), refused in one line otherwise."""
        if self.algo.routing_replay == "off":
            return
        from turbogrpo.engines import MISSING_BECAUSE, capable_engines, missing_capability
        _require(not missing_capability(self.rollout.engine, ["routing_replay"]), "rollout.engine",
                 f"{_either([*capable_engines('routing_replay'), 'auto'])} with algo.routing_replay = \"replay\" "
                 f"({MISSING_BECAUSE.get((self.rollout.engine, 'routing_replay'), 'it records no routes')})",
                 self.rollout.engine)

    def engine_needs(self) -> tuple[str, ...]:
        """What this run needs of its rollout engine (``engines.EngineCapabilities`` fields): "auto" picks an
        engine with all of them whatever ``AUTO_ENGINES`` says. Speculation counts whatever the device (an engine's
        own drafter needs a draft of layout "eagle", which "auto" does not assume)."""
        from turbogrpo.engines import run_needs
        return run_needs(speculation=self.rollout.speculation != "off", conversations=bool(self.env.factory),
                         partial_rollouts=self.train.partial_rollouts > 0, asynchronous=self.train.max_staleness > 0,
                         sharded=self.distributed.strategy == "fsdp2", routing_replay=self.algo.routing_replay != "off")

    def _check_vllm_speculation(self) -> None:
        """An engine that speculates through its own drafter (vLLM's EAGLE: it lacks ``tree_speculation``) with
        rollout.speculation on: the draft runs as that drafter (docs/guide/vllm_speculation.md), so it must be one,
        in vLLM's layout."""
        from turbogrpo.engines import CAPABILITIES
        engine = CAPABILITIES.get(self.rollout.engine)  # (None: "auto", which drafts in the tree-verifying engine)
        if engine is None or engine.tree_speculation or self.rollout.speculation == "off":
            return
        from turbogrpo.engines.vllm_speculation import speculation_problem
        problem = speculation_problem("cpu" if self.model._runs_on_cpu() else "cuda", greedy=False)  # GRPO samples
        _require(problem is None, "rollout.speculation", f"\"off\" with rollout.engine = \"vllm\" here: {problem}",
                 self.rollout.speculation)
        _require(not self.draft.history, "draft.history", "false with rollout.engine = \"vllm\" (vLLM drafts with "
                 "its EAGLE drafter alone; history drafts run in the native engine)", self.draft.history)
        from turbogrpo.speculative.built_drafts import resolve_draft_path
        from turbogrpo.speculative.draft import saved_layout
        if self.draft.path == "scratch":
            _require(self.draft.layout == "eagle", "draft.layout", "\"eagle\" with rollout.engine = \"vllm\" and "
                     "rollout.speculation on (vLLM's EAGLE drafter runs only that layout)", self.draft.layout)
            return
        layout = saved_layout(resolve_draft_path(self.draft.path))
        _require(layout == "eagle", "draft.path", "a draft of layout \"eagle\" with rollout.engine = \"vllm\" "
                 f"(this one's is {layout!r}; vLLM's EAGLE drafter runs only that layout: `turbogrpo draft train "
                 "--layout eagle`)", self.draft.path)

    def _check_asynchronous(self) -> None:
        """train.max_staleness > 0: what the rollout worker process cannot do (yet), refused in one line each."""
        _require(self.train.rollout_worker == "local" or self.train.max_staleness > 0, "train.rollout_worker",
                 "\"local\" with train.max_staleness = 0 (the on-policy loop has no rollout worker)",
                 self.train.rollout_worker)
        if self.train.max_staleness <= 0:  # (a negative k is the [train] section's to refuse)
            return
        # Stale tokens without the behaviour weight would be taken as the proximal policy's samples: a bias that
        # grows with k (docs/design/async.md); the correction is exact at lag 0, so it costs nothing on-policy.
        _require(self.algo.tis_cap != 0, "algo.tis_cap", "\"auto\" or a number >= 1 with train.max_staleness > 0 "
                 "(the off-policy correction of stale rollouts; verl/slime use 2)", self.algo.tis_cap)
        if self.rollout.speculation != "off":  # the worker drafts with each version's draft; the trainer teaches it
            from turbogrpo.engines import capable_engines, missing_capability
            _require(not missing_capability(self.rollout.engine, ["trainer_taught_drafts"]), "rollout.engine",
                     f"{_either([*capable_engines('trainer_taught_drafts'), 'auto'])} with "
                     "rollout.speculation on and train.max_staleness > 0 (the rollout worker drafts with the draft the "
                     "trainer teaches; an engine's own drafter fed from the trainer is not built)", self.rollout.engine)
        _require(self.distributed.strategy != "fsdp2", "distributed.strategy", "\"ddp\" with train.max_staleness "
                 "> 0 (the rollout worker copies whole weights, which FSDP2 shards)", self.distributed.strategy)
        if self.train.partial_rollouts:  # what a carried generation cannot do yet
            _require(not self.env.factory, "env.factory", "\"\" with train.partial_rollouts > 0 (partial rollouts "
                     "carry single-turn completions only; multi-turn conversations are not carried yet)",
                     self.env.factory)
            _require(not self.rollout.stop_strings, "rollout.stop_strings", "[] with train.partial_rollouts > 0 (a "
                     "stop string spanning a carried generation's two parts would be missed; stop_token_ids work)",
                     self.rollout.stop_strings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------
# Loading, overrides and validation.
# ---------------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML/YAML file (or start from the defaults), apply ``key.sub=value`` overrides, validate.

    A file that sets nothing, with no overrides either, is refused: it would start a default run.

    Raises :class:`ConfigError` naming the key for anything wrong, before any model is loaded.
    """
    raw = read_config_file(path) if path is not None else {}
    if path is not None and not raw and not overrides:
        raise ConfigError(f"config file {str(path)!r} holds no settings; give at least the sections you change "
                          "(see configs/ for examples), or run `turbogrpo demo` for the built-in defaults")
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def read_config_file(path: str | Path) -> dict:
    """The sections of a TOML/YAML config file ({} when empty); ConfigError for a missing or malformed one."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder; pass a .toml or .yaml file (see configs/)")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark some editors write is dropped
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise ConfigError(f"config file {str(path)!r} line {line}: not valid UTF-8 "
                          f"(byte 0x{err.object[err.start]:02x}); save it as UTF-8") from None
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    elif path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(err)}") from None
    else:
        raise ConfigError(f"config file {str(path)!r}: allowed extensions are .toml, .yaml and .yml")
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table of sections, not {type(data).__name__}")
    return data


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: where and what (PyYAML's own message spans several, quoting the file)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(err).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (as in TOML), not
    a silent replacement of the first value and everything under it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "merge the two into one", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``key.sub=value`` (``rewards.0.weight=2`` indexes lists) to the raw config dict.

    The value is read as a TOML value (numbers, true/false, "strings", [lists]); anything that is not
    valid TOML is taken as a bare string, so ``algo.loss=grpo`` works without quotes.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected the form key.sub=value, e.g. optim.lr=1e-5")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    parts = dotted.split(".")
    if not dotted or any(p == "" for p in parts):
        raise ConfigError(f"override {item!r}: expected the form key.sub=value, e.g. optim.lr=1e-5")
    value = _parse_override_value(text.strip())
    node: Any = raw
    schema: Any = Config
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        key = ".".join(parts[:depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError(f"config key {key!r}: {part!r} is not an index of the list (it has {len(node)} "
                                  "entries; use an index < that, or = the length to append)")
            index = int(part)
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                node = node[index]
                schema = _list_item_type(schema)
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"config key {key!r}: its parent is a value, not a table")
        if last:
            node[part] = value
            break
        child_schema = _field_type(schema, part, key)
        if part not in node:
            node[part] = [dataclasses.asdict(x) for x in _default_of(schema, part)] \
                if _is_list_of_dataclass(child_schema) else {}
        node = node[part]
        schema = child_schema


def config_from_dict(raw: Mapping) -> Config:
    config = _build(Config, raw, "")
    _check_all(config, "")
    return config


def _parse_override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(cls: type, raw: Any, key: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config key {key or '(top level)'!r} must be a table of keys, got "
                          f"{_describe(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for name, value in raw.items():
        sub = f"{key}.{name}" if key else str(name)
        if name not in names:
            raise _unknown_key(cls, str(name), key)
        values[name] = _coerce(value, hints[name], sub)
    return cls(**values)


MAX_WAIT_S = 7 * 24 * 3600.0
"""The longest wait a setting may ask for (seconds): more is a typo, and overflows the clocks' arithmetic."""

_EXPECTED = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
"""What a value of each plain type is called in an error (a Literal names its values)."""


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key {key!r}: {value!r} is not allowed; expected one of "
                              f"{', '.join(repr(a) for a in args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inners = [a for a in args if a is not type(None)]
        if len(inners) == 1:
            return _coerce(value, inners[0], key)
        for inner in inners:  # e.g. float | Literal["auto"]: the first type that takes the value
            try:
                return _coerce(value, inner, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key {key!r}: {value!r} is not allowed; expected "
                          f"{' or '.join(_EXPECTED.get(a) or ' or '.join(map(repr, typing.get_args(a))) for a in inners)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r}: expected a list, got {_describe(value)}")
        return [_coerce(v, args[0], f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a table, got {_describe(value)}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        # YAML 1.1 reads "1e-5" as a string; accept any string that is a number.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r}: expected a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"config key {key!r}: {value!r} is not allowed; expected a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r}: expected a string, got {_describe(value)}")
        return value
    raise AssertionError(f"config field type {hint} of {key} has no loader")


def _check_all(node: Any, key: str) -> None:
    if dataclasses.is_dataclass(node):
        if hasattr(node, "check"):
            node.check(key or "config")
        for f in dataclasses.fields(node):
            _check_all(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            _check_all(item, f"{key}.{i}")


def _either(names: list[str]) -> str:
    """``"a" or "b"``: the values a setting may take, for messages."""
    return " or ".join(f'"{name}"' for name in names)


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r}: {value!r} is not allowed; expected {allowed}")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _field_type(schema: Any, name: str, key: str) -> Any:
    if not dataclasses.is_dataclass(schema):
        raise ConfigError(f"config key {key!r}: its parent is a value, not a table")
    hints = typing.get_type_hints(schema)
    if name not in hints:
        raise _unknown_key(schema, name, key.rpartition(".")[0])
    return hints[name]


def _unknown_key(schema: type, name: str, parent: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f"[{parent}]" if parent else "the top level"
    key = f"{parent}.{name}" if parent else name
    return ConfigError(f"config key {key!r} is unknown{hint}; allowed keys in {where}: {', '.join(names)}")


def _is_list_of_dataclass(hint: Any) -> bool:
    return typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0])


def _list_item_type(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is list else None


def _default_of(schema: type, name: str) -> Any:
    return getattr(schema(), name)


def dump_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as JSON (kept next to checkpoints, so a run says what it was)."""
    from turbogrpo.files import write_text_atomically  # (a run killed mid-write must not leave half a config)
    write_text_atomically(Path(path), json.dumps(config.to_dict(), indent=2, sort_keys=True))
