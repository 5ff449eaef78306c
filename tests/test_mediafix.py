"""data=auto's vote over a spread sample of a mixed folder, and eval/infer decoding images with the checkpoint's
data.resize when the command line names data=image without one."""

from __future__ import annotations

import dataclasses
import io
import logging
import wave
from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from PIL import Image

from onn.config.convert import as_dict
from onn.config.data import ImageData
from onn.modalities.image.dataset import as_trained, decode_settings
from onn.modalities.image.formats.read import read_splits
from onn.modalities.registry import detect


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 400)
    return out.getvalue()


def _write(folder: Path, count: int, suffix: str, data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i:03d}{suffix}").write_bytes(data)


def test_a_side_folder_of_sounds_sorting_first_does_not_outvote_the_images(tmp_path):
    """600 PNGs in train/cat and train/dog beside 201 WAVs in _notes/, which sorts first: the vote took the
    first 200 files in walk order, all WAVs, and data=auto planned an audio model for an image dataset."""
    png = _png(np.zeros((8, 8, 3), np.uint8))
    for label in ("cat", "dog"):
        _write(tmp_path / "train" / label, 300, ".png", png)
    _write(tmp_path / "_notes", 201, ".wav", _wav())
    modality, why = detect(tmp_path)
    assert modality.name == "image", why


def test_an_audio_dataset_with_a_folder_of_cover_images_stays_audio(tmp_path):
    """The spread sample gives each folder a turn, so a few pictures beside the class folders do not tip an audio
    dataset over to images either."""
    for label in ("cat", "dog"):
        _write(tmp_path / label, 40, ".wav", _wav())
    _write(tmp_path / "covers", 3, ".png", _png(np.zeros((8, 8, 3), np.uint8)))
    modality, why = detect(tmp_path)
    assert modality.name == "audio" and "of 83 files sampled" in why, why


@pytest.fixture(scope="module")
def image_data() -> ImageData:
    """conf/data/image.yaml as `data=image` gives it (data.resize=error: the default)."""
    return compose("data=image").data


def _saved(data: ImageData, **trained) -> dict:
    """A checkpoint's run config as saved: the data config it trained with and the model's inputs."""
    return {"data": as_dict(dataclasses.replace(data, **trained)), "inputs": {"input_shape": [3, 8, 8]}}


def test_eval_with_data_image_decodes_as_the_checkpoint_cropped(tmp_path, image_data):
    """Trained with data.resize=center_crop on 8x24 images (white centre, black sides); eval with data=image and
    no data.resize stretched them (black at the edges), so the model saw other inputs than in training."""
    wide = np.zeros((8, 24, 3), np.uint8)
    wide[:, 8:16] = 255
    _write(tmp_path / "src" / "a", 2, ".png", _png(wide))
    _write(tmp_path / "src" / "b", 2, ".png", _png(wide))
    saved = _saved(image_data, resize="center_crop", image_size=[8, 8])
    data = as_trained(dataclasses.replace(image_data, source=str(tmp_path / "src")), saved, "last.ckpt")
    assert data.resize == "center_crop"
    images = next(iter(read_splits(tmp_path / "src", **decode_settings(data)).values())).images
    assert np.asarray(images).min() == 255  # the white centre only, as in training


def test_an_explicit_resize_is_kept_and_the_difference_said(caplog, image_data):
    """data.resize given on the command line wins over the checkpoint's, with a warning naming both; a model trained
    on images of one size (resize=error) has images of another size resized, as before."""
    explicit = dataclasses.replace(image_data, resize="resize")
    with caplog.at_level(logging.WARNING, logger="onn"):
        assert as_trained(explicit, _saved(image_data, resize="center_crop"), "last.ckpt").resize == "resize"
    assert "trained with data.resize=center_crop" in caplog.text
    assert as_trained(image_data, _saved(image_data), "last.ckpt").resize == "resize"
