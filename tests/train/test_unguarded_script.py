"""A script that calls ``turbogrpo.train`` at import (no ``if __name__ == "__main__":`` guard) with
train.max_staleness > 0: its rollout worker process, started with multiprocessing's spawn, imports the script again.
The run stops with one error naming the guard, and nothing leaks (before: two tracebacks, "died ... (out of
memory? see the system log)" and three leaked semaphores)."""

import subprocess
import sys
import textwrap

from .test_resume import REPO, child_env


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from tests.train.tiny_run import overrides, write_model, write_rows
        from turbogrpo.config import load_config
        from turbogrpo.train.loop import train
        here = Path({str(tmp_path)!r})
        model_dir, rows = write_model(here / "model"), write_rows(here / "rows.jsonl")
        train(load_config(None, overrides(model_dir, rows, here / "out", **{{"train.max_staleness": 1,
                                                                              "train.num_steps": 2}})))
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("Traceback") == 1 and "leaked" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("turbogrpo.train.worker.protocol.RolloutWorkerError: the rollout worker process could not "
                           "start") and 'put the call under `if __name__ == "__main__":`' in last, done.stderr[-3000:]
