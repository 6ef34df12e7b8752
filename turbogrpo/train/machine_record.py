"""What machine each start of a run ran on: ``machine.jsonl`` in the output folder, one line per start
(a resumed run may continue on another kind of CPU, and its figures then mean something else)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from turbogrpo.cpu_capability import cpu_capability

MACHINE_FILE = "machine.jsonl"


def machine_record(device: torch.device, step: int) -> dict:
    """This process's machine as a run records it: the CPU capability every kernel choice saw, torch's
    build and threads, the device, and the step the run (re)started at."""
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "step": step, "device": str(device),
              "cpu": platform.processor() or platform.machine(), "cpu_capability": cpu_capability().record(),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record


def record_machine(output_dir: Path, device: torch.device, step: int) -> dict:
    """Append this start's ``machine_record`` to ``output_dir/machine.jsonl``; returns it. (An appended
    line: a kill mid-write leaves at most one cut last line, which ``read_machine_records`` skips.)"""
    record = machine_record(device, step)
    with open(output_dir / MACHINE_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_machine_records(output_dir: Path) -> list[dict]:
    """Every whole line of ``machine.jsonl`` (none where it is missing)."""
    path = output_dir / MACHINE_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
