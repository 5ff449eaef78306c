"""The data layer and image formats as a third review found them (2026-12): a tar's hard and symbolic links dropped
without a word, an image data.source scored by task=eval refused for a test class its own train/ lacks, a line per
undecodable streamed item, and a manifest's file_name cleaned character by character ("../x.wav" read as "x.wav")."""

from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import compose
from test_data_review import audio_data, wav_bytes

from onn.errors import UserError


def add_file(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def add_link(tf: tarfile.TarFile, name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    tf.addfile(info)


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_tar_links_are_read_as_their_targets_and_links_out_of_the_archive_are_named(tmp_path, mode):
    """iter_members kept only regular members: a hard-linked file (tar stores the second name of a file as a link)
    and a symbolic link vanished without a word. They read as what they lead to inside the archive; a link that
    leads out of it is refused and named, never followed onto this machine's files (tarfile's data filter)."""
    from onn.data.files import iter_members

    (tmp_path / "secret.png").write_bytes(b"host file")  # what "../secret.png" would reach if followed
    archive = tmp_path / ("ds.tar" if mode == "w" else "ds.tar.gz")
    with tarfile.open(archive, mode) as tf:
        add_file(tf, "ds/cat/1.png", b"one")
        add_link(tf, "ds/cat/2.png", "ds/cat/1.png", tarfile.LNKTYPE)  # a hard link: named from the archive's top
        add_link(tf, "ds/cat/3.png", "1.png")  # symbolic: from its own folder
        add_link(tf, "ds/cat/4.png", "3.png")  # a link to a link
        add_link(tf, "ds/cat/5.png", "../dog/6.png")  # to a member stored after it
        add_file(tf, "ds/dog/6.png", b"six")
        add_link(tf, "ds/dog/7.png", "../../../secret.png")
        add_link(tf, "ds/bird", "/home/someone/birds")  # a class folder packed as a link (tar without -h)
        add_link(tf, "ds/all_dogs", "dog")  # a folder of the archive: its files are listed by their own names
        add_link(tf, "ds/loop.png", "loop.png")
        add_link(tf, "ds/gone.png", "missing.png")
    read, refused = {}, {}
    for m in iter_members(archive):
        if m.name is None:
            refused[m.raw] = m.problem
        else:
            with m.open() as f:
                read[m.name] = f.read()
    assert read == {
        "ds/cat/1.png": b"one",
        "ds/cat/2.png": b"one",
        "ds/cat/3.png": b"one",
        "ds/cat/4.png": b"one",
        "ds/cat/5.png": b"six",
        "ds/dog/6.png": b"six",
    }
    assert refused == {
        "ds/dog/7.png": "a link to ../../../secret.png, which leads outside the archive, not read (pack it with "
        "tar -h: what it leads to is stored)",
        "ds/bird": "a link to /home/someone/birds, which leads outside the archive, not read (pack it with tar -h: "
        "what it leads to is stored)",
        "ds/loop.png": "a link to loop.png, which is a loop of links, not read (pack it with tar -h: what it leads to "
        "is stored)",
        "ds/gone.png": "a link to missing.png, which the archive does not hold, not read",
    }


def test_a_tar_made_without_h_reads_its_linked_files_and_names_a_class_folder_left_outside(tmp_path):
    """A folder packed with tar (no -h) stores its links as links: the audio listing dropped the hard-linked and
    symlinked recordings and a class folder that was a link to elsewhere on the disk, without a word."""
    from onn.data.labelled import list_labelled

    src = tmp_path / "recordings"
    for label, freq in (("a", 300), ("b", 900)):
        (src / label).mkdir(parents=True)
        for i in range(3):
            (src / label / f"{i}.wav").write_bytes(wav_bytes(freq + 10 * i))
    os.link(src / "a" / "0.wav", src / "a" / "hard.wav")
    os.symlink("1.wav", src / "a" / "soft.wav")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "0.wav").write_bytes(wav_bytes(600))
    os.symlink(tmp_path / "elsewhere", src / "c")
    archive = tmp_path / "recordings.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(src, "recordings")  # dereference=False: as tar without -h
    listing = list_labelled(archive, frozenset({".wav"}), kind="audio")
    names = sorted(m.name for m in listing.splits["all"])
    assert names == [f"recordings/a/{n}.wav" for n in ("0", "1", "2", "hard", "soft")] + [
        f"recordings/b/{i}.wav" for i in range(3)
    ]
    hard = next(m for m in listing.splits["all"] if m.name.endswith("hard.wav"))
    assert hard.source.open().read() == wav_bytes(300)
    assert listing.refused == [
        f"recordings/c: a link to {tmp_path / 'elsewhere'}, which leads outside the archive, not read (pack it with "
        "tar -h: what it leads to is stored)"
    ]


def two_class_folders(root: Path) -> Path:
    """class0 and class1 under train/, and a class2 under test/ only."""
    from PIL import Image

    for split, classes in (("train", ("class0", "class1")), ("test", ("class0", "class1", "class2"))):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (8, 8), (80 * c, 40 * i, 0)).save(root / split / name / f"{i}.png")
    return root


def test_an_image_source_scored_whole_does_not_refuse_a_test_class_its_train_split_lacks(tmp_path, caplog):
    """task=eval data.source=X scores every split of X (data.val_source=X): X's own train/ is not what the model
    learned from, yet a test/ class it lacked refused the run ("has classes the training data does not"). The
    checkpoint's classes decide (trained_data); training on X still names the class, when training starts."""
    from onn.modalities import classification, get

    source = two_class_folders(tmp_path / "images")
    common = ("data=image", "model=v28_cnn", f"data.source={source}", f"paths.cache={tmp_path / 'cache'}")
    scored = classification.setup_data(get("image"), compose(*common, f"data.val_source={source}"), "cpu")
    assert scored.classes == ["class0", "class1", "class2"] and len(scored.splits["val"]) == 20
    with caplog.at_level(logging.WARNING, logger="onn"):
        trained = classification.setup_data(get("image"), compose(*common), "cpu")
        trained.train_dataloader()
    assert "the training data has no item of the class(es) class2, which test hold(s)" in caplog.text


@pytest.mark.slow
def test_task_eval_scores_a_test_class_the_checkpoint_knows_and_names_one_it_does_not(tmp_path):
    """The whole command: a checkpoint of three classes scored on a folder whose train/ has two of them and test/ all
    three; a test/ class it never learned is one sentence."""
    from test_eval_infer_edges import scored
    from test_vision_train import make_images, run

    images = make_images(tmp_path / "images", train=8, test=4, size=8)
    _, run_dir = run(tmp_path, f"data.source={images}", "trainer.max_epochs=1")
    other = tmp_path / "other"
    for c in ("class0", "class1"):
        shutil.copytree(images / "train" / c, other / "train" / c)
    for c in ("class0", "class1", "class2"):
        shutil.copytree(images / "test" / c, other / "test" / c)
    assert "test/acc" in scored(tmp_path, run_dir, f"data.source={other}", name="known")
    shutil.copytree(images / "test" / "class2", other / "test" / "class9")
    with pytest.raises(UserError, match=r"data\.source has the classes \['class9'\], which ckpt .* never learned"):
        scored(tmp_path, run_dir, f"data.source={other}", name="unknown")


def test_undecodable_streamed_items_are_one_warning_with_their_reasons(tmp_path, caplog):
    """The up-front pass over streamed audio logged "skipped NAME: why" for every bad file, then the count: a thousand
    lines for a thousand bad files. It is the one warning, which names the first few and why."""
    src = tmp_path / "src"
    for label, freq in (("a", 300), ("b", 900)):
        (src / label).mkdir(parents=True)
        for i in range(12):
            (src / label / f"{i}.wav").write_bytes(wav_bytes(freq + 10 * i))
    for i in range(12):
        (src / "a" / f"bad{i:02d}.wav").write_bytes(b"not a wav" * 10)
    with caplog.at_level(logging.WARNING, logger="onn"):
        data = audio_data(tmp_path, src, "data.resident=false", "data.max_bad_fraction=0.5")
    assert data.streamed and len(data.skipped) == 12
    said = [r.getMessage() for r in caplog.records if "bad0" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Skipped 12 of 36 audio files")
    assert "a/bad00.wav: not decodable audio" in said[0] and "and 2 more" in said[0]


def test_a_manifest_file_name_is_a_path_not_characters_to_strip(tmp_path):
    """file_name was cleaned with lstrip("./"): "../x.wav" labelled the x.wav beside the manifest, and ".hidden/x.wav"
    labelled hidden/x.wav. A leading "./" is dropped as a path part, a hidden folder stays hidden, and a name that
    leads out of data.source is one sentence naming the manifest's line."""
    src = tmp_path / "src"
    (src / "hidden").mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.wav").write_bytes(wav_bytes(300 + 50 * i))
    (src / "hidden" / "h.wav").write_bytes(wav_bytes(700))
    rows = ["file_name,label", "./0.wav,a", "1.wav,b", "sub/../2.wav,a", "3.wav,b", ".hidden/h.wav,a"]
    (src / "metadata.csv").write_text("\n".join(rows) + "\n")
    data = audio_data(tmp_path, src, "data.max_bad_fraction=0.5", "data.val_split=0.25")
    named = {n: data.classes[int(label)] for s in data.splits.values() for n, label in zip(s.names, s.labels)}
    assert named == {"0.wav": "a", "1.wav": "b", "2.wav": "a", "3.wav": "b"}  # hidden/h.wav is not .hidden/h.wav
    (src / "metadata.csv").write_text("\n".join([*rows[:4], "../3.wav,b"]) + "\n")
    with pytest.raises(UserError, match=r"metadata\.csv line 5 has file_name '\.\./3\.wav', which leads out of"):
        audio_data(tmp_path, src)
