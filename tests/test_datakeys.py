"""Data cache keys and the pairs split: a large archive replaced with its size and mtime kept is keyed anew, a
caption rewritten inside a tar shard is decoded anew, and identical captions in a shard are one right answer; a long
text member of a shard is listed by its sha256, not held whole for the run."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from conftest import compose

from onn.data.files import HASHED_BYTES, SAMPLED_BLOCKS, SAMPLED_ENDS, content_digest
from onn.modalities.pairs.data import PairData, side_keys
from onn.modalities.pairs.demo import write_shapes
from onn.modalities.pairs.detect import CAPTION_BYTES, find_pairs
from onn.modalities.pairs.tasks import sides_of


def rewrite(path: Path, offset: int, data: bytes) -> None:
    """Write data at offset in place and put the mtime back, as cp -p or rsync -t leave a replaced file."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_large_archive_replaced_with_its_size_and_mtime_kept_is_keyed_anew(tmp_path):
    """A file over HASHED_BYTES was keyed by its path, size and mtime: one rewritten in place (cp -p) with its size
    and mtime kept read the stale decoded cache. The same bytes copied again into place keep their key."""
    archive = tmp_path / "photos.tar"
    size = HASHED_BYTES + (3 << 20)
    with archive.open("wb") as f:
        f.truncate(size)  # sparse zeros: no time spent writing 19 MiB
    first = content_digest(archive)
    assert content_digest(archive) == first  # the key is stable while nothing changes
    step = (size - 2 * SAMPLED_ENDS) // (SAMPLED_BLOCKS + 1)
    rewrite(archive, SAMPLED_ENDS + 7 * step, b"changed")  # in the middle, where a block is sampled
    assert archive.stat().st_size == size
    middle = content_digest(archive)
    assert middle != first
    rewrite(archive, size - 10, b"tail")  # a zip's central directory sits at the end
    tail = content_digest(archive)
    assert tail not in (first, middle)
    st = archive.stat()
    with archive.open("ab") as f:  # only the size changes
        f.write(b"\0")
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_digest(archive) not in (first, middle, tail)
    copied = tmp_path / "copy.tar"  # the same bytes copied again into place with the mtime kept (rsync -a):
    copied.write_bytes(archive.read_bytes())  # another inode, the same key (the decoded cache is kept)
    os.utime(copied, ns=(archive.stat().st_atime_ns, archive.stat().st_mtime_ns))
    grown = content_digest(archive)
    os.replace(copied, archive)
    assert content_digest(archive) == grown


def add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_shard(shard: Path, pictures: Path, captions: list[str]) -> None:
    """shard.tar of NNNN.png + NNNN.txt, the pictures from the folder and the captions given."""
    with tarfile.open(shard, "w") as tf:
        for i, caption in enumerate(captions):
            add(tf, f"{i:04d}.png", (pictures / f"{i:04d}.png").read_bytes())
            add(tf, f"{i:04d}.txt", caption.encode())


def decoded_captions(source: Path, cache: Path) -> dict[str, list[str]]:
    """{train, val}: the captions PairData decodes for each split, as text (the byte tokenizer's ids below 256)."""
    config = compose(
        "data=pairs",
        "model=dual_encoder",
        f"data.source={source}",
        f"paths.cache={cache}",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
    )
    data = PairData(config, sides_of(config))
    data.setup()
    return {
        name: [bytes(row[row < 256].tolist()).decode() for row in split.labels.cpu()]  # the text side rides there
        for name, split in data.splits.items()
    }


@pytest.fixture
def pictures(tmp_path) -> Path:
    """Twelve 16x16 shape pictures, 0000.png ... 0011.png, without their caption files."""
    folder = write_shapes(tmp_path / "pictures", 12, seed=0, size=16)
    for caption in folder.glob("*.txt"):
        caption.unlink()
    return folder


def test_a_caption_rewritten_in_a_shard_is_decoded_anew(pictures, tmp_path):
    """A folder of tar shards was keyed by each shard's name, size and mtime, and its captions by name: a shard
    rewritten with a caption changed keeps its size (tar pads members to 512 bytes), and with its mtime kept
    (rsync -t) every later run trained on the old caption from the decoded cache."""
    shard = tmp_path / "shards" / "shard-000000.tar"
    shard.parent.mkdir()
    captions = [f"caption number {i:02d}" for i in range(6)]
    write_shard(shard, pictures, captions)
    st = shard.stat()
    first = decoded_captions(shard.parent, tmp_path / "cache")
    assert sorted(first["train"] + first["val"]) == captions
    write_shard(shard, pictures, [c.replace("caption", "changed") for c in captions])
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size  # the premise: same size, same mtime
    second = decoded_captions(shard.parent, tmp_path / "cache")
    assert {k: [c.replace("caption", "changed") for c in v] for k, v in first.items()} == second


def repeated(i: int) -> str:
    return f"a picture of kind {i % 4}"  # twelve pairs, three under each of four captions


def test_one_caption_in_a_shard_is_one_right_answer(pictures, tmp_path):
    """A shard's captions were told apart by their member names, so retrieval counted a picture captioned "a picture
    of kind 0" wrong for another picture's identical caption; .txt files and metadata captions were one answer."""
    source = tmp_path / "shard.tar"
    write_shard(source, pictures, [repeated(i) for i in range(12)])
    listing = find_pairs(source)
    keys = side_keys(listing, list(range(12)))
    text = listing.modalities.index("text")
    assert len({k[text] for k in keys}) == 4


def test_a_long_text_member_of_a_shard_is_keyed_by_its_digest_not_held(pictures, tmp_path):
    """Listing a shard read every .txt member whole into its entry and kept it for the run (three 40 MiB members:
    120 MiB held). A member over CAPTION_BYTES is held as its sha256: identical ones are still one answer, and one
    rewritten at the same size and mtime is still decoded anew (materialize reads it from the shard)."""
    shard = tmp_path / "shards" / "shard-000000.tar"
    shard.parent.mkdir()
    pad = " " + "x" * CAPTION_BYTES
    captions = [f"caption number {i % 3:02d}{pad}" for i in range(6)]  # three captions, each twice
    write_shard(shard, pictures, captions)
    st = shard.stat()
    listing = find_pairs(shard.parent)
    texts = listing.entries["text"]
    assert len(texts) == 6 and all(e.data is None and e.digest for e in texts)
    keys = side_keys(listing, list(range(6)))
    assert len({k[listing.modalities.index("text")] for k in keys}) == 3
    first = decoded_captions(shard.parent, tmp_path / "cache")
    assert sorted(c[:17] for c in first["train"] + first["val"]) == sorted(c[:17] for c in captions)
    write_shard(shard, pictures, [c.replace("caption", "changed") for c in captions])
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size  # the premise: same size, same mtime
    second = decoded_captions(shard.parent, tmp_path / "cache")
    assert {k: [c.replace("caption", "changed") for c in v] for k, v in first.items()} == second
