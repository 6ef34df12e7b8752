"""Multi-process training under ``torchrun``: DDP / FSDP2 wrapping of the training forward, each rank's share
of a step's prompts, and the collectives the run's parts use. Where each process sits in the job (its rank and
device, ``DistInfo``) is ``turbogrpo.placement``'s.

Applied from outside the loop so the loop reads the same with one process or many. Each rank rolls
out its own share of the step's prompts; gradients are averaged by DDP (or reduce-scattered by FSDP2).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as torch_dist
from torch import nn

from turbogrpo.placement import DistInfo
from turbogrpo.train.precision import Precision


def local_slice(num_items: int, dist: DistInfo) -> slice:
    """This rank's contiguous share of ``num_items`` (which the world size must divide)."""
    if num_items % dist.world_size:
        raise ValueError(f"config key 'train.prompts_per_step': {num_items} is not divisible by the "
                         f"{dist.world_size} processes; use a multiple of {dist.world_size}")
    per_rank = num_items // dist.world_size
    return slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)


def all_reduce_sum(tensor: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Sum ``tensor`` over ranks (in place when distributed; returned either way)."""
    if dist.enabled:
        torch_dist.all_reduce(tensor)
    return tensor


def all_gather_cat(tensor: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Concatenate every rank's equally shaped ``tensor`` along dim 0, in rank order."""
    if not dist.enabled:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.world_size)]
    torch_dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


class LogprobModule(nn.Module):
    """Makes the shared-prefix forward the ``forward`` of a module, so DDP/FSDP2 hooks see it.

    DDP prepares its gradient all-reduce in ``forward``; calling ``completion_logprobs`` on the bare
    model would bypass it. ``forward(prompts, completions, **options)`` returns what ``logprob_fn``
    returns for those options (e.g. ``with_entropy=False``).
    """

    def __init__(self, model: nn.Module, logprob_fn):
        super().__init__()
        self.model = model
        self.logprob_fn = logprob_fn

    def forward(self, prompts, completions, **options):
        return self.logprob_fn(self.model, prompts, completions, **options)


def wrap_for_training(model: nn.Module, logprob_fn, dist: DistInfo, strategy: str,
                      precision: Precision | None = None) -> nn.Module:
    """The module the update calls: ``module(prompts, completions) -> per-group log-probs``.

    One process: a plain :class:`LogprobModule`. DDP: that module wrapped in DistributedDataParallel
    (gradients averaged over ranks in backward). FSDP2: ``fully_shard`` on every decoder layer and on
    the root, so parameters are sharded at rest and gathered per layer in forward and backward.
    ``precision`` (float32 storage by default): DDP all-reduces the float32 gradients of the float32
    masters; FSDP2 gathers the float32 shards cast to the compute dtype and reduce-scatters in float32.
    """
    module = LogprobModule(model, logprob_fn)
    if not dist.enabled:
        return module
    return WRAPPERS[strategy](module, dist, precision or Precision(torch.float32, torch.float32))


def _wrap_ddp(module: LogprobModule, dist: DistInfo, precision: Precision) -> nn.Module:
    # Mixed precision needs nothing here: the parameters (and so their gradients) are the float32 masters.
    from torch.nn.parallel import DistributedDataParallel
    device_ids = [dist.device.index] if dist.device.type == "cuda" else None
    # Buffers (rotary tables) are identical on every rank and never trained: no per-forward broadcast.
    return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)


def _wrap_fsdp2(module: LogprobModule, dist: DistInfo, precision: Precision) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    base = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
    # Float32 shards at rest (masters and AdamW state); each layer is gathered in the compute dtype and
    # its gradients reduce-scattered in float32, so small updates and the gradient sum stay exact.
    options = {"mp_policy": fsdp_mixed_precision(precision)} if precision.mixed else {}
    for layer in base.get_decoder().layers:
        fully_shard(layer, **options)
    fully_shard(module, **options)
    # FSDP2 sets up its module tree on the root's first forward; rollouts call the layers directly,
    # which would otherwise make each layer a root of its own. One token through the root fixes that.
    one_token = torch.zeros(1, dtype=torch.long, device=dist.device)
    with torch.no_grad():
        module([one_token], [[one_token]])
    # The root keeps its parameters gathered after forward (for the backward that usually follows);
    # reshard so the optimizer, built next, holds the sharded parameters that training will update.
    module.reshard()
    return module


WRAPPERS = {"ddp": _wrap_ddp, "fsdp2": _wrap_fsdp2}


def fsdp_mixed_precision(precision: Precision):
    """FSDP2's policy for float32 shards with low-precision compute: gather in the compute dtype,
    reduce gradients in float32, outputs left as the forward made them (the log-probs are float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32,
                                output_dtype=None, cast_forward_inputs=False)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Inside, backward reduces gradients over ranks only if ``enabled`` (the last micro-batch)."""
    # By the wrapper, not by torch.distributed.is_initialized(): a colocated vLLM engine initialises a
    # process group of its own in a one-process run, whose module is not wrapped.
    if enabled or not hasattr(module, "no_sync") and not hasattr(module, "set_requires_gradient_sync"):
        yield
    elif hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    else:  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


def all_reduce_max_int(value: int, dist: DistInfo, device: torch.device) -> int:
    """The largest ``value`` over ranks (host sync: the caller needs the number)."""
    if not dist.enabled:
        return value
    t = torch.tensor([value], device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def full_parameters(module: nn.Module):
    """Inside, every FSDP2-sharded parameter of ``module`` is gathered and stays gathered.

    Rollouts and evaluation decode token by token with a different number of forwards on each rank,
    so FSDP2's per-layer all-gathers could not be matched across ranks: gather once, decode locally,
    reshard after. Without FSDP2 this does nothing.
    """
    from torch.distributed.fsdp import FSDPModule
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:  # root first (modules() order), so it initialises as the root
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in reversed(sharded):
            m.set_reshard_after_forward(True)
            m.reshard()
