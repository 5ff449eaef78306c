"""Data loading and paired data, review 11: the decoded cache's key, data.val_source naming data.source, zips written
on Windows, and retrieval among identical captions."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import wave
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import compose

from onn.data.files import content_digest
from onn.data.labelled import list_labelled, sniff_files
from onn.modalities import classification, get
from onn.modalities.pairs.data import PairData, side_keys
from onn.modalities.pairs.demo import write_shapes
from onn.modalities.pairs.detect import find_pairs
from onn.modalities.pairs.module import retrieval_metrics
from onn.modalities.pairs.tasks import sides_of
from onn.modalities.text.datamodule import TextDataModule
from onn.models.tokenizer import byte_tokenizer

AUDIO = ("data=audio", "model=audio_cnn", "data.num_workers=0", "data.sample_rate=8000", "data.clip_seconds=0.1")
NOBODY = 65534


def wav_bytes(freq: float, rate: int = 8000) -> bytes:
    """A short 16-bit mono WAV of a sine, written with the standard library."""
    samples = torch.sin(torch.arange(rate // 10) * (2 * torch.pi * freq / rate)) * 8000
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.to(torch.int16).numpy().tobytes())
    return out.getvalue()


def write_classes(folder: Path, per_class: int = 4) -> Path:
    for k, label in enumerate(("cat", "dog")):
        (folder / label).mkdir(parents=True)
        for i in range(per_class):
            (folder / label / f"{i}.wav").write_bytes(wav_bytes(200 + 300 * k + 20 * i))
    return folder


def digest_as_another_user(path: Path) -> str:
    """content_digest(path) as a user who is not root (root reads every file whatever its mode): in a forked child
    that drops to nobody when this process is root, else here."""
    if os.geteuid() != 0:
        return content_digest(path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os and hashlib run here
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, content_digest(path).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        digest = f.read()
    os.waitpid(pid, 0)
    return digest


def test_a_file_made_readable_again_changes_the_cache_key():
    """A file the run could not read (mode 000) was cached as skipped; the chmod that fixes it changes neither its
    size nor its mtime, so the key stayed and every later run read the cache and left the file out."""
    folder = Path(tempfile.mkdtemp(prefix="onn-review11-", dir="/tmp"))  # (pytest's tmp_path is root's alone)
    try:
        folder.chmod(0o755)
        write_classes(folder / "sounds", per_class=2)
        for path in folder.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        blocked = folder / "sounds" / "cat" / "0.wav"
        readable = digest_as_another_user(folder / "sounds")
        stat = blocked.stat()
        blocked.chmod(0o000)
        unreadable = digest_as_another_user(folder / "sounds")
        blocked.chmod(0o644)
        assert (blocked.stat().st_size, blocked.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
        assert readable and unreadable and readable != unreadable
        assert digest_as_another_user(folder / "sounds") == readable  # fixed: the key of the readable folder again
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("written", ["as given", "another way"])
def test_val_source_that_is_data_source_is_said_when_training_starts(tmp_path, caplog, written):
    """data.val_source pointing at data.source itself validated on the very items trained on, without a word: the
    val/ figures looked like held-out accuracy. A held-out folder of its own is not said."""
    source, held = write_classes(tmp_path / "sounds"), write_classes(tmp_path / "held")
    given = str(source) if written == "as given" else f"{tmp_path}/./sounds/"

    def said(val_source: Path | str) -> list[str]:
        caplog.clear()
        config = compose(
            *AUDIO, f"data.source={source}", f"data.val_source={val_source}", f"paths.cache={tmp_path / 'c'}"
        )
        dm = classification.setup_data(get("audio"), config, "cpu")
        with caplog.at_level(logging.WARNING, logger="onn"):
            dm.train_dataloader()
            dm.train_dataloader()  # said once
        return [r.getMessage() for r in caplog.records if "data.val_source is data.source itself" in r.getMessage()]

    warned = said(given)
    assert len(warned) == 1 and "unset it" in warned[0]
    assert said(held) == []


def test_a_zip_written_on_windows_lists_its_folders_as_folders(tmp_path):
    """.NET's ZipFile and older Windows tools store folder entries as "data\\train\\cat\\", which zipfile's is_dir
    misses: each folder was listed as a file of an unknown type, named in a warning and counted in data=auto's vote."""
    archive = tmp_path / "sounds.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for label in ("cat", "dog"):
            zf.writestr(zipfile.ZipInfo(f"data\\train\\{label}\\"), b"")
            for i in range(2):
                zf.writestr(f"data\\train\\{label}\\{i}.wav", wav_bytes(300 + 100 * i))
        zf.writestr(zipfile.ZipInfo("data\\empty\\"), b"")
        zf.writestr(zipfile.ZipInfo("data\\notes\\"), b"")
        zf.writestr(zipfile.ZipInfo("data\\more\\"), b"")
    listing = list_labelled(archive, frozenset({".wav"}), kind="audio")
    assert listing.classes == ["cat", "dog"] and listing.unknown == []
    assert [m.name for m in listing.splits["train"]][0] == "data/train/cat/0.wav"
    assert len(listing.splits["train"][0].source.open().read()) == len(wav_bytes(300))
    assert sniff_files(archive, frozenset({".wav"}), "audio", "one audio file") is not None  # 4 of 4, not 4 of 10


def test_identical_captions_retrieved_count_as_hits(tmp_path):
    """Two photos both captioned "a red square": a perfect model embeds the two captions alike, and the query of
    either photo finds the other's caption first on the tie; that was counted a miss (recall@1 below 1)."""
    shapes = write_shapes(tmp_path / "shapes", 3, seed=0, size=16)
    captions = ["a red square", "a red square", "a blue circle"]
    rows = [{"file_name": f"{i:04d}.png", "text": text} for i, text in enumerate(captions)]
    (shapes / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    listing = find_pairs(shapes)
    assert [e.text for e in listing.entries["text"]] == captions
    keys = torch.tensor(side_keys(listing, [0, 1, 2]))
    texts = torch.eye(2)[[0, 0, 1]]  # identical texts embed identically
    images = texts.clone()  # each photo embedded exactly as its caption
    figures = retrieval_metrics(images, texts, ("image", "text"), "val", keys)
    assert figures["val/recall@1/image_to_text"] == figures["val/recall@1/text_to_image"] == 1.0
    assert figures["val/recall@1_chance"] == pytest.approx((2 + 2 + 1) / 3 / 3)


def pair_data(tmp_path: Path, source: Path, split: str = "data.val_split=0.25") -> PairData:
    cfg = compose(
        *("data=pairs", "model=dual_encoder", f"data.source={source}", f"paths.cache={tmp_path / 'cache'}"),
        *("data.sides.image.image_size=[16,16]", "data.sides.text.max_length=16", split),
    )
    dm = PairData(cfg, sides_of(cfg))
    dm.setup()
    return dm


def test_identical_caption_files_retrieved_count_as_hits(tmp_path):
    """The shapes demo's layout, NNNN.png + NNNN.txt: captions repeat across files ("a red square"), and a perfect
    model's held-out query that found its twin's caption first was counted a miss."""
    folder = write_shapes(tmp_path / "shapes", 8, seed=0, size=16)
    captions = ["a red square" if i % 2 else "a blue circle\n" for i in range(8)]
    for i, caption in enumerate(captions):
        (folder / f"{i:04d}.txt").write_text(caption)
    dm = pair_data(tmp_path, folder, "data.val_split=0.5")  # 4 held out of two captions: twins among them
    held = [captions[int(name)].strip() for name in dm.splits["val"].names]
    assert len(set(held)) < len(held)  # the premise
    embedded = torch.eye(2)[[0 if caption == "a blue circle" else 1 for caption in held]]
    figures = retrieval_metrics(embedded, embedded.clone(), ("image", "text"), "val", dm.val_groups)
    assert figures["val/recall@1/image_to_text"] == figures["val/recall@1/text_to_image"] == 1.0


def test_a_replaced_image_in_a_hidden_folder_is_decoded_again(tmp_path):
    """A metadata.jsonl naming its images under .images/: the folder's digest passes hidden folders over, so an
    image replaced there was read from the cache as it was before."""
    shapes = write_shapes(tmp_path / "shapes", 8, seed=0, size=16)
    folder = tmp_path / "captioned"
    (folder / ".images").mkdir(parents=True)
    rows = []
    for i in range(6):
        shutil.copy(shapes / f"{i:04d}.png", folder / ".images" / f"{i:04d}.png")
        rows.append({"file_name": f".images/{i:04d}.png", "text": (shapes / f"{i:04d}.txt").read_text().strip()})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def image_of(dm: PairData, key: str) -> torch.Tensor:
        for split in dm.splits.values():
            if key in split.names:
                return split.inputs[split.names.index(key)]
        raise AssertionError(key)

    first = pair_data(tmp_path, folder)
    key = first.listing.keys[0]
    before = image_of(first, key)
    shutil.copy(shapes / "0007.png", folder / ".images" / "0000.png")  # another shape in its place
    after = image_of(pair_data(tmp_path, folder), key)
    assert not torch.equal(before, after)


def test_a_text_models_val_source_that_is_data_source_is_said_when_training_starts(tmp_path, caplog):
    """The text data module validated on its own training lines without a word when data.val_source named
    data.source; a held-out file of its own is not said."""
    lines, held = tmp_path / "lines.txt", tmp_path / "held.txt"
    lines.write_text("a line of text to learn\n" * 40)
    held.write_text("a line held out\n" * 8)

    def said(val_source: Path) -> list[str]:
        caplog.clear()
        cfg = compose("recipe=char_lstm", "data=text", f"data.source={lines}", f"data.val_source={val_source}")
        dm = TextDataModule(cfg.data, byte_tokenizer(), 4)
        dm.setup()
        with caplog.at_level(logging.WARNING, logger="onn"):
            dm.train_dataloader()
            dm.train_dataloader()  # said once
        return [r.getMessage() for r in caplog.records if "data.val_source is data.source itself" in r.getMessage()]

    assert len(said(tmp_path / "." / "lines.txt")) == 1
    assert said(held) == []
