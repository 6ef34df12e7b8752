"""Outputs are written whole or not at all, and a full disk is an OSError naming the file."""

import errno
import types

import pytest
import torch
from safetensors import SafetensorError

from turbogrpo.files import WriteError, describe_os_error, save_tensors, write_folder_atomically
from turbogrpo.models import tiny_model
from turbogrpo.placement import DistInfo
from turbogrpo.train.state import export

DISK_FULL = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                            '"No space left on device" })')


def test_a_folder_appears_whole_and_replaces_the_older_copy_only_once_complete(tmp_path):
    final = tmp_path / "final"
    write_folder_atomically(final, lambda folder: (folder / "a.txt").write_text("old"), "the test output")

    def half_then_full_disk(folder):
        (folder / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "weights"))
    with pytest.raises(WriteError, match=r"could not write the test output .*final \(No space left on device: "
                                         r".*weights\); nothing was left half-written"):
        write_folder_atomically(final, half_then_full_disk, "the test output")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (final / "a.txt").read_text() == "old"
    write_folder_atomically(final, lambda folder: (folder / "b.txt").write_text("new"), "the test output")
    assert [p.name for p in final.iterdir()] == ["b.txt"] and [p.name for p in tmp_path.iterdir()] == ["final"]

    def interrupted(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_folder_atomically(final, interrupted, "the test output")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and [p.name for p in final.iterdir()] == ["b.txt"]


def test_a_safetensors_write_failure_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    def disk_full(tensors, path):
        raise DISK_FULL
    monkeypatch.setattr("turbogrpo.files.save_file", disk_full)
    with pytest.raises(OSError) as err:
        save_tensors({"x": torch.zeros(2)}, tmp_path / "x.safetensors")
    assert err.value.errno == errno.ENOSPC
    assert describe_os_error(err.value) == f"No space left on device: {tmp_path / 'x.safetensors'}"


def test_an_export_that_fails_midway_leaves_no_final_folder(tmp_path):
    train = types.SimpleNamespace(save_final_model=True, output_dir=str(tmp_path), final_dtype="float32")

    class FullDiskTokenizer:  # the model's files are written first, then the disk fills up
        def save_pretrained(self, folder):
            raise DISK_FULL
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    run = types.SimpleNamespace(train=train, export_dtype="float32", policy=tiny_model(), tokenizer=FullDiskTokenizer(),
                                dist=dist)
    with pytest.raises(WriteError, match=r"could not write the final model .*final \(No space left on device\)"):
        export(run)
    assert list(tmp_path.iterdir()) == []
