"""The held-out split is the same for copies of one dataset (macOS NFD names, a zip of the folder), and data=auto's
sniffers leave an unreadable folder for the listing to name."""

from __future__ import annotations

import logging
import os
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from PIL import Image

from onn.modalities.image.dataset import ImageDataModule
from onn.modalities.registry import detect, get


def write_classes(root: Path, form: str = "NFC") -> None:
    """cat/ and dog/ of 30 small PNGs each, named café_NN.png in Unicode `form`."""
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for k in range(30):
            name = unicodedata.normalize(form, f"café_{k:02d}.png")
            Image.fromarray(np.full((4, 4), k * 8, np.uint8), "L").save(root / c / name)


def val_names(source: Path, tmp: Path) -> set[str]:
    """The names data.val_split holds out of source for seed 0, in NFC and below an archive's wrapper folder."""
    cfg = compose("data=image", "data.resident=true", f"data.source={source}", "data.val_split=0.2", root=tmp)
    dm = ImageDataModule(cfg.data, str(tmp / "cache"), seed=0)
    dm.setup("fit")
    names = [unicodedata.normalize("NFC", n) for n in dm.splits["val"].names]
    return {n.removeprefix("pets/") for n in names}


def test_a_copy_with_decomposed_names_holds_out_the_same_files(tmp_path):
    """macOS writes é as e + accent (NFD); the hash took those bytes and drew another split (2 of 8 shared)."""
    write_classes(tmp_path / "nfc", "NFC")
    write_classes(tmp_path / "nfd", "NFD")
    composed = val_names(tmp_path / "nfc", tmp_path / "a")
    assert composed == val_names(tmp_path / "nfd", tmp_path / "b")
    assert 0 < len(composed) < 60


def test_a_zip_of_the_folder_holds_out_the_same_files(tmp_path):
    """A zip made of the folder names pets/cat/06.png where the folder lists cat/06.png: 4 of 15 were shared."""
    source = tmp_path / "pets"
    write_classes(source)
    with zipfile.ZipFile(tmp_path / "pets.zip", "w") as z:
        for p in sorted(source.rglob("*.png")):
            z.write(p, p.relative_to(tmp_path).as_posix())
    folder = val_names(source, tmp_path / "a")
    assert folder == val_names(tmp_path / "pets.zip", tmp_path / "b")
    assert 0 < len(folder) < 60


@pytest.fixture
def unreadable_bird(tmp_path, monkeypatch) -> Path:
    """A folder of cat/, dog/ and bird/ whose bird/ the kernel refuses to list (root ignores chmod 0: simulated)."""
    for c in ("cat", "dog", "bird"):
        (tmp_path / c).mkdir()
        for k in range(3):
            Image.fromarray(np.zeros((4, 4), np.uint8), "L").save(tmp_path / c / f"{k}.png")
    real = os.scandir

    def scandir(path="."):
        if Path(path) == tmp_path / "bird":
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return tmp_path


def test_the_audio_and_video_sniffers_leave_an_unreadable_folder_unsaid(unreadable_bird, caplog):
    """Each sniff sampling the folder repeated the unreadable-folder warning (three of detect()'s five)."""
    with caplog.at_level(logging.WARNING):
        assert get("audio").sniff(unreadable_bird) is None
        assert get("video").sniff(unreadable_bird) is None
    assert not [r for r in caplog.records if "cannot be read" in r.getMessage()]


def test_detect_names_an_unreadable_folder_at_most_once(unreadable_bird, caplog):
    with caplog.at_level(logging.WARNING):
        assert detect(unreadable_bird)[0].name == "image"
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) <= 1
