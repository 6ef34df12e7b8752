"""Host memory that stays mapped: glibc malloc tuned so freed blocks are reused, not unmapped.

glibc serves every allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh
``mmap`` and returns it to the OS on free. A training step or a rollout on the CPU allocates
activations, logits chunks and gradients of tens to hundreds of MB, over and over, so each one
page-faults its pages in again (a 4 KiB fault per page, zero-filled by the kernel). On this
project's 2-core Xeon, ``python bench/update.py --parts allocator`` measures a float32 SmolLM2
forward + backward 1.44x faster on the kept heap (bf16: unchanged; its blocks are half the size,
mostly under the adaptive threshold already). Raising the mmap threshold to 1 GiB and the trim threshold to 2 GiB makes such
blocks come from the heap and stay there after free, which is what jemalloc/tcmalloc do and what
Intel's PyTorch CPU guide preloads them for.

The cost: freed memory is kept by the process, so its resident size stays near its peak instead of
shrinking between steps. ``TURBOGRPO_HOST_MALLOC=system`` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

ENV = "TURBOGRPO_HOST_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = (1 << 31) - 1               # mallopt takes an int


def _libc():
    """glibc's functions, or None where there is no C library to load."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_host_memory() -> bool:
    """Tune glibc malloc as the module docstring says (once per process); False where it does not
    apply (not Linux/glibc, or ``TURBOGRPO_HOST_MALLOC=system``), True once applied."""
    setting = os.environ.get(ENV, "keep").strip().lower()
    if setting not in ("keep", "system"):
        raise ValueError(f"{ENV} must be 'keep' or 'system', got {setting!r}")
    if setting == "system" or not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(_libc(), "mallopt", None)  # musl and other libcs have none
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD_BYTES))


def release_freed_host_memory() -> None:
    """Return the heap's free blocks to the OS now (glibc ``malloc_trim``), e.g. before measuring a
    peak resident set; a no-op elsewhere."""
    malloc_trim = getattr(_libc(), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if malloc_trim is not None:
        malloc_trim(0)
