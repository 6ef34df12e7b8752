"""Per-step metrics to JSONL and TensorBoard, sample completions to JSONL, and phase timing."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from turbogrpo.files import write_text_atomically

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


class PhaseTimer:
    """Wall time per phase of a step (rollout, rewards, logprobs, update ...), in seconds.

    Each phase ends with a device synchronize so its time is its own, not spilled into the next
    phase's first host sync (one sync per phase, not per kernel).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Only rank 0 writes; on resume the file is truncated to the checkpoint's step so that the log
    matches the resumed run exactly (a last line torn by a kill mid-write is dropped, with a notice).
    """

    def __init__(self, output_dir: str | Path, *, tensorboard: bool, enabled: bool, resume_step: int | None):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.writer = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, COMPLETIONS_FILE):
            _truncate_after(self.dir / name, resume_step, notice=tqdm.write)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.dir / "tensorboard"), purge_step=resume_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)

    def log_completions(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        with open(self.dir / COMPLETIONS_FILE, "a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``output_dir/metrics.jsonl`` (a torn last line is left out)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [record for _, record in read_records(path)]


def read_records(path: Path, notice: Callable[[str], None] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every line of a JSONL log. The last line may be torn (a kill during a write):
    it is dropped, with ``notice``; a bad line before it is an error naming the file and line."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not valid JSON ({err}); fix or remove that line") from None
            if notice is not None:
                notice(f"{path}: dropped its last line, cut short by an interrupted write ({line[:60]!r}...)")
    return records


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _truncate_after(path: Path, step: int | None, notice: Callable[[str], None]) -> None:
    """Keep records of steps <= ``step`` (later ones belong to the interrupted run). None: a new run,
    whose folder the output-dir check found empty; nothing is ever deleted here."""
    if step is None or not path.exists():
        return
    kept = [line for line, record in read_records(path, notice) if record["step"] <= step]
    write_text_atomically(path, "".join(line + "\n" for line in kept))  # a kill mid-rewrite loses nothing
