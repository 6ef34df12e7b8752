"""The GRPO training loop.

One step, as in the algorithm:

    prompts -> rollout (G samples each, the policy's own weights; speculative with the run's draft)
            -> rewards -> group advantages
            -> old-policy / reference log-probs (shared-prefix forward, forward only, when needed)
            -> num_iterations x [micro-batched loss and backward, clip, AdamW step (skipped if NaN/inf)]
            -> draft update on every group's features (draft_learning.py; policy frozen)

Everything else (building the run's components, checkpoints, metrics, evaluation) is called from here
and lives in its own module (run.py, checkpoint.py, step_metrics.py, evaluate.py ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from turbogrpo.algo import LossNormalizer, group_advantages, statistics_are_finite
from turbogrpo.config import Config
from turbogrpo.rewards import build_rewards, score_completions
from turbogrpo.rollout import generate
from turbogrpo.train import distributed
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.draft_learning import frozen, speculation_metrics
from turbogrpo.train.metrics import PhaseTimer
from turbogrpo.train.microbatch import pad_to_count, plan_micro_batches
from turbogrpo.train.optim import learning_rate, set_learning_rate
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.report import speculation_summary, write_report
from turbogrpo.train.output_dir import claim_output_dir, mark_complete
from turbogrpo.train.run import Run, RunComplete, build_run, check_rewards, evaluate, export, interrupted, save
from turbogrpo.train.step_metrics import completion_samples, step_metrics
from turbogrpo.train.update import StepBatch, UpdateResult, score, update_policy


class TrainingDiverged(RuntimeError):
    """Too many optimizer steps in a row had NaN/inf loss or gradients; a checkpoint was saved."""


@dataclass
class RunSummary:
    steps: int
    evals: list[dict]
    wall_time_s: float
    output_dir: Path
    final_model: Path | None
    already_complete: bool = False
    """``--resume`` found the run finished and did nothing."""
    speculation: list[str] = field(default_factory=list)
    """With rollout.speculation on: acceptance and draft-training figures (the report's lines)."""


def train(config: Config, *, resume: bool = False, overwrite: bool = False) -> RunSummary:
    """Run GRPO as ``config`` says; with ``resume``, continue from the latest checkpoint in output_dir.

    A fresh run needs an empty output_dir (``overwrite`` moves what is there aside); Ctrl-C raises
    TrainingInterrupted naming the last complete checkpoint.
    """
    rewards = build_rewards(config.rewards)  # import errors surface before any model loads
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    dist = distributed.setup(config.model.device, config.distributed.backend)
    start = time.perf_counter()
    output, run = None, None
    try:
        output = claim_output_dir(config, dist, resume=resume, overwrite=overwrite)
        run = build_run(config, dist, rewards, resume)
        total = config.train.num_steps
        if run.state.step == 0:
            evaluate(run)
        with tqdm(total=total, initial=run.state.step, desc="GRPO", unit="step", dynamic_ncols=True,
                  disable=not (dist.is_main and config.log.progress_bar)) as bar:
            while run.state.step < total:
                metrics = grpo_step(run, run.state.step)
                run.state.step += 1
                run.log.log(run.state.step, metrics)
                if config.train.eval_every and run.state.step % config.train.eval_every == 0 \
                        and run.state.step < total:
                    evaluate(run)
                bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward", "accuracy") if k in metrics},
                                refresh=False)
                bar.update()
                if config.train.checkpoint_every and run.state.step % config.train.checkpoint_every == 0:
                    save(run)
        evaluate(run)
        if not (config.train.checkpoint_every and total % config.train.checkpoint_every == 0):
            save(run)  # (otherwise the loop has just saved this step)
        final_model = export(run)
        run.log.close()
        if dist.is_main and config.log.report:
            write_report(config.train.output_dir)
        if dist.is_main:
            mark_complete(output.path, total)
        speculation = (speculation_summary(read_metrics(config.train.output_dir))
                       if run.draft is not None and dist.is_main else [])
        return RunSummary(total, run.state.evals, time.perf_counter() - start, Path(config.train.output_dir),
                          final_model, speculation=speculation)
    except RunComplete as done:
        return RunSummary(done.step, done.evals, time.perf_counter() - start, output.path, None, already_complete=True)
    except KeyboardInterrupt:
        raise interrupted(run, Path(config.train.output_dir)) from None
    finally:
        if output is not None:
            output.release()
        distributed.teardown(dist)


def grpo_step(run: Run, step: int) -> dict[str, float]:
    """One GRPO step on this rank's share of the step's prompts; returns the step's metrics."""
    config, dist = run.config, run.dist
    timer = PhaseTimer(dist.device)
    num_samples = config.rollout.num_generations
    examples = next(run.batches)[distributed.local_slice(config.train.prompts_per_step, dist)]
    prompts = [e.token_ids.to(dist.device) for e in examples]
    seed = rollout_seed(config.train.seed, step, dist.rank)
    draft = run.draft  # None: speculation off
    learns = draft is not None and draft.learns

    # The rollout samples under the training forward's precision: the same bf16 weights and kernels' dtypes.
    with timer("rollout"), distributed.full_parameters(run.trainer), run.precision.autocast():
        run.policy.eval()
        rollout = generate(run.policy, prompts, num_samples=num_samples, sampling=run.sampling, seed=seed,
                           draft=draft.speculation() if draft is not None else None, return_hidden=learns)
    if learns:
        with timer("draft"):
            draft_data = draft.collect(run.policy, rollout, seed)  # all groups, before the policy moves
    with timer("rewards"):
        texts = run.tokenizer.batch_decode(rollout.tokens, skip_special_tokens=True)
        rewards = score_completions(run.rewards, examples, texts, [t.numel() for t in rollout.tokens], num_samples)
        # Advantages need every group's rewards only for batch-level std; gathering is cheap either way.
        all_rewards = distributed.all_gather_cat(rewards.total.to(dist.device), dist)
        group_sizes = [num_samples] * (all_rewards.numel() // num_samples)
        advantages = group_advantages(all_rewards, group_sizes, config.algo.scale_rewards)
        check_rewards(run, rewards, step, statistics_are_finite(all_rewards, group_sizes, config.algo.scale_rewards))
        advantages = advantages[distributed.local_slice(all_rewards.numel(), dist)]
    batch = StepBatch(prompts, rollout.tokens_per_group(), advantages,
                      rollout_logps=rollout.logprobs_per_group() if config.algo.tis_cap else None)
    normalizer = step_normalizer(batch, config, dist)  # totals of the whole batch, skipped groups included
    trained = trainable_groups(advantages, num_samples, config.algo.beta)
    batch = batch.groups(trained)
    micro_batches = plan(batch, config, dist)
    with timer("logprobs"):
        if config.algo.num_iterations > 1:
            batch.old_logps = score(run.trainer, batch, micro_batches)
        if run.reference is not None:
            batch.ref_logps = score(run.reference, batch, micro_batches)
    with timer("update"), frozen(draft.draft if draft is not None else None):
        run.policy.train()
        updates = []
        for iteration in range(config.algo.num_iterations):
            optimizer_step = step * config.algo.num_iterations + iteration
            set_learning_rate(run.optimizer, learning_rate(
                optimizer_step, config.train.num_steps * config.algo.num_iterations, config.optim))
            updates.append(update_policy(run.trainer, batch, micro_batches, run.loss, normalizer,
                                         run.optimizer, max_grad_norm=config.optim.max_grad_norm, dist=dist))
            guard_nonfinite(run, updates[-1], step)
    draft_metrics = {}
    if learns:
        with timer("draft"):
            draft_metrics = draft.learn(run.policy, draft_data, seed)

    trainer_logps = batch.old_logps if batch.old_logps is not None else _regroup(updates[0].logps, batch)
    sampler_logps = [rollout.logprobs_per_group()[g] for g in trained]
    metrics = step_metrics(rollout, rewards, sampler_logps, trainer_logps, updates, timer.seconds, run, dist)
    metrics["frac_groups_trained"] = len(trained) / len(examples)
    metrics.update(speculation_metrics(rollout.stats), **draft_metrics)
    if dist.is_main and config.log.completions_every and (step + 1) % config.log.completions_every == 0:
        run.log.log_completions(step + 1, completion_samples(examples, texts, rewards, num_samples,
                                                             config.log.num_completions))
    return metrics


# --- pieces of a step -------------------------------------------------------------------------------


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible sampling seed per (run seed, step, rank): resumed runs draw the same."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def trainable_groups(advantages: torch.Tensor, num_samples: int, beta: float) -> list[int]:
    """The groups the update runs on.

    With beta = 0, a completion whose advantage is exactly 0 adds exactly 0 to the loss and to its
    gradient, so groups whose advantages are all 0 (equal rewards) are left out of the forward and
    backward: the same update for less work (the loss denominators still count them). One group is
    always kept, so every rank runs its collectives and every parameter gets a gradient (zero, if
    nothing else) for AdamW, exactly as in the full update.
    """
    num_groups = advantages.numel() // num_samples
    if beta != 0:
        return list(range(num_groups))
    # Host sync: which groups run decides the micro-batch plan.
    moving = advantages.view(num_groups, num_samples).ne(0).any(1).tolist()
    return [g for g, m in enumerate(moving) if m] or [0]


def plan(batch: StepBatch, config: Config, dist: DistInfo):
    """Micro-batches by token budget; every rank runs as many (fillers of weight 0 where short)."""
    micro_batches = plan_micro_batches([p.numel() for p in batch.prompts],
                                       [[c.numel() for c in group] for group in batch.completions],
                                       config.train.micro_batch_tokens)
    count = distributed.all_reduce_max_int(len(micro_batches), dist, dist.device)
    return pad_to_count(micro_batches, count)


def step_normalizer(batch: StepBatch, config: Config, dist: DistInfo) -> LossNormalizer:
    """Whole-batch totals over all ranks, divided by the world size.

    DDP averages gradients over ranks; with totals of the global batch / world size each rank's
    loss is its share of the global-batch loss, so the averaged gradient is the global batch's
    gradient, exactly as one process on the whole batch would compute it, for every loss variant.
    """
    lengths = [c.numel() for group in batch.completions for c in group]
    totals = torch.tensor([len(lengths), sum(lengths)], dtype=torch.float32, device=dist.device)
    totals = distributed.all_reduce_sum(totals, dist) / dist.world_size
    num_sequences, num_tokens = totals[0], totals[1]
    return LossNormalizer(num_sequences=num_sequences, num_tokens=num_tokens,
                          max_completion_length=config.rollout.max_new_tokens,
                          generation_tokens_per_step=num_tokens)


def guard_nonfinite(run: Run, update: UpdateResult, step: int) -> None:
    """Count skipped steps; after too many in a row, save a checkpoint and stop with a clear message."""
    state = run.state
    if update.applied:
        state.nonfinite_in_a_row = 0
        return
    state.nonfinite_in_a_row += 1
    state.nonfinite_total += 1
    limit = run.config.train.max_nonfinite_steps
    if state.nonfinite_in_a_row >= limit:
        state.step = step + 1  # this step's data and RNG are consumed; its updates were not applied
        path = save(run)
        raise TrainingDiverged(
            f"stopped at step {step + 1}: {state.nonfinite_in_a_row} optimizer steps in a row had NaN/inf loss "
            f"or gradients (train.max_nonfinite_steps = {limit}) and were skipped, so the weights are the last "
            f"good ones. Checkpoint saved to {path}. Lower optim.lr, set optim.max_grad_norm, or check the "
            "rewards and data; then continue with --resume.")


def _regroup(flat: list[torch.Tensor], batch: StepBatch) -> list[list[torch.Tensor]]:
    out, i = [], 0
    for group in batch.completions:
        out.append(flat[i:i + len(group)])
        i += len(group)
    return out


