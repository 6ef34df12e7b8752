"""The kept host heap (turbogrpo.host_memory): applied once, opt-out by environment, bad values named."""

import sys

import pytest
import torch

from turbogrpo import host_memory


@pytest.fixture(autouse=True)
def fresh_setting():
    host_memory.keep_freed_host_memory.cache_clear()
    yield
    host_memory.keep_freed_host_memory.cache_clear()


def test_system_leaves_glibc_alone(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "system")
    assert host_memory.keep_freed_host_memory() is False


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "jemalloc")
    with pytest.raises(ValueError, match="TURBOGRPO_HOST_MALLOC must be 'keep' or 'system'"):
        host_memory.keep_freed_host_memory()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux's")
def test_keep_applies_and_large_tensors_still_work(monkeypatch):
    monkeypatch.delenv(host_memory.ENV, raising=False)
    assert host_memory.keep_freed_host_memory() is True
    for _ in range(3):  # blocks above glibc's default mmap threshold, freed and allocated again
        x = torch.ones(1 << 23)
        assert float(x.sum()) == 1 << 23
        del x
    host_memory.release_freed_host_memory()


def test_generate_called_directly_keeps_the_heap(monkeypatch):
    """The Python API's rollout applies the setting as the trainer does (issue 44: 83-157 s instead of 34-36 s
    for a bf16 rollout on a busy machine without it)."""
    from turbogrpo.models import load_demo_model
    from turbogrpo.rollout import SamplingConfig, generate

    monkeypatch.delenv(host_memory.ENV, raising=False)
    model, tokenizer = load_demo_model()
    assert host_memory.keep_freed_host_memory.cache_info().currsize == 0
    generate(model, [torch.tensor(tokenizer("1 + 2 =").input_ids)], num_samples=2, seed=0,
             sampling=SamplingConfig(max_new_tokens=2))
    assert host_memory.keep_freed_host_memory.cache_info().currsize == 1  # asked once, by generate
