"""Audio/video class folders beside a test/ split folder (review 2026-12): list_labelled turned split detection off
and made `test` a class holding every class's test files, which were then trained on. Image folders refused this
layout; labelled folders now refuse it the same way, and keep the layouts that were right: classes of session
folders named like a split (valid/ and invalid/, a class `test`) stay classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from onn.data.labelled import list_labelled
from onn.errors import UserError

WAV = frozenset({".wav"})


def make_wavs(root: Path, names: list[str]) -> Path:
    """Real 8 kHz mono WAV files, a short tone each (distinct so no two are the same file)."""
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        t = np.arange(400) / 8000
        sf.write(path, 0.1 * np.sin(2 * np.pi * (200 + 50 * i) * t), 8000)
    return root


def labels(root: Path) -> dict[str, list[tuple[str, str | None]]]:
    listing = list_labelled(root, WAV, kind="audio")
    return {split: [(m.name, m.label) for m in files] for split, files in listing.splits.items()}


def test_class_folders_beside_a_test_folder_of_classes_are_refused_naming_the_folder(tmp_path):
    """The reviewer's layout: yes/, no/ and test/{yes,no}/ gave classes no, test, yes and trained on test/."""
    root = make_wavs(
        tmp_path / "ds", ["yes/1.wav", "yes/2.wav", "no/1.wav", "no/2.wav", "test/yes/3.wav", "test/no/3.wav"]
    )
    with pytest.raises(
        UserError, match=r"data\.source: .*ds mixes split folders \(test\) with other folders \(no, yes\)"
    ):
        list_labelled(root, WAV, kind="audio")


def test_a_wrapped_mixed_layout_names_the_wrapping_folder(tmp_path):
    """An archive-style top folder over the mixed layout: the sentence names that folder, where the user looks."""
    root = make_wavs(tmp_path / "ds", ["speech/yes/1.wav", "speech/no/1.wav", "speech/val/yes/2.wav"])
    with pytest.raises(UserError, match=r"ds/speech mixes split folders \(val\) with other folders \(no, yes\)"):
        list_labelled(root, WAV, kind="audio")


def test_train_and_test_folders_of_classes_are_splits(tmp_path):
    root = make_wavs(tmp_path / "ds", ["train/yes/1.wav", "train/no/1.wav", "test/yes/2.wav", "test/no/2.wav"])
    listing = list_labelled(root, WAV, kind="audio")
    assert listing.classes == ["no", "yes"]
    assert labels(root) == {
        "test": [("test/no/2.wav", "no"), ("test/yes/2.wav", "yes")],
        "train": [("train/no/1.wav", "no"), ("train/yes/1.wav", "yes")],
    }


def test_plain_class_folders_are_one_split(tmp_path):
    root = make_wavs(tmp_path / "ds", ["yes/1.wav", "no/1.wav", "no/2.wav"])
    assert labels(root) == {"all": [("no/1.wav", "no"), ("no/2.wav", "no"), ("yes/1.wav", "yes")]}


def test_a_class_named_test_holding_files_directly_stays_a_class(tmp_path):
    """CIFAR-100 has a class `train`: a split-named folder that holds files, beside class folders, is a class."""
    root = make_wavs(tmp_path / "ds", ["yes/1.wav", "test/2.wav"])
    listing = list_labelled(root, WAV, kind="audio")
    assert listing.classes == ["test", "yes"]
    assert labels(root) == {"all": [("test/2.wav", "test"), ("yes/1.wav", "yes")]}


def test_classes_of_session_folders_named_like_a_split_stay_classes(tmp_path):
    """CLASS/SESSION/FILE with classes valid/ and invalid/ was refused as split folders mixed with other folders."""
    root = make_wavs(tmp_path / "ds", ["valid/s1/1.wav", "valid/s2/2.wav", "invalid/s3/3.wav", "invalid/s1/4.wav"])
    listing = list_labelled(root, WAV, kind="audio")
    assert listing.classes == ["invalid", "valid"]
    assert {label for _, label in labels(root)["all"]} == {"invalid", "valid"} and list(labels(root)) == ["all"]


def test_a_class_named_test_holding_sessions_stays_a_class_but_test_of_the_classes_is_refused(tmp_path):
    """A class `test` of session folders beside yes/ and no/ is a class; test/yes/ beside yes/ is the mistake."""
    sessions = ["yes/a/1.wav", "no/b/2.wav", "test/c/3.wav"]
    listing = list_labelled(make_wavs(tmp_path / "ok", sessions), WAV, kind="audio")
    assert listing.classes == ["no", "test", "yes"]
    with pytest.raises(UserError, match=r"mixes split folders \(test\) with other folders \(no, yes\)"):
        list_labelled(make_wavs(tmp_path / "bad", [*sessions, "test/yes/4.wav"]), WAV, kind="audio")


def test_train_and_test_folders_of_classes_beside_another_folder_are_refused(tmp_path):
    """train/ and test/ of classes beside background/: both split folders hold folders, which no one class of
    sessions does; read as classes background, test and train, every test file was trained on."""
    root = make_wavs(
        tmp_path / "ds", ["train/yes/1.wav", "train/no/1.wav", "test/yes/2.wav", "test/no/2.wav", "background/1.wav"]
    )
    with pytest.raises(UserError, match=r"mixes split folders \(test, train\) with other folders \(background\)"):
        list_labelled(root, WAV, kind="audio")
