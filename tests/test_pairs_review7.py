"""Seventh review of paired data: a metadata file's other caption column is read, not the captions cached from the
first; a shard member longer than the bytes read to learn its suffix pairs; a metadata file pairing two files of one
modality, an empty one, and a spreadsheet's "Caption" column beside a url column are each read or refused rightly."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.modalities import detect
from onn.modalities.pairs import detect as pairs_detect
from onn.modalities.pairs.data import PairData
from onn.modalities.pairs.demo import write_primitives, write_shapes
from onn.modalities.pairs.detect import find_pairs
from onn.modalities.pairs.tasks import sides_of


@pytest.fixture
def pictures(tmp_path) -> Path:
    """Six 16x16 shape pictures, 0000.png ... 0005.png, without their caption files."""
    folder = write_shapes(tmp_path / "pictures", 6, seed=0, size=16)
    for caption in folder.glob("*.txt"):
        caption.unlink()
    return folder


def write_metadata(folder: Path, rows: list[dict]) -> None:
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def held_captions(source: Path, cache: Path, text_column: str) -> list[str]:
    """The captions PairData decodes for its training pairs, as text (the byte tokenizer's ids below 256)."""
    config = compose(
        "data=pairs",
        "model=dual_encoder",
        f"data.source={source}",
        f"data.text_column={text_column}",
        f"paths.cache={cache}",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
    )
    data = PairData(config, sides_of(config))
    data.setup()
    ids = data.splits["train"].labels  # the partner side rides in the labels' place
    return [bytes(row[row < 256].tolist()).decode() for row in ids.cpu()]


def test_another_text_column_of_one_metadata_file_is_read_not_the_cached_captions(pictures, tmp_path):
    """The decode cache was keyed by the source's files and the rows, not the caption column: a second run with
    data.text_column=alt trained on the first run's captions without a word."""
    rows = [{"file_name": f"{i:04d}.png", "caption": f"caption {i}", "alt": f"other words {i}"} for i in range(6)]
    write_metadata(pictures, rows)
    first = held_captions(pictures, tmp_path / "cache", "caption")
    second = held_captions(pictures, tmp_path / "cache", "alt")
    assert first and all(text.startswith("caption ") for text in first)
    assert [text.replace("caption", "other words") for text in first] == second


def test_a_shard_member_longer_than_its_suffix_example_still_pairs(pictures, tmp_path, monkeypatch):
    """A suffix whose first member was longer than EXAMPLE_BYTES (a 100 MB video in a webdataset shard) had no
    example, and find_pairs stopped on KeyError: '.png'. Its head is the example now."""
    for i in range(6):
        (pictures / f"{i:04d}.txt").write_text(f"caption {i}\n")
    shard = tmp_path / "shards" / "shard-000000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tf:
        for path in sorted(pictures.iterdir()):
            tf.add(path, arcname=path.name)
    smallest_picture = min(p.stat().st_size for p in pictures.glob("*.png"))
    monkeypatch.setattr(pairs_detect, "EXAMPLE_BYTES", smallest_picture // 2)
    listing = find_pairs(shard.parent)
    assert listing.modalities == ("image", "text") and listing.complete == 6 and not listing.orphan_count


@pytest.mark.parametrize("kind", ["image-image", "text-text"])
def test_metadata_pairing_two_files_of_one_modality_is_one_sentence(pictures, kind):
    """file_name + mask_file_name (both pictures), or a .txt file + its caption: data=auto read them as pairs, and
    every task stopped on 'ValueError: not enough values to unpack', the sides being keyed by modality."""
    if kind == "image-image":
        for i in range(6):
            shutil.copy(pictures / f"{i:04d}.png", pictures / f"{i:04d}_mask.png")
        rows = [{"file_name": f"{i:04d}.png", "mask_file_name": f"{i:04d}_mask.png"} for i in range(6)]
        said = r"pairs image \(file_name\) with image \(mask_file_name\); a dual encoder's two sides are two different"
    else:
        for i in range(6):
            (pictures / f"{i:04d}.png").unlink()
            (pictures / f"{i:04d}.txt").write_text(f"a question {i}")
        rows = [{"file_name": f"{i:04d}.txt", "text": f"an answer {i}"} for i in range(6)]
        said = r"pairs text \(file_name\) with text \(text\); a dual encoder's two sides are two different"
    write_metadata(pictures, rows)
    with pytest.raises(UserError, match=said):
        find_pairs(pictures)
    try:
        modality, _ = detect(pictures)
    except UserError:  # nothing else reads the folder: one sentence too
        modality = None
    assert modality is None or modality.name != "pairs"


def test_masks_beside_captions_pair_file_name_with_the_caption_column_named(pictures):
    """file_name, mask_file_name and text (an imagefolder with masks and captions): the two picture columns were
    paired whatever data.text_column said, and refused with no way out. The column named is the partner."""
    for i in range(6):
        shutil.copy(pictures / f"{i:04d}.png", pictures / f"{i:04d}_mask.png")
    rows = [
        {"file_name": f"{i:04d}.png", "mask_file_name": f"{i:04d}_mask.png", "text": f"shape {i}"} for i in range(6)
    ]
    write_metadata(pictures, rows)
    with pytest.raises(
        UserError, match=r"with image \(mask_file_name\);.* set data.text_column=NAME to pair file_name"
    ):
        find_pairs(pictures)
    listing = find_pairs(pictures, text_column="text")
    assert listing.modalities == ("image", "text") and listing.complete == 6
    assert [e.text for e in listing.entries["text"]] == [f"shape {i}" for i in range(6)]


def test_a_capitalised_caption_column_is_the_captions_not_a_url_beside_it(pictures):
    """CAPTION_COLUMNS was matched case for case: a spreadsheet's "Caption" was passed over for the first text
    column, a url column, and the dual encoder trained on urls."""
    rows = "".join(f"{i:04d}.png,https://example.com/{i}.png,a shape {i}\n" for i in range(6))
    (pictures / "metadata.csv").write_text("file_name,url,Caption \n" + rows)
    listing = find_pairs(pictures)
    assert listing.how == "metadata.csv (file_name + Caption )"
    assert [e.text for e in listing.entries["text"][:2]] == ["a shape 0", "a shape 1"]


def test_a_metadata_file_without_rows_says_so(pictures):
    """A metadata.csv of its header alone was 'has no file_name column (columns: )', though its header names one."""
    (pictures / "metadata.csv").write_text("file_name,text\n")
    with pytest.raises(UserError, match=r"metadata.csv holds no rows; add one per pair"):
        find_pairs(pictures)


def test_pairs_that_share_one_of_their_files_are_one_group(tmp_path):
    """A picture on two metadata rows, each with another mesh: the pairs shared a file but not both, so they were
    groups of their own, split between training and held out (the held-out picture trained on) and each the other's
    wrong answer. Pairs a file joins are one group, as pairs of one file and several captions were."""
    from onn.modalities.pairs.data import joined_groups

    folder = write_primitives(tmp_path / "meshes", 4, seed=0, size=16, file_types=("obj",))
    rows = [{"file_name": f"{i:04d}.png", "mesh_file_name": f"{i:04d}.obj"} for i in range(4)]
    rows.append({"file_name": "0000.png", "mesh_file_name": "0003.obj"})  # joins pairs 0 and 3 through two files
    write_metadata(folder, rows)
    listing = find_pairs(folder)
    assert listing.modalities == ("image", "mesh") and listing.complete == 5
    groups = joined_groups(listing, [4, 0, 1, 2, 3])
    assert groups[0] == groups[1] == groups[4] >= 0 and groups[2] == groups[3] == -1


def test_retrieval_counts_the_partners_of_a_querys_own_file_not_the_files_a_chain_joins():
    """a-x, b-x, b-y, c-y, d-z: a's right answer is x (its own partner), b's x or y; the groups that hold such pairs
    out together chained a to y, so an image embedded nearest a sound it was never paired with scored as right."""
    from onn.modalities.pairs.data import joined_groups, side_keys
    from onn.modalities.pairs.detect import Entry, Listing
    from onn.modalities.pairs.module import retrieval_metrics

    rows = [("a.png", "x.wav"), ("b.png", "x.wav"), ("b.png", "y.wav"), ("c.png", "y.wav"), ("d.png", "z.wav")]
    listing = Listing("metadata.csv (file_name + audio_file_name)", ("image", "audio"))
    listing.keys = [str(i) for i in range(len(rows))]
    listing.entries = {"image": [Entry(r[0]) for r in rows], "audio": [Entry(r[1]) for r in rows]}
    assert joined_groups(listing, list(range(5))) == [0, 0, 0, 0, -1]  # held out together
    keys = torch.tensor(side_keys(listing, list(range(5))))
    embed = {
        name: torch.eye(8)[i] for i, name in enumerate(["a.png", "b.png", "c.png", "d.png", "x.wav", "y.wav", "z.wav"])
    }
    sounds = torch.stack([embed[s] for _, s in rows])
    images = sounds.clone()  # every image embedded as its row's sound: right everywhere
    images[0] = embed["y.wav"]  # but a, nearest y: never its partner
    figures = retrieval_metrics(images, sounds, ("image", "audio"), "val", keys)
    assert figures["val/recall@1/image_to_audio"] == pytest.approx(4 / 5)
    perfect = retrieval_metrics(sounds, sounds, ("image", "audio"), "val", keys)
    assert perfect["val/recall@1/image_to_audio"] == perfect["val/recall@1/audio_to_image"] == 1.0
    # a random pick: a is right with x's 2 rows, b's rows with 3, c with 2, d with 1 (rows sharing either file)
    assert perfect["val/recall@1_chance"] == pytest.approx((2 + 3 + 3 + 2 + 1) / 5 / 5)
