"""An unreadable folder is named: a source nothing recognises says which folder it could not read, and an
unreadable class folder is refused rather than counted as one bad item (the run would lose a label); infer on an
earlier predictions.jsonl keeps the real reference."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_heldout import refusing_scandir

from onn.errors import UserError


def class_folders(root: Path, folders: list[str], count: int) -> Path:
    for c in folders:
        (root / c).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(np.full((4, 4), 20 * i % 256, np.uint8), "L").save(root / c / f"{i}.png")
    return root


def test_a_source_whose_root_cannot_be_read_is_named_with_the_reason(tmp_path, monkeypatch):
    """data=auto and data.format=auto said only 'no modality recognises' / 'holds no images', not why."""
    from onn.modalities.image.formats.detect import detect_format
    from onn.modalities.registry import detect

    source = class_folders(tmp_path / "locked", ["a", "b"], 2)
    refusing_scandir(monkeypatch, "locked")
    with pytest.raises(UserError, match="no modality recognises") as caught:
        detect(source)
    assert f"not read: {source}/: a folder that cannot be read (Permission denied)" in str(caught.value)
    with pytest.raises(UserError, match=f"not read: {re.escape(str(source))}/: .*Permission denied"):
        detect_format(source)


@pytest.mark.parametrize("locked", ["c3", "train/c3"])
def test_an_unreadable_class_folder_is_refused_naming_it(tmp_path, monkeypatch, locked):
    """With 10 classes of 20 images and c3/ unreadable, 1 of 181 passed max_bad_fraction=0.01: the run trained on
    9 classes, one label silently missing. Here 10 classes of 6 under 0.05."""
    from onn.modalities.image.formats.read import read_splits

    folders = [f"c{i}" for i in range(10)]
    prefix = locked.rpartition("/")[0]
    if prefix:
        folders = [f"{s}/{c}" for s in ("train", "test") for c in folders]
    source = class_folders(tmp_path / "src", folders, 6)
    refusing_scandir(monkeypatch, "c3")
    where = f"{re.escape(str(source))}/(test|train)/c3" if prefix else f"{re.escape(str(source))}/c3"
    with pytest.raises(UserError, match=rf"folder {where} cannot be read \(Permission denied\)"):
        read_splits(source, max_bad_fraction=0.05)  # 1 of 55 (or 2 of 110): under it


def test_an_unreadable_folder_below_a_class_counts_as_one_refused_item(tmp_path, monkeypatch):
    """Deeper than the classes the set of labels stays: the folder is one skipped item, as before."""
    from onn.modalities.image.formats.read import read_splits

    source = class_folders(tmp_path / "src", ["bird", "cat", "dog", "dog/old"], 3)
    refusing_scandir(monkeypatch, "old")
    skipped = [s for d in read_splits(source, max_bad_fraction=0.5).values() for s in d.skipped]
    assert any(s.startswith("dog/old/") and "cannot be read" in s for s in skipped), skipped


def test_an_unreadable_audio_class_folder_is_refused(tmp_path, monkeypatch):
    """list_labelled (audio, video) follows the image folder's rule."""
    from onn.data.labelled import list_labelled

    for c in ("bird", "cat", "dog"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "0.wav").write_bytes(b"RIFF")
    refusing_scandir(monkeypatch, "dog")
    with pytest.raises(UserError, match=f"folder {re.escape(str(tmp_path))}/dog cannot be read"):
        list_labelled(tmp_path, frozenset({".wav"}), kind="audio")


def test_infer_on_earlier_predictions_keeps_the_first_reference(caplog):
    """The second run moved the first run's generation over the real reference_completion."""
    from onn.modalities.text.tasks import prediction_rows

    first = prediction_rows([{"prompt": "2+2?", "completion": "4"}], ["model A says 5"], "in.jsonl")
    assert first == [{"prompt": "2+2?", "reference_completion": "4", "completion": "model A says 5"}]
    with caplog.at_level(logging.WARNING):
        second = prediction_rows(first, ["model B says 4"], "predictions.jsonl")
    assert second == [{"prompt": "2+2?", "reference_completion": "4", "completion": "model B says 4"}]
    assert "keeps that one" in caplog.text
