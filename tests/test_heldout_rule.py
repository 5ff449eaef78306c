"""A checkpoint records the rule its held-out split was drawn by, and an earlier ONN's checkpoint is warned about.

The held-out split changed from a seeded shuffle of positions to a per-item draw by name (held_out_share): a
checkpoint an earlier ONN wrote, evaluated or resumed, re-draws its split from its seed by the new rule, and most
of the items held out now were trained on, so its val/ figures silently measured memorising. Such a checkpoint (one
without HELD_OUT_RULE beside its seed) still loads, evaluates and resumes, with one warning naming it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import execute_run
from PIL import Image

from onn.data.resident import HELD_OUT_RULE
from onn.training.checkpoints import load, save, saved_config

WARNED = "drawn by an earlier ONN (by position)"


def images(root: Path) -> Path:
    """Two classes of twelve 8x8 grey pictures, each a different shade."""
    for c, base in (("cat", 0), ("dog", 128)):
        (root / c).mkdir(parents=True)
        for k in range(12):
            Image.fromarray(np.full((8, 8), base + 9 * k, np.uint8), "L").save(root / c / f"{k:02d}.png")
    return root


def classify(tmp: Path, name: str, *overrides: str) -> dict:
    """A run of the tiny CNN on image data, in this process, in tmp/name."""
    fixed = ("model=v28_cnn", "data=image", "hardware=cpu_16gb", "data.batch_size=4", "optim.warmup_steps=0")
    given = {o.split("=", 1)[0] for o in overrides}
    return execute_run(tmp, tmp / "cache", *fixed, *overrides, name=name, given=given)


def as_earlier_onn(ckpt: Path, copy: Path, *keys: str) -> Path:
    """`ckpt` as an earlier ONN wrote it: the same checkpoint without the rule, at `copy` (the run's record at
    checkpoint["onn"]["config"], `keys` down to the dict that holds the rule beside the seed)."""
    checkpoint = load(ckpt)
    record = checkpoint["onn"]["config"]
    for key in keys:
        record = record[key]
    assert record.pop("held_out_rule") == HELD_OUT_RULE
    save(checkpoint, copy)
    return copy


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onn" and WARNED in r.getMessage()]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(tmp, the image folder, a 2-step classifier run's last.ckpt)."""
    tmp = tmp_path_factory.mktemp("classifier")
    source = images(tmp / "pictures")
    classify(tmp, "train", f"data.source={source}", "trainer.max_steps=2")
    return tmp, source, tmp / "train" / "checkpoints" / "last.ckpt"


def test_an_image_classifiers_checkpoint_records_the_rule_and_an_earlier_ones_is_warned_about(classifier, caplog):
    """The run's checkpoint holds the rule beside its seed, and task=eval of it says nothing; the same checkpoint
    without it (an earlier ONN's) is evaluated all the same, with one warning naming it."""
    tmp, _, ckpt = classifier
    assert saved_config(ckpt)["inputs"]["held_out_rule"] == HELD_OUT_RULE
    with caplog.at_level(logging.WARNING, logger="onn"):
        marked = classify(tmp, "eval", "task=eval", f"ckpt={ckpt}")
    assert warnings_of(caplog) == []
    earlier = as_earlier_onn(ckpt, tmp / "earlier.ckpt", "inputs")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):
        scored = classify(tmp, "eval_earlier", "task=eval", f"ckpt={earlier}")
    said = warnings_of(caplog)
    assert len(said) == 1 and str(earlier) in said[0] and "data.val_source" in said[0], said
    assert scored["val/acc"] == marked["val/acc"]  # never refused: the same model on the same split


@pytest.mark.slow
def test_a_resumed_earlier_classifier_is_warned_about_and_its_checkpoints_keep_lacking_the_rule(classifier, caplog):
    """Resuming an earlier ONN's checkpoint warns once, and the checkpoints it goes on to write lack the rule too:
    it trained on the earlier split, so their val/ figures are no more held out than its own."""
    tmp, source, ckpt = classifier
    earlier = as_earlier_onn(ckpt, tmp / "resumed_from.ckpt", "inputs")
    with caplog.at_level(logging.WARNING, logger="onn"):
        classify(tmp, "resumed", f"data.source={source}", "trainer.max_steps=3", f"ckpt={earlier}")
    assert len(warnings_of(caplog)) == 1
    assert "held_out_rule" not in saved_config(tmp / "resumed" / "checkpoints" / "last.ckpt")["inputs"]


def test_an_earlier_classifier_scored_on_a_given_val_source_is_not_warned_about(classifier, caplog):
    """data.val_source is scored whole: no split is drawn from the seed, and nothing is said."""
    tmp, _, ckpt = classifier
    earlier = as_earlier_onn(ckpt, tmp / "given.ckpt", "inputs")
    other = images(tmp / "other_pictures")
    with caplog.at_level(logging.WARNING, logger="onn"):
        classify(tmp, "eval_given", "task=eval", f"ckpt={earlier}", f"data.val_source={other}")
    assert warnings_of(caplog) == []


@pytest.mark.slow  # a second 2-step classifier, on a train/ + val/ layout
def test_an_earlier_classifier_of_data_with_its_own_val_folder_is_not_warned_about(tmp_path: Path, caplog):
    """A source with its own val/ folder draws no split from the seed, so an earlier ONN's checkpoint of it is
    scored on the very split it validated on: nothing to say (it was told to give a data.val_source)."""
    source = tmp_path / "split"
    images(source / "train"), images(source / "val")
    classify(tmp_path, "train", f"data.source={source}", "trainer.max_steps=2")
    earlier = as_earlier_onn(tmp_path / "train" / "checkpoints" / "last.ckpt", tmp_path / "earlier.ckpt", "inputs")
    with caplog.at_level(logging.WARNING, logger="onn"):
        classify(tmp_path, "eval", "task=eval", f"ckpt={earlier}")
    assert warnings_of(caplog) == []


TEXT = (
    "data=text",
    "data.val_split=0.25",
    "data.max_length=32",
    "data.batch_size=4",
    "task.validate_before=false",
    "task.exact_match_samples=0",
)


@pytest.mark.slow  # llama_tiny trained, evaluated twice and resumed: ~15 s on a shared CPU
def test_a_text_checkpoint_records_the_rule_and_an_earlier_ones_is_warned_about(tmp_path: Path, caplog):
    """As for classifiers: the text run's checkpoint holds the rule beside its seed and its task=eval says nothing;
    without it, task=eval scores the same records with one warning naming the checkpoint."""
    cache, source = tmp_path / "cache", tmp_path / "corpus.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"Record {i}: the mill and the river {i * 7}"}) + "\n" for i in range(20))
    )
    execute_run(tmp_path, cache, *TEXT, f"data.source={source}", "trainer.max_steps=2")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert saved_config(ckpt)["held_out_rule"] == HELD_OUT_RULE
    with caplog.at_level(logging.WARNING, logger="onn"):
        marked = execute_run(tmp_path, cache, "task=eval", f"ckpt={ckpt}", name="eval")
    assert warnings_of(caplog) == []
    earlier = as_earlier_onn(ckpt, tmp_path / "earlier.ckpt")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):
        scored = execute_run(tmp_path, cache, "task=eval", f"ckpt={earlier}", name="eval_earlier")
    said = warnings_of(caplog)
    assert len(said) == 1 and str(earlier) in said[0], said
    assert scored["val/loss"] == pytest.approx(marked["val/loss"], rel=1e-6)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):  # resumed, it says so, and its checkpoints lack the rule too
        execute_run(
            tmp_path, cache, *TEXT, f"data.source={source}", "trainer.max_steps=3", f"ckpt={earlier}", name="on"
        )
    assert len(warnings_of(caplog)) == 1
    assert "held_out_rule" not in saved_config(tmp_path / "on" / "checkpoints" / "last.ckpt")


def pairs(tmp: Path, name: str, *overrides: str) -> dict:
    """A run of a tiny dual encoder on paired files, in this process, in tmp/name."""
    from onn.app import given_keys

    fixed = ("data=pairs", "model=dual_encoder", "hardware=cpu_16gb", "strategy.precision=32-true")
    return execute_run(tmp, tmp / "cache", *fixed, *overrides, name=name, given=given_keys(list(overrides)))


@pytest.mark.slow  # a dual encoder trained an epoch and evaluated: ~10 s on a shared CPU
def test_a_dual_encoders_checkpoint_records_the_rule_and_an_earlier_ones_is_warned_about(tmp_path: Path, caplog):
    """The pairs run's checkpoint holds the rule beside its seed; without it, task=eval of its own held-out pairs
    (drawn again from the seed) warns once, naming it, and scores the same pairs."""
    from onn.modalities.pairs.demo import write_shapes

    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    tiny = ("data.sides.image.image_size=[16,16]", "data.sides.text.max_length=32", "model.feature_dim=16")
    pairs(tmp_path, "train", f"data.source={shapes}", "data.batch_size=4", "trainer.max_epochs=1", *tiny)
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    assert saved_config(ckpt)["held_out_rule"] == HELD_OUT_RULE
    earlier = as_earlier_onn(ckpt, tmp_path / "earlier.ckpt")
    with caplog.at_level(logging.WARNING, logger="onn"):
        scored = pairs(tmp_path, "eval", "task=eval", f"ckpt={earlier}")
    said = warnings_of(caplog)
    assert len(said) == 1 and str(earlier) in said[0], said
    assert scored["pairs/held_out"] == 3  # its own held-out pairs, scored all the same
