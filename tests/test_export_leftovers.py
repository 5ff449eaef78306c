"""What a killed export leaves beside its path: the weights file an ONNX export moved beside the graph
(onnx_export.move_into_place) that no graph names, killed before the graph's rename (the new one) or after it (the
replaced one), goes with the next export; a Hugging Face folder and its adapter (hf.save_export) are never a pair of
two exports. Kills land before each change to the file system in turn (test_export_round94's harness)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import tiny_llama
from hostile_corpus import tiny_onnx
from kill_harness import killed_at
from test_export_round94 import FEEDS, _computes, _scaled, _staged

from onn.export.folders import MARKER
from onn.export.hf import adapter_folder, save_export
from onn.export.onnx_export import move_into_place, run_onnx, weights_files


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _export(model: onnx.ModelProto, output: Path) -> None:
    """An ONNX export's last steps: `model` staged (its weights file named by this process), moved into place."""
    move_into_place(_staged(model, output), output)


def test_the_weights_a_killed_onnx_export_left_go_with_the_next_export(tmp_path):
    """Killed between moving its weights beside the graph and renaming the graph, an export left the new weights
    file; killed after the rename, the replaced one: no graph names either, and nothing removed them. The next
    export leaves exactly its graph and the weights file it names, and computes its model."""
    source = tiny_onnx(tmp_path / "src.onnx")
    old, new, later = (_scaled(source, s) for s in (1.0, 0.5, 0.25))
    wants = {name: run_onnx(m, FEEDS)["y"] for name, m in (("old", old), ("new", new), ("later", later))}
    left, step = set(), 0
    while True:
        step += 1
        out = tmp_path / f"step{step}" / "model.onnx"
        out.parent.mkdir()
        assert not killed_at(0, partial(_export, old, out))  # by an earlier process
        killed = killed_at(step, partial(_export, new, out))  # staged in the killed process, as an export stages
        if len(_names(out.parent)) > 2:  # a weights file the graph does not name
            left.add(_computes(out, {k: wants[k] for k in ("old", "new")}))
        move_into_place(_staged(later, out), out)
        assert _names(out.parent) == sorted([out.name, *(p.name for p in weights_files(out))])
        assert len(_names(out.parent)) == 2
        np.testing.assert_allclose(run_onnx(out, FEEDS)["y"], wants["later"], atol=1e-6)
        if not killed:
            break
    assert left == {"old", "new"}  # kills left one before the graph's rename and one after it


def test_the_weights_of_an_export_still_running_stay(tmp_path):
    """A weights file named with a running process's id (another export of this path, between its two renames)
    stays; one named with an ended process's id goes; files of other names are not the export's to remove."""
    source, out = tiny_onnx(tmp_path / "src.onnx"), tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    running = out.parent / f"model.onnx.{os.getppid()}-0123456789ab.data"
    dead = out.parent / f"model.onnx.{ended.pid}-0123456789ab.data"
    mine = out.parent / "model.onnx.v1-notes.data"  # not staged_name's PID-<12 hex>: not an export's
    for path in (running, dead, mine):
        path.write_bytes(b"\0" * 64)
    move_into_place(_staged(_scaled(source, 1.0), out), out)
    (named,) = weights_files(out)
    assert _names(out.parent) == sorted([out.name, named.name, running.name, mine.name])


def _trained(seed: int):
    """A tiny Llama under peft (LoRA on q_proj), its adapters moved from their start as training moves them."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


def _contents(folder: Path) -> dict[str, bytes] | None:
    """Every file of `folder` by name (None where there is no folder)."""
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else None


@pytest.mark.slow  # an export of a tiny Llama killed at each of ~27 steps: 40 s on a busy machine
def test_a_killed_export_leaves_no_adapter_beside_weights_it_was_not_trained_with(tmp_path):
    """The adapter folder was swapped in after the weights folder: killed between the two, the new merged weights
    sat beside the earlier export's adapter, each whole, not a pair. Killed at any step now, the folder is one
    export's, whole, and the adapter beside it is that export's or none; the next export leaves the pair alone."""
    models = {"first": _trained(1), "second": _trained(2)}
    pairs = {}
    for name, model in models.items():
        out = tmp_path / name / "hf"
        out.parent.mkdir()
        save_export(model, None, out, max_shard_size="2GB", adapter=True, model_name="tiny")
        pairs[name] = (_contents(out), _contents(adapter_folder(out)))
    assert pairs["first"][0] != pairs["second"][0] and pairs["first"][1] != pairs["second"][1]
    seen, step = set(), 0
    while True:
        step += 1
        out = tmp_path / f"step{step}" / "hf"
        shutil.copytree(tmp_path / "first", out.parent)  # the earlier export's pair
        work = partial(save_export, models["second"], None, out, max_shard_size="2GB", adapter=True, model_name="tiny")
        killed = killed_at(step, work)
        weights, adapter = _contents(out), _contents(adapter_folder(out))
        (which,) = [name for name, pair in pairs.items() if pair[0] == weights]
        assert adapter in (None, pairs[which][1]), f"killed before change {step}: {which}'s weights, another adapter"
        seen.add((which, adapter is not None))
        if not killed:
            break
    assert seen >= {("first", True), ("second", True)} and step > 5
    save_export(models["second"], None, out, max_shard_size="2GB", adapter=True, model_name="tiny")
    assert _names(out.parent) == ["hf", "hf-adapter"]


def test_killed_right_after_the_folders_swap_the_earlier_adapter_is_gone(tmp_path):
    """Killed at its first removal after the new weights folder was staged whole (the earlier folder's, once swapped
    out: the moment the old order left the new weights beside the earlier adapter), the export leaves the new folder
    with no adapter beside it; the next export, one without an adapter, removes the adapter the killed one set aside."""
    models = {"first": _trained(1), "second": _trained(2)}
    out = tmp_path / "hf"
    save_export(models["first"], None, out, max_shard_size="2GB", adapter=True, model_name="tiny")
    pid = os.fork()
    if pid == 0:
        try:
            staged = f"/.hf.tmp-{os.getpid()}/{MARKER}"  # the new folder's marker: written last, before the swap

            def hook(event: str, args: tuple) -> None:
                nonlocal staged
                if staged == "" and event in ("os.remove", "os.rmdir"):
                    os.kill(os.getpid(), signal.SIGKILL)
                if event == "open" and str(args[0]).endswith(staged):
                    staged = ""

            sys.addaudithook(hook)
            save_export(models["second"], None, out, max_shard_size="2GB", adapter=True, model_name="tiny")
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    assert adapter_folder(out).is_dir() is False, "the new weights beside the earlier export's adapter"
    reference = tmp_path / "ref" / "hf"
    reference.parent.mkdir()
    save_export(models["second"], None, reference, max_shard_size="2GB", adapter=False, model_name="tiny")
    assert _contents(out) == _contents(reference)  # the new weights, whole
    save_export(models["second"], None, out, max_shard_size="2GB", adapter=False, model_name="tiny")
    assert _names(tmp_path) == ["hf", "ref"]
