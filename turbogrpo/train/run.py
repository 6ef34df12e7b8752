"""A training run's components, built once from its config, and what the loop does with them between
steps: held-out evaluation, checkpoints, export of the final model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from turbogrpo.algo import build_loss
from turbogrpo.config import Config, dump_config
from turbogrpo.data import PromptBatches, PromptExample
from turbogrpo.files import WriteError, write_folder_atomically
from turbogrpo.models import resolve_dtype
from turbogrpo.rewards import Reward
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train import checkpoint, distributed, setup
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.draft_learning import OnlineDraft, build_online_draft
from turbogrpo.train.evaluate import HeldOut, build_held_out, describe_accuracies, measure_held_out
from turbogrpo.train import output_dir as output_dir_state
from turbogrpo.train.metrics import METRICS_FILE, MetricsLog
from turbogrpo.train.optim import build_optimizer
from turbogrpo.train.precision import Precision, warn_if_pure




@dataclass
class RunState:
    """What changes from step to step besides weights and optimizer (saved in checkpoints)."""

    step: int = 0
    """GRPO steps completed."""
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    evals: list[dict] = field(default_factory=list)
    """Held-out accuracy measurements: {"step": s, "accuracy": a}."""


@dataclass
class Run:
    """The components one run's steps use, built once from the config."""

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
    log: MetricsLog
    state: RunState
    reported_reward_failures: set[str] = field(default_factory=set)
    """Reward functions whose first failure has been printed (each is printed once per process)."""
    draft: OnlineDraft | None = None
    """The speculative rollouts' draft head and its online learning; None when rollout.speculation is "off"."""


class RewardFailure(ValueError):
    """A reward function failed on too many of a step's completions (train.reward_failure_limit)."""


def build_run(config: Config, dist: DistInfo, rewards: list[Reward], resume: bool) -> Run:
    torch.manual_seed(config.train.seed)  # LoRA initialisation; resumed runs load their adapters
    if dist.is_main:
        warn_if_pure(config.model.pure_bf16)
    precision = setup.precision(config, dist.device)
    policy, tokenizer = setup.load_policy(config, dist.device, precision)
    if dist.enabled and config.distributed.strategy == "fsdp2" and config.lora.enabled and config.algo.beta > 0:
        raise ValueError("config key 'algo.beta': with distributed.strategy = \"fsdp2\" and LoRA the reference "
                         "(the base model without adapters) cannot be scored; use beta = 0 or strategy \"ddp\"")
    fn = setup.logprob_fn(config, precision)
    trainer = distributed.wrap_for_training(policy, fn, dist, config.distributed.strategy, precision)
    reference = setup.build_reference(config, policy, dist.device, precision, fn)
    optimizer = build_optimizer(policy, config.optim)
    max_positions = setup.position_limit(policy)
    prompt_set = setup.load_train_prompts(config, tokenizer, max_positions)
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
    sampling = setup.rollout_sampling(config, policy, tokenizer)
    longest_prompt = max(e.token_ids.numel() for e in prompt_set.examples)
    draft = build_online_draft(config, policy, longest_prompt + config.rollout.max_new_tokens // 2)
    state = RunState()
    output_dir = Path(config.train.output_dir)
    latest = find_resume_checkpoint(output_dir, dist) if resume else None
    if latest is not None:
        resumed = checkpoint.load_checkpoint(latest, policy, optimizer, dist)
        batches.load_state_dict(resumed.state["data"])
        state = RunState(step=resumed.step, nonfinite_in_a_row=resumed.state["nonfinite_in_a_row"],
                         nonfinite_total=resumed.state["nonfinite_total"], evals=resumed.state["evals"])
        if draft is not None and resumed.rank_state is not None:
            draft.load_state_dict(*resumed.rank_state)
        done = output_dir_state.completed_step(output_dir)
        if done is not None and resumed.step >= config.train.num_steps and done >= resumed.step:
            raise RunComplete(resumed.step, state.evals)
        if dist.is_main:
            tqdm.write(f"resumed from {latest} (step {resumed.step})")
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, output_dir / "config.json")
        output_dir_state.record_inputs(output_dir, config)
    log = MetricsLog(output_dir, tensorboard=config.log.tensorboard, enabled=dist.is_main,
                     resume_step=state.step if latest is not None else None)
    return Run(
        config=config, dist=dist, policy=policy, tokenizer=tokenizer, precision=precision, trainer=trainer,
        reference=reference,
        optimizer=optimizer, batches=batches, rewards=rewards, sampling=sampling,
        held_out=build_held_out(config, policy, tokenizer, rewards, sampling),
        loss=build_loss(config.algo),
        log=log, state=state, draft=draft)


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


class RunComplete(Exception):
    """``--resume`` of a run that already trained ``train.num_steps`` steps and wrote its outputs."""

    def __init__(self, step: int, evals: list[dict]):
        super().__init__(f"the run is complete ({step} steps); nothing to do")
        self.step, self.evals = step, evals


class TrainingInterrupted(Exception):
    """Ctrl-C: ``step`` steps were done; ``checkpoint`` is the last complete checkpoint (None: none yet)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


def find_resume_checkpoint(output_dir: Path, dist: DistInfo) -> Path | None:
    """The newest verified checkpoint to resume from (damaged ones are named and passed over); None in an
    empty folder. Metrics without any usable checkpoint are refused, not deleted."""
    latest = checkpoint.latest_checkpoint(output_dir, notice=tqdm.write if dist.is_main else lambda _: None)
    if latest is None and (output_dir / METRICS_FILE).is_file():
        raise ValueError(f"--resume: {output_dir} has {METRICS_FILE} but no complete checkpoint to continue from; "
                         "start the run again with --overwrite (which moves the old files aside) or use another "
                         "train.output_dir")
    if latest is None and dist.is_main:
        tqdm.write(f"--resume: no checkpoint in {output_dir}; starting from step 0")
    return latest


def interrupted(run: Run | None, output_dir: Path) -> TrainingInterrupted:
    """What to report after Ctrl-C: the steps done and the newest checkpoint verified complete."""
    latest = checkpoint.latest_checkpoint(output_dir, notice=tqdm.write) if output_dir.is_dir() else None
    return TrainingInterrupted(run.state.step if run is not None else 0, latest)


def evaluate(run: Run) -> dict | None:
    """Held-out accuracy now: greedy, and sampled at the rollout temperature (fixed seed); recorded,
    logged and printed. None without eval prompts or an accuracy reward.

    An accuracy is never computed from failed rewards: answers the reward failed on are left out (with
    a notice); when it fails on every answer, the run stops before training (step 0) and later skips
    the measurement with a notice, so a long run is not lost at its last evaluation.
    """
    held_out = run.held_out
    if not held_out.enabled:
        return None
    with distributed.full_parameters(run.trainer), run.precision.autocast():
        measured = measure_held_out(held_out, run.policy, run.tokenizer, run.dist)
    greedy, name = measured["accuracy"], held_out.accuracy.name
    if greedy.accuracy is None:
        problem = (f"held-out accuracy at step {run.state.step} cannot be measured: "
                   f"{greedy.describe_failures(name)}. Check train.accuracy_reward and the columns "
                   "of the held-out rows it reads")
        if run.state.step == 0:
            raise RewardFailure(problem)
        if run.dist.is_main:
            tqdm.write(f"warning: {problem}; skipped")
        return None
    if greedy.num_failed and run.dist.is_main:
        tqdm.write(f"warning: {greedy.describe_failures(name)}; the accuracy counts only the "
                   f"{greedy.num_scored} it scored")
    result = {"step": run.state.step, **{k: m.accuracy for k, m in measured.items() if m.accuracy is not None}}
    run.state.evals.append(result)
    run.log.log(run.state.step, {f"eval/{k}": v for k, v in result.items() if k != "step"})
    if run.dist.is_main:
        tqdm.write(f"step {run.state.step}: {describe_accuracies(held_out, result)}")
    return result


def save(run: Run) -> Path:
    extra = {"data": run.batches.state_dict(), "nonfinite_in_a_row": run.state.nonfinite_in_a_row,
             "nonfinite_total": run.state.nonfinite_total, "evals": run.state.evals}
    path = checkpoint.save_checkpoint(run.config.train.output_dir, run.state.step, run.policy, run.optimizer,
                                      extra, run.dist, keep=run.config.train.keep_checkpoints,
                                      rank_state=run.draft.state_dict() if run.draft is not None else None)
    if run.dist.is_main:
        tqdm.write(f"checkpoint saved: {path}")
    return path


def export(run: Run) -> Path | None:
    """The trained model (LoRA: its adapters) and tokenizer, with save_pretrained, to output_dir/final
    (written whole or not at all), in train.final_dtype ("auto": model.dtype, so a bf16 run exports bf16
    casts of its float32 masters). A failed write raises WriteError on every rank."""
    if not run.config.train.save_final_model:
        return None
    path = Path(run.config.train.output_dir) / "final"
    state_dict = checkpoint.full_model_state(run.policy)  # collective under FSDP2: every rank calls it
    error = None
    if run.dist.is_main:
        name = run.config.model.dtype if run.config.train.final_dtype == "auto" else run.config.train.final_dtype
        state_dict = {key: t.to(resolve_dtype(name)) if t.is_floating_point() else t
                      for key, t in (state_dict or run.policy.state_dict()).items()}

        def write(folder: Path) -> None:
            run.policy.save_pretrained(folder, state_dict=state_dict)
            model_config = folder / "config.json"  # (LoRA saves adapters only, with no config.json)
            if model_config.is_file():  # save_pretrained records the float32 masters' dtype; "auto" reads this
                model_config.write_text(json.dumps({**json.loads(model_config.read_text()), "dtype": name},
                                                   indent=2))
            run.tokenizer.save_pretrained(folder)
        # A kill or a full disk mid-export must not leave a final/ with config.json but no weights.
        try:
            write_folder_atomically(path, write, "the final model")
        except WriteError as err:
            error = err
    if distributed.all_reduce_max_int(int(error is not None), run.dist, run.dist.device):  # no rank left waiting
        raise error or WriteError(f"rank 0 could not write the final model {path}; see its message")
    return path
