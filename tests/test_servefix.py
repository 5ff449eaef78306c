"""ckpt=last resolved once for the task (serve's every upload searched paths.outputs again), the quoting hint for a
value holding a double quote, and an unreadable class folder of data=image counted with the refused files."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose
from PIL import Image
from test_heldout import refusing_scandir

import onn.training.checkpoints as checkpoints
from onn.config import ONNConfig, as_dict
from onn.errors import UserError


def image_checkpoint(config: ONNConfig, outputs: Path, run: str, resize: str) -> Path:
    """An ONN image classifier checkpoint's files (`config`'s, trained with data.resize=`resize`, and a tensor):
    what ckpt= finds and reads the decoding settings from, without training one."""
    onn_config = {
        "model": as_dict(config.model),
        "strategy": as_dict(config.strategy),
        "data": {**as_dict(config.data), "resize": resize},
        "optim": as_dict(config.optim),
        "inputs": {"input_shape": [1, 8, 8], "classes": ["a", "b"]},
        "modality": "image",
    }
    path = outputs / run / "checkpoints" / "last.ckpt"
    checkpoints.save({"state_dict": {"w": torch.zeros(1)}, "onn": {"config": onn_config}}, path)
    return path


def test_ckpt_last_is_searched_for_once_and_uploads_decode_as_the_served_checkpoint(tmp_path, monkeypatch):
    """task=serve's read_inputs read config.ckpt, still `last`, on every upload: paths.outputs searched each time,
    and a run finished meanwhile gave its resize to the model served."""
    from onn.app import from_checkpoint
    from onn.modalities import get
    from onn.training.classifier import trained_config

    outputs = tmp_path / "outputs"
    config = compose("task=serve", "model=v28_cnn", "data=image", f"paths.outputs={outputs}")
    served = image_checkpoint(config, outputs, "old", "resize")
    config.ckpt = "last"
    ckpt, _ = from_checkpoint(config, {"data"})
    assert ckpt == served
    newer = image_checkpoint(config, outputs, "new", "center_crop")
    later = os.stat(served / checkpoints.META).st_mtime + 60
    os.utime(newer / checkpoints.META, (later, later))  # the newest last.ckpt now, as a run finished meanwhile

    searches: list[str] = []
    real = checkpoints.resolve

    def counted(given: str, where: str) -> Path:
        if str(given) == "last":
            searches.append(given)
        return real(given, where)

    monkeypatch.setattr(checkpoints, "resolve", counted)
    upload = tmp_path / "upload.png"
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(upload)
    image = get("image")
    for _ in range(3):
        sets = image.read_inputs(upload, {"input_shape": [1, 8, 8]}, config)
        assert sum(len(d.labels) for d in sets.values()) == 1
    assert searches == []
    assert trained_config(config)["data"]["resize"] == "resize"


@pytest.mark.parametrize("value", ['say "hi" (now)', 'it\'s "odd" $HOME (x)', 'a\\"b (c)', "ends in (\\"])
def test_the_quoting_hint_for_a_value_with_a_double_quote_reads_back_as_the_value(value):
    """The hint put the value's own double quotes inside Hydra's: 'prompt="say "hi" (now)"', which Hydra refuses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from onn.config.registry import value_problem

    problem = value_problem(["task=infer", f"prompt={value}"])
    assert problem is not None and problem.startswith(f"prompt={value}: Hydra cannot read this value")
    example = re.search(r"e\.g\. (.+)\.$", problem)[1]
    typed = subprocess.run(["bash", "-c", f"printf %s {example}"], capture_output=True, text=True, check=True).stdout
    assert OverridesParser.create().parse_override(typed).value() == value


def class_folders(root: Path, classes: list[str], count: int) -> Path:
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(root / c / f"{i}.png")
    return root


def test_an_unreadable_class_folder_of_an_image_folder_is_among_the_skipped(tmp_path, monkeypatch):
    """data=image's folder reader passed over an unreadable class folder with a warning: a run trained on the other
    classes as the whole dataset, and data.max_bad_fraction never counted it."""
    from onn.modalities.image.formats import read_splits

    source = class_folders(tmp_path / "src", ["bird", "cat", "dog", "dog/old"], 3)
    refusing_scandir(monkeypatch, "old")  # below a class: one refused item (a class folder itself is refused)
    sets = read_splits(source, max_bad_fraction=0.5)
    skipped = [s for d in sets.values() for s in d.skipped]
    assert any(s.startswith("dog/old/") and "cannot be read" in s for s in skipped), skipped
    with pytest.raises(UserError, match="dog/old/"):  # 1 of 10 items refused: over a max_bad_fraction of 0.05
        read_splits(source, max_bad_fraction=0.05)
