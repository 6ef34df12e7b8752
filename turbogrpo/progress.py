"""A progress line for one long call that reports nothing itself (building an engine, compiling a step)."""

from __future__ import annotations

import contextlib
import threading

from tqdm import tqdm


@contextlib.contextmanager
def ticking(description: str, every_s: float = 1.0):
    """A progress line showing the time spent in the block, refreshed every ``every_s`` by a thread (the
    block is one long call that reports nothing)."""
    done = threading.Event()
    with tqdm(total=1, desc=description, bar_format="{desc}: {elapsed}", dynamic_ncols=True) as bar:
        thread = threading.Thread(target=lambda: [bar.refresh() for _ in iter(lambda: done.wait(every_s), True)],
                                  daemon=True)
        thread.start()
        try:
            yield
            bar.update()
        finally:
            done.set()
            thread.join()
