"""The pairs cache of decoded sides is keyed by each side's reader version: pictures decoded before a change to the
image decoder (EXIF orientation, transparency on white) were served from the pairs cache after it."""

from __future__ import annotations

from pathlib import Path

from conftest import compose

from onn.modalities.image.formats import decode
from onn.modalities.pairs.data import PairData
from onn.modalities.pairs.demo import write_shapes
from onn.modalities.pairs.tasks import sides_of
from onn.modalities.registry import get


def pair_entries(cache: Path) -> int:
    return len(list((cache / "pairs").rglob("*.safetensors")))


def test_a_new_image_reader_version_decodes_the_pairs_again(tmp_path, monkeypatch):
    source = write_shapes(tmp_path / "shapes", 8, seed=0, size=16)
    config = compose(
        "data=pairs",
        "model=dual_encoder",
        f"data.source={source}",
        f"paths.cache={tmp_path / 'cache'}",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
    )
    assert get("image").reader_version() == decode.READER_VERSION
    PairData(config, sides_of(config)).setup()
    PairData(config, sides_of(config)).setup()
    assert pair_entries(tmp_path / "cache") == 1  # read again from the cache
    monkeypatch.setattr(decode, "READER_VERSION", decode.READER_VERSION + 1)
    PairData(config, sides_of(config)).setup()
    assert pair_entries(tmp_path / "cache") == 2
