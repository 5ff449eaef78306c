"""Finding and labelling a user's files as a fifth review found them (2026-12): hidden links in an archive counted as
undecodable files (on disk never looked at), a class folder linked into a hidden store read from a folder and lost
from its tar, a .tar.gz name stored twice counted twice by the mesh and graph readers, a rewritten file whose mtime
was put back read from its stale decoded cache, a macOS copy of a folder held out other files than the folder, and
labels that are empty or given twice taken without a word."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import unicodedata
import zipfile
from pathlib import Path

import pytest
from test_data_review import wav_bytes
from test_data_review3 import add_file, add_link
from test_data_review4 import add_zip_link, read_all

from onn.data.files import content_digest
from onn.data.labelled import list_labelled
from onn.errors import UserError

WAV = frozenset({".wav"})


def pack(folder: Path, archive: Path) -> Path:
    """The folder as `tar c` (links kept as links) or Info-ZIP's `zip -ry` would pack it, under its own name."""
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive, "w") as zf:
            for dirpath, dirnames, filenames in os.walk(folder):
                for entry in sorted(dirnames + filenames):
                    path = Path(dirpath) / entry
                    name = path.relative_to(folder.parent).as_posix()
                    if path.is_symlink():
                        add_zip_link(zf, name, os.readlink(path))
                    elif path.is_file():
                        zf.write(path, name)
        return archive
    with tarfile.open(archive, "w:gz" if archive.name.endswith(".gz") else "w") as tf:
        tf.add(folder, arcname=folder.name)
    return archive


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".zip"])
def test_hidden_entries_and_links_into_hidden_folders_read_from_an_archive_as_from_its_folder(tmp_path, suffix):
    """A packed .venv's bin/python -> /usr/bin/python3 and a .thumbs link out of the folder were refused members,
    counted with the undecodable files (a run with data.max_bad_fraction=0 refused), where the folder never looks at
    them; a class folder linked into a hidden store (.store/cat, as DVC and HF caches lay data out) was read from the
    folder and dropped from its archive without a word."""
    ds = tmp_path / "ds"
    for name in ("dog/0.wav", "dog/1.wav", ".store/cat/0.wav", ".store/cat/1.wav"):
        (ds / name).parent.mkdir(parents=True, exist_ok=True)
        (ds / name).write_bytes(wav_bytes(300 + len(name)))
    (ds / "cat").symlink_to(".store/cat")
    (ds / ".venv/bin").mkdir(parents=True)
    (ds / ".venv/bin/python").symlink_to("/usr/bin/python3")
    (ds / ".thumbs").mkdir()
    (ds / ".thumbs/0.wav").symlink_to("/nonexistent/0.wav")
    folder = list_labelled(ds, WAV, kind="audio")
    archive = list_labelled(pack(ds, tmp_path / f"ds{suffix}"), WAV, kind="audio")
    names = ["ds/cat/0.wav", "ds/cat/1.wav", "ds/dog/0.wav", "ds/dog/1.wav"]
    assert [m.name for m in folder.splits["all"]] == [n.removeprefix("ds/") for n in names]
    assert [m.name for m in archive.splits["all"]] == names and archive.classes == ["cat", "dog"]
    assert archive.refused == folder.refused == []
    read = {m.name: m.source.open().read() for m in archive.splits["all"]}
    assert read["ds/cat/1.wav"] == (ds / ".store/cat/1.wav").read_bytes()


def test_a_link_to_a_folder_that_holds_only_links_is_not_refused(tmp_path):
    """A Hugging Face snapshot's files are links into blobs/: a folder of links only. A link to it was refused as "a
    link to snapshot, which the archive does not hold" and counted undecodable; walk_files lists that folder once."""
    archive = tmp_path / "hub.tar"
    with tarfile.open(archive, "w") as tf:
        add_file(tf, "hub/blobs/5d41", b"one")
        add_link(tf, "hub/snapshot/cat/1.png", "../../blobs/5d41")
        add_link(tf, "hub/latest", "snapshot")
    read, refused = read_all(archive)
    assert refused == {}
    assert read == {"hub/blobs/5d41": [b"one"], "hub/snapshot/cat/1.png": [b"one"]}


def test_a_compressed_tar_name_stored_twice_is_one_graph_its_last_entry(tmp_path):
    """A .tar.gz streams an entry before a later one of its name is known; the graph reader took both,
    so a file re-added to the archive (tar rf, or two folders packed over each other) was counted twice, its
    replaced entry too: here a replaced broken file refused the run as "1 of 7 graph files cannot be used"."""
    from onn.modalities.graph.read import read_source

    archive = tmp_path / "graphs.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        add_file(tf, "graphs/ring/0.edges", b"not a graph\n")
        for c, edges in (("ring", b"0 1\n1 2\n2 0\n"), ("star", b"0 1\n0 2\n0 3\n")):
            for i in range(3):
                add_file(tf, f"graphs/{c}/{i}.edges", edges)
    found = read_source(archive, align="none", max_nodes=100, max_bad_fraction=0.0)
    assert {k: (len(v.names), v.classes) for k, v in found.items()} == {"all": (6, ["ring", "star"])}


def test_a_folder_copied_with_its_mtimes_kept_shares_its_decoded_cache_key(tmp_path):
    """A dataset copied to each job's scratch with its mtimes kept (cp -a, rsync -a) keys one cache entry: with the
    change time in the key (which every copy sets), each job decoded the whole dataset again into a new entry."""
    source = tmp_path / "recordings"
    for label, freq in (("a", 300), ("b", 900)):
        (source / label).mkdir(parents=True)
        for i in range(2):
            (source / label / f"{i}.wav").write_bytes(wav_bytes(freq + 20 * i))
    copy = tmp_path / "scratch" / "recordings"
    shutil.copytree(source, copy, copy_function=shutil.copy2)
    assert content_digest(copy) == content_digest(source)
    (copy / "a" / "0.wav").write_bytes(wav_bytes(2000))  # a change the key sees: a new mtime
    assert content_digest(copy) != content_digest(source)


def test_a_folder_macos_wrote_decomposed_is_listed_in_the_order_of_its_typed_copy(tmp_path):
    """The listing was sorted by the names as stored: "é" written decomposed (e + accent, as macOS and its zips write
    it) sorts before "f", typed (one character) after it, so the same seed held out other files of each copy."""
    names = ["a.wav", "é.wav", "f.wav", "ü.wav", "v.wav"]
    orders = []
    for form in ("NFC", "NFD"):
        folder = tmp_path / form / "x"
        folder.mkdir(parents=True)
        for i, name in enumerate(names):
            (folder / unicodedata.normalize(form, name)).write_bytes(wav_bytes(300 + 50 * i))
        listing = list_labelled(folder.parent, WAV, kind="audio")
        orders.append([unicodedata.normalize("NFC", m.name) for m in listing.splits["all"]])
    assert orders[0] == orders[1] == [f"x/{n}" for n in sorted(names)]


def test_a_label_pattern_that_matches_empty_names_no_class(tmp_path):
    """data.label_from="^([a-z]*)" on FSDD's 3_george_7.wav matches the empty string: every file was of the class
    "", one class, where the user meant a label and deserves the sentence that names the files without one."""
    folder = tmp_path / "recordings"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i % 2}_george_{i}.wav").write_bytes(wav_bytes(300 + 100 * i))
    assert list_labelled(folder, WAV, label_from=r"^(\d+)_", kind="audio").classes == ["0", "1"]
    with pytest.raises(UserError, match=r"4 audio files have no label, e\.g\. 0_george_0\.wav"):
        list_labelled(folder, WAV, label_from="^([a-z]*)", kind="audio")


def test_a_manifest_that_labels_a_file_twice_differently_is_one_sentence(tmp_path):
    """Two rows for one file with different labels (two annotators' lists joined) took the last without a word."""
    folder = tmp_path / "recordings"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.wav").write_bytes(wav_bytes(300 + 100 * i))
    rows = "file_name,label\n0.wav,cat\n1.wav,dog\n2.wav,cat\n"
    (folder / "metadata.csv").write_text(rows + "0.wav,cat\n")  # the same label again: one file, as before
    assert [m.label for m in list_labelled(folder, WAV, kind="audio").splits["all"]] == ["cat", "dog", "cat"]
    (folder / "metadata.csv").write_text(rows + "2.wav,dog\n")
    with pytest.raises(UserError, match=r"metadata\.csv line 5 labels 2\.wav 'dog', which an earlier row labels 'cat'"):
        list_labelled(folder, WAV, kind="audio")


def test_a_compressed_tar_image_stored_twice_is_one_image_its_last_entry(tmp_path):
    """The image reader appended both entries of a name a .tar.gz stores twice: 7 images for 6, the replaced one
    trained on too."""
    from PIL import Image

    from onn.modalities.image.formats.folder import list_tree

    def png(colour: tuple[int, int, int]) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (4, 4), colour).save(out, format="PNG")
        return out.getvalue()

    archive = tmp_path / "images.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        add_file(tf, "cat/0.png", png((255, 0, 0)))
        for c, colour in (("cat", (0, 0, 255)), ("dog", (0, 255, 0))):
            for i in range(3):
                add_file(tf, f"{c}/{i}.png", png(colour))
    listing = list_tree(archive, "data.source", allow_unlabelled=False, stream=False)
    (split,) = listing.splits.values()
    assert sorted(split.names) == [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(3)]
    first_cat = split.fetch.get(split.names.index("cat/0.png"))
    assert Image.open(io.BytesIO(first_cat)).getpixel((0, 0)) == (0, 0, 255)


def test_a_compressed_tar_mesh_stored_twice_is_one_mesh_its_last_entry(tmp_path):
    """The mesh reader took both entries of a name a .tar.gz stores twice: a replaced broken file refused the run
    at data.max_bad_fraction=0, and a replaced good one was trained on beside its new version."""
    from onn.modalities.mesh.read import Sampling, read_source

    tetrahedron = b"OFF\n4 4 0\n0 0 0\n1 0 0\n0 1 0\n0 0 1\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"
    archive = tmp_path / "meshes.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        add_file(tf, "shapes/a/0.off", b"OFF\n4 1 0\nbroken")
        for c in ("a", "b"):
            for i in range(3):
                add_file(tf, f"shapes/{c}/{i}.off", tetrahedron)
    found = read_source(archive, Sampling(points=16, normals=False), max_bad_fraction=0.0)
    assert {k: (sorted(v.names), v.classes) for k, v in found.items()} == {
        "all": (sorted(f"shapes/{c}/{i}.off" for c in "ab" for i in range(3)), ["a", "b"])
    }
