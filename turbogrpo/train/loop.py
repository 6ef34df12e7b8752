"""The GRPO training loop.

One step is seven phases, each taking and returning the step's data (``StepData``), with the collectives
of each inside it:

    sample   G completions per prompt with the policy's weights by the run's engine (rollout.engine; speculative
             with the run's draft on the native one), or
             G conversations per prompt with an environment each ([env]: ``episodes.py``; speculative
             too, the draft frozen); the draft's training features of every group, before the policy moves;
             asynchronous (train.max_staleness > 0): the rollout the worker drew ahead (``rollout_worker.py``)
    score    rewards (checked: failures, float32 overflow) -> group advantages      [gather, all-reduce]
    prepare  loss totals, the trained groups, the micro-batch plan, old-policy / reference log-probs
             (shared-prefix forward, forward only, when the loss needs them)          [all-reduce x 2]
    update   num_iterations x [micro-batched loss and backward, clip, AdamW step (skipped if NaN/inf)]
                                                                                      [all-reduce]
             then the new weights into the rollout engine when it holds its own (rollout.engines: vLLM)
    draft    the draft's update on the collected features (draft_learning.py; policy frozen)
    hand over   asynchronous: the new version (policy and draft) to the rollout worker
    record   the step's metrics over the global batch (staleness/* too), sample completions
                                                                                      [gather x 2, all-reduce]

One owner per lifetime: what is built once lives in run.py and setup.py (``build_run``, the one reader of
the whole config: each part from its own section), the run's state between steps (resume, checkpoints,
export, interrupt) in state.py and checkpoint.py, held-out evaluation in evaluate.py, and the step here.
The step sees the run's parts and the few sections it reads (``run.algo``, ``run.optim``, ``run.train``,
``run.log``), never the whole config.
"""

from __future__ import annotations

import gc
import itertools
import time
from functools import partial
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from turbogrpo.algo import LossNormalizer, group_advantages, statistics_are_finite
from turbogrpo.algo.losses import CorrectionBounds
from turbogrpo.algo.mismatch import mismatch_metrics, mismatch_statistics
from turbogrpo.algo.staleness import policy_version, staleness_metrics, staleness_statistics
from turbogrpo.batch import Groups, pad_to_count
from turbogrpo.config import Config
from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.data import PromptExample
from turbogrpo.host_memory import keep_freed_host_memory
from turbogrpo.placement import DistInfo, join_job, leave_job, thread_split
from turbogrpo.rewards import RewardResult, build_rewards, score_completions
from turbogrpo.engines import draw
from turbogrpo.env import EnvRollout
from turbogrpo.rollout import Rollout
from turbogrpo.train import distributed
from turbogrpo.train.draft_learning import frozen, speculation_metrics
from turbogrpo.train.metrics import PhaseTimer
from turbogrpo.train.optim import learning_rate, set_learning_rate
from turbogrpo.train.machine_record import record_machine
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.report import speculation_summary, write_report
from turbogrpo.train.output_dir import claim_output_dir, mark_complete, run_record
from turbogrpo.train.rank_agreement import check_ranks_agree
from turbogrpo.train.worker.rollout_worker import RolloutWorker, WorkerSpec
from turbogrpo.train.worker.local import leave_if_importing_main, transport_options
from turbogrpo.train.run import Run, build_run
from turbogrpo.sharing import SHARINGS, Sharing
from turbogrpo.train.state import (RewardFailure, RunComplete, evaluate, evaluate_and_save_final, export, interrupted,
                                   save, start)
from turbogrpo.train.stops import stops_at_step_ends
from turbogrpo.train.step_metrics import completion_samples, step_metrics
from turbogrpo.train.update import UpdateResult, update_policy
from turbogrpo.train.update import score as logprobs_of


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
    leave_if_importing_main()  # a script without the __main__ guard, run again by its rollout worker's start
    cpu_capability()  # a TURBOGRPO_CPU_CAPABILITY above this CPU's is refused before anything loads
    rewards = build_rewards(config.rewards)  # import errors surface before any model loads
    keep_freed_host_memory()
    # A local worker shares this machine's cores with the trainer; a remote one has its own machine.
    local_worker = config.train.max_staleness and config.train.rollout_worker == "local"
    trainer_threads, rollout_threads = (thread_split(config.train.num_threads, config.train.rollout_threads)
                                        if local_worker else (config.train.num_threads, config.train.rollout_threads))
    if trainer_threads:
        torch.set_num_threads(trainer_threads)
    dist = join_job(config.model.device, config.distributed.backend)
    started = time.perf_counter()
    output, run = None, None
    try:
        record = run_record(config)
        check_ranks_agree(record, dist)  # under torchrun: one config and the same inputs on every rank
        output = claim_output_dir(record, dist, resume=resume, overwrite=overwrite)
        run = build_run(config, dist, rewards, record)
        total = config.train.num_steps
        if config.train.max_staleness:  # started first: the worker builds its model while the trainer resumes
            spec = WorkerSpec.of(config.model, config.lora, config.rollout, config.env, config.train, config.algo,
                                 config.draft, rollout_threads, run.draft_context, run.engine_max_length)
            run.rollouts = RolloutWorker(spec, dist, run.policy, num_steps=total,
                                         draft=run.draft.draft if run.draft is not None else None,
                                         prompts_per_step_slice=run.prompts_slice,
                                         seed_of=partial(rollout_seed, config.train.seed, rank=dist.rank),
                                         transport=config.train.rollout_worker,
                                         options=transport_options(config.train))
        state = start(run, resume)
        if run.rollouts is not None:
            run.rollouts.begin(state.step, run.batches)
        if dist.is_main:
            machine = record_machine(output.path, dist.device, state.step)
            tqdm.write(f"CPU: {machine['cpu_capability']['description']} (torch {machine['torch']}, "
                       f"{machine['torch_threads']} threads, device {machine['device']})")
        if state.step == 0:
            evaluate(run)
        # Under torchrun, SIGTERM and Ctrl-C stop every rank together at a step's end (stops.py).
        with stops_at_step_ends(dist) as stop, tqdm(total=total, initial=state.step, desc="GRPO", unit="step",
                                                    dynamic_ncols=True,
                                                    disable=not (dist.is_main and config.log.progress_bar)) as bar:
            while state.step < total:
                metrics = grpo_step(run, state.step)
                state.step += 1
                state.log.log(state.step, metrics)
                if config.train.eval_every and state.step % config.train.eval_every == 0 and state.step < total:
                    evaluate(run)
                bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("reward", "accuracy") if k in metrics},
                                refresh=False)
                bar.update()
                if (config.train.checkpoint_every and state.step % config.train.checkpoint_every == 0
                        and state.step < total):
                    save(run)
                stop.check()
        evaluate_and_save_final(run)
        final_model = export(run)
        state.log.close()
        speculation = []
        if dist.is_main:
            records = read_metrics(config.train.output_dir)  # read once, for the report and the summary
            if config.log.report:
                write_report(config.train.output_dir, records)
            if run.draft is not None:
                speculation = speculation_summary(records)
            mark_complete(output.path, total)
        return RunSummary(total, state.evals, time.perf_counter() - started, Path(config.train.output_dir),
                          final_model, speculation=speculation)
    except RunComplete as done:
        return RunSummary(done.step, done.evals, time.perf_counter() - started, output.path, None, already_complete=True)
    except KeyboardInterrupt:
        raise interrupted(run, Path(config.train.output_dir), report=dist.is_main) from None
    finally:
        if run is not None and run.rollouts is not None:
            run.rollouts.close()  # no worker outlives the run, however it ends
        if output is not None:
            output.release()
        # Free the run's DDP/FSDP wrappers while the process group is still registered: freed after it, they
        # hold its last reference, destroy it in C++ with the GIL held and deadlock against gloo's worker
        # thread, which needs the GIL to free a finished all-reduce's tensors (pytorch#56297).
        run = None
        gc.collect()
        leave_job(dist)


@dataclass
class StepData:
    """One GRPO step on this rank, as its phases fill it in; each phase takes it and returns it."""

    index: int
    """Steps done before this one."""
    seed: int
    """This rank's sampling seed (``rollout_seed``)."""
    examples: list[PromptExample]
    """This rank's share of the step's prompts."""
    prompts: list[torch.Tensor]
    """Their token ids ``[P]`` on the device."""
    timer: PhaseTimer
    rollout: Rollout | None = None
    """The rollout (its stats); its completions are ``batch``."""
    episodes: EnvRollout | None = None
    """With an environment: the conversations' episodes (rewards read them) and env/* metrics."""
    batch: Groups | None = None
    """This rank's groups, flat and group-major: the rollout's completions with the sampler's log-probs,
    then their total rewards and advantages ``[N]`` (score)."""
    draft_data: Groups | None = None
    """The draft's training data, collected before the policy moves (None: the draft does not learn)."""
    texts: list[str] = field(default_factory=list)
    """The completions decoded, group-major."""
    rewards: RewardResult | None = None
    """Every reward function's values, failures and first errors."""
    trained: list[int] = field(default_factory=list)
    """The groups the update runs on (``trainable_groups``)."""
    trained_batch: Groups | None = None
    """Those groups of ``batch``, with the fields the loss reads (old/reference log-probs added in prepare)."""
    normalizer: LossNormalizer | None = None
    micro_batches: list[Groups] = field(default_factory=list)
    """``trained_batch`` cut by the token budget (each carries its share of every field)."""
    updates: list[UpdateResult] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def grpo_step(run: Run, step: int) -> dict[str, float]:
    """One GRPO step on this rank's share of the step's prompts; returns the step's metrics."""
    data = begin_step(run, step)
    for phase in (sample, score, prepare, update, learn_draft, hand_over, record):
        data = phase(run, data)
    return data.metrics


def begin_step(run: Run, step: int) -> StepData:
    """The step's prompts (this rank's share of the next batch) and sampling seed."""
    examples = next(run.batches)[run.prompts_slice]
    return StepData(step, rollout_seed(run.train.seed, step, run.dist.rank), examples,
                    [e.token_ids.to(run.dist.device) for e in examples], PhaseTimer(run.dist.device))


def sample(run: Run, data: StepData) -> StepData:
    """G completions per prompt with the policy's weights (speculative with the run's draft), and the
    draft's training data from every group, before the policy moves."""
    draft = run.draft  # None: speculation off
    learns = draft is not None and draft.learns  # never with an environment (the config refuses it)
    if run.rollouts is not None:  # asynchronous: drawn ahead by the worker; the timer counts the wait
        with data.timer("rollout"):
            drawn = run.rollouts.take(data.index)
        data.rollout, data.episodes = drawn.rollout, drawn.episodes
        if drawn.examples is not None:  # partial rollouts: the groups that finished, carried ones among them
            data.examples = drawn.examples
    else:  # the rollout samples under the training forward's precision: the same bf16 weights and kernels' dtypes
        with data.timer("rollout"), distributed.full_parameters(run.trainer), run.precision.autocast():
            run.policy.eval()
            data.rollout, data.episodes = draw(run.engine, run.policy, run.tokenizer, run.episodes, data.examples,
                                               data.prompts, num_samples=run.num_generations, sampling=run.sampling,
                                               seed=data.seed, draft=draft.speculation() if draft is not None else None,
                                               return_hidden=learns)
    data.batch = data.rollout.groups
    if learns:  # (a worker's rollout keeps no features: collect computes them with the policy of now, a forward)
        run.policy.eval()
        with data.timer("draft"), training_linears(run):
            data.draft_data = draft.collect(run.policy, data.rollout, data.seed)
    return data


def score(run: Run, data: StepData) -> StepData:
    """Rewards, checked, and group advantages over the whole batch (one gather, one all-reduce)."""
    dist, batch, scale_rewards = run.dist, data.batch, run.algo.scale_rewards
    num_samples = run.num_generations
    with data.timer("rewards"):
        data.texts = run.tokenizer.batch_decode(batch.completions, skip_special_tokens=True)
        episodes = {"environments": data.episodes.episodes} if data.episodes is not None else None
        data.rewards = score_completions(run.rewards, data.examples, data.texts, batch.lengths, num_samples, episodes)
        # Advantages need every group's rewards only for batch-level std; gathering is cheap either way.
        all_rewards = distributed.all_gather_cat(data.rewards.total.to(dist.device), dist)
        group_sizes = [num_samples] * (all_rewards.numel() // num_samples)
        advantages = group_advantages(all_rewards, group_sizes, scale_rewards)
        check_rewards(run, data.rewards, data.index, statistics_are_finite(all_rewards, group_sizes, scale_rewards))
        batch.rewards = data.rewards.total
        batch.advantages = advantages[distributed.local_slice(all_rewards.numel(), dist)]
    return data


def prepare(run: Run, data: StepData) -> StepData:
    """The update's batch: loss totals of the whole batch, the trained groups, the micro-batch plan
    (both agreed over ranks) and old-policy / reference log-probs where the loss needs them."""
    algo, batch = run.algo, data.batch
    if batch.versions is None:  # a rollout that did not mark its versions was drawn by the current weights
        batch = data.batch = batch.at_version(policy_version(data.index, algo.num_iterations))
    data.trained = trainable_groups(batch.advantages, run.num_generations, algo.beta)
    # Totals of the whole batch, skipped groups included.
    data.normalizer = step_normalizer(batch, run.max_completion_tokens, run.dist, trained=data.trained)
    # The loss reads the sampler's log-probs only for the off-policy correction; hidden states stay behind.
    # Its proximal policy is old_logps with num_iterations > 1, else the update's own first forward (no
    # optimizer step comes between it and the start of the update, so no forward is needed for it here).
    trained = replace(batch, hidden=None, sampler_logps=batch.sampler_logps if algo.tis_cap else None)
    data.trained_batch = trained = trained.select(data.trained)
    data.micro_batches = plan(trained, run.train.micro_batch_tokens, run.dist, run.sharing)
    with data.timer("logprobs"), training_linears(run):
        if algo.num_iterations > 1:
            trained.old_logps = logprobs_of(run.trainer, data.micro_batches, "old_logps")
        if run.reference is not None:
            trained.ref_logps = logprobs_of(run.reference, data.micro_batches, "ref_logps")
    return data


def update(run: Run, data: StepData) -> StepData:
    """algo.num_iterations optimizer steps on the batch (the draft frozen), NaN/inf steps skipped."""
    num_iterations = run.algo.num_iterations
    with data.timer("update"), frozen(run.draft.draft if run.draft is not None else None), training_linears(run):
        run.policy.train()
        for iteration in range(num_iterations):
            optimizer_step = data.index * num_iterations + iteration
            set_learning_rate(run.optimizer, learning_rate(optimizer_step, run.train.num_steps * num_iterations,
                                                           run.optim))
            data.updates.append(update_policy(run.trainer, data.micro_batches, run.loss, data.normalizer,
                                              run.optimizer, max_grad_norm=run.optim.max_grad_norm, dist=run.dist))
            guard_nonfinite(run, data.updates[-1], data.index)
    if run.rollouts is None and run.engine.holds_weights:  # an engine with its own copy (vLLM) gets the new ones
        with data.timer("weight_push"):
            run.engine.push_weights(run.policy)
    return data


def hand_over(run: Run, data: StepData) -> StepData:
    """Asynchronous: the new version to the rollout worker, the policy after this step's update and the draft after
    this step's lesson (version v is both after v steps); its next rollouts start from them."""
    if run.rollouts is not None:
        with data.timer("weight_push"):
            run.rollouts.publish(data.index + 1)
    return data


def training_linears(run: Run):
    """The training forwards' weight-matmul kernel (``model.linear_kernel``) over the policy, the reference
    and the draft head."""
    roots = [run.policy] + [m for m in (run.reference, run.draft.draft if run.draft is not None else None)
                            if m is not None]
    return run.training_kernels(roots)


def learn_draft(run: Run, data: StepData) -> StepData:
    """The draft's update on the features collected at sampling (the policy frozen)."""
    if data.draft_data is not None:
        with data.timer("draft"), training_linears(run):
            data.metrics.update(run.draft.learn(run.policy, data.draft_data, data.seed))
    return data


def record(run: Run, data: StepData) -> StepData:
    """The step's metrics over the global batch (two gathers, two host syncs) and sample completions."""
    log, rollout, trained = run.log, data.rollout, data.trained_batch
    trainer_logps = trained.old_logps if trained.old_logps is not None else data.updates[0].logps
    sampler_logps, versions = data.batch.select(data.trained).sampler_logps, trained.versions
    if trained.model_mask is not None:  # the gap over the sampled tokens (environment ids have no sampler log-prob)
        sampler_logps, trainer_logps, versions = ([t[m.to(t.device)] for t, m in zip(logps, trained.model_mask)]
                                                  for logps in (sampler_logps, trainer_logps, versions))
    draft_metrics, data.metrics = data.metrics, step_metrics(rollout, data.rewards, sampler_logps, trainer_logps,
                                                             data.updates, data.timer.seconds, run, run.dist)
    data.metrics["frac_groups_trained"] = len(data.trained) / len(data.examples)
    data.metrics.update(step_staleness(run, data.index, versions, trainer_logps, sampler_logps))
    data.metrics.update(speculation_metrics(rollout.stats), **draft_metrics)
    if data.episodes is not None:
        data.metrics.update(environment_metrics(data.episodes.metrics, run.dist))
        report_environment_failure(run, data.episodes, data.index)
    step = data.index + 1
    if run.dist.is_main and log.completions_every and step % log.completions_every == 0:
        env_errors = [e.failure for e in data.episodes.episodes] if data.episodes is not None else None
        run.state.log.log_completions(step, completion_samples(data.examples, data.texts, data.rewards,
                                                               run.num_generations, log.num_completions, env_errors))
    return data


# --- pieces of a step -------------------------------------------------------------------------------


def report_environment_failure(run: Run, episodes: EnvRollout, step: int) -> None:
    """Print this rank's first failed conversation's own text, once per run (whatever reward reads the
    episodes; each step's are in completions.jsonl as ``env_error``)."""
    failures = [e.failure for e in episodes.episodes if e.failure is not None]
    if failures and "[env]" not in run.state.reported_reward_failures and run.dist.is_main:
        run.state.reported_reward_failures.add("[env]")
        tqdm.write(f"warning: {len(failures)} of {len(episodes.episodes)} conversations failed at step {step + 1} "
                   f"(first: {failures[0]}); only the first environment failure is printed (env/failures in "
                   "metrics.jsonl, env_error in completions.jsonl)")


def environment_metrics(metrics: dict[str, float], dist: DistInfo) -> dict[str, float]:
    """The episodes' env/* figures (means per conversation on each rank) averaged over ranks (one all-reduce;
    every rank has as many conversations)."""
    names = sorted(metrics)
    values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=dist.device)
    means = (distributed.all_reduce_sum(values, dist) / dist.world_size).tolist()  # host sync: logged numbers
    return dict(zip(names, means))


def step_staleness(run: Run, step: int, versions: list[torch.Tensor], prox_logps: list[torch.Tensor],
                   behav_logps: list[torch.Tensor]) -> dict[str, float]:
    """staleness/* (``algo.staleness``) and mismatch/* (``algo.mismatch``) over the global batch: one gather of
    one row per rank, one host sync."""
    algo, cap = run.algo, run.algo.tis_cap
    sums, maxima = staleness_statistics(versions, policy_version(step, algo.num_iterations), prox_logps,
                                        behav_logps, cap)
    mismatch_sums, quantiles, mismatch_maxima = mismatch_statistics(
        prox_logps, behav_logps, algo.off_policy_correction if cap else None, CorrectionBounds.of(algo, cap))
    parts = [sums, mismatch_sums, quantiles, maxima, mismatch_maxima]  # summed, summed, averaged, maxed, maxed
    ranks_RC = distributed.all_gather_cat(torch.cat([p.to(run.dist.device) for p in parts])[None], run.dist)
    ends = list(itertools.accumulate(p.numel() for p in parts))
    reduced = torch.cat([ranks_RC[:, :ends[1]].sum(0), ranks_RC[:, ends[1]:ends[2]].mean(0),
                         ranks_RC[:, ends[2]:].amax(0)]).tolist()  # host sync: logged numbers
    staleness = staleness_metrics(reduced[:ends[0]], reduced[ends[2]:ends[3]], cap)
    return {**staleness, **mismatch_metrics(reduced[ends[0]:ends[1]], reduced[ends[1]:ends[2]], reduced[ends[3]:],
                                            corrected=bool(cap))}


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


def plan(batch: Groups, micro_batch_tokens: int, dist: DistInfo,
         sharing: Sharing = SHARINGS["prompt"]) -> list[Groups]:
    """Micro-batches by token budget (train.micro_batch_tokens, tokens counted as the ``sharing`` forward
    runs them, train.sharing's); every rank runs as many (fillers of weight 0 where short)."""
    micro_batches = sharing.micro_batches(batch, micro_batch_tokens)
    count = distributed.all_reduce_max_int(len(micro_batches), dist, dist.device)
    return pad_to_count(micro_batches, count)


def step_normalizer(batch: Groups, max_new_tokens: int, dist: DistInfo, trained: list[int] | None = None
                    ) -> LossNormalizer:
    """Whole-batch totals over all ranks, divided by the world size; ``max_new_tokens`` (the rollout's
    length limit) is dr_grpo's constant; ``trained``: the groups the update runs (None: all), whose tokens
    are the behaviour weights' denominator.

    DDP averages gradients over ranks; with totals of the global batch / world size each rank's
    loss is its share of the global-batch loss, so the averaged gradient is the global batch's
    gradient, exactly as one process on the whole batch would compute it, for every loss variant.
    """
    lengths = batch.trained_lengths  # environment ids (multi-turn) are not completion tokens of the loss
    scored = lengths if trained is None else [lengths[i] for g in trained for i in batch.positions(g)]
    totals = torch.tensor([len(lengths), sum(lengths), sum(scored)], dtype=torch.float32, device=dist.device)
    totals = distributed.all_reduce_sum(totals, dist) / dist.world_size
    num_sequences, num_tokens, trained_tokens = totals[0], totals[1], totals[2]
    return LossNormalizer(num_sequences=num_sequences, num_tokens=num_tokens,
                          max_completion_length=max_new_tokens,
                          generation_tokens_per_step=num_tokens, trained_tokens=trained_tokens)


def check_rewards(run: Run, rewards: RewardResult, step: int, statistics_finite: torch.Tensor) -> None:
    """Print each reward function's first failure (once per run, with its message), and stop the run
    when one fails on at least ``train.reward_failure_limit`` of the step's completions (all ranks), or
    when the rewards overflow the advantages' float32 statistics (``statistics_finite`` False), before
    any update is made from them."""
    names = list(rewards.num_failed)
    counts = torch.tensor([*(float(rewards.num_failed[n]) for n in names), float(rewards.total.numel())],
                          dtype=torch.float64, device=run.dist.device)
    counts = torch.cat([counts, (~statistics_finite).to(counts)[None]])
    *failed, total, overflowed = distributed.all_reduce_sum(counts, run.dist).tolist()  # host sync: the run goes on?
    limit = run.train.reward_failure_limit
    for name, num_failed in zip(names, failed):
        if not num_failed:
            continue
        reward = next(r for r in run.rewards if r.name == name)
        problem = (f"reward {name!r} failed on {num_failed:.0f} of {total:.0f} completions at step {step + 1} "
                   f"({rewards.first_error[name] or 'on another rank; see metrics.jsonl'})")
        if limit and num_failed >= limit * total:
            raise RewardFailure(f"{problem}; stopped, since train.reward_failure_limit = {limit:g} and no update "
                                "was made from these rewards. Fix the function or the data columns it reads "
                                "(or raise train.reward_failure_limit, 0 never stops), then continue with --resume")
        if name not in run.state.reported_reward_failures and run.dist.is_main:
            tqdm.write(f"warning: {problem}; those get its fallback {reward.fallback:g} (counted in metrics.jsonl "
                       "as rewards/<name>/num_failed; only the first failure of each function is printed)")
        run.state.reported_reward_failures.add(name)
    if overflowed:
        largest = ", ".join(f"{name!r} {float(values.abs().max()):.3g}" for name, values in rewards.per_function.items()
                            if values.numel())
        raise RewardFailure(f"the rewards at step {step + 1} are too large for float32: their group means or stds "
                            f"overflow to inf, so the advantages would be 0 or NaN (largest |reward| on this rank: "
                            f"{largest}; weights {[r.weight for r in run.rewards]}). Stopped before any update; keep "
                            "rewards well within +-1e18, then continue with --resume")


def guard_nonfinite(run: Run, update: UpdateResult, step: int) -> None:
    """Count skipped steps; after too many in a row, save a checkpoint and stop with a clear message."""
    state = run.state
    if update.applied:
        state.nonfinite_in_a_row = 0
        return
    state.nonfinite_in_a_row += 1
    state.nonfinite_total += 1
    limit = run.train.max_nonfinite_steps
    if state.nonfinite_in_a_row >= limit:
        state.step = step + 1  # this step's data and RNG are consumed; its updates were not applied
        path = save(run)
        raise TrainingDiverged(
            f"stopped at step {step + 1}: {state.nonfinite_in_a_row} optimizer steps in a row had NaN/inf loss "
            f"or gradients (train.max_nonfinite_steps = {limit}) and were skipped, so the weights are the last "
            f"good ones. Checkpoint saved to {path}. Lower optim.lr, set optim.max_grad_norm, or check the "
            "rewards and data; then continue with --resume.")


