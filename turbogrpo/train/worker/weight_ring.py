"""The policy's weights handed from the trainer to the rollout worker (train.max_staleness = k > 0) through
shared memory: k + 1 slots of the trainable parameters, version v in slot v mod (k + 1).

A version here counts GRPO steps done (the weights after step v - 1's update; ``algo.staleness`` counts
optimizer steps, v x algo.num_iterations). Step s samples with version ``max(0, s - k)``
(``sampling_version``). Why k + 1 slots and no lock: the trainer writes version v + 1 at the end of step v,
into the slot of version v - k, which only step v sampled from; the worker copied it into its own model
before drawing step v, and the trainer has step v's rollout in hand, so that copy is over. Every other slot
the worker may still read is a version the trainer does not touch. The trainer writes only the
parameters an optimizer step changes (``requires_grad``: all of a full fine-tune, the adapters of LoRA),
in place, then raises ``published``; the worker waits for the version it needs and copies it in.

Only the trainable parameters travel: the worker loads the frozen rest (LoRA's base, buffers) from the same
model source, so its model equals the trainer's at every version.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch
from torch import nn


def sampling_version(step: int, max_staleness: int) -> int:
    """The weights (GRPO steps done) step ``step`` samples with when rollouts run ``max_staleness`` steps ahead:
    the newest that the trainer has finished by the time the worker starts that step's rollout."""
    return max(0, step - max_staleness)


def trainable_parameters(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters an optimizer step changes, by name (the same names in the worker's copy)."""
    return {name: p for name, p in policy.named_parameters() if p.requires_grad}


def frozen_digest(policy: nn.Module) -> str:
    """SHA-256 of the parameters no optimizer step changes (a LoRA run's base model), names, dtypes and shapes
    included: the weights a remote worker loads itself instead of receiving them, which must equal the trainer's.
    About 0.4 s per 540 MB (SmolLM2-135M in float32) at SHA-NI speed, once per run."""
    digest = hashlib.sha256()
    for name, p in policy.named_parameters():
        if not p.requires_grad:
            data = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # host sync on a GPU, once
            digest.update(f"{name}|{p.dtype}|{list(p.shape)}|".encode())
            digest.update(memoryview(data.numpy()))
    return digest.hexdigest()


class WeightRing:
    """``num_slots`` copies of the trainable parameters in host memory (shared with the worker process where a
    multiprocessing context is given), and the newest version in them."""

    def __init__(self, parameters: dict[str, torch.Tensor], num_slots: int, context=None):
        """``parameters``: the policy's trainable parameters (shapes and dtypes; values are published later);
        ``context``: the multiprocessing context the worker is spawned with (its shared counter); None: a ring of
        one process (a remote transport's: each side keeps its own, ``remote.py``)."""
        self.slots = [{name: _host(torch.empty(p.shape, dtype=p.dtype), shared=context is not None)
                       for name, p in parameters.items()} for _ in range(num_slots)]
        # Lock-free: the trainer is its only writer and an aligned int64 is read and written whole. A locked
        # Value would hang the trainer for good if the worker were killed while reading it (holding the lock).
        self.published = context.Value("q", -1, lock=False) if context is not None else _Counter()
        """The newest version written (-1: none yet)."""

    def publish(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        """Write ``parameters`` as ``version`` (the trainer, after the step's optimizer steps)."""
        slot = self.slots[version % len(self.slots)]
        with torch.no_grad():
            for name, p in parameters.items():
                slot[name].copy_(p.detach())  # host sync on a GPU: the copy must be done before the worker reads
        self.published.value = max(self.published.value, version)  # after the copies: the worker may read it now

    def load_into(self, version: int, parameters: dict[str, torch.Tensor], *, alive: Callable[[], None],
                  poll_s: float = 0.01) -> None:
        """Copy ``version`` into ``parameters`` (the worker's model), once the trainer has published it;
        ``alive()`` raises when the trainer is gone (checked while waiting)."""
        while self.published.value < version:
            alive()
            time.sleep(poll_s)
        slot = self.slots[version % len(self.slots)]
        with torch.no_grad():
            for name, p in parameters.items():
                p.copy_(slot[name])

    def check_fits(self, parameters: dict[str, torch.Tensor]) -> None:
        """A ValueError naming the first parameter whose name, shape or dtype differs between the ring (the
        trainer's weights, as they arrived) and ``parameters`` (this side's model)."""
        slot = self.slots[0]
        for name in sorted(slot.keys() | parameters.keys()):
            there, here = slot.get(name), parameters.get(name)
            if there is None or here is None or there.shape != here.shape or there.dtype != here.dtype:
                def shown(t):
                    return "absent" if t is None else f"{list(t.shape)} {t.dtype}"
                raise ValueError(f"the trainer's weights do not fit this worker's model: parameter {name!r} is "
                                 f"{shown(there)} there and {shown(here)} here; start the worker with the run's config")

    def state(self, versions: list[int]) -> dict[str, torch.Tensor]:
        """Those versions' tensors, ``"v<version>/<name>"`` (a checkpoint's rollout weights)."""
        return {f"v{v}/{name}": t.clone() for v in versions for name, t in self.slots[v % len(self.slots)].items()}

    def restore(self, tensors: dict[str, torch.Tensor], versions: list[int]) -> None:
        """Write a checkpoint's versions back (``state``'s tensors) before the worker draws from them."""
        for v in versions:
            slot = self.slots[v % len(self.slots)]
            for name, t in slot.items():
                t.copy_(tensors[f"v{v}/{name}"])


class _Counter:
    """The newest version of a ring that one process reads and writes (its threads: under the GIL, whole)."""

    value: int = -1


def _host(tensor: torch.Tensor, *, shared: bool) -> torch.Tensor:
    return tensor.share_memory_() if shared else tensor
