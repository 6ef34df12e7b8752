"""A training run's parts, built once from its config (``build_run``), each from its own section; the
part that samples from a model (``build_policy``: precision, policy, tokenizer, sampling) is shared with
``turbogrpo eval``. ``build_run`` is the one place that reads the whole ``Config``: the step and the
run's state see the parts and the few sections they read. The run's state between steps (resume,
checkpoints, export, interrupt) is state.py's; the step is loop.py's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from turbogrpo.algo import build_loss
from turbogrpo.config import (AlgoConfig, Config, LogConfig, LoraConfig, ModelConfig, OptimConfig,
                              RolloutConfig, TrainConfig)
from turbogrpo.data import PromptBatches
from turbogrpo.data.prompt_sets import check_prompt_count, load_eval_prompts, load_train_prompts
from turbogrpo.linears import TRAINING_LINEAR_KERNELS
from turbogrpo.moe_routes import route_shape
from turbogrpo.placement import DistInfo
from turbogrpo.rewards import Reward, accuracy_reward
from turbogrpo.rollout import SamplingConfig
from turbogrpo.rollout.decode import DecodeSchedule, run_schedule
from turbogrpo.sharing import Sharing, sharing_of
from turbogrpo.engines import CAPABILITIES, DEFAULT_ENGINE, RolloutEngine, build_engine, resolve_choice
from turbogrpo.train import distributed, setup
from turbogrpo.train.draft_learning import OnlineDraft, build_online_draft
from turbogrpo.train.episodes import EpisodeSampler, build_episode_sampler
from turbogrpo.train.evaluate import HeldOut, build_held_out
from turbogrpo.train.metrics import MetricsLog
from turbogrpo.train.optim import build_optimizer
from turbogrpo.train.output_dir import RunRecord
from turbogrpo.train.precision import PURE_BF16_WARNING, Precision, run_precision
from turbogrpo.train.worker.protocol import AheadRollouts


@dataclass
class RunState:
    """What changes from step to step besides weights and optimizer (the counters and evaluations are
    saved in checkpoints); state.py starts, saves and restores it."""

    step: int = 0
    """GRPO steps completed."""
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    evals: list[dict] = field(default_factory=list)
    """Held-out accuracy measurements: {"step": s, "accuracy": a}."""
    log: MetricsLog | None = None
    """The run's metrics.jsonl (and TensorBoard) log, opened by ``state.start`` (not saved)."""
    reported_reward_failures: set[str] = field(default_factory=set)
    """Reward functions (and "[env]", the environments) whose first failure has been printed (each once per
    process; not saved)."""
    checkpointed_step: int | None = None
    """The step of the newest checkpoint holding this state (the one resumed from, or the last saved);
    None: none yet."""


class PolicyParts(NamedTuple):
    """What sampling from the config's policy needs (a run and ``turbogrpo eval`` alike)."""

    precision: Precision
    """Storage and compute dtypes; rollouts and evaluation run under ``precision.autocast()`` like training."""
    policy: nn.Module
    """The Hugging Face model (or PEFT model); rollouts sample with its weights."""
    tokenizer: object
    sampling: SamplingConfig
    """How rollouts sample (the [rollout] section with the model's stop ids)."""


def build_policy(model: ModelConfig, lora: LoraConfig, rollout: RolloutConfig, dist: DistInfo, *,
                 seed: int) -> PolicyParts:
    """The [model] section's policy (with [lora]'s adapters, initialised from ``seed``, train.seed) on
    this rank's device with its precision, built once, and the [rollout] section's sampling."""
    torch.manual_seed(seed)  # LoRA initialisation; resumed runs load their adapters
    precision = run_precision(model.dtype, model.pure_bf16, dist.device)
    policy, tokenizer = setup.load_policy(model, lora, dist.device, precision)
    return PolicyParts(precision, policy, tokenizer, setup.rollout_sampling(rollout, policy, tokenizer))


@dataclass
class Run:
    """The parts one run's steps use, each built once from its own config section, the few sections the
    step and the run's state read, and the run's state (``state``, kept by state.py: resumed, saved,
    exported)."""

    dist: DistInfo
    policy: nn.Module
    """The Hugging Face model (or PEFT model) being trained; rollouts sample with its weights."""
    tokenizer: object
    precision: Precision
    """Storage and compute dtypes; rollouts and evaluation run under ``precision.autocast()`` like training."""
    trainer: nn.Module
    """``trainer(prompts, completions) -> CompletionLogprobs``: the policy's training forward (sharing tokens
    as train.sharing says), wrapped for DDP/FSDP2 when distributed."""
    reference: nn.Module | None
    """The same for the reference policy; None when algo.beta == 0."""
    optimizer: torch.optim.Optimizer
    batches: PromptBatches
    """The training prompts, train.prompts_per_step at a time, in a seeded order (in the checkpoint)."""
    prompts_slice: slice
    """This rank's share of each step's prompts (``distributed.local_slice``; the rollout worker's too)."""
    rewards: list[Reward]
    sampling: SamplingConfig
    """How rollouts sample (the [rollout] section with the model's stop ids)."""
    num_generations: int
    """G: completions per prompt (rollout.num_generations)."""
    decode_schedule: DecodeSchedule
    """When the rollout engine looks at the host, on this device, with the weight-matmul kernel of
    model.linear_kernel."""
    training_kernels: Callable
    """``training_kernels(modules)``: a context manager running their weight matmuls with the training
    kernel of model.linear_kernel (``linears.TRAINING_LINEAR_KERNELS``)."""
    held_out: HeldOut
    """Held-out evaluation: prompts, the accuracy reward, greedy and sampled settings."""
    engine: RolloutEngine
    """What samples the step's completions and conversations (rollout.engine, ``rollout.engines``)."""
    loss: Callable
    """The policy loss with the [algo] settings bound (``algo.build_loss``)."""
    sharing: Sharing
    """What the training forward shares between sequences (train.sharing): the trainer's, the reference's and the
    micro-batch plan's."""
    algo: AlgoConfig
    """The [algo] section: the step reads scale_rewards, beta, tis_cap and num_iterations from it."""
    optim: OptimConfig
    """The [optim] section: the learning-rate schedule and grad-norm clipping of each optimizer step."""
    train: TrainConfig
    """The [train] section: steps, seed, micro-batch budget, failure limits, the output folder."""
    log: LogConfig
    """The [log] section: what the step and the run record besides metrics.jsonl."""
    export_dtype: str
    """dtype of the exported final model: train.final_dtype, or model.dtype for "auto"."""
    record: RunRecord
    """The output folder's record of the run's inputs (config.json, inputs.json)."""
    draft: OnlineDraft | None = None
    """The speculative rollouts' draft head and its online learning; None when rollout.speculation is "off"."""
    draft_context: int = 0
    """The tokens a typical decoding step attends to (longest prompt + half the completion limit): the draft's
    hardware profile is measured there (a rollout worker's too)."""
    engine_max_length: int = 0
    """The longest prompt + completion the engine serves (0: the model's limit; the rollout worker's is the same)."""
    episodes: EpisodeSampler | None = None
    """The [env] section: each step samples conversations with an environment each; None: single completions."""
    rollouts: AheadRollouts | None = None
    """train.max_staleness > 0: the rollout worker (``worker.rollout_worker.RolloutWorker``, started by the loop
    after the build, closed with the run); None: the step samples itself (on-policy)."""
    state: RunState = field(default_factory=RunState)
    """Steps done, skipped-step counters, evaluations, the metrics log (``state.start`` resumes it)."""

    @property
    def max_completion_tokens(self) -> int:
        """The most ids a completion holds: rollout.max_new_tokens, or a whole conversation's after its
        prompt ([env] max_conversation_tokens); dr_grpo's constant."""
        return self.sampling.max_new_tokens if self.episodes is None else self.episodes.max_completion_tokens


def build_run(config: Config, dist: DistInfo, rewards: list[Reward], record: RunRecord) -> Run:
    """The run's parts, each built once from its own section of ``config``, with a fresh state
    (``state.start`` resumes it and opens its output folder); ``record``: the output folder's record of
    ``config`` (``output_dir.run_record``)."""
    if dist.is_main and config.model.pure_bf16:  # the opt-in's warning, from rank 0 (precision.py says why)
        warnings.warn(PURE_BF16_WARNING, UserWarning, stacklevel=1)
    parts = build_policy(config.model, config.lora, config.rollout, dist, seed=config.train.seed)
    precision, policy = parts.precision, parts.policy
    # Before the prompts: it may set the chat template.
    episodes = build_episode_sampler(config.env, parts.tokenizer, config.rollout.branching)
    limits = setup.PromptLimits.of(parts.sampling, episodes, policy)
    # The run's choices by name, each resolved once: its engine (a hybrid vLLM does not serve: one line); the
    # correction that engine calls for (another engine's kernels, or weights some versions old, sample a distribution
    # the trainer's forward only approximates: algo.tis_cap = "auto" corrects for it there and stays off where the
    # sampler is that forward); how the training forward shares tokens; the reward that defines accuracy.
    choice = resolve_choice(config.rollout.engine, dist.device, conversations=episodes is not None,
                            needs=config.engine_needs(), model_type=policy.config.model_type)
    engine_name = choice.engine
    algo = config.algo.resolved(sampler_differs=not CAPABILITIES[engine_name].exact_sampler
                                or config.train.max_staleness > 0)
    sharing = sharing_of(config.train.sharing)
    accuracy = accuracy_reward(config.train.accuracy_reward, rewards)
    # The [data] section's held-out and training prompts, bounded alike (``limits``).
    held_out_prompts = load_eval_prompts(config.data, parts.tokenizer, **limits._asdict())
    prompt_set = load_train_prompts(config.data, parts.tokenizer, seed=config.train.seed, **limits._asdict())
    if dist.is_main and (prompt_set.num_too_long or prompt_set.num_empty):
        model_limit = (f" (or, with {limits.limit_key}={limits.max_new_tokens}, over the model's "
                       f"{limits.max_positions} positions)" if limits.max_positions else "")
        tqdm.write(f"skipped {prompt_set.num_too_long} prompts over data.max_prompt_tokens="
                   f"{config.data.max_prompt_tokens}{model_limit} and {prompt_set.num_empty} empty prompts")
    check_prompt_count(config.data, config.train.prompts_per_step, prompt_set)
    held_out = build_held_out(held_out_prompts, accuracy, parts.sampling, config.data.num_eval_samples,
                              config.train.seed, episodes)
    fn = setup.logprob_fn(config.model.logprob_backend, config.rollout.temperature, precision, sharing)
    trainer = distributed.wrap_for_training(policy, fn, dist, config.distributed.strategy, precision)
    reference = setup.build_reference(config.algo.beta, config.model.path, config.lora.enabled, policy, dist.device,
                                      precision, fn)
    optimizer = build_optimizer(policy, config.optim)
    batches = PromptBatches(prompt_set.examples, config.train.prompts_per_step, seed=config.train.seed,
                            shuffle=config.data.shuffle)
    prompts_slice = distributed.local_slice(config.train.prompts_per_step, dist)
    longest_prompt = max(e.token_ids.numel() for e in prompt_set.examples)
    schedule = run_schedule(dist.device, linears=config.model.linear_kernel,
                            runner=choice.runner_for(config.rollout.step_runner, lora=config.lora.enabled))
    # A conversation's prompt is rendered at rollout time, with its environment's tools listed: longer than the
    # data's ids, so an [env] run's engine serves up to the model's own limit. At k > 0 the rollout worker samples
    # with its own engine; the trainer's samples only held-out answers (a vLLM one would still import vllm into the
    # trainer), so it keeps the default one.
    engine_max_length = longest_prompt + limits.max_new_tokens if episodes is None else 0
    if config.algo.routing_replay == "replay":
        route_shape(policy)  # a model without MoE routers (or with routers moe_routes does not know) stops here
    engine = build_engine(DEFAULT_ENGINE if config.train.max_staleness else engine_name, dist.device, schedule=schedule,
                          dtype=precision.compute_dtype, tokenizer=parts.tokenizer, max_length=engine_max_length or None,
                          enforce_eager=config.rollout.vllm_enforce_eager,
                          record_routes=config.algo.routing_replay == "replay" and not config.train.max_staleness)
    draft_context = longest_prompt + config.rollout.max_new_tokens // 2
    draft = build_online_draft(config.rollout.speculation, config.draft, policy, draft_context)
    return Run(dist=dist, policy=policy, tokenizer=parts.tokenizer, precision=precision, trainer=trainer,
               reference=reference, optimizer=optimizer, batches=batches, prompts_slice=prompts_slice,
               rewards=rewards, sampling=parts.sampling, num_generations=config.rollout.num_generations,
               decode_schedule=schedule, engine=engine,
               training_kernels=TRAINING_LINEAR_KERNELS[config.model.linear_kernel], held_out=held_out,
               loss=build_loss(algo), sharing=sharing, algo=algo, optim=config.optim, train=config.train,
               log=config.log, export_dtype=str(parts.precision.compute_dtype).removeprefix("torch.")
               if config.train.final_dtype == "auto" else config.train.final_dtype, record=record, draft=draft,
               draft_context=draft_context, engine_max_length=engine_max_length, episodes=episodes)
