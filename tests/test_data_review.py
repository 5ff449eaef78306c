"""The shared data layer (onn/data) as a review found it (2026-12): a manifest and class folders whose names macOS
wrote decomposed, a zip member damaged in the download, zip handles kept for every archive ever read (and read from
after the archive was replaced), and a dataset sized by an undecodable first item. Each is read as the user laid
it out, or skipped and named in one sentence."""

from __future__ import annotations

import io
import json
import os
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import MODALITY_HARDWARE, compose
from PIL import Image

from onn.errors import UserError

AUDIO = ("data=audio", "model=audio_cnn", "data.num_workers=0", "data.sample_rate=8000", "data.clip_seconds=0.3")


def wav_bytes(freq: float) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    t = np.arange(2400) / 8000
    sf.write(out, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 8000, format="WAV")
    return out.getvalue()


def audio_data(tmp_path: Path, source: Path, *overrides: str):
    """The audio datamodule `python run.py data=audio data.source=SOURCE OVERRIDES` sets up."""
    from onn.modalities import classification, get

    config = compose(*AUDIO, f"data.source={source}", f"paths.cache={tmp_path / 'cache'}", *overrides, root=tmp_path)
    return classification.setup_data(get("audio"), config, "cpu")


def test_a_manifest_and_class_folders_named_in_decomposed_unicode_match_typed_names(tmp_path):
    """macOS writes "café" in a file name as "cafe" + a combining accent (NFD); a typed metadata.jsonl holds "é" as
    one character. The manifest matched none of its files ("6 files are not in the manifest ..., e.g. café_0.wav"),
    and a val_source whose class folder was typed was refused as a class the training data lacks."""
    decomposed = tmp_path / "recordings"
    decomposed.mkdir()
    rows = []
    for i in range(6):
        name = f"café_{i}.wav"
        (decomposed / unicodedata.normalize("NFD", name)).write_bytes(wav_bytes(300 + 300 * (i % 2)))
        rows.append({"file_name": unicodedata.normalize("NFC", name), "label": "é" if i % 2 else "a"})
    (decomposed / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    data = audio_data(tmp_path, decomposed)
    assert data.classes == ["a", "é"] and sum(len(s) for s in data.splits.values()) == 6

    folders = tmp_path / "folders"
    for label, freq in (("é", 300), ("a", 600)):
        for root, form in ((folders / "train", "NFD"), (folders / "val", "NFC")):
            (root / unicodedata.normalize(form, label)).mkdir(parents=True)
            for i in range(3):
                (root / unicodedata.normalize(form, label) / f"{i}.wav").write_bytes(wav_bytes(freq + i))
    data = audio_data(tmp_path, folders / "train", f"data.val_source={folders / 'val'}")
    assert data.classes == ["a", "é"] and len(data.splits["val"]) == 6
    assert sorted(data.splits["val"].labels.tolist()) == [0, 0, 0, 1, 1, 1]


def damaged_zip(path: Path) -> Path:
    """Two classes of five tones, stored; the bytes of a/1.wav flipped after writing (its CRC no longer matches)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for label, freq in (("a", 300), ("b", 600)):
            for i in range(5):
                archive.writestr(f"{label}/{i}.wav", wav_bytes(freq + 10 * i))
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("a/1.wav")
    raw[info.header_offset + 30 + len(info.filename) + 100] ^= 0xFF  # past its local header, into the samples
    path.write_bytes(bytes(raw))
    return path


def test_a_damaged_zip_member_is_skipped_and_named_and_the_run_trains(tmp_path):
    """A zip member whose bytes fail their CRC (a cut-off or bit-flipped download) ended every run, resident or
    streamed, in zipfile's bare "BadZipFile: Bad CRC-32 for file 'a/1.wav'" traceback."""
    from onn.app import execute

    source = damaged_zip(tmp_path / "tones.zip")
    with pytest.raises(UserError, match=r"1 of 10 audio files could not be decoded \(first: a/1\.wav: .*Bad CRC-32"):
        audio_data(tmp_path, source)
    for resident in ("true", "false"):
        data = audio_data(tmp_path, source, f"data.resident={resident}", "data.max_bad_fraction=0.2")
        assert [s.split(":")[0] for s in data.skipped] == ["a/1.wav"], resident
    given = (*AUDIO, f"data.source={source}", "data.max_bad_fraction=0.2", "data.batch_size=4")
    config = compose(
        *given,
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        "trainer.max_steps=2",
        "+model.kwargs.widths=[4,8]",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
    )
    metrics = execute(config, tmp_path / "run")
    assert metrics["steps"] == 2 and metrics["items_skipped"] == 1


def test_a_zip_replaced_at_its_path_is_read_anew_and_old_handles_are_let_go(tmp_path):
    """ZipSource kept one handle per archive path for the life of the process: an archive replaced at the same path
    was read through the old file's directory (old bytes, or a CRC error), and a server decoding zip uploads kept
    every upload open (a descriptor and the deleted file's disk space each)."""
    from onn.data.labelled import KEPT_OPEN, ZipSource

    path = tmp_path / "clips.zip"
    for content in (b"first version", b"the second, longer version"):
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("a/0.wav", content)
        assert ZipSource(path, "a/0.wav").open().read() == content
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("counting open descriptors needs /proc")
    before = len(os.listdir(fds))
    for i in range(3 * KEPT_OPEN):
        upload = tmp_path / f"upload{i}" / "upload.zip"
        upload.parent.mkdir()
        with zipfile.ZipFile(upload, "w") as archive:
            archive.writestr("x.wav", b"%d" % i)
        assert ZipSource(upload, "x.wav").open().read() == b"%d" % i
    assert len(os.listdir(fds)) - before <= KEPT_OPEN


def test_a_dataset_whose_first_item_does_not_decode_is_sized_by_one_that_does(tmp_path):
    """data.resident=auto sized the decoded dataset by its first item alone: an undecodable one counted 0 MB, and a
    folder far over data.resident_max_mb was decoded into memory whole."""
    from onn.modalities.image.dataset import ImageDataModule

    for label in ("a", "b"):
        for i in range(6):
            (tmp_path / "src" / label).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(tmp_path / "src" / label / f"{i}.png")
    (tmp_path / "src" / "a" / "0.png").write_bytes(b"\x89PNG damaged")  # the first file listed
    config = compose(
        "data=image",
        f"data.source={tmp_path / 'src'}",
        "data.resident=auto",
        "data.resident_max_mb=0.05",  # 12 images of 12 KB decoded: over it
        "data.num_workers=0",
        "data.max_bad_fraction=0.2",
        root=tmp_path,
    )
    data = ImageDataModule(config.data, tmp_path / "cache")
    data.setup()
    assert data.streamed and sum(len(index) for _, index in data.streamed.values()) == 11


def test_a_class_that_only_the_test_split_holds_is_named(tmp_path, caplog):
    """A class folder under test/ alone (or in a val_source alone) trained a model that never saw it, and scored every
    one of its items wrong, in silence."""
    import logging

    for split, labels in (("train", ("a", "b")), ("test", ("a", "b", "c"))):
        for k, label in enumerate(labels):
            (tmp_path / "src" / split / label).mkdir(parents=True)
            for i in range(3):
                (tmp_path / "src" / split / label / f"{i}.wav").write_bytes(wav_bytes(300 * (k + 1) + i))
    with caplog.at_level(logging.WARNING, logger="onn"):
        data = audio_data(tmp_path, tmp_path / "src")
        data.train_dataloader()  # said when training starts (task=eval trains nothing: test_data_review2)
    assert data.classes == ["a", "b", "c"] and len(data.splits["test"]) == 9
    assert "the training data has no item of the class(es) c, which test hold(s)" in caplog.text
