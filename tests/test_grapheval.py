"""task=eval of a graph-level data.source the command line gives scores every graph of it (its train/ and test/
folders alike, as the image path's every_split), and a folder of test/ alone is scored rather than refused; a
training run whose data.val_source names data.source validates on its val/ folder alone and refuses test/ alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import compose
from test_graph import run, write_rings_and_stars

from onn.errors import UserError


def write_split_folder(root: Path) -> Path:
    """train/ (3 rings, 3 stars) and test/ (2 rings, 2 stars): 10 graphs."""
    write_rings_and_stars(root / "train", 3, 0)
    write_rings_and_stars(root / "test", 2, 1)
    return root


def eval_data(source: Path):
    """The data module task=eval builds for `data.source=SOURCE` on the command line (onn.app.score_all_given)."""
    from onn.app import score_all_given
    from onn.modalities.graph.modality import GraphModality

    config = compose("data=graph", "model=gin", "task=eval", f"data.source={source}")
    score_all_given(config, {"data.source"})
    dm = GraphModality().datamodule(config, "cpu")
    dm.setup()
    return dm


def test_eval_of_a_given_source_scores_every_graph_of_its_split_folders(tmp_path):
    source = write_split_folder(tmp_path / "src")
    files = {p.relative_to(source).as_posix() for p in source.rglob("*.edges")}
    dm = eval_data(source)
    assert len(files) == 10 and set(dm.splits["val"].names) == files
    assert sorted(int(g.y) for g in dm.splits["val"].graphs) == [0] * 5 + [1] * 5  # ring, star by folder name


@pytest.mark.slow  # (about 8 s: the whole eval run)
def test_eval_run_reports_scoring_all_graphs_of_the_folder(tmp_path, caplog):
    """The whole runner (task=eval, no ckpt: the untrained network) says it validates all 10 graphs."""
    source = write_split_folder(tmp_path / "src")
    with caplog.at_level(logging.INFO, logger="onn"):
        metrics, _ = run(tmp_path, "task=eval", f"data.source={source}", name="eval")
    (said,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert "val 10," in said and 0 <= metrics["val/acc"] <= 1 and "test/acc" in metrics


def test_eval_of_a_folder_of_test_alone_scores_it(tmp_path):
    source = tmp_path / "src"
    write_rings_and_stars(source / "test", 2, 1)
    dm = eval_data(source)
    assert len(dm.splits["val"]) == 4 and dm.classes == ["ring", "star"]


def train_data(source: Path):
    """The data module a training run builds for data.source=SOURCE data.val_source=SOURCE (the same string)."""
    from onn.modalities.graph.modality import GraphModality

    config = compose("data=graph", "model=gin", "task=train", f"data.source={source}", f"data.val_source={source}")
    dm = GraphModality().datamodule(config, "cpu")
    dm.setup()
    return dm


def test_a_training_run_whose_val_source_is_its_source_validates_on_val_alone(tmp_path):
    """It validated on every graph of the folder, its train/ among them, as task=eval scores them."""
    source = tmp_path / "src"
    write_rings_and_stars(source / "train", 3, 0)
    write_rings_and_stars(source / "val", 2, 1)
    dm = train_data(source)
    assert all(name.startswith("val/") for name in dm.splits["val"].names) and len(dm.splits["val"]) == 4
    assert len(dm.splits["train"]) == 6 and dm.scored_on_training == []


def test_a_training_run_on_a_folder_of_test_alone_is_refused(tmp_path):
    """It trained on the test graphs (as task=eval reads their classes from them) instead of saying there are none."""
    source = tmp_path / "src"
    write_rings_and_stars(source / "test", 2, 1)
    with pytest.raises(UserError, match="has no training graphs"):
        train_data(source)
