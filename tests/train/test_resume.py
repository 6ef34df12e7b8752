"""Exact resume: a run SIGKILLed after a checkpoint and resumed ends bit for bit where an
uninterrupted run ends (CPU, real subprocesses)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turbogrpo.config import load_config
from turbogrpo.train.machine_record import read_machine_records
from turbogrpo.train import checkpoint as ckpt
from turbogrpo.train.loop import train
from turbogrpo.train.metrics import read_metrics

from .tiny_run import overrides, write_model, write_rows

REPO = Path(__file__).resolve().parents[2]
EXTRA = {"train.num_steps": 8, "train.checkpoint_every": 2, "algo.num_iterations": 2, "algo.beta": 0.02,
         "optim.warmup_steps": 2, "optim.schedule": "cosine", "optim.weight_decay": 0.01}
# bf16-mixed: float32 masters and AdamW state in the checkpoint, bf16 autocast compute.
BF16_MIXED = {**EXTRA, "model.dtype": "bfloat16"}
# Speculative rollouts with a draft learnt online: the draft, its optimizer and the sizing statistics
# must resume too (fixed sizing: its tree shapes, hence its draws, do not depend on timings).
SPECULATIVE = {"train.num_steps": 4, "train.checkpoint_every": 2, "rollout.speculation": "fixed",
               "draft.lr": 3e-3, "draft.max_tokens": 40, "draft.steps": 2}


def subprocess_run_setup(tmp_path: Path) -> tuple[Path, Path, Path, dict]:
    """A tiny model, its data rows, an empty config file (everything is set with --set) and the env of a
    one-thread ``python -m turbogrpo`` child that imports this checkout."""
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    config = tmp_path / "run.toml"
    config.write_text("# everything is set on the command line\n")
    return model_dir, rows, config, child_env()


def child_env() -> dict:
    """The environment of a one-thread ``python -m turbogrpo`` child that imports this checkout."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def command(config: Path, sets: list[str], *flags: str) -> list[str]:
    return [sys.executable, "-m", "turbogrpo", "train", str(config), *flags, "--set", *sets]


def at_first_checkpoint(argv: list[str], env: dict, stderr=subprocess.PIPE, **options) -> subprocess.Popen:
    """A ``turbogrpo`` child of ``argv``, returned once it printed its first "checkpoint saved:" line."""
    child = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, **options)
    for line in child.stdout:
        if line.startswith("checkpoint saved:"):
            break
    return child


# grpo: slow (grpo_bf16_mixed runs the same settings and SIGKILL-resume path, with float32 masters under bf16)
@pytest.mark.parametrize("extra", [pytest.param(EXTRA, marks=pytest.mark.slow), BF16_MIXED, SPECULATIVE],
                         ids=["grpo", "grpo_bf16_mixed", "speculative_online_draft"])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, extra):
    last = f"step-{extra['train.num_steps']:06d}"
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)

    killed_dir = tmp_path / "killed"
    sets = overrides(model_dir, rows, killed_dir, **extra)
    child = at_first_checkpoint(command(config, sets), env, stderr=subprocess.DEVNULL)
    child.send_signal(signal.SIGKILL)  # mid-training, after the first checkpoint
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (killed_dir / "final").exists()
    interrupted_at = max(int(p.name.split("-")[1]) for p in killed_dir.glob("step-*"))
    assert interrupted_at < extra["train.num_steps"]

    # The killed run's lock on the folder died with it: the resume is not blocked.
    resumed = subprocess.run(command(config, sets, "--resume"), cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed_dir / 'step-'}" in resumed.stdout
    assert [m["step"] for m in read_machine_records(killed_dir)] == [0, interrupted_at]  # one line per start

    straight_dir = tmp_path / "straight"
    train(load_config(None, overrides(model_dir, rows, straight_dir, **extra)))  # in-process, one thread too

    final_killed = load_file(killed_dir / last / "model.safetensors")
    final_straight = load_file(straight_dir / last / "model.safetensors")
    assert final_killed.keys() == final_straight.keys()
    assert {t.dtype for t in final_straight.values()} == {torch.float32}  # the masters, whatever computes
    for name in final_straight:
        assert torch.equal(final_killed[name], final_straight[name]), name
    optim_killed = load_file(killed_dir / last / "optimizer.safetensors")
    optim_straight = load_file(straight_dir / last / "optimizer.safetensors")
    assert all(torch.equal(optim_killed[k], optim_straight[k]) for k in optim_straight)
    if "rollout.speculation" in extra:
        draft_killed = load_file(killed_dir / last / "extra-rank0.safetensors")
        draft_straight = load_file(straight_dir / last / "extra-rank0.safetensors")
        assert any(k.startswith("optimizer/") for k in draft_straight) and draft_killed.keys() == draft_straight.keys()
        for name in draft_straight:
            assert torch.equal(draft_killed[name], draft_straight[name]), name

    killed, straight = comparable(read_metrics(killed_dir)), comparable(read_metrics(straight_dir))
    assert [r["step"] for r in killed] == [r["step"] for r in straight]
    for a, b in zip(killed, straight):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def comparable(records):
    """Metrics records without their timings (which differ between any two runs)."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k} for r in records]


LONG_RUN_STEPS = 1_000_000


def long_run_after_its_first_checkpoint(tmp_path, *flags: str):
    """A ``turbogrpo train`` child (with ``flags``) far too long to finish by itself (so only the test's
    signal ends it, on however fast a machine), returned once it printed its first checkpoint; and its
    config file, set options and output folder."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    out = tmp_path / "out"
    sets = overrides(model_dir, rows, out, **{"train.num_steps": LONG_RUN_STEPS, "train.checkpoint_every": 1,
                                              "data.eval_path": '""'})
    # SIGINT's default action restored in the child: a shell without job control starts background jobs
    # with SIGINT ignored (CI run as `cmd &`), which Python then keeps, and the Ctrl-C case could not be tested.
    child = at_first_checkpoint(command(config, sets, *flags), env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return child, config, sets, out


@pytest.mark.parametrize("stop, code, how", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, r"terminated \(SIGTERM\)")],
                         ids=["ctrl_c", "sigterm"])
def test_ctrl_c_or_sigterm_prints_one_line_naming_the_checkpoint_and_the_lock_keeps_other_runs_out(
        tmp_path, stop, code, how):
    from turbogrpo.placement import DistInfo
    from turbogrpo.train.output_dir import claim_output_dir, run_record

    child, config, sets, out = long_run_after_its_first_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is in use by another run"):  # a second run into the folder
        claim_output_dir(run_record(load_config(None, sets)), DistInfo(0, 1, 0, torch.device("cpu")), resume=True,
                         overwrite=False)
    child.send_signal(stop)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"turbogrpo: {how} at step (\d+); continue with `turbogrpo train {config} --resume` "
                        rf"\(with the same --set options\) \(from {out}/step-(\d+)\)", last), last
    step, saved = map(int, re.fullmatch(r".* at step (\d+);.*step-(\d+)\)", last).groups())
    assert 1 <= saved <= step < LONG_RUN_STEPS
    assert ckpt.checkpoint_problem(out / f"step-{saved:06d}") is None


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def assert_stopped_by_sigterm_naming_one_checkpoint(child, config, out, flags: str) -> None:
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "Connection reset" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("turbogrpo: ")]
    assert len(said) == 1, said  # rank 0 speaks for both
    after = stderr.strip().splitlines()[stderr.strip().splitlines().index(said[0]) + 1:]
    # Only torchrun's launcher may log after it (the ranks' exit, when a rank was stopped and not the launcher).
    assert all(re.match(r"[WEI]\d{4} .*torch/distributed/elastic/", line) for line in after), after
    found = re.fullmatch(rf"turbogrpo: terminated \(SIGTERM\) at step (\d+); continue with `turbogrpo train {config} "
                         rf"{flags} --resume` \(with the same --set options\) \(from {out}/step-(\d+)\)", said[0])
    assert found, said[0]
    step, saved = map(int, found.groups())
    assert 1 <= saved <= step < LONG_RUN_STEPS
    assert ckpt.checkpoint_problem(out / f"step-{saved:06d}") is None
    assert ckpt.checkpoint_problem(out / f"step-{step:06d}") is None  # the ranks stopped at a step's end


def test_sigterm_to_the_launcher_of_two_ranks_ends_like_one_process(tmp_path):
    child, config, _, out = long_run_after_its_first_checkpoint(tmp_path, "--nproc-per-node", "2")
    child.send_signal(signal.SIGTERM)
    assert_stopped_by_sigterm_naming_one_checkpoint(child, config, out, "--nproc-per-node 2")


def test_sigterm_to_one_rank_stops_both_at_the_same_step_end(tmp_path):
    child, config, _, out = long_run_after_its_first_checkpoint(tmp_path, "--nproc-per-node", "2")
    ranks = children(child.pid)
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGTERM)  # rank 1 (started second) alone: rank 0 must not be left in a collective
    assert_stopped_by_sigterm_naming_one_checkpoint(child, config, out, "--nproc-per-node 2")


# --- the end of a run, stopped anywhere and resumed: every record once, complete.json never rewritten ---

END = {"train.num_steps": 2, "train.checkpoint_every": 1, "log.completions_every": 0}


class Killed(BaseException):
    """Stands for a kill at a chosen point of a run's end: nothing after it runs and the files stay as they
    are (no handler of the run catches a BaseException; metrics.jsonl is written line by line)."""


def killed(*args, **kwargs):
    raise Killed()


# Where a run's end can be stopped (module, function replaced by a kill), in the order they come.
KILL_POINTS = {
    "after_the_final_evaluation": ("turbogrpo.train.state", "save"),  # logged; its checkpoint not written
    "during_the_export": ("turbogrpo.train.loop", "export"),  # the final checkpoint written
    "during_the_report": ("turbogrpo.train.loop", "write_report"),
    "before_complete_json": ("turbogrpo.train.loop", "mark_complete"),
}


@pytest.fixture(scope="module")
def end_inputs(tmp_path_factory):
    """A tiny model and rows, and the metrics of the uninterrupted run of END (evaluations at steps 0 and 2)."""
    folder = tmp_path_factory.mktemp("end")
    model_dir, rows = write_model(folder / "model"), write_rows(folder / "rows.jsonl")
    train(load_config(None, overrides(model_dir, rows, folder / "straight", **END)))
    return model_dir, rows, end_records(read_metrics(folder / "straight"))


SAMPLER_DIAGNOSTICS = ("logprob_gap", "staleness/weight_mean", "staleness/weight_max", "mismatch/")
"""Metrics (names and prefixes) computed from the sampler's log-probs against the trainer's (at k = 0 they feed
no loss)."""


def end_records(records):
    """``comparable`` records less ``SAMPLER_DIAGNOSTICS``: the first run of a test process and a later one
    differ there by about 5e-9 (measured: every other metric, grad_norm included, equal bit for bit; seen only
    when this module's runs are the first of their pytest process, so with two workers it depends on which files
    a worker ran before), which is not what this test is about."""
    return [{k: v for k, v in r.items() if not k.startswith(SAMPLER_DIAGNOSTICS)} for r in comparable(records)]


def stopped_at(point: str, sets: list[str], monkeypatch) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(".".join(KILL_POINTS[point]), killed)
        with pytest.raises(Killed):
            train(load_config(None, sets))


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_run_stopped_anywhere_in_its_end_and_resumed_logs_every_record_once(tmp_path, monkeypatch, end_inputs,
                                                                               point):
    model_dir, rows, straight = end_inputs
    out = tmp_path / "out"
    sets = overrides(model_dir, rows, out, **END)
    stopped_at(point, sets, monkeypatch)
    assert not (out / "complete.json").exists()
    summary = train(load_config(None, sets), resume=True)
    assert not summary.already_complete and summary.steps == 2
    assert [e["step"] for e in summary.evals] == [0, 2]
    got = end_records(read_metrics(out))
    assert [(r["step"], "eval/accuracy" in r) for r in got] == [(0, True), (1, False), (2, False), (2, True)]
    assert got == straight
    assert json.loads((out / "complete.json").read_text()) == {"step": 2} and (out / "final" / "config.json").is_file()


def test_resume_with_fewer_steps_than_done_is_refused_or_reports_the_run_complete_at_its_step(
        tmp_path, monkeypatch, end_inputs):
    model_dir, rows, _ = end_inputs
    out = tmp_path / "out"
    sets = overrides(model_dir, rows, out, **END)
    stopped_at("during_the_export", sets, monkeypatch)  # checkpoint step-000002, not complete
    fewer = overrides(model_dir, rows, out, **{**END, "train.num_steps": 1})
    with pytest.raises(ValueError, match=rf"^config key 'train.num_steps': 1 is fewer than the 2 steps of checkpoint "
                                         rf"{out}/step-000002, and a run cannot go back; resume with "
                                         r"train.num_steps = 2 to finish the run"):
        train(load_config(None, fewer), resume=True)
    assert not (out / "complete.json").exists() and not (out / "final").exists()

    train(load_config(None, sets), resume=True)  # finished
    metrics = (out / "metrics.jsonl").read_text()
    summary = train(load_config(None, fewer), resume=True)
    assert summary.already_complete and summary.steps == 2 and [e["step"] for e in summary.evals] == [0, 2]
    assert json.loads((out / "complete.json").read_text()) == {"step": 2}  # the record stands
    assert (out / "metrics.jsonl").read_text() == metrics and (out / "latest").read_text() == "step-000002"


def test_resume_from_another_runs_checkpoint_of_the_same_shapes_names_the_keys_that_differ(tmp_path, monkeypatch,
                                                                                              end_inputs):
    model_dir, rows, _ = end_inputs
    other, out = tmp_path / "other", tmp_path / "out"
    train(load_config(None, overrides(model_dir, rows, other, **{**END, "optim.lr": 1e-3, "data.eval_path": '""'})))
    sets = overrides(model_dir, rows, out, **END)
    stopped_at("during_the_export", sets, monkeypatch)
    shutil.rmtree(out / "step-000002")
    shutil.copytree(other / "step-000002", out / "step-000002")  # this run's config.json, the other run's weights
    with pytest.raises(ValueError, match=rf"^--resume: the config differs from the one checkpoint {out}/step-000002 "
                                         r"was trained with in keys that change training: optim.lr \(0.001 -> 0.003\)"
                                         r"\. Resume with the stored values"):
        train(load_config(None, sets), resume=True)


def test_resume_where_every_checkpoint_is_damaged_says_so(tmp_path, monkeypatch, end_inputs):
    model_dir, rows, _ = end_inputs
    out = tmp_path / "out"
    sets = overrides(model_dir, rows, out, **END)
    stopped_at("during_the_export", sets, monkeypatch)
    for folder in out.glob("step-*"):
        (folder / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(ValueError, match=rf"^--resume: none of the 2 checkpoints in {out} can be resumed from "
                                         r"\(step-000001, step-000002: each is unfinished or damaged"):
        train(load_config(None, sets), resume=True)
