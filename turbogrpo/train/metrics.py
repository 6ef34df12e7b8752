"""Per-step metrics to JSONL and TensorBoard, sample completions to JSONL, and phase timing."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

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
    matches the resumed run exactly.
    """

    def __init__(self, output_dir: str | Path, *, tensorboard: bool, enabled: bool, resume_step: int | None):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.writer = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        _truncate_after(self.dir / METRICS_FILE, resume_step)
        _truncate_after(self.dir / COMPLETIONS_FILE, resume_step)
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
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _truncate_after(path: Path, step: int | None) -> None:
    """Keep records of steps <= ``step`` (later ones belong to the interrupted run); None: start anew."""
    if not path.exists():
        return
    if step is None:
        path.unlink()
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
