"""Classes named by numbers, labelled by name (review r5, 2026-12-07): image and mesh class folders sorted as text
(0, 1, 10, 11, 2, ...), so a separate val source, task=eval or task=infer of folders 0, 1 and 2 kept its labels
by position and scored folder 2 as class 10; and val_split holding out a class's only item, leaving it untrained."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose
from PIL import Image

from onn.modalities.classification import trained_data, true_classes
from onn.modalities.image.dataset import ImageDataModule
from onn.modalities.image.modality import ImageModality
from onn.modalities.mesh.read import Sampling, read_source

DIGITS = [str(c) for c in range(12)]
TEXT_ORDER = sorted(DIGITS)  # 0, 1, 10, 11, 2, ...: how a folder of classes 0..11 trained before


def images(root: Path, classes: list[str], per_class: int, size: int = 8) -> Path:
    """Grey PNGs under root/CLASS/, each filled with 10 * class + k: a label read back names its folder."""
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            Image.fromarray(np.full((size, size), 10 * int(c) + k, np.uint8), "L").save(root / c / f"{k}.png")
    return root


def setup(tmp: Path, *overrides: str, seed: int = 0) -> ImageDataModule:
    cfg = compose("data=image", "data.resident=true", *overrides, root=tmp)
    dm = ImageDataModule(cfg.data, str(tmp / "cache"), seed=seed)
    dm.setup("fit")
    return dm


def scored_as(dm: ImageDataModule, split: str) -> set[tuple[str, str]]:
    """(the item's class folder, the class its label names) for each item of a split."""
    s = dm.splits[split]
    return {(Path(n).parent.name, dm.classes[y]) for n, y in zip(s.names, s.labels.tolist())}


@pytest.mark.parametrize("given", [[], [f"data.classes=[{','.join(TEXT_ORDER)}]"]], ids=["own", "text_order"])
def test_a_val_folder_of_some_numbered_classes_is_labelled_by_name(tmp_path, given):
    """Folder 2 of the val source was labelled 2, class 10 of the training folders' text order (and so with
    data.classes in that order, as a checkpoint of them gives it)."""
    train = images(tmp_path / "train", DIGITS, 1)
    val = images(tmp_path / "val", ["0", "1", "2"], 1)
    dm = setup(tmp_path, f"data.source={train}", f"data.val_source={val}", *given)
    assert dm.classes == (TEXT_ORDER if given else DIGITS)  # a folder's numbers sort as numbers: 2 before 10
    assert scored_as(dm, "val") == {("0", "0"), ("1", "1"), ("2", "2")}
    assert {a == b for a, b in scored_as(dm, "train")} == {True}


@pytest.mark.parametrize(
    ("names", "want"),
    [(["cat", "dog", "eel"], ["cat", "dog", "eel"]), (["1", "2", "0"], ["1", "2", "0"])],
    ids=["words", "digits"],
)
def test_label_numbers_of_a_format_still_take_data_classes_by_position(tmp_path, names, want):
    """Unnamed label numbers (an integer-label CSV here) are named by data.classes in its order, as before, digits
    too (label 0 is the digit 1, as SVHN-style data names them): mapped by name, label 0 had become class '0'."""
    folder = images(tmp_path / "flat", ["0", "1", "2"], 2)
    rows = ["file_name,label"] + [f"{c}/{k}.png,{c}" for c in ("0", "1", "2") for k in range(2)]
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    given = f"data.classes=[{','.join(repr(n) for n in names)}]"
    dm = setup(tmp_path, f"data.source={folder / 'labels.csv'}", given, "data.val_split=0.5")
    assert dm.classes == want
    found = scored_as(dm, "train") | scored_as(dm, "val")
    assert found == {("0", want[0]), ("1", want[1]), ("2", want[2])}


def test_infer_names_a_numbered_folder_by_its_name(tmp_path):
    """task=infer's truths of folders 0, 1, 2 as read by the image modality, for a model of classes 0..11 in text
    order: folder 2 was class 10 (every row of it scored against the wrong class)."""
    folder = images(tmp_path / "input", ["0", "1", "2"], 1)
    config = compose("data=image", root=tmp_path)
    inputs = {"classes": TEXT_ORDER, "input_shape": [1, 8, 8]}
    (decoded,) = ImageModality().read_inputs(folder, inputs, config).values()
    truths = true_classes(decoded.classes, TEXT_ORDER)
    assert [truths[y] for y in decoded.labels.tolist()] == [Path(n).parent.name for n in decoded.names]
    assert true_classes(["0", "1"], ["cat", "dog"]) == ["cat", "dog"]  # label numbers: the model's class of each


@pytest.mark.slow  # trains a checkpoint (a few seconds on 2 cores)
def test_eval_of_an_old_text_order_checkpoint_scores_numbered_folders_by_name(tmp_path):
    """A checkpoint trained on folders 0..11 in text order (as they sorted before) scored on folders 0, 1, 2
    through task=eval's data path: folder 2 was scored as class 10."""
    from test_vision_train import run

    train = images(tmp_path / "train", DIGITS, 2, size=16)
    overrides = (f"data.source={train}", f"data.classes=[{','.join(TEXT_ORDER)}]", "trainer.max_epochs=1")
    _, run_dir = run(tmp_path, *overrides)
    few = images(tmp_path / "few", ["0", "1", "2"], 2, size=16)
    config = compose("task=eval", "data=image", f"data.source={few}", f"data.val_source={few}", root=tmp_path)
    dm = trained_data(ImageModality(), config, run_dir / "checkpoints" / "last.ckpt", "cpu")
    assert dm.classes == TEXT_ORDER  # the checkpoint's order, its label ids
    assert scored_as(dm, "val") == {("0", "0"), ("1", "1"), ("2", "2")}


def test_mesh_folders_named_by_numbers_sort_as_numbers(tmp_path):
    """As image folders and labelled files: class 2 before class 10 (text order put 10 and 11 first)."""
    off = "OFF\n4 4 0\n0 0 0\n1 0 0\n0 1 0\n0 0 1\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"
    for c in DIGITS:
        (tmp_path / c).mkdir()
        (tmp_path / c / "t.off").write_text(off)
    (found,) = read_source(tmp_path, Sampling(points=8, normals=False), max_bad_fraction=0.0).values()
    assert found.classes == DIGITS
    assert [found.classes[y] for y in found.labels.tolist()] == [Path(n).parent.name for n in found.names]


def test_val_split_never_holds_out_a_class_s_only_item(tmp_path):
    """10 images, class a with one: val_split=0.1 held a out whole for seeds 4, 6 and 9 (never trained on). It now
    trains for every seed, b is validated on (each image drawn by its name: one or more), and the same seed draws
    the same split."""
    source = tmp_path / "src"
    for c, n in (("a", 1), ("b", 9)):
        (source / c).mkdir(parents=True)
        for k in range(n):
            Image.fromarray(np.full((4, 4), 20 * k, np.uint8), "L").save(source / c / f"{k}.png")
    cfg = compose("data=image", "data.resident=true", f"data.source={source}", "data.val_split=0.1", root=tmp_path)
    drawn = []
    for seed in [*range(12), 0]:
        dm = ImageDataModule(cfg.data, str(tmp_path / "cache"), seed=seed)
        dm.setup("fit")
        train, val = dm.splits["train"], dm.splits["val"]
        assert 0 in train.labels.tolist() and set(val.labels.tolist()) == {1}, seed  # a trains; b is validated
        assert len(train) + len(val) == 10
        drawn.append(val.names)
    assert drawn[-1] == drawn[0] and len({tuple(n) for n in drawn}) > 1  # seeded: the same seed, the same split
    every_class_once = torch.tensor([0, 1, 2])  # nothing can be held out without its class: it stays, said
    dm.seed = 0
    kept, val_index = dm._held_out(every_class_once, ["a/1.png", "b/1.png", "c/1.png"])
    assert sorted(kept + val_index) == [0, 1, 2] and len(val_index) == 1
