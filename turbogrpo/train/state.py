"""A run's state between steps, and its one owner: start (fresh or resumed from the newest checkpoint, the
output folder's records, the metrics log), held-out evaluation, checkpoints, export of the final model,
and what Ctrl-C reports. The parts it works on (and ``RunState`` itself) are built once by run.py
(``build_run``); this module builds on run.py, never the other way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from turbogrpo.files import WriteError, write_folder_atomically
from turbogrpo.models import resolve_dtype
from turbogrpo.placement import DistInfo
from turbogrpo.train import checkpoint, distributed
from turbogrpo.train import output_dir as output_dir_state
from turbogrpo.train.evaluate import describe_accuracies, measure_held_out
from turbogrpo.train.metrics import METRICS_FILE, MetricsLog
from turbogrpo.train.run import Run, RunState

__all__ = ["RewardFailure", "RunComplete", "RunState", "TrainingInterrupted", "check_resume_point", "evaluate",
           "evaluate_and_save_final", "export", "find_resume_checkpoint", "interrupted", "save", "start"]


def start(run: Run, resume: bool) -> RunState:
    """The run's state: fresh, or (``resume``) the newest verified checkpoint's, loaded into the policy,
    optimizer, data order and draft; RunComplete when that run had finished. Records the config and
    inputs in the output folder and opens the metrics log. Sets and returns ``run.state``."""
    dist = run.dist
    state = RunState()
    output_dir = Path(run.train.output_dir)
    latest = find_resume_checkpoint(output_dir, dist) if resume else None
    if latest is not None:
        check_resume_point(latest, output_dir, run.train.num_steps, run.record.config)
        resumed = checkpoint.load_checkpoint(latest, run.policy, run.optimizer, dist)
        run.batches.load_state_dict(resumed.state["data"])
        state = RunState(step=resumed.step, nonfinite_in_a_row=resumed.state["nonfinite_in_a_row"],
                         nonfinite_total=resumed.state["nonfinite_total"], evals=resumed.state["evals"],
                         checkpointed_step=resumed.step)
        if run.draft is not None and resumed.rank_state is not None:
            run.draft.load_state_dict(*resumed.rank_state)
        if run.rollouts is not None and resumed.rank_state is not None:
            run.rollouts.load_state_dict(*resumed.rank_state)
        if dist.is_main:
            tqdm.write(f"resumed from {latest} (step {resumed.step})")
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        output_dir_state.record_inputs(output_dir, run.record)  # config.json and inputs.json
    state.log = MetricsLog(output_dir, tensorboard=run.log.tensorboard, enabled=dist.is_main,
                           resume_step=state.step if latest is not None else None)
    run.state = state
    return state


def check_resume_point(latest: Path, output_dir: Path, num_steps: int, config: dict) -> None:
    """Whether checkpoint ``latest`` (verified) is this run's to continue to ``num_steps`` (train.num_steps),
    read from its state.json before any weight loads: RunComplete when the run finished at or past it (so
    complete.json's record stands); ValueError when it was trained with other training keys than
    ``config`` (another run's checkpoint), or is past ``num_steps`` (a run cannot go back)."""
    saved = checkpoint.checkpoint_record(latest)
    step, extra = saved["step"], saved["extra"]
    if "config" in extra:  # (checkpoints from before the config was recorded in them have only config.json)
        output_dir_state.check_same_training(f"checkpoint {latest}", extra["config"], config)
    done = output_dir_state.completed_step(output_dir)
    if done is not None and done >= step >= num_steps:
        raise RunComplete(step, extra["evals"])
    if step > num_steps:
        raise ValueError(f"config key 'train.num_steps': {num_steps} is fewer than the {step} steps of checkpoint "
                         f"{latest}, and a run cannot go back; resume with train.num_steps = {step} to finish the "
                         "run (or more, to train longer), or start a new run (another train.output_dir, or "
                         "--overwrite)")


class RewardFailure(ValueError):
    """A reward function failed on too many of a step's completions (train.reward_failure_limit), or on every
    held-out answer before training."""


class RunComplete(Exception):
    """``--resume`` of a run that already trained ``train.num_steps`` steps and wrote its outputs."""

    def __init__(self, step: int, evals: list[dict]):
        super().__init__(f"the run is complete ({step} steps); nothing to do")
        self.step, self.evals = step, evals


class TrainingInterrupted(Exception):
    """Ctrl-C: ``step`` steps were done; ``checkpoint`` is the last complete checkpoint (None: none yet);
    ``report``: this process says so (rank 0; every rank of a torchrun job stops with the same)."""

    def __init__(self, step: int, checkpoint: Path | None, report: bool = True):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint, self.report = step, checkpoint, report


def find_resume_checkpoint(output_dir: Path, dist: DistInfo) -> Path | None:
    """The newest verified checkpoint to resume from (damaged ones are named and passed over); None in an
    empty folder. Metrics without any usable checkpoint are refused, not deleted."""
    latest = checkpoint.latest_checkpoint(output_dir, notice=tqdm.write if dist.is_main else lambda _: None)
    unusable = sorted(output_dir.glob("step-*"))
    if latest is None and unusable:
        raise ValueError(f"--resume: none of the {len(unusable)} checkpoints in {output_dir} can be resumed from "
                         f"({', '.join(p.name for p in unusable[:3])}{', ...' if len(unusable) > 3 else ''}: each is "
                         "unfinished or damaged, as named above); start the run again with --overwrite (which moves "
                         "the old files aside) or use another train.output_dir")
    if latest is None and (output_dir / METRICS_FILE).is_file():
        raise ValueError(f"--resume: {output_dir} has {METRICS_FILE} but no complete checkpoint to continue from; "
                         "start the run again with --overwrite (which moves the old files aside) or use another "
                         "train.output_dir")
    if latest is None and dist.is_main:
        tqdm.write(f"--resume: no checkpoint in {output_dir}; starting from step 0")
    return latest


def interrupted(run: Run | None, output_dir: Path, *, report: bool = True) -> TrainingInterrupted:
    """What to report after Ctrl-C: the steps done and the newest checkpoint verified complete (``report``:
    this process reports it, and names the damaged checkpoints it passes over)."""
    notice = tqdm.write if report else (lambda _: None)
    latest = checkpoint.latest_checkpoint(output_dir, notice=notice) if output_dir.is_dir() else None
    return TrainingInterrupted(run.state.step if run is not None else 0, latest, report)


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
    run.state.log.log(run.state.step, {f"eval/{k}": v for k, v in result.items() if k != "step"})
    if run.dist.is_main:
        tqdm.write(f"step {run.state.step}: {describe_accuracies(held_out, result)}")
    return result


def save(run: Run) -> Path:
    """A checkpoint of the run now: weights, optimizer, data order, the state's counters and evaluations,
    each rank's draft, and the run's config (``--resume`` tells another run's checkpoint by it)."""
    extra = {"data": run.batches.state_dict(), "nonfinite_in_a_row": run.state.nonfinite_in_a_row,
             "nonfinite_total": run.state.nonfinite_total, "evals": run.state.evals, "config": run.record.config}
    path = checkpoint.save_checkpoint(run.train.output_dir, run.state.step, run.policy, run.optimizer,
                                      extra, run.dist, keep=run.train.keep_checkpoints,
                                      rank_state=rank_state(run))
    run.state.checkpointed_step = run.state.step
    if run.dist.is_main:
        tqdm.write(f"checkpoint saved: {path}")
    return path


def rank_state(run: Run):
    """This rank's own part of a checkpoint, (tensors, JSON scalars): the online draft's state (``draft/``,
    ``optimizer/``, ``sizing/``) and, in the asynchronous loop, the weights its in-flight rollouts sample with
    (``v<version>/``, the draft's among them) and carried generations; None: neither."""
    parts = [part for part in (run.draft.state_dict() if run.draft is not None else None,
                               run.rollouts.state_dict(run.state.step) if run.rollouts is not None else None)
             if part is not None]
    if not parts:
        return None
    tensors, scalars = {}, {}
    for part_tensors, part_scalars in parts:  # (their names do not overlap: the prefixes above)
        tensors.update(part_tensors)
        scalars.update(part_scalars)
    return tensors, scalars


def evaluate_and_save_final(run: Run) -> None:
    """The final evaluation, then the final checkpoint that holds it, each once: a run resumed from its
    final checkpoint (stopped while exporting) has both, so metrics.jsonl keeps one record of each
    (the loop never checkpoints the last step itself: a checkpoint taken before the final evaluation
    would resume into evaluating again)."""
    state = run.state
    if not any(e["step"] == state.step for e in state.evals):
        evaluate(run)
    if state.checkpointed_step != state.step:
        save(run)


def export(run: Run) -> Path | None:
    """The trained model (LoRA: its adapters) and tokenizer, with save_pretrained, to output_dir/final
    (written whole or not at all), in train.final_dtype ("auto": model.dtype, so a bf16 run exports bf16
    casts of its float32 masters). A failed write raises WriteError on every rank."""
    if not run.train.save_final_model:
        return None
    path = Path(run.train.output_dir) / "final"
    state_dict = checkpoint.full_model_state(run.policy)  # collective under FSDP2: every rank calls it
    error = None
    if run.dist.is_main:
        name = run.export_dtype
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
