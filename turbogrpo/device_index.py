"""Index tensors built on the host from host ints, copied to the device without making the host wait."""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy an index tensor built on the host to ``device`` without making the host wait.

    A plain ``.to("cuda")`` from pageable memory synchronises the stream; from pinned memory with
    ``non_blocking=True`` it is queued like a kernel (the caching host allocator keeps the pinned
    buffer alive until the copy has run).
    """
    if host.device == device:
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
