"""Where this process runs: its place in a ``torchrun`` job (rank, device) and its share of this machine's CPU
cores beside a local rollout worker.

``join_job`` joins the job when there is one (``WORLD_SIZE`` > 1) and picks this rank's device from a device
setting; ``DistInfo`` carries the answer to every part that asks where it runs (a training run's, ``turbogrpo
eval``'s, a rollout worker's). What runs across the ranks (DDP / FSDP2, the collectives) is
``train.distributed``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from turbogrpo.models import checked_device


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            torch_dist.barrier()


def join_job(device: str = "auto", backend: str = "auto") -> DistInfo:
    """Join the torchrun job if there is one (``WORLD_SIZE`` > 1) and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_obj = resolve_device(device, local_rank)
    if world_size > 1 and not torch_dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device_obj.type == "cuda" else "gloo"
        if device_obj.type == "cuda":
            torch.cuda.set_device(device_obj)
        torch_dist.init_process_group(backend=backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device_obj)


def leave_job(dist: DistInfo) -> None:
    """Leave the torchrun job ``join_job`` joined (nothing in a one-process run)."""
    if dist.enabled and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def resolve_device(device: str, local_rank: int = 0, key: str = "config key 'model.device'") -> torch.device:
    """The torch device of a device setting ("auto", "cpu", "cuda", "cuda:N"); ValueError naming ``key``
    when this machine lacks it."""
    given = device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    resolved = checked_device(device, key, shown=given)
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"{key}: {given!r} is not supported; use \"auto\", \"cpu\", \"cuda\" or \"cuda:N\"")
    return resolved


def thread_split(num_threads: int, rollout_threads: int, cores: int | None = None) -> tuple[int, int]:
    """(trainer threads, worker threads) of the asynchronous loop on ``cores`` CPU cores (this machine's): the
    settings where given (train.num_threads, train.rollout_threads), else half the cores each (the worker at
    least one, the trainer the rest): both sides are compute-bound, so the split is the cores, not more
    (oversubscribed threads spin against each other). The best split is measured by bench/async_grpo.py."""
    cores = cores or os.cpu_count() or 1
    worker = rollout_threads or max(1, cores // 2)
    return num_threads or max(1, cores - worker), worker
