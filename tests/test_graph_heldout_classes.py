"""A graph-level source without a val folder holds out graphs by name (held_out_share) and, as image and audio
classification do, trains on every class it validates on: a class of one graph that drew under data.val_split was
validated on only, and a run that held out graph by name alone never learnt a class it was scored on."""

from __future__ import annotations

import logging
from pathlib import Path

from conftest import compose
from test_graph import ring, star, write_edges

from onn.data.resident import held_out_share
from onn.modalities.graph.dataset import GraphDataModule


def named(folder: str, low: float, high: float, taken: int = 0) -> list[str]:
    """File names (stems) whose seed-0 draw falls in [low, high): the test picks which graphs draw under val_split."""
    found = [f"{i:03d}" for i in range(2000) if low <= held_out_share(0, f"{folder}/{i:03d}.edges") < high]
    return found[taken:]


def split_classes(source: Path, val_split: float) -> tuple[GraphDataModule, set[int], set[int]]:
    """The module and the (trained, validated) class numbers of a graph-level source with no val folder."""
    cfg = compose("data=graph", "model=gcn", f"data.source={source}", f"data.val_split={val_split}")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    trained = {int(g.y) for g in dm.splits["train"].graphs}
    validated = {int(g.y) for g in dm.splits["val"].graphs}
    return dm, trained, validated


def test_a_class_of_one_graph_drawn_into_val_is_trained_on(tmp_path):
    for stem in named("ring", 0.0, 1.0)[:8]:
        write_edges(tmp_path / "ring" / f"{stem}.edges", ring(6))
    (lone,) = named("star", 0.0, 0.25)[:1]  # the star class's only graph draws under val_split
    write_edges(tmp_path / "star" / f"{lone}.edges", star(6))
    dm, trained, validated = split_classes(tmp_path, 0.25)
    star_class = dm.classes.index("star")
    assert star_class in trained and star_class not in validated
    assert validated <= trained and len(dm.splits["val"])  # rings still validate it


def test_when_none_draws_under_val_split_a_class_that_keeps_another_gives_one(tmp_path):
    (lone,) = named("star", 0.1, 0.15)[:1]  # over val_split, yet the lowest draw of all: the old choice
    for stem in named("ring", 0.2, 1.0)[:4]:
        write_edges(tmp_path / "ring" / f"{stem}.edges", ring(6))
    write_edges(tmp_path / "star" / f"{lone}.edges", star(6))
    dm, trained, validated = split_classes(tmp_path, 0.1)
    assert validated == {dm.classes.index("ring")} and trained == {0, 1}
    assert len(dm.splits["val"]) == 1 and len(dm.splits["train"]) == 4


def test_where_every_class_has_one_graph_the_held_out_class_is_warned_as_untrained(tmp_path, caplog):
    write_edges(tmp_path / "ring" / "a.edges", ring(6))
    write_edges(tmp_path / "star" / "b.edges", star(6))
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm, trained, validated = split_classes(tmp_path, 0.25)
    (held,) = validated
    assert held not in trained and len(dm.splits["train"]) == 1
    assert f"no item of the class(es) {dm.classes[held]}, which val hold(s)" in caplog.text
