"""The command line: train / demo / eval, and errors before any work."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbogrpo.cli import Terminated, demo_config, main
from turbogrpo.config import load_config

from tests.train.tiny_run import overrides, write_model, write_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_config_file_matches_the_demo_command():
    assert load_config(REPO / "configs" / "demo.toml") == demo_config()


def test_smollm2_config_file_matches_the_smollm2_demo_command():
    config = demo_config(model="smollm2")
    assert load_config(REPO / "configs" / "smollm2_arithmetic.toml") == config
    assert config.model.path == "smollm2-135m-instruct" and config.data.kind == "small_arithmetic"


def test_longform_config_file_matches_the_longform_demo_command():
    config = demo_config(longform=True)
    assert load_config(REPO / "configs" / "longform.toml") == config
    assert config.rollout.speculation == "cost" and config.draft.learn


@pytest.mark.parametrize("argv, message", [
    (["train", "missing.toml"], "turbogrpo: error: config file 'missing.toml' does not exist"),
    (["demo", "--set", "algo.loss=ppo"], "turbogrpo: error: config key 'algo.loss': 'ppo' is not allowed; expected "
                                         "one of bnpo, dapo, dr_grpo, grpo, gspo"),
    (["demo", "--set", "train.num_step=3"], "turbogrpo: error: config key 'train.num_step' is unknown (did you mean "
                                            "'num_steps'?)"),
    (["demo", "--set", "rewards.0.function=nowhere:f"], "turbogrpo: error: config key 'rewards.0.function': reward "
                                                        "'nowhere:f': cannot import module 'nowhere'"),
    (["demo", "--set", "model.path=/no/such/model"], "turbogrpo: error: model path '/no/such/model' is not an "
                                                     "existing folder"),
    (["rollout-worker", str(REPO / "configs" / "demo.toml"), "--trainer", "127.0.0.1:29600"],
     "turbogrpo: error: config key 'train.max_staleness': 0 is not allowed in a rollout worker's config"),
    (["rollout-worker", str(REPO / "configs" / "demo.toml"), "--trainer", "nohost", "--set", "train.max_staleness=1"],
     "turbogrpo: error: --trainer 'nohost': expected HOST:PORT"),
])
def test_bad_input_exits_2_with_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err


@pytest.mark.parametrize("world_size, argv, message", [
    (None, ["demo", "--nproc-per-node", "0"], "turbogrpo: error: --nproc-per-node: 0 is not a number of processes; "
                                              "use an integer >= 1\n"),
    ("4", ["demo", "--nproc-per-node", "2"], "turbogrpo: error: --nproc-per-node: 2 processes asked for inside a "
                                             "torchrun job of 4; drop the flag under torchrun, or start the command "
                                             "without torchrun\n"),
])
def test_a_bad_number_of_processes_is_one_line_before_any_launch(world_size, argv, message, capsys, monkeypatch):
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main(argv) == 2
    assert capsys.readouterr().err == message


def test_train_then_eval_the_exported_model(tmp_path, capsys):
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  num_steps: 2\n")
    sets = [s for s in overrides(model_dir, rows, tmp_path / "out") if not s.startswith("train.num_steps")]
    assert main(["train", str(config), "--set", *sets]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy, greedy: 0.0% (step 0) -> 0.0% (step 2)" in out
    assert "held-out accuracy, sampled (pass@1 at the rollout temperature): 0.0% -> 0.0%" in out
    assert "2 steps in" in out and (tmp_path / "out" / "final" / "config.json").is_file()

    assert main(["eval", str(config), "--set", *sets, "--model", str(tmp_path / "out" / "final")]) == 0
    assert "held-out accuracy greedy 0.0%, sampled 0.0% (4 per problem, temperature 1) on 8 problems" in \
        capsys.readouterr().out

    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    assert main(["train", str(config), "--set", *sets]) == 2  # a fresh run would mix with this one
    assert capsys.readouterr().err.startswith(f"turbogrpo: error: train.output_dir '{tmp_path / 'out'}' already "
                                              "holds files (")
    assert main(["train", str(config), "--resume", "--set", *sets]) == 0
    assert f"turbogrpo: the run in {tmp_path / 'out'} is complete (2 steps); nothing to do." in capsys.readouterr().out
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # no second final evaluation


def test_an_output_dir_that_holds_the_config_file_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('[train]\noutput_dir = "."\n')
    assert main(["train", "run.toml", "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"turbogrpo: error: config key 'train.output_dir': '{tmp_path}' holds the "
                                       f"config file '{tmp_path / 'run.toml'}'; outputs must not mix with what the "
                                       "run reads, so choose a train.output_dir outside it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


@pytest.mark.parametrize("output_dir, problem", [
    ("/dev/full", "'/dev/full' is a file, not a folder; choose a folder path"),
    ("{tmp}/a_file/run", "cannot create folder '{tmp}/a_file/run' (Not a directory); choose a folder path you can "
                         "write to"),
])
def test_an_output_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, output_dir, problem):
    (tmp_path / "a_file").write_text("not a folder")
    output_dir = output_dir.format(tmp=tmp_path)
    assert main(["demo", "--set", f"train.output_dir=\"{output_dir}\""]) == 2
    expected = f"turbogrpo: error: config key 'train.output_dir': {problem.format(tmp=tmp_path)}\n"
    assert capsys.readouterr().err == expected


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "turbogrpo", "train", "--help"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0 and "--resume" in result.stdout and "--set" in result.stdout


@pytest.mark.parametrize("stop, how, code", [(KeyboardInterrupt, "interrupted", 130),
                                             (Terminated, "terminated (SIGTERM)", 143)])
def test_ctrl_c_or_sigterm_outside_training_is_one_line(monkeypatch, capsys, stop, how, code):
    def stopped(args):
        raise stop
    monkeypatch.setattr("turbogrpo.commands.draft.run_profile", stopped)
    assert main(["profile"]) == code
    assert capsys.readouterr().err == (f"turbogrpo: profile {how}; its outputs are written whole or not at all, "
                                       "so nothing half-written is left\n")


def test_eval_measures_a_model_exactly_as_a_run_does_at_step_0(tmp_path, capsys):
    # One builder (train.evaluate.build_held_out) serves both: same prompts, sampling and seed.
    sets = ["data.num_eval_problems=12", "data.num_eval_samples=2", "train.num_steps=1", "train.checkpoint_every=0",
            "train.save_final_model=false", "log.report=false", "log.progress_bar=false",
            f'train.output_dir="{tmp_path / "run"}"']
    assert main(["demo", "--set", *sets]) == 0
    step_0 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step 0: "))
    assert main(["eval", "--set", *sets]) == 0
    measured = capsys.readouterr().out.strip().splitlines()[-1]
    assert measured.startswith(f"demo: {step_0.removeprefix('step 0: ')} (")


def test_an_env_factory_that_cannot_be_imported_is_one_line_before_any_step(tmp_path, capsys):
    """`turbogrpo train` with an [env] whose factory cannot be imported exits 2 with one line naming it,
    before any step: no metrics, no checkpoint, no model export (the other load_factory errors:
    tests/env/test_interface.py)."""
    factory, message = "no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"
    out = tmp_path / "run"
    argv = ["train", str(REPO / "configs" / "demo_multiturn.toml"), "--set", f'env.factory="{factory}"',
            f'train.output_dir="{out}"', "log.progress_bar=false", "log.tensorboard=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("turbogrpo: error: ") and message in err and factory.split(":")[0] in err, err
    assert err.count("\n") == 1
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("step-*")) and not (out / "final").exists()
