"""Every code block of README.md and docs/ runs: Python blocks and the quick starts' shell commands on the
shipped demo model (runs cut to one short step), config fragments through the config loader. Blocks that
must not run carry a <!-- not run: why --> marker and are listed here, so none is skipped silently."""

import os

import pytest
import torch

from tests.docs.blocks import BlockFailed, run_block, shell_commands
from tests.docs.markdown import code_blocks, doc_files

BLOCKS = [block for path in doc_files() for block in code_blocks(path)]

# Each block that is not run, by page and first line. A new one must be added here, with its marker's reason.
NOT_RUN = {
    ("README.md", "make demo   # creates .venv, installs, trains GRPO on the built-in arithmetic task (minutes on 2 CPU cores)"),
    ("README.md", "turbogrpo demo --model smollm2     # = turbogrpo train configs/smollm2_arithmetic.toml"),
    ("README.md", "turbogrpo train configs/smollm2_calculator.toml     # SmolLM2 learns to call a calculator tool"),
    ("docs/guide/demo.md", "turbogrpo demo --longform          # long-form task, speculative rollouts, draft learnt online"),
    ("docs/guide/demo.md", "turbogrpo demo --model demo-hybrid --overwrite   # runs/demo_hybrid/"),
    ("docs/guide/distributed.md", "torchrun --nproc_per_node 4 -m turbogrpo train configs/gsm8k_lora_ddp.yaml"),
    ("docs/guide/distributed.md", "export TURBOGRPO_ROLLOUT_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')  "
                                  "# the same on both"),
    ("docs/guide/gguf.md", "turbogrpo demo --model smollm2                                   # = turbogrpo train configs/smollm2_arithmetic.toml"),
    ("docs/guide/install.md", "make setup   # .venv with the CPU build of torch, turbogrpo (editable) and the dev tools"),
    ("docs/guide/install.md", 'pip install -e ".[dev]"'),
    ("docs/guide/trl.md", "python bench/trl_vllm.py --shape smollm2-zero-shot --engine vllm"),
    ("docs/guide/trl.md", "python3 -m venv /work/venv-trlvllm"),
    ("docs/guide/trl.md", "PYTHONPATH=$PWD /work/venv-trlvllm/bin/python bench/trl_async.py            # 1 warm-up + 3 "
                          "timed steps each"),
    ("docs/guide/install.md", 'pip install vllm            # after your CUDA torch; then pip install -e ".[dev]"'),
}


@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory):
    """One working folder for every block, so later commands see the run an earlier one made (runs/demo);
    configs/ is the repository's. Caches (latency curves, drafts) go to the folder too."""
    folder = tmp_path_factory.mktemp("doc_blocks")
    (folder / "configs").symlink_to(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
    return folder


@pytest.fixture
def in_shared_folder(shared_folder, monkeypatch):
    monkeypatch.chdir(shared_folder)
    monkeypatch.setenv("TURBOGRPO_CACHE", str(shared_folder / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # (a run sets train.num_threads)


def test_blocks_that_do_not_run_are_the_listed_ones():
    marked = {(b.file, b.first_line) for b in BLOCKS if b.not_run}
    assert marked == NOT_RUN, (f"marked but not listed: {sorted(marked - NOT_RUN)}; listed but not marked (or "
                               f"gone): {sorted(NOT_RUN - marked)}")


def test_the_quick_starts_are_run():
    readme = [b for b in BLOCKS if b.file == "README.md" and not b.not_run]
    assert [b.language for b in readme] == ["python", "bash", "python"]
    assert [argv[:2] for _, argv in shell_commands(readme[1])][0] == ["turbogrpo", "demo"]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs(block, in_shared_folder):
    if block.not_run:
        pytest.skip(f"not run ({block.not_run})")
    run_block(block)


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\nraise RuntimeError('stale example')\n```\n\n"
                    "```toml\n[algo]\nloss = \"ppo\"\n```\n\n```bash\nls -l\n```\n", encoding="utf-8")
    python, toml, bash = code_blocks(page, root=tmp_path)
    with pytest.raises(BlockFailed, match=r"^page\.md:3: the Python block fails:(.|\n)*stale example"):
        run_block(python)
    with pytest.raises(BlockFailed, match=r"^page\.md:8: the toml block is not a valid config: .*algo\.loss"):
        run_block(toml)
    with pytest.raises(BlockFailed, match=r"^page\.md:14: `ls` is not a command the doc test can run"):
        run_block(bash)
