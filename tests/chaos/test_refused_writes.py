"""Faults on purpose: a disk that fills, or refuses writes, while ONN writes a checkpoint, a layer store, an
export or metrics.json. Each write ends in one sentence naming the path (and, for a full disk, the space
needed), the previous artefact stays whole and loadable, and nothing half-written is left where a later run
would take it as whole. The full disk is a real 1 MB tmpfs where this machine lets the tests mount one (as
root on Linux), else an OSError(ENOSPC) injected into the writer; a read-only folder needs the mount."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from onn.errors import UserError
from onn.streaming import store as store_module
from onn.streaming.store import LayerStore
from onn.tasks.record import RunRecord, writable_folder
from onn.training import checkpoints


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs at tmp_path/disk (None where mounting is not permitted); unmounted after."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)]).returncode:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _half_then_enospc(path, *_args, **_kwargs):
    """A writer that puts half a file down, then finds the disk full."""
    Path(path).write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    checkpoints.save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)
    monkeypatch.setattr(checkpoints, "save_file", lambda tensors, where: _half_then_enospc(where))
    with pytest.raises(UserError) as caught:
        checkpoints.save({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    message = str(caught.value)
    assert str(path) in message and "disk is full" in message and "MB are needed" in message
    assert "\n" not in message
    previous = checkpoints.load(path)
    assert previous["global_step"] == 1 and torch.equal(previous["state_dict"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no .tmp a resume could pick up


def test_a_full_disk_during_a_layer_store_build_leaves_no_block_taken_as_whole(tmp_path, monkeypatch):
    store = LayerStore("disk", "bfloat16", folder=tmp_path / "store")
    blocks = {0: {"w": torch.ones(4, 4)}, 1: {"w": torch.full((4, 4), 2.0)}}
    calls = []

    def second_fails(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            _half_then_enospc(path)
        real_write(path, tensors)

    real_write = store_module.write_safetensors
    monkeypatch.setattr(store_module, "write_safetensors", second_fails)
    with pytest.raises(UserError, match=r"disk is full .* layer store"):
        store.fill(blocks)
    shapes = {"w": [4, 4]}
    assert store.is_complete(0, shapes) and not store.is_complete(1, shapes)
    assert not list((tmp_path / "store").glob("*.tmp"))
    monkeypatch.setattr(store_module, "write_safetensors", real_write)
    again = LayerStore("disk", "bfloat16", folder=tmp_path / "store")
    again.fill(blocks)
    assert again.rebuilt == [1]  # only the block that was not whole is written again
    assert torch.equal(again.read(1)["w"].float(), blocks[1]["w"])


def test_a_full_disk_for_metrics_json_is_one_sentence_and_keeps_the_last_record(small_disk):
    if small_disk is None:
        pytest.skip("mounting a tmpfs is not permitted here")
    record = RunRecord(small_disk, {"status": "ok", "note": "first"})
    record.write()
    (small_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 64 * 1024))  # most of the 1 MB
    with pytest.raises(OSError):  # the disk is full now: fill what is left
        (small_disk / "rest").write_bytes(b"\0" * 1024 * 1024)
    record.metrics["note"] = "x" * 200_000
    with pytest.raises(UserError, match=r"cannot write .*metrics\.json: the disk is full"):
        record.write()
    assert '"note": "first"' in (small_disk / "metrics.json").read_text()
    assert [p.name for p in small_disk.iterdir() if p.name.endswith(".tmp")] == []


def test_an_export_onto_a_full_disk_is_one_sentence_and_writes_nothing(small_disk):
    if small_disk is None:
        pytest.skip("mounting a tmpfs is not permitted here")
    from onn.config import typed
    from onn.config.export import OnnxExport
    from onn.export.write import export_model

    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))  # 2 MB
    sample = {"batch_size": 2, "sequence_length": 16, "image_size": None}
    settings = typed(
        OnnxExport, {"name": "onnx", "output": None, "opset": 18, "atol": 1e-4, "sample": sample}, "export"
    )
    with pytest.raises(UserError, match=r"cannot write .*model\.onnx: the disk is full"):
        export_model(model, small_disk / "model.onnx", {"x": torch.randn(2, 512)}, settings)
    assert list(small_disk.iterdir()) == []


def test_a_read_only_run_folder_or_cache_is_refused_before_any_work(small_disk):
    if small_disk is None:
        pytest.skip("mounting a tmpfs is not permitted here")
    (small_disk / "old_run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for key in ("hydra.run.dir", "paths.cache"):
        with pytest.raises(UserError, match=rf"{key}=.*old_run cannot be written to: Read-only file system"):
            writable_folder(small_disk / "old_run", key)
    with pytest.raises(UserError, match="cannot be made"):
        writable_folder(small_disk / "new_run", "hydra.run.dir")
