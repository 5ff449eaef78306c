"""Sides of a dual encoder: an audio side read a set of files with audio.yaml's 1% max_bad_fraction and, above it,
dropped every file of the set; a side's data.mean/std and an audio side's normalize=dataset were silently ignored;
infer counted only the exact partner where eval counts a repeated caption's twin as right."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import MODALITY_HARDWARE, compose

from onn.errors import UserError
from onn.modalities.pairs.data import decode_pairs
from onn.modalities.pairs.demo import write_shapes
from onn.modalities.pairs.detect import find_pairs
from onn.modalities.pairs.sides import build_side, side_config
from onn.modalities.registry import REGISTRY

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def pairs_config(tmp: Path, *overrides: str):
    return compose("data=pairs", "model=dual_encoder", f"paths.cache={tmp / 'cache'}", *overrides)


def test_an_audio_side_with_two_unreadable_files_of_60_keeps_the_58_others(tmp_path):
    """2 corrupt WAVs of 60 (3%: under the pairs' 5%) failed the audio side's own 1%, and its read named all 60
    pairs unreadable: decode_pairs refused the source."""
    src = tmp_path / "pairs"
    src.mkdir()
    t = np.arange(800) / 8000
    for i in range(60):
        sf.write(src / f"{i:04d}.wav", (0.3 * np.sin(2 * np.pi * (200 + 10 * i) * t)).astype(np.float32), 8000)
        (src / f"{i:04d}.txt").write_text(f"tone number {i}")
    for i in (5, 17):
        (src / f"{i:04d}.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 4)
    config = pairs_config(tmp_path)
    sides = {name: build_side(name, side_config(name, config)) for name in ("audio", "text")}
    decoded = decode_pairs(find_pairs(str(src), ("audio", "text"), "auto"), sides, 0.05, str(src))
    assert len(decoded["audio"].labels) == len(decoded["text"].labels) == 58
    kept = set(decoded["audio"].labels.tolist())
    assert kept == set(range(60)) - {5, 17}
    _, index, skipped = sides["audio"].read(sorted(src.glob("*.wav")))
    assert len(index) == 58 and [i for i, _ in skipped] == [5, 17]


def test_an_image_sides_mean_and_std_normalise_its_inputs(tmp_path):
    """data.sides.image.mean/std (ImageNet's, for a pretrained tower) became 0.5/0.5 without a word."""
    mean, std = IMAGENET
    config = pairs_config(tmp_path, f"data.sides.image.mean={mean}", f"data.sides.image.std={std}")
    side = build_side("image", side_config("image", config))
    assert side.inputs["mean"] == mean and side.inputs["std"] == std
    stored = torch.full((1, *side.sample(1).shape[1:]), 128, dtype=side.sample(1).dtype)
    prepared = side.encoder(8).prepare(stored, train=False)
    expected = (torch.full((3,), 128 / 255) - torch.tensor(mean)) / torch.tensor(std)
    assert torch.allclose(prepared[0].mean((1, 2)), expected, atol=1e-4)
    plain = build_side("image", side_config("image", pairs_config(tmp_path)))
    assert plain.inputs["mean"] == [0.5] * 3  # auto: nothing measures a side's statistics


def test_an_audio_side_with_normalize_dataset_is_refused_in_one_sentence(tmp_path):
    config = pairs_config(tmp_path, "data.modalities=[audio,text]", "+data.sides.audio.features.normalize=dataset")
    with pytest.raises(UserError, match=r"^data.sides.audio.features.normalize=dataset is not available .*instance"):
        REGISTRY["pairs"].check(config)
    REGISTRY["pairs"].check(pairs_config(tmp_path, "data.modalities=[audio,text]"))  # instance: fine
    # an audio side the pair does not use is not read
    REGISTRY["pairs"].check(
        pairs_config(tmp_path, "data.modalities=[image,text]", "+data.sides.audio.features.normalize=dataset")
    )


def test_a_side_saved_before_its_mean_and_std_were_used_reads_them_as_it_trained(tmp_path):
    """A checkpoint's side saved data.sides.image.mean/std that training then ignored (it normalised by 0.5): read
    with them, its inputs were scaled otherwise than it trained. A side saved since carries STATS_USED."""
    from onn.config import as_dict
    from onn.modalities.pairs.sides import STATS_USED, saved_side

    mean, std = IMAGENET
    config = pairs_config(tmp_path, f"data.sides.image.mean={mean}", f"data.sides.image.std={std}")
    saved = as_dict(side_config("image", config))
    before = build_side("image", saved_side("image", saved, "ckpt old"))
    assert before.inputs["mean"] == [0.5] * 3 and before.inputs["std"] == [0.5] * 3
    since = build_side("image", saved_side("image", {**saved, STATS_USED: True}, "ckpt new"))
    assert since.inputs["mean"] == mean and since.inputs["std"] == std


def run(tmp: Path, name: str, *overrides: str) -> dict:
    from onn.app import execute, given_keys

    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        "trainer.max_steps=-1",
        "trainer.max_epochs=1",
        "optim.warmup_steps=5",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
        "model.feature_dim=16",
        "model.embed_dim=8",
        *overrides,
    )
    (tmp / name).mkdir(parents=True, exist_ok=True)
    return execute(cfg, tmp / name, given_keys(list(overrides)))


@pytest.mark.slow
def test_infer_recall_counts_a_repeated_captions_twin_as_eval_does(tmp_path):
    """Eight pictures all captioned alike: eval counts any of the captions right (recall@1 1.0), infer counted only
    the picture's own one, which ties with the seven others and ranks at its place (recall@1 1/8)."""
    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    run(tmp_path, "train", f"data.source={shapes}", "data.batch_size=4")
    held = write_shapes(tmp_path / "held", 8, seed=5, size=16)
    for caption in held.glob("*.txt"):
        caption.write_text("a shape\n")
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for picture in held.glob("*.png"):
        shutil.copy(picture, pictures / picture.name)
    ckpt = f"ckpt={tmp_path / 'train'}"
    inferred = run(tmp_path, "infer", "task=infer", ckpt, f"task.input={pictures}", f"task.gallery={held}")
    evaluated = run(tmp_path, "eval", "task=eval", ckpt, f"data.source={held}")
    assert evaluated["val/recall@1/image_to_text"] == 1.0
    for k in (1, 5):
        assert inferred[f"infer/recall@{k}"] == evaluated[f"val/recall@{k}/image_to_text"]
    rows = [json.loads(line) for line in Path(inferred["infer/output"]).read_text().splitlines()]
    assert [r["partner_rank"] for r in rows] == [1] * 8
