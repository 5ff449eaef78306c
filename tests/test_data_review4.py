"""The data layer's archives as a fourth review found them (2026-12): a zip's symbolic links (zip -y) read as files
holding a path, a tar name stored twice read as its first entry (or as a loop of links), and a .tar.gz with links
decompressed twice over."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest
from test_data_review import audio_data, wav_bytes
from test_data_review3 import add_file, add_link

import onn.data.files as files
from onn.data.files import iter_members


def add_zip_link(zf: zipfile.ZipFile, name: str, target: str) -> None:
    """A symbolic link as Info-ZIP's `zip -y` stores it: its bytes are its target, S_IFLNK in the mode bits."""
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # Unix: external_attr's high 16 bits are st_mode
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    zf.writestr(info, target)


def read_all(archive: Path) -> tuple[dict[str, list[bytes]], dict[str, str]]:
    """Each clean name's bytes, in the order iter_members yields them, and each refused member's reason."""
    read: dict[str, list[bytes]] = {}
    refused: dict[str, str] = {}
    for m in iter_members(archive):
        if m.name is None:
            refused[m.raw] = m.problem
        else:
            with m.open() as f:
                read.setdefault(m.name, []).append(f.read())
    return read, refused


def test_zip_symbolic_links_are_read_as_their_targets_and_links_out_of_the_archive_are_named(tmp_path):
    """A zip -y link was a member whose bytes are its target's path: "3.png" read as the 5 bytes "1.png", counted
    undecodable, and "../../../secret.png" was a file too. Links read as tar links do: what they lead to inside the
    archive, and one that leads out of it is refused and named, never followed onto this machine's files."""
    (tmp_path / "secret.png").write_bytes(b"host file")
    archive = tmp_path / "ds.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ds/cat/1.png", b"one")
        add_zip_link(zf, "ds/cat/3.png", "1.png")
        add_zip_link(zf, "ds/cat/4.png", "3.png")  # a link to a link
        add_zip_link(zf, "ds/cat/5.png", "../dog/6.png")  # to a member stored after it
        zf.writestr("ds/dog/6.png", b"six")
        add_zip_link(zf, "ds/dog/7.png", "../../../secret.png")
        add_zip_link(zf, "ds/bird", "/home/someone/birds")
        add_zip_link(zf, "ds/all_dogs", "dog")  # a folder of the archive: its files are listed by their own names
        add_zip_link(zf, "ds/gone.png", "missing.png")
    read, refused = read_all(archive)
    assert read == {
        "ds/cat/1.png": [b"one"],
        "ds/cat/3.png": [b"one"],
        "ds/cat/4.png": [b"one"],
        "ds/cat/5.png": [b"six"],
        "ds/dog/6.png": [b"six"],
    }
    out = "leads outside the archive, not read (zip it without -y: what it leads to is stored)"
    assert refused == {
        "ds/dog/7.png": f"a link to ../../../secret.png, which {out}",
        "ds/bird": f"a link to /home/someone/birds, which {out}",
        "ds/gone.png": "a link to missing.png, which the archive does not hold, not read",
    }


def test_a_zip_made_with_y_trains_on_its_linked_recordings(tmp_path):
    """The audio listing read a zip -y link by its stored name (ZipSource): the bytes were a path, so each linked
    recording was one more undecodable file. Each is now its target's recording under the link's name."""
    from onn.data.labelled import list_labelled

    archive = tmp_path / "recordings.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for label, freq in (("a", 300), ("b", 900)):
            for i in range(3):
                zf.writestr(f"recordings/{label}/{i}.wav", wav_bytes(freq + 10 * i))
            add_zip_link(zf, f"recordings/{label}/linked.wav", "0.wav")
    listing = list_labelled(archive, frozenset({".wav"}), kind="audio")
    linked = {m.name: m.source.open().read() for m in listing.splits["all"] if m.name.endswith("linked.wav")}
    assert linked == {"recordings/a/linked.wav": wav_bytes(300), "recordings/b/linked.wav": wav_bytes(900)}
    data = audio_data(tmp_path, archive, "data.max_bad_fraction=0.0")  # an undecodable file would refuse the run
    assert sum(len(s) for s in data.splits.values()) == 8


@pytest.mark.parametrize("mode", ["w", "w:gz"])
@pytest.mark.parametrize("order", ["file then link", "link then file"])
def test_a_tar_name_stored_twice_is_its_last_entry(tmp_path, mode, order):
    """tar extracts a name stored twice as its later entry (tarfile.getmember reads it so too). The listing took a
    regular file over a link of its name whatever their order: "a.png" stored as a link after a file read as both,
    and as a link before a file it read as the link's target, as did every link to "a.png"."""
    archive = tmp_path / ("ds.tar" if mode == "w" else "ds.tar.gz")
    with tarfile.open(archive, mode) as tf:
        add_file(tf, "ds/b.png", b"bee")
        if order == "file then link":
            add_file(tf, "ds/a.png", b"old")
            add_link(tf, "ds/a.png", "b.png")
        else:
            add_link(tf, "ds/a.png", "b.png")
            add_file(tf, "ds/a.png", b"new")
        add_link(tf, "ds/c.png", "a.png")
    read, refused = read_all(archive)
    a = b"bee" if order == "file then link" else b"new"
    assert refused == {}
    assert {name: got[-1] for name, got in read.items()} == {"ds/a.png": a, "ds/b.png": b"bee", "ds/c.png": a}
    if mode == "w":  # random access: each name once (a compressed tar streams an entry before it knows a later one)
        assert all(len(got) == 1 for got in read.values())


@pytest.mark.parametrize("order", ["file then link", "link then file"])
def test_a_zip_name_stored_twice_is_its_last_entry(tmp_path, order):
    """zipfile reads a name stored twice as its later entry; the zip listing yielded every regular entry and then
    the links found, so a link stored before a file of its name was read after it, and won."""
    archive = tmp_path / "ds.zip"
    with warnings.catch_warnings(), zipfile.ZipFile(archive, "w") as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it is asked to write
        zf.writestr("ds/b.png", b"bee")
        if order == "file then link":
            zf.writestr("ds/a.png", b"old")
            add_zip_link(zf, "ds/a.png", "b.png")
        else:
            add_zip_link(zf, "ds/a.png", "b.png")
            zf.writestr("ds/a.png", b"new")
    read, refused = read_all(archive)
    a = b"bee" if order == "file then link" else b"new"
    assert refused == {} and read == {"ds/a.png": [a], "ds/b.png": [b"bee"]}


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_a_folder_packed_twice_is_read_once_without_a_loop_of_links(tmp_path, mode):
    """GNU `tar cf x.tar d d` stores each file of d a second time as a hard link to its own name. The listing
    followed that link to itself and refused every file of the folder as "a loop of links", counting them
    undecodable; tar (and tarfile) take a hard link's target as the file of that name stored before it."""
    from onn.data.labelled import list_labelled

    recordings = {
        f"recordings/{label}/{i}.wav": wav_bytes(freq + 10 * i)
        for label, freq in (("a", 300), ("b", 900))
        for i in (0, 1)
    }
    archive = tmp_path / ("recordings.tar" if mode == "w" else "recordings.tar.gz")
    with tarfile.open(archive, mode) as tf:
        for name, data in recordings.items():
            add_file(tf, name, data)
        for name in recordings:  # as GNU tar writes the second time it meets a file it stored
            add_link(tf, name, name, tarfile.LNKTYPE)
    read, refused = read_all(archive)
    assert refused == {}
    assert read == {name: [data] for name, data in recordings.items()}
    listing = list_labelled(archive, frozenset({".wav"}), kind="audio")
    assert listing.refused == [] and len(listing.splits["all"]) == 4


def test_a_compressed_tar_with_links_is_not_decompressed_twice(tmp_path, monkeypatch):
    """A .tar.gz's links are read in a second pass (their targets' bytes went by in the first), which decompressed
    the whole archive again; it now ends at the last target, here the first member."""
    archive = tmp_path / "ds.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(10):
            add_file(tf, f"ds/{i}.bin", os.urandom(100_000))  # random: gzip keeps it as large as it is
        add_link(tf, "ds/link.bin", "ds/0.bin", tarfile.LNKTYPE)
    counted = {"bytes": 0}
    open_regular = files.open_regular

    class Counted(io.RawIOBase):
        """The archive's file, counting the bytes taken from it."""

        def __init__(self, f: io.BufferedReader):
            self.f = f

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            n = self.f.readinto(buffer)
            counted["bytes"] += n
            return n

        def close(self) -> None:
            self.f.close()
            super().close()

    monkeypatch.setattr(files, "open_regular", lambda path: io.BufferedReader(Counted(open_regular(path))))
    read, refused = read_all(archive)
    assert read["ds/link.bin"] == read["ds/0.bin"] and len(read) == 11
    assert counted["bytes"] < 1.2 * archive.stat().st_size
