"""Graph-level graphs and pairs are held out by a hash of each item's name (held_out_share), not by a seeded
permutation of positions: one graph file or one pair added re-drew the whole split, so a resumed run or task=eval
validated on items it had trained on. Here one seed's split before and after an item is added."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import compose
from test_graph import ring, star, write_edges, write_rings_and_stars

from onn.modalities.graph.dataset import GraphDataModule
from onn.modalities.pairs.data import PairData
from onn.modalities.pairs.demo import write_shapes
from onn.modalities.pairs.tasks import sides_of


def graph_split(source: Path) -> tuple[set[str], set[str]]:
    """(held-out, trained) graph names of a graph-level source with no val folder."""
    cfg = compose("data=graph", "model=gcn", f"data.source={source}", "data.val_split=0.25")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    return set(dm.splits["val"].names), set(dm.splits["train"].names)


def test_a_graph_added_leaves_every_other_graph_in_its_split(tmp_path):
    source = write_rings_and_stars(tmp_path / "graphs", per_class=10, seed=0)
    held, trained = graph_split(source)
    assert held and trained and not held & trained and len(held | trained) == 20
    write_edges(source / "ring" / "000a.edges", ring(7))  # sorts among the others: every later position moves
    write_edges(source / "star" / "extra.edges", star(6))
    held_after, trained_after = graph_split(source)
    assert held <= held_after and trained <= trained_after
    assert len(held_after | trained_after) == 22


def pair_split(tmp_path: Path, source: Path) -> tuple[list[str], list[str]]:
    """(held-out, trained) pairs' images; the held-out pairs' val_groups checked: one image, one number."""
    cfg = compose(
        *("data=pairs", "model=dual_encoder", f"data.source={source}", f"paths.cache={tmp_path / 'cache'}"),
        *("data.sides.image.image_size=[16,16]", "data.sides.text.max_length=16", "data.val_split=0.3"),
    )
    dm = PairData(cfg, sides_of(cfg))
    dm.setup()
    image_of = dict(zip(dm.listing.keys, (e.name for e in dm.listing.entries["image"])))
    held, trained = ([image_of[n] for n in dm.splits[s].names] for s in ("val", "train"))
    groups = dm.val_groups.tolist()
    assert len(groups) == len(held)
    assert all((groups[i][0] == groups[j][0]) == (held[i] == held[j]) for i in range(len(held)) for j in range(i))
    return held, trained


def test_a_pair_added_leaves_every_other_pair_in_its_split(tmp_path):
    shapes = write_shapes(tmp_path / "shapes", 13, seed=0, size=16)
    source = tmp_path / "pairs"
    source.mkdir()
    for i in range(12):
        for suffix in (".png", ".txt"):
            shutil.copy(shapes / f"{i:04d}{suffix}", source / f"{i:04d}{suffix}")
    held, trained = pair_split(tmp_path, source)
    assert len(held) >= 2 and len(trained) >= 2 and not set(held) & set(trained)
    for suffix in (".png", ".txt"):
        shutil.copy(shapes / f"0012{suffix}", source / f"0012{suffix}")
    held_after, trained_after = pair_split(tmp_path, source)
    assert set(held) <= set(held_after) and set(trained) <= set(trained_after)
    assert len(held_after) + len(trained_after) == 13


def test_an_images_captions_stay_together_and_in_their_split_when_a_row_is_added_above(tmp_path):
    """Each image on two metadata rows: a group, keyed by its file name, not by the rows' line numbers."""
    shapes = write_shapes(tmp_path / "shapes", 9, seed=0, size=16)
    source = tmp_path / "captioned"
    (source / "images").mkdir(parents=True)
    for i in range(9):
        shutil.copy(shapes / f"{i:04d}.png", source / "images" / f"{i:04d}.png")

    def rows(images: range) -> str:
        return "".join(
            json.dumps({"file_name": f"images/{i:04d}.png", "text": f"shape {i}, take {k}"}) + "\n"
            for i in images
            for k in range(2)
        )

    (source / "metadata.jsonl").write_text(rows(range(8)))
    held, trained = pair_split(tmp_path, source)
    assert len(held) == 2 * len(set(held)) and not set(held) & set(trained)
    (source / "metadata.jsonl").write_text(rows(range(8, 9)) + rows(range(8)))  # every line number moves by two
    held_after, trained_after = pair_split(tmp_path, source)
    assert set(held) <= set(held_after) and set(trained) <= set(trained_after)
    assert len(held_after) + len(trained_after) == 18 and not set(held_after) & set(trained_after)
