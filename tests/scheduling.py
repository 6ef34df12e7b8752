"""How ``make test`` hands test files to its pytest-xdist workers (``-n 2 --dist loadfile``; tests/conftest.py
installs it). Two changes to xdist's file-by-file scheduling:

* Files that share a session fixture too costly to build twice go to one worker as one unit: the vLLM modules that
  wrap the session's compiled engine (tests/rollout/conftest.py's ``vllm_llm``: a minute or more on 2 cores), which a
  second worker would build again.
* The longest files start first (longest-processing-time order), so the run does not end with one worker idle while
  the other works through a file of minutes. xdist's own order (most tests first) would start them anywhere.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

SHARED_UNITS = {
    "tests/rollout/test_vllm_engine.py": "vllm_llm: tests/rollout/test_vllm_engine.py, test_vllm_conversations.py",
    "tests/rollout/test_vllm_conversations.py": "vllm_llm: tests/rollout/test_vllm_engine.py, test_vllm_conversations.py",
}
"""File -> the unit it runs in when it shares a session fixture with other files (else the file is its own unit)."""

LONGEST_FIRST = (
    "tests/train/test_remote_worker.py",
    "tests/train/test_async.py",
    "tests/train/test_distributed.py",
    "tests/train/test_resume.py",
    "tests/test_gguf_models.py",
    "tests/docs/test_code_blocks.py",
    SHARED_UNITS["tests/rollout/test_vllm_engine.py"],
    "tests/mixers/test_parity.py",
    "tests/train/test_remote_security.py",
    "tests/train/test_partial_rollouts.py",
    "tests/rollout/test_compiled.py",
    "tests/train/test_multiturn_run.py",
    "tests/rollout/test_vllm_speculation.py",
    "tests/test_portable_cpu.py",
    "tests/test_cli.py",
)
"""Units of a minute or more on 2 cores, longest first (measured with ``--junitxml`` over the default suite, 2026-12:
2-6 minutes each on a loaded machine); only their order matters, and a file missing here just starts later."""


class SharedUnitsLongestFirst(LoadFileScheduling):
    """``--dist loadfile`` with ``SHARED_UNITS`` kept together and ``LONGEST_FIRST`` handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        file = super()._split_scope(nodeid)
        return SHARED_UNITS.get(file, file)

    def _assign_work_unit(self, node) -> None:
        rank = {unit: position for position, unit in enumerate(LONGEST_FIRST)}
        first = min(self.workqueue, key=lambda unit: rank.get(unit, len(rank)))  # ties: xdist's order (min is stable)
        self.workqueue.move_to_end(first, last=False)
        super()._assign_work_unit(node)


def refines_this_xdist() -> bool:
    """Whether the installed pytest-xdist's loadfile scheduler has the internals ``SharedUnitsLongestFirst`` refines
    (``_split_scope``, ``_assign_work_unit`` and the ``workqueue`` they share)."""
    import inspect
    return (all(hasattr(LoadFileScheduling, name) for name in ("_split_scope", "_assign_work_unit"))
            and "workqueue" in inspect.getsource(LoadFileScheduling.__mro__[1]))
