"""The shared-prefix forward and backward never read device values back to the host.

On a GPU every such read (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``.cpu()``) stalls the
host until the device catches up, which made the call launch-bound. The CPU test forbids those
reads on every tensor while the call runs; the CUDA test asks torch itself to fail on a sync.
"""

from contextlib import contextmanager

import pytest
import torch

import turbogrpo
from tests.prefix.conftest import PACKS, build_model as build_unchecked_model, random_groups
from turbogrpo.output_head import check_logits_head


def build_model(*args, **kwargs):
    """A test model whose logits head was checked already: that probe reads its result back once per model
    (``turbogrpo.output_head``), by design; the calls below must read nothing back."""
    model = build_unchecked_model(*args, **kwargs)
    check_logits_head(model)
    return model

# Tensor methods that copy device values to the host (each one a host sync on a GPU).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def host_reads_forbidden():
    """Inside the block, any of ``HOST_READS`` on any tensor raises AssertionError."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def forbidden(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a tensor on the host: a host sync on a GPU")
        return method

    for name in HOST_READS:
        setattr(torch.Tensor, name, forbidden(name))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def test_forbidding_host_reads_catches_them():
    """The detector itself: it must see the reads the old code made."""
    t = torch.tensor([1, 2])
    for read in (lambda: t.max().item(), lambda: t.tolist(), lambda: int(t[0]), lambda: bool(t[0]),
                 lambda: t.cpu()):
        with host_reads_forbidden(), pytest.raises(AssertionError, match="host sync"):
            read()
    assert t.tolist() == [1, 2]  # restored afterwards


def _loss(model, prompts, completions, **kwargs):
    per_group = turbogrpo.completion_logprobs(model, prompts, completions, **kwargs)
    return torch.cat([t for group in per_group for t in group]).sum()


@pytest.mark.parametrize("backend", ["auto", "cascade", "varlen", "reference"])
def test_shared_prefix_forward_and_backward_read_nothing_back(backend):
    model = build_model("qwen2")
    prompts, completions = random_groups(*PACKS["mixed"])
    with host_reads_forbidden():
        _loss(model, prompts, completions, backend=backend).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_standard_layout_reads_nothing_back():
    model = build_model("qwen2")
    prompts, completions = random_groups(*PACKS["mixed"])
    with host_reads_forbidden():
        _loss(model, prompts, completions, share_prefix=False).backward()


def test_flex_forward_reads_nothing_back():
    model = build_model("qwen2")
    prompts, completions = random_groups(*PACKS["mixed"])
    with torch.no_grad(), host_reads_forbidden():
        _loss(model, prompts, completions, backend="flex")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counting device syncs needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "varlen", "cascade", "flex"])
def test_no_cuda_sync_in_forward_and_backward(backend):
    model = build_model("qwen2", torch.bfloat16).cuda()
    prompts, completions = random_groups(*PACKS["mixed"])
    prompts, completions = [p.cuda() for p in prompts], [[c.cuda() for c in cs] for cs in completions]
    _loss(model, prompts, completions, backend=backend).backward()  # warm-up: compiles, allocator, pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _loss(model, prompts, completions, backend=backend).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
