"""The held-out validation split keeps its items when files are added, and an unreadable class folder is said."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from PIL import Image

import onn.data.files as files
from onn.data.files import walk_files
from onn.errors import UserError
from onn.modalities.image.dataset import ImageDataModule


def write_images(folder: Path, names: list[str]) -> None:
    """One small grey PNG per name, each a different shade."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        Image.fromarray(np.full((4, 4), (7 * k + len(name)) % 256, np.uint8), "L").save(folder / f"{name}.png")


def split_names(source: Path, tmp: Path, resident: bool, seeds: range = range(1)) -> list[tuple[set[str], set[str]]]:
    """(train names, val names) of the split data.val_split holds out of source, for each seed."""
    cfg = compose("data=image", f"data.source={source}", f"data.resident={str(resident).lower()}", root=tmp)
    splits = []
    for seed in seeds:
        dm = ImageDataModule(cfg.data, str(tmp / "cache"), seed=seed)
        dm.setup("fit")
        if resident:
            splits.append((set(dm.splits["train"].names), set(dm.splits["val"].names)))
        else:
            (train, kept), (val, held) = dm.streamed["train"], dm.streamed["val"]
            splits.append(({train.names[i] for i in kept}, {val.names[i] for i in held}))
    return splits


@pytest.mark.parametrize("resident", [True, False])
def test_adding_files_never_moves_a_trained_item_into_val(tmp_path, resident):
    """A resumed run or task=eval keeps the run's seed: the items it trained on must stay out of val when the
    source has grown. The split was a seeded shuffle of positions, and 6 files added to 80 put trained items in
    val (both the resident and the streamed path hold out by the same rule)."""
    source = tmp_path / "src"
    for c in ("cat", "dog"):
        write_images(source / c, [f"{k:03d}" for k in range(40)])
    ((train0, val0),) = split_names(source, tmp_path, resident)
    assert train0 and val0 and not train0 & val0
    write_images(source / "cat", [f"new{k}" for k in range(6)])
    (train1, val1), other_seed = split_names(source, tmp_path, resident, range(2))
    assert len(train1) + len(val1) == 86
    assert not val1 & train0, sorted(val1 & train0)  # nothing the first run trained on is validated on
    assert val0 <= val1  # and what it validated on still is
    assert other_seed != (train1, val1)  # the seed still draws it


def test_a_class_is_never_held_out_whole_and_something_is_held_out(tmp_path):
    """A class of one image trains (it is never validated on only), and val is never empty however the names
    draw: 3 classes of one image each hold out one (its class said as untrained, as before)."""
    source = tmp_path / "src"
    write_images(source / "a", ["only"])
    write_images(source / "b", [f"{k}" for k in range(9)])
    for seed, (train, val) in enumerate(split_names(source, tmp_path, resident=True, seeds=range(8))):
        assert "a/only.png" in train and val and val <= {f"b/{k}.png" for k in range(9)}, seed
    tiny = tmp_path / "tiny"
    for c in ("x", "y", "z"):
        write_images(tiny / c, ["one"])
    ((train, val),) = split_names(tiny, tmp_path, resident=True)
    assert len(val) == 1 and len(train) == 2


def refusing_scandir(monkeypatch, folder_name: str) -> None:
    """os.scandir raising PermissionError for one folder, as the kernel does for a chmod 000 folder (tests run as
    root, which reads any folder)."""
    real = os.scandir

    def scandir(path="."):
        if os.path.basename(str(path)) == folder_name:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(files.os, "scandir", scandir)


def test_an_unreadable_folder_is_named_by_walk_files(tmp_path, monkeypatch, caplog):
    """Listed for a caller that counts it, else warned about by path; it was passed over without a word."""
    for c in ("cat", "dog"):
        write_images(tmp_path / c, ["1"])
    refusing_scandir(monkeypatch, "dog")
    unreadable: list[str] = []
    with caplog.at_level(logging.WARNING, logger="onn"):
        assert [rel for rel, _ in walk_files(tmp_path, unreadable=unreadable)] == ["cat/1.png"]
        assert unreadable == ["dog/: a folder that cannot be read (Permission denied)"] and not caplog.records
        assert [rel for rel, _ in walk_files(tmp_path)] == ["cat/1.png"]
    assert str(tmp_path / "dog") in caplog.text and "Permission denied" in caplog.text


def test_a_run_on_a_source_with_an_unreadable_class_folder_says_so(tmp_path, monkeypatch, caplog):
    """With three class folders, one unreadable, a run trained on the other two as the whole dataset, silently."""
    source = tmp_path / "src"
    for c in ("bird", "cat", "dog"):
        write_images(source / c, [f"{k}" for k in range(5)])
    refusing_scandir(monkeypatch, "dog")
    # a class folder is refused: counted as one bad item, it passed data.max_bad_fraction and a label went missing
    with pytest.raises(UserError, match=r"folder .*/dog cannot be read \(Permission denied\)"):
        split_names(source, tmp_path, resident=True)
