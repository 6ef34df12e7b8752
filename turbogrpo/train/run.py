"""A training run's components, built once from its config, and what the loop does with them between
steps: held-out evaluation, checkpoints, export of the final model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from turbogrpo.algo import LOSSES, LossSettings, PolicyLoss
from turbogrpo.config import Config, dump_config
from turbogrpo.data import PromptBatches, PromptExample
from turbogrpo.models import resolve_dtype
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train import checkpoint, distributed, setup
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.evaluate import evaluate_accuracy
from turbogrpo.train.metrics import MetricsLog
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
    rewards: list[setup.Reward]
    accuracy: setup.Reward | None
    eval_prompts: list[PromptExample]
    sampling: SamplingConfig
    greedy: SamplingConfig
    loss: PolicyLoss
    settings: LossSettings
    log: MetricsLog
    state: RunState



def build_run(config: Config, dist: DistInfo, rewards: list[setup.Reward], resume: bool) -> Run:
    torch.manual_seed(config.train.seed)  # LoRA initialisation; resumed runs load their adapters
    if dist.is_main:
        warn_if_pure(config.model.pure_bf16)
    policy, tokenizer = setup.load_policy(config, dist.device)
    if dist.enabled and config.distributed.strategy == "fsdp2" and config.lora.enabled and config.algo.beta > 0:
        raise ValueError("config key 'algo.beta': with distributed.strategy = \"fsdp2\" and LoRA the reference "
                         "(the base model without adapters) cannot be scored; use beta = 0 or strategy \"ddp\"")
    precision = setup.precision(config, dist.device)
    fn = setup.logprob_fn(config, dist.device)
    trainer = distributed.wrap_for_training(policy, fn, dist, config.distributed.strategy, precision)
    reference = setup.build_reference(config, policy, dist.device)
    optimizer = build_optimizer(policy, config.optim)
    prompt_set = setup.load_train_prompts(config, tokenizer)
    if dist.is_main and (prompt_set.num_too_long or prompt_set.num_empty):
        tqdm.write(f"skipped {prompt_set.num_too_long} prompts over data.max_prompt_tokens="
                   f"{config.data.max_prompt_tokens} and {prompt_set.num_empty} empty prompts")
    batches = PromptBatches(prompt_set.examples, config.train.prompts_per_step, seed=config.train.seed,
                            shuffle=config.data.shuffle)
    stop_ids = setup.stop_token_ids(policy, tokenizer)
    state = RunState()
    output_dir = Path(config.train.output_dir)
    latest = checkpoint.latest_checkpoint(output_dir) if resume else None
    if resume and latest is None and dist.is_main:
        tqdm.write(f"--resume: no checkpoint in {output_dir}; starting from step 0")
    if latest is not None:
        resumed = checkpoint.load_checkpoint(latest, policy, optimizer, dist)
        batches.load_state_dict(resumed.state["data"])
        state = RunState(step=resumed.step, nonfinite_in_a_row=resumed.state["nonfinite_in_a_row"],
                         nonfinite_total=resumed.state["nonfinite_total"], evals=resumed.state["evals"])
        if dist.is_main:
            tqdm.write(f"resumed from {latest} (step {resumed.step})")
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, output_dir / "config.json")
    log = MetricsLog(output_dir, tensorboard=config.log.tensorboard, enabled=dist.is_main,
                     resume_step=state.step if latest is not None else None)
    return Run(
        config=config, dist=dist, policy=policy, tokenizer=tokenizer, precision=precision, trainer=trainer,
        reference=reference,
        optimizer=optimizer, batches=batches, rewards=rewards, accuracy=setup.accuracy_function(config, rewards),
        eval_prompts=setup.load_eval_prompts(config, tokenizer),
        sampling=setup.sampling_config(config.rollout, stop_ids, tokenizer),
        greedy=setup.sampling_config(config.rollout, stop_ids, tokenizer, greedy=True),
        loss=LOSSES[config.algo.loss],
        settings=LossSettings(epsilon_low=config.algo.epsilon_low, epsilon_high=config.algo.epsilon_high,
                              beta=config.algo.beta, tis_cap=config.algo.tis_cap),
        log=log, state=state)


def evaluate(run: Run) -> dict | None:
    """Held-out accuracy now: greedy, and sampled at the rollout temperature (fixed seed); recorded,
    logged and printed. None without eval prompts or an accuracy reward."""
    if not run.eval_prompts or run.accuracy is None:
        return None
    config = run.config
    with distributed.full_parameters(run.trainer), run.precision.autocast():
        result = {"step": run.state.step, "accuracy": evaluate_accuracy(
            run.policy, run.tokenizer, run.eval_prompts, run.accuracy, run.greedy, run.dist)}
        if config.data.num_eval_samples:
            result["sampled_accuracy"] = evaluate_accuracy(
                run.policy, run.tokenizer, run.eval_prompts, run.accuracy, run.sampling, run.dist,
                num_samples=config.data.num_eval_samples, seed=config.train.seed + 7_919)
    run.state.evals.append(result)
    run.log.log(run.state.step, {f"eval/{k}": v for k, v in result.items() if k != "step"})
    if run.dist.is_main:
        sampled = (f", sampled {result['sampled_accuracy']:.1%} ({config.data.num_eval_samples} per problem, "
                   f"temperature {config.rollout.temperature:g})" if "sampled_accuracy" in result else "")
        tqdm.write(f"step {run.state.step}: held-out accuracy greedy {result['accuracy']:.1%}{sampled} on "
                   f"{len(run.eval_prompts)} problems")
    return result


def save(run: Run) -> Path:
    extra = {"data": run.batches.state_dict(), "nonfinite_in_a_row": run.state.nonfinite_in_a_row,
             "nonfinite_total": run.state.nonfinite_total, "evals": run.state.evals}
    path = checkpoint.save_checkpoint(run.config.train.output_dir, run.state.step, run.policy, run.optimizer,
                                      extra, run.dist, keep=run.config.train.keep_checkpoints)
    if run.dist.is_main:
        tqdm.write(f"checkpoint saved: {path}")
    return path


def export(run: Run) -> Path | None:
    """The trained model (LoRA: its adapters) and tokenizer, with save_pretrained, to output_dir/final,
    in train.final_dtype ("auto": model.dtype, so a bf16 run exports bf16 casts of its float32 masters)."""
    if not run.config.train.save_final_model:
        return None
    path = Path(run.config.train.output_dir) / "final"
    state_dict = checkpoint.full_model_state(run.policy)  # collective under FSDP2: every rank calls it
    if run.dist.is_main:
        name = run.config.model.dtype if run.config.train.final_dtype == "auto" else run.config.train.final_dtype
        state_dict = {key: t.to(resolve_dtype(name)) if t.is_floating_point() else t
                      for key, t in (state_dict or run.policy.state_dict()).items()}
        run.policy.save_pretrained(path, state_dict=state_dict)
        model_config = path / "config.json"  # (LoRA saves adapters only, with no config.json)
        if model_config.is_file():  # save_pretrained records the float32 masters' dtype; dtype="auto" reads this
            model_config.write_text(json.dumps({**json.loads(model_config.read_text()), "dtype": name}, indent=2))
        run.tokenizer.save_pretrained(path)
    run.dist.barrier()
    return path
