"""The runner's entry point and config composition under review: a run from a checkpoint named after its model, a
plan with a checkpoint sized as the checkpoint's network, a .tar.gz of class folders planned from its first image,
and an ONNX output that cannot hold the export refused before training."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, compose, execute_run
from hostile_corpus import images, png_bytes
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from onn.errors import UserError


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(run folder, photos, metrics) of a v28 CNN trained one step on 12 px photos of two classes."""
    tmp = tmp_path_factory.mktemp("trained")
    photos = images(tmp / "photos", {"a": 30, "b": 220}, n=8, size=12)
    metrics = execute_run(
        tmp, tmp / "cache", "model=v28_cnn", "data=image", f"data.source={photos}", "trainer.max_steps=1", name="run"
    )
    return tmp / "run", photos, metrics


def test_a_run_from_a_checkpoint_is_named_after_the_checkpoints_model(trained):
    """ckpt=RUN: the Aim experiment and the run folder (hydra.run.dir's resolver) named the default model, phi4_tiny."""
    from onn.app import checkpoint_name, name_after_checkpoint, to_config
    from onn.training.checkpoints import saved_config

    run, _, _ = trained
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={ROOT}", "task=eval", f"ckpt={run}", "tracking=aim"])
        plain = hydra_compose("config", overrides=[f"paths.root={ROOT}", "task=eval", "tracking=aim"])
    assert checkpoint_name("model", _root_=cfg) == "v28_cnn"
    saved = saved_config(run / "checkpoints" / "last.ckpt")
    assert checkpoint_name("strategy", _root_=cfg) == saved["strategy"]["name"]  # the plan's: full, not auto
    assert checkpoint_name("model", _root_=plain) == "phi4_tiny"  # no ckpt: the composed model
    name_after_checkpoint(cfg, {"task", "ckpt", "tracking"})
    assert to_config(cfg).tracking.loggers[0]["experiment"] == "v28_cnn-image"


def test_a_plan_with_a_checkpoint_sizes_the_network_the_checkpoint_holds(trained, tmp_path):
    """data.image_size=[48,48] with a checkpoint trained at 12 px: eval resizes to 12 px, the plan sized a 48 px net."""
    run, photos, metrics = trained
    given = {"task", "ckpt", "data", "data.source", "data.image_size"}
    planned = execute_run(
        tmp_path,
        tmp_path / "cache",
        "task=plan",
        f"ckpt={run}",
        "data=image",
        f"data.source={photos}",
        "data.image_size=[48,48]",
        given=given,
    )
    assert planned["params_total"] == metrics["params_total"]
    reasons = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["reasons"]
    assert any(r.startswith("images of 12x12 px, as the checkpoint's model was trained") for r in reasons)


def _tar_gz(path: Path, tail_bytes: int = 0) -> Path:
    """A .tar.gz of two class folders of 12 px PNGs; with `tail_bytes`, a member of that many random bytes follows
    them and the archive is cut in its middle (a download that stopped)."""
    with tarfile.open(path, "w:gz") as tf:
        for cls, level in (("a", 30), ("b", 220)):
            for i in range(6):
                data = png_bytes(level + i)
                info = tarfile.TarInfo(f"photos/{cls}/{i}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        if tail_bytes:
            info = tarfile.TarInfo("photos/zz_notes.bin")
            info.size = tail_bytes
            tf.addfile(info, io.BytesIO(os.urandom(tail_bytes)))
    if tail_bytes:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    return path


def test_a_compressed_tar_of_class_folders_plans_from_its_first_image_and_trains(tmp_path):
    """A .tar.gz with data.image_size null: the plan's first-image read was list_items', which refuses a compressed
    tar, so the plan, and every training on it, failed."""
    cut = _tar_gz(tmp_path / "cut.tar.gz", tail_bytes=1 << 21)  # its end is unreadable: the read stops before it
    execute_run(tmp_path, tmp_path / "cache", "task=plan", "model=v28_cnn", "data=image", f"data.source={cut}")
    reasons = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["reasons"]
    assert any(r.startswith("images of 12x12 px, as photos/a/0.png in data.source has them") for r in reasons)
    whole = _tar_gz(tmp_path / "whole.tar.gz")
    metrics = execute_run(
        tmp_path,
        tmp_path / "cache",
        "model=v28_cnn",
        "data=image",
        f"data.source={whole}",
        "trainer.max_steps=1",
        name="train",
    )
    assert metrics["steps"] == 1


def test_an_onnx_output_that_cannot_hold_the_export_is_refused_before_training(trained, tmp_path):
    """export.output=DIR/model (no .onnx) for a one-graph network passed the checks and failed after training; a
    file where a dual encoder's towers folder goes is refused by the same check."""
    _, photos, _ = trained
    with pytest.raises(UserError, match=r"exports as one ONNX graph, a \.onnx file; .*model\.onnx") as e:
        execute_run(
            tmp_path,
            tmp_path / "cache",
            "model=v28_cnn",
            "data=image",
            f"data.source={photos}",
            "trainer.max_steps=1",
            "export=onnx",
            f"export.output={tmp_path / 'model'}",
        )
    assert type(e.value) is UserError  # not ExportFailed: nothing trained
    assert not (tmp_path / "run" / "checkpoints").exists()
    from onn.export.settings import check_graph_output

    (tmp_path / "towers").write_text("my notes")
    export = compose("export=onnx", f"export.output={tmp_path / 'towers.onnx'}").export
    with pytest.raises(UserError, match=r"several graphs into the folder .*towers, where a file is"):
        check_graph_output(export, several_graphs=True)
    assert (tmp_path / "towers").read_text() == "my notes"
