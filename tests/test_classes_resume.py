"""Class names kept across a checkpoint: a resumed run whose class folders were renamed is refused (trained by
position, ant/ took zebra's label without a word), and a folder of one class folder in the CLASS/SESSION/FILE
layout is that class for a checkpoint that knows it (its sessions were read as the classes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import soundfile as sf
from conftest import compose
from test_audio import tone

from onn.data.labelled import list_labelled
from onn.errors import UserError
from onn.modalities.audio.decode import SUFFIXES

TONES = {"bee": 300.0, "cat": 700.0, "zebra": 1500.0}


def class_folders(root: Path, per_class: int = 6) -> Path:
    """CLASS/i.wav: one tone a class, a little off-pitch from file to file."""
    for name, freq in TONES.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            sf.write(root / name / f"{i}.wav", tone(freq * (1 + 0.01 * i), 0.3, seed=i), 8000)
    return root


def one_nested_class(root: Path, name: str = "zebra") -> Path:
    """root/zebra/s1/*.wav, root/zebra/s2/*.wav: a folder of one class folder of sessions."""
    for session in ("s1", "s2"):
        (root / name / session).mkdir(parents=True)
        for i in range(3):
            sf.write(root / name / session / f"{i}.wav", tone(TONES[name], 0.3, seed=i), 8000)
    return root


def run_args(root: Path) -> list[str]:
    return [
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={root}",
        f"paths.cache={root}/cache",
        "hardware=cpu_16gb",
    ]


DATA = ["data=audio", "data.label_from=folder", "data.sample_rate=8000", "data.clip_seconds=0.3"]
DATA += ["data.test_pattern=null", "data.batch_size=4", "data.val_split=0.2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(the root, the checkpoint of one epoch of a small audio CNN on bee/, cat/, zebra/)."""
    from onn.app import execute

    root = tmp_path_factory.mktemp("classes")
    data = class_folders(root / "data")
    model = ["model=audio_cnn", "+model.kwargs.widths=[8,16]", "trainer.max_epochs=1"]
    execute(compose(*run_args(root), *DATA, f"data.source={data}", *model), root / "train")
    return root, root / "train" / "checkpoints" / "last.ckpt"


def test_a_lone_top_folder_named_as_a_known_class_is_that_class_not_a_wrapper(tmp_path):
    """With no classes known the lone top folder stays an archive's wrapper (its folders the classes); known, it is
    the class its sessions belong to."""
    one = one_nested_class(tmp_path / "one")
    assert list_labelled(one, frozenset(SUFFIXES), kind="audio").classes == ["s1", "s2"]
    known = list_labelled(one, frozenset(SUFFIXES), kind="audio", known=["bee", "cat", "zebra"])
    assert known.classes == ["zebra"]
    assert {m.label for files in known.splits.values() for m in files} == {"zebra"}


def test_a_resumed_runs_data_of_other_class_names_is_refused_and_of_the_same_names_reordered(tmp_path):
    """The data module run.py's resume builds, against a checkpoint's classes: one renamed folder (same count of
    classes, so the head loads) was trained on by position without a word; the same names in another order map by
    name."""
    from onn.modalities.audio.modality import AudioModality
    from onn.modalities.classification import in_checkpoint_order, setup_data

    data = class_folders(tmp_path / "data", per_class=3)
    (data / "zebra").rename(data / "ant")
    config = compose(*run_args(tmp_path), *DATA, f"data.source={data}", "model=audio_cnn", root=tmp_path)
    m = AudioModality()
    dm = setup_data(m, config, "cpu")
    with pytest.raises(UserError, match=r"classes \['ant'\], which the resumed .*lacks its classes \['zebra'\]"):
        in_checkpoint_order(m, config, dm, {"classes": ["bee", "cat", "zebra"]}, "cpu")
    assert in_checkpoint_order(m, config, dm, {"classes": ["cat", "bee", "ant"]}, "cpu").classes == [
        "cat",
        "bee",
        "ant",
    ]


@pytest.mark.slow  # trains a checkpoint (about 14 s on 2 shared cores)
def test_resuming_on_a_renamed_class_folder_is_refused_naming_both_names(trained, tmp_path):
    """zebra/ renamed ant/ keeps three classes, so the head loaded and the resumed run trained ant as bee (label 0):
    now one sentence naming the new and the missing class."""
    from onn.app import execute, given_keys

    root, ckpt = trained
    data = shutil.copytree(root / "data", tmp_path / "data")
    (data / "zebra").rename(data / "ant")
    given = [f"data.source={data}", "trainer.max_epochs=2"]
    with pytest.raises(UserError, match=r"classes \['ant'\].*lacks its classes \['zebra'\]"):
        execute(compose(*run_args(tmp_path), f"ckpt={ckpt}", *given), tmp_path / "resumed", given_keys(given))


@pytest.mark.slow  # trains a checkpoint (about 14 s on 2 shared cores)
def test_eval_of_a_folder_of_one_nested_class_folder_scores_that_class(trained, tmp_path):
    """task=eval on one/zebra/{s1,s2}/*.wav: was refused as the classes ['s1', 's2'] the checkpoint never learned;
    now it is zebra's data, scored; task=infer on it gives its rows zebra as their true class."""
    from onn.app import execute, given_keys

    root, ckpt = trained
    one = one_nested_class(tmp_path / "one")
    given = [f"data.source={one}"]
    cfg = compose(*run_args(tmp_path), "task=eval", f"ckpt={ckpt}", *given)
    metrics = execute(cfg, tmp_path / "eval", given_keys(given))
    assert 0.0 <= metrics["val/acc"] <= 1.0
    infer = compose(*run_args(tmp_path), "task=infer", f"ckpt={ckpt}", f"task.input={one}")
    execute(infer, tmp_path / "infer")
    rows = [json.loads(line) for line in (tmp_path / "infer" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["true"] for r in rows} == {"zebra"}  # were None: s1, s2 no class of the model
