"""The output folder: a lock, no mixing of runs, nothing deleted, resumes that train the same thing."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbogrpo.config import dump_config, load_config
from turbogrpo.placement import DistInfo
from turbogrpo.train.metrics import MetricsLog, read_metrics
from turbogrpo.train.output_dir import changed_training_keys, claim_output_dir, run_record
from turbogrpo.train.state import find_resume_checkpoint

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def config_for(out, *sets):
    return load_config(None, [f"train.output_dir=\"{out}\"", *sets])


def claim(out, *sets, resume=False, overwrite=False):
    return claim_output_dir(run_record(config_for(out, *sets)), SINGLE, resume=resume, overwrite=overwrite)


def earlier_run(out: Path) -> dict[str, str]:
    (out / "step-000008").mkdir(parents=True)
    files = {"metrics.jsonl": '{"step": 1, "reward": 0.5}\n', "latest": "step-000008",
             "step-000008/state.json": "{}"}
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def test_a_fresh_run_refuses_a_used_folder_and_touches_nothing(tmp_path):
    files = earlier_run(tmp_path / "out")
    with pytest.raises(ValueError, match=r"train.output_dir '.*out' already holds files \(latest, metrics.jsonl, "
                                         r"step-000008\); continue that run with --resume, start anew with "
                                         r"--overwrite \(which moves them aside, deleting nothing\)"):
        claim(tmp_path / "out")
    assert all((tmp_path / "out" / name).read_text() == text for name, text in files.items())
    claim(tmp_path / "empty").release()  # an empty or new folder is fine


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    files = earlier_run(tmp_path / "out")
    claim(tmp_path / "out", overwrite=True).release()
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".lock"]
    (aside,) = tmp_path.glob("out.previous-*")
    assert all((aside / name).read_text() == text for name, text in files.items())


def test_a_second_run_into_a_locked_folder_fails_at_once(tmp_path):
    first = claim(tmp_path / "out")
    with pytest.raises(ValueError, match=rf"train.output_dir '.*out' is in use by another run \(pid {os.getpid()} on "):
        claim(tmp_path / "out", resume=True)
    first.release()
    claim(tmp_path / "out", resume=True).release()


def test_the_lock_of_a_killed_run_does_not_block(tmp_path):
    """A process holding the lock as a run does (flock on .lock) is SIGKILLed: the kernel drops its lock.
    (test_resume.py's --resume after SIGKILL checks the same with a whole run.)"""
    claim(tmp_path / "out").release()
    holder = subprocess.Popen(
        [sys.executable, "-S", "-c", "import fcntl, os, sys, time\nf = open(sys.argv[1], 'a+')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\nf.truncate(0)\nf.write(f'pid {os.getpid()}')\nf.flush()\n"
         "print('locked', flush=True)\n"
         "time.sleep(60)\n", str(tmp_path / "out" / ".lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(ValueError, match=f"in use by another run \\(pid {holder.pid}\\)"):
        claim(tmp_path / "out", resume=True)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    claim(tmp_path / "out", resume=True).release()


def test_resume_refuses_a_config_that_changes_training_and_names_the_keys(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dump_config(config_for(out), out / "config.json")
    with pytest.raises(ValueError, match=r"--resume: the config differs from the one .*out was trained with in keys "
                                         r"that change training: algo.beta \(0.0 -> 0.04\), optim.lr \(1e-06 -> 0.001\)"
                                         r"\. Resume with the stored values"):
        claim(out, "algo.beta=0.04", "optim.lr=1e-3", "train.num_steps=500", "log.tensorboard=false", resume=True)
    # Longer, logged or evaluated differently: the same training.
    claim(out, "train.num_steps=500", "log.tensorboard=false", "train.eval_every=5", resume=True).release()


def test_the_machines_settings_are_free_to_change_on_resume():
    """Ports, hosts, the secret's file, timeouts, thread counts and where the worker runs change nothing trained
    (a remote run moved to another port was refused as a key that changes training)."""
    before = load_config(None, ["train.max_staleness=1", "train.rollout_worker=\"remote\""]).to_dict()
    after = load_config(None, ["train.max_staleness=1", "train.rollout_port=31000", "train.rollout_host=\"0.0.0.0\"",
                               "train.rollout_connect_timeout_s=30", "train.rollout_secret_file=\"/s\"",
                               "train.rollout_threads=3", "train.num_threads=5"]).to_dict()
    assert changed_training_keys(before, after) == []
    assert [key for key, _, _ in changed_training_keys(before, {**after, "train": {**after["train"], "seed": 9}})] \
        == ["train.seed"]


def test_changed_rewards_are_a_change_in_training():
    before = load_config(None).to_dict()
    after = load_config(None, ["rewards.0.kwargs={answer_column = \"gold\"}"]).to_dict()
    assert [key for key, _, _ in changed_training_keys(before, after)] == ["rewards"]


def test_resume_with_metrics_but_no_checkpoint_refuses_and_keeps_them(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n')
    with pytest.raises(ValueError, match=r"--resume: .* has metrics.jsonl but no complete checkpoint to continue "
                                         r"from; start the run again with --overwrite"):
        find_resume_checkpoint(tmp_path, SINGLE)
    assert read_metrics(tmp_path) == [{"step": 0, "eval/accuracy": 0.25}]


def test_a_torn_last_metrics_line_is_dropped_with_a_notice(tmp_path, capsys):
    good = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75}, {"step": 3, "reward": 1.0}]
    text = "".join(json.dumps(r) + "\n" for r in good)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 4, "rew')
    assert read_metrics(tmp_path) == good
    MetricsLog(tmp_path, tensorboard=False, enabled=True, resume_step=2)
    assert read_metrics(tmp_path) == good[:2]
    assert "metrics.jsonl: dropped its last line, cut short by an interrupted write ('{\"step\": 4, \"rew'" in \
        capsys.readouterr().out

    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n' + text)  # damage before the end is not a torn write
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is not valid JSON"):
        MetricsLog(tmp_path, tensorboard=False, enabled=True, resume_step=2)


@pytest.mark.parametrize("key, where", [("model.path", "out"), ("model.path", "out/model"), ("data.path", "out"),
                                        ("draft.path", "out/draft")])
def test_an_output_folder_that_is_or_holds_an_input_is_refused_and_nothing_moves(tmp_path, key, where):
    (tmp_path / where).mkdir(parents=True, exist_ok=True)
    kept = tmp_path / where / ("rows.jsonl" if key == "data.path" else "config.json")
    kept.write_text("{}")
    source = kept if key == "data.path" else tmp_path / where
    if key == "draft.path":
        (source / "draft_config.json").write_text("{}")
        (source / "draft.safetensors").write_text("")
    relation = "is" if where == "out" and key != "data.path" else "holds"
    with pytest.raises(ValueError, match=rf"config key 'train.output_dir': '.*out' {relation} {key} '.*'; outputs "
                                         "must not mix"):
        claim(tmp_path / "out", f'{key}="{source}"', overwrite=True)
    assert kept.read_text() == "{}" and not list(tmp_path.glob("out.previous-*"))


def test_an_output_folder_that_holds_a_reward_module_is_refused(tmp_path, monkeypatch):
    import importlib.util
    (tmp_path / "my_rewards.py").write_text("def score(prompts, completions, **columns):\n    return [0.0]\n")
    spec = importlib.util.spec_from_file_location("my_rewards", tmp_path / "my_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "my_rewards", module)  # train imports reward modules before the claim
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'.*' holds rewards.0.function '.*my_rewards.py'"):
        claim(".", "rewards.0.function=my_rewards:score", "train.accuracy_reward=\"\"", overwrite=True)
    assert (tmp_path / "my_rewards.py").is_file()


def test_an_output_folder_inside_the_model_folder_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError, match=r"'.*model/run' sits inside model.path"):
        claim(tmp_path / "model" / "run", f'model.path="{tmp_path / "model"}"')
    assert not (tmp_path / "model" / "run").exists()


@pytest.mark.parametrize("spelled", ["out/sub/..", "."])
def test_overwrite_resolves_the_path_before_anything_moves(tmp_path, monkeypatch, spelled):
    (tmp_path / "out" / "sub").mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path / "out" if spelled == "." else tmp_path)
    (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    claim(spelled, overwrite=True).release()
    (aside,) = tmp_path.glob("out.previous-*")
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "sub"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".lock"]


def test_overwrite_moves_everything_or_nothing(tmp_path, monkeypatch):
    earlier_run(tmp_path / "out")
    real_rename = Path.rename

    def rename_fails_on_the_second(self, target):
        if self.name == "metrics.jsonl":
            raise OSError(18, "Invalid cross-device link")
        return real_rename(self, target)
    monkeypatch.setattr(Path, "rename", rename_fails_on_the_second)
    with pytest.raises(ValueError, match=r"--overwrite: cannot move '.*metrics.jsonl' to .* \(Invalid cross-device "
                                         r"link\); nothing was moved"):
        claim(tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock", "latest", "metrics.jsonl", "step-000008"]
    assert not list(tmp_path.glob("out.previous-*"))


def test_resume_refuses_training_data_or_a_model_rewritten_since_the_run_started(tmp_path, monkeypatch):
    from tests.train.tiny_run import write_model
    from turbogrpo.train import output_dir
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    model = write_model(tmp_path / "model")
    sets = ("data.kind=rows", f'data.path="{rows}"', f'model.path="{model}"')
    claim(tmp_path / "out", *sets).release()
    output_dir.record_inputs(tmp_path / "out", output_dir.run_record(config_for(tmp_path / "out", *sets)))
    claim(tmp_path / "out", *sets, resume=True).release()  # the same inputs resume
    rows.write_text('{"prompt": "b"}\n')  # same row count, other content
    with pytest.raises(ValueError, match=rf"--resume: data.path '{rows}' changed since .*out started \(the content "
                                         "differs from the fingerprint in .*inputs.json\)"):
        claim(tmp_path / "out", *sets, resume=True)
    rows.write_text('{"prompt": "a"}\n')
    monkeypatch.setattr(output_dir, "SAMPLED_ABOVE_BYTES", 1000)  # the weights are sampled, not read whole
    output_dir.record_inputs(tmp_path / "out", output_dir.run_record(config_for(tmp_path / "out", *sets)))
    write_model(model, seed=1)  # retrained: same files and sizes, other weights
    with pytest.raises(ValueError, match=rf"--resume: model.path '{model}' changed since"):
        claim(tmp_path / "out", *sets, resume=True)
