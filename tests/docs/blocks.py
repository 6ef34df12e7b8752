"""Running a documented code block: Python is executed, a shell line runs its `turbogrpo` command in this
process (with a run of minutes cut to seconds), and a TOML or YAML block must load as a config fragment.
Every failure names the page and line."""

from __future__ import annotations

import shlex
import tomllib
import traceback

import yaml

from tests.docs.markdown import Block

# Options appended to a documented command so that a run of minutes takes seconds: one GRPO step of a few
# prompts, a few held-out problems, a tiny draft, a short latency curve. Later --set values win, so these
# override what the block sets. Keyed by the command's words before its options.
# A run keeps its held-out evaluation (greedy only, on 2 problems) and a group of 4, so the step still trains
# (most groups of 4 mix rewards; a group of 2 would often be skipped).
ONE_SHORT_STEP = ["--set", "train.num_steps=1", "train.prompts_per_step=2", "rollout.num_generations=4",
                  "rollout.max_new_tokens=16", "data.num_eval_problems=2", "data.num_eval_samples=0"]
SHORTER = {
    ("demo",): ONE_SHORT_STEP,
    ("train",): ONE_SHORT_STEP,
    ("eval",): ["--set", "data.num_eval_problems=4", "data.num_eval_samples=1"],
    ("draft", "train"): ["--num-prompts", "2", "--num-samples", "2", "--max-new-tokens", "8", "--epochs", "1"],
    ("draft", "export-vllm"): [],  # a file conversion: already short
    ("profile",): ["--max-tokens", "4"],
}


class BlockFailed(AssertionError):
    """A documented block that no longer runs; the message starts with 'file:line'."""


def shorter(argv: list[str]) -> list[str]:
    for words, extra in SHORTER.items():
        if tuple(argv[:len(words)]) == words:
            return [*argv, *extra]
    raise BlockFailed(f"`turbogrpo {' '.join(argv)}`: no entry in tests/docs/blocks.py SHORTER says how to cut it "
                      "short; add one")


def shell_commands(block: Block) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each command of a shell block; backslash continues a line."""
    commands, pending, first = [], "", 0
    for offset, line in enumerate(block.code.splitlines(), 1):
        if not pending:
            first = block.line + offset
        pending += line.rstrip("\\") + " "
        if line.endswith("\\"):
            continue
        argv = shlex.split(pending, comments=True)
        pending = ""
        if argv:
            commands.append((first, argv))
    return commands


def run_shell(block: Block) -> None:
    from turbogrpo.cli import main
    for line, argv in shell_commands(block):
        if argv[0] != "turbogrpo":
            raise BlockFailed(f"{block.file}:{line}: `{argv[0]}` is not a command the doc test can run; run it "
                              "with turbogrpo, or mark the block <!-- not run: why -->")
        try:
            status = main(shorter(argv[1:]))
        except SystemExit as stop:  # argparse
            status = stop.code
        if status != 0:
            raise BlockFailed(f"{block.file}:{line}: `{' '.join(argv)}` exited with status {status} (its error "
                              "is printed above)")


def run_python(block: Block) -> None:
    try:
        exec(compile(block.code, block.where, "exec"), {"__name__": "__doc_block__"})
    except Exception:
        raise BlockFailed(f"{block.where}: the Python block fails:\n{traceback.format_exc()}") from None


def load_config_fragment(block: Block) -> None:
    from turbogrpo.config import ConfigError, config_from_dict
    try:
        raw = tomllib.loads(block.code) if block.language == "toml" else yaml.safe_load(block.code)
        config_from_dict(raw)
    except (ConfigError, tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        raise BlockFailed(f"{block.where}: the {block.language} block is not a valid config: {err}") from None


RUNNERS = {"python": run_python, "bash": run_shell, "toml": load_config_fragment, "yaml": load_config_fragment}
NOT_CODE = {"text"}  # file trees and other listings: nothing to run


def run_block(block: Block) -> None:
    if block.language in NOT_CODE:
        return
    if block.language not in RUNNERS:
        raise BlockFailed(f"{block.where}: a code block needs a language the doc test knows "
                          f"({', '.join([*RUNNERS, *NOT_CODE])}), not {block.language!r}")
    RUNNERS[block.language](block)
