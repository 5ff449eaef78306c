"""The decoded-image cache sees every file a source's reader reads and the decoder's version; transparency is read
on white by training's decode as by the export pipeline."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from PIL import Image

import onn.modalities.image.dataset as image_dataset
from onn.export.pipelines.images import load_rgb
from onn.modalities.image.dataset import read_cached
from onn.modalities.image.formats.decode import decode


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
    """The default image data config (paths do not matter: read_cached is given the source)."""
    return compose("data=image", root=tmp_path_factory.mktemp("root")).data


def _write_idx(folder: Path, labels: list[int]) -> Path:
    n = len(labels)
    images = np.arange(n * 16, dtype=np.uint8).reshape(n, 4, 4)
    header = b"\0\0\x08\x03" + b"".join(v.to_bytes(4, "big") for v in (n, 4, 4))
    (folder / "train-images-idx3-ubyte").write_bytes(header + images.tobytes())
    (folder / "train-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01" + n.to_bytes(4, "big") + bytes(labels))
    return folder / "train-images-idx3-ubyte"


def test_rewritten_idx_labels_beside_the_named_images_file_are_read_not_cached(tmp_path, image_data):
    source = _write_idx(tmp_path, [0, 1, 0, 1, 0, 1])
    cache = tmp_path / "cache"
    assert read_cached(str(source), image_data, cache)["all"].labels.tolist() == [0, 1, 0, 1, 0, 1]
    _write_idx(tmp_path, [1, 1, 1, 0, 0, 0])  # a corrected labels file; the images file's bytes are the same
    assert read_cached(str(source), image_data, cache)["all"].labels.tolist() == [1, 1, 1, 0, 0, 0]
    assert len(list((cache / "images").glob("*.safetensors"))) == 2


def test_a_new_reader_version_decodes_again(tmp_path, image_data, monkeypatch):
    for name, value in (("a/0.png", 40), ("b/0.png", 90)):
        (tmp_path / "src" / name).parent.mkdir(parents=True)
        Image.fromarray(np.full((8, 8), value, np.uint8)).save(tmp_path / "src" / name)
    cache = tmp_path / "cache"
    read_cached(str(tmp_path / "src"), image_data, cache)
    read_cached(str(tmp_path / "src"), image_data, cache)
    assert len(list((cache / "images").glob("*.safetensors"))) == 1  # the same decoder: read from the cache
    monkeypatch.setattr(image_dataset, "READER_VERSION", 1000, raising=False)  # on old code: in no key
    again = read_cached(str(tmp_path / "src"), image_data, cache)
    assert len(list((cache / "images").glob("*.safetensors"))) == 2  # a cache miss: decoded again, cached anew
    assert again["all"].inputs[:, 0, 0, 0].tolist() == [40, 90]


def _png(path: Path, array: np.ndarray, mode: str, **save) -> bytes:
    Image.fromarray(array, mode).save(path, **save)
    return path.read_bytes()


def test_transparency_is_laid_on_white_as_the_export_pipeline_does(tmp_path):
    rgba = np.zeros((4, 4, 4), np.uint8)  # fully transparent, hidden black
    rgba[0, 0] = (255, 0, 0, 255)
    rgba[0, 1] = (0, 0, 255, 128)
    data = _png(tmp_path / "rgba.png", rgba, "RGBA")
    got = decode(data, "auto")
    assert got[1, 1].tolist() == [255, 255, 255] and got[0, 0].tolist() == [255, 0, 0]
    assert np.array_equal(got, np.asarray(load_rgb(tmp_path / "rgba.png")))  # one rule: the export's

    la = np.zeros((4, 4, 2), np.uint8)
    la[..., 0], la[0, 0] = 200, (30, 255)
    got = decode(_png(tmp_path / "la.png", la, "LA"), "auto")
    assert got.ndim == 2 and got[0, 0] == 30 and got[1, 1] == 255  # grey kept grey, transparent grey-200 white
    assert np.array_equal(np.repeat(got[..., None], 3, axis=2), np.asarray(load_rgb(tmp_path / "la.png")))

    palette = Image.fromarray(np.array([[0, 1], [1, 1]], np.uint8), "P")
    palette.putpalette([0, 0, 0, 0, 128, 0])
    buf = io.BytesIO()
    palette.save(buf, "PNG", transparency=0)  # palette entry 0 (black) transparent
    got = decode(buf.getvalue(), 3)
    assert got[0, 0].tolist() == [255, 255, 255] and got[0, 1].tolist() == [0, 128, 0]
