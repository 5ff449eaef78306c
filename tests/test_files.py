"""onn.data.files: walking, listing and sniffing what users hand over, without hanging, looping or trusting
archive member names."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from onn.data.files import (
    NotRegularFileError,
    UnsafeMemberNameError,
    archive_kind,
    clean_member_name,
    content_digest,
    existing_source,
    is_hidden,
    iter_members,
    read_file,
    read_head,
    walk_files,
)
from onn.errors import UserError


def write(root: Path, names: list[str]) -> Path:
    for n in names:
        p = root / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(n.encode())
    return root


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_walk_files_follows_links_once_and_ends_on_loops(tmp_path):
    root = write(tmp_path / "root", ["a/1.txt", "b/2.txt", ".git/x", "a/.hidden", "__MACOSX/a/._1.txt"])
    (root / "a/loop").symlink_to(root / "a")  # a/loop -> a
    (root / "b/up").symlink_to("..")  # b/x -> ..
    (root / "b/self").symlink_to(".")
    outside = write(tmp_path / "outside", ["c/3.txt", "c/deeper/4.txt"])
    (outside / "c/back").symlink_to(root)  # from outside back in: already walked
    (root / "c").symlink_to(outside / "c")  # another folder: followed, once
    (root / "c_again").symlink_to(outside / "c")
    (root / "file.txt").symlink_to(outside / "c/3.txt")  # a link to a file
    (root / "broken.txt").symlink_to(tmp_path / "gone")
    (root / "x").symlink_to(root / "y")  # a file-name loop: x -> y -> x
    (root / "y").symlink_to(root / "x")
    os.mkfifo(root / "a/pipe.txt")
    names = [rel for rel, _ in walk_files(root)]
    assert sorted(names) == ["a/1.txt", "b/2.txt", "c/3.txt", "c/deeper/4.txt", "file.txt"]
    assert names[:3] == ["file.txt", "a/1.txt", "b/2.txt"]  # real folders before linked ones
    assert [rel for rel, _ in walk_files(root, max_depth=1)] == ["file.txt"]
    assert sorted(rel for rel, _ in walk_files(root, max_depth=2)) == [
        "a/1.txt",
        "b/2.txt",
        "c/3.txt",
        "file.txt",
    ]
    assert dict(walk_files(root))["c/3.txt"].read_bytes() == b"c/3.txt"


def test_clean_member_name_refuses_absolute_and_parent_paths():
    assert clean_member_name("./train/cat/1.png") == "train/cat/1.png"
    assert clean_member_name("train\\cat\\.//1.png") == "train/cat/1.png"
    for name, why in (
        ("/x/cat/1.png", "an absolute path"),
        ("C:/x/1.png", "an absolute path"),
        ("../x/1.png", "'..'"),
        ("cat/../../1.png", "'..'"),
    ):
        with pytest.raises(UnsafeMemberNameError, match=why):
            clean_member_name(name)
    assert is_hidden("a/.b/c") and is_hidden("__MACOSX/a") and is_hidden("._x") and not is_hidden("a/b.c")


def test_archive_kind_by_magic_bytes_and_members(tmp_path):
    members = {"./cat/1.png": b"one", "/abs/2.png": b"two", "../up/3.png": b"three"}
    raw = tar_bytes(members)
    (tmp_path / "a.tar").write_bytes(raw)
    (tmp_path / "a.weird").write_bytes(gzip.compress(raw))  # the name does not matter
    (tmp_path / "a.tbz").write_bytes(bz2.compress(raw))
    (tmp_path / "a.txz").write_bytes(lzma.compress(raw))
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("dir/", b"")
    (tmp_path / "plain.gz").write_bytes(gzip.compress(b"not a tar" * 100))
    (tmp_path / "text.tar").write_text("just text")
    want = {"a.tar": "tar", "a.weird": "targz", "a.tbz": "targz", "a.txz": "targz", "a.zip": "zip"}
    for name, kind in want.items():
        assert archive_kind(tmp_path / name) == kind, name
        got = [(m.name, m.problem, m.raw, m.size) for m in iter_members(tmp_path / name)]
        assert got == [
            ("cat/1.png", None, "./cat/1.png", 3),
            (None, "an absolute path, not read", "/abs/2.png", 3),
            (None, "a '..' in its path, not read", "../up/3.png", 5),
        ], name
        assert [m.open().read() for m in iter_members(tmp_path / name)] == [b"one", b"two", b"three"]
    with open(tmp_path / "a.tar", "rb") as f:  # an uncompressed tar's offsets give random access
        m = next(iter_members(tmp_path / "a.tar"))
        f.seek(m.offset)
        assert f.read(m.size) == b"one"
    assert archive_kind(tmp_path / "plain.gz") is None and archive_kind(tmp_path / "text.tar") is None


def test_special_files_are_never_read(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    specials = [fifo] + [Path("/dev/zero")] * Path("/dev/zero").exists()
    for path in specials:
        assert archive_kind(path) is None
        for read in (read_head, read_file, content_digest):
            with pytest.raises(NotRegularFileError, match="not a regular file"):
                read(path)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 100_000)
    assert read_head(big, 10) == b"x" * 10 and len(read_file(big)) == 100_000


def test_existing_source_says_what_is_wrong_in_one_sentence(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "c").symlink_to(tmp_path / "gone")
    os.mkfifo(tmp_path / "pipe")
    cases = {
        tmp_path / "a": "is a symbolic link loop",
        tmp_path / "c": "is a broken symbolic link to .*gone",
        tmp_path / "nope": "does not exist",
        tmp_path / "pipe": r"is a FIFO \(named pipe\), not a regular file or folder",
    }
    if Path("/dev/zero").exists():
        cases[Path("/dev/zero")] = "is a character device, not a regular file or folder"
    for path, said in cases.items():
        with pytest.raises(
            UserError, match=rf"^data\.source {path} {said}; point it at a dataset file or folder \(HINT\)\.$"
        ):
            existing_source(path, "data.source", "HINT")
    assert existing_source(tmp_path, "k") == tmp_path


def test_content_digest_follows_content(tmp_path):
    root = write(tmp_path / "d", ["a/1.txt", "b/2.txt"])
    d0 = content_digest(root)
    assert d0 == content_digest(root) and len(d0) == 64
    (root / "a/loop").symlink_to(root)
    assert content_digest(root) == d0  # a loop adds nothing
    (root / "b/2.txt").write_bytes(b"longer content")
    assert content_digest(root) != d0
    assert content_digest(root / "a/1.txt") == hashlib.sha256(b"a/1.txt").hexdigest()


def test_an_encrypted_zip_member_is_an_archive_error(tmp_path):
    from onn.data.files import ARCHIVE_ERRORS

    path = tmp_path / "locked.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("cat/scan", b"\x89PNG\r\n\x1a\n" + bytes(64))
    raw = bytearray(path.read_bytes())
    for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # set the "encrypted" flag in both headers
        i = raw.index(sig) + at
        raw[i] |= 1
    path.write_bytes(raw)
    members = iter_members(path)
    with pytest.raises(ARCHIVE_ERRORS, match="encrypted"):
        next(members).open()


def test_a_zip_members_utf8_name_without_the_utf8_flag_is_read_as_utf8(tmp_path):
    """Info-ZIP's `zip` and macOS write UTF-8 names without the flag that says so; zipfile read them as cp437,
    so a class folder "zéro un" became "z├⌐ro un", a class the model trained on the folder had never seen."""
    import struct

    from onn.data.files import iter_members

    path = tmp_path / "classes.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("zéro un/1.wav", b"RIFF")
        zf.writestr("plain/2.wav", b"RIFF")
    data = bytearray(path.read_bytes())
    for signature, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # clear bit 11 in each header's flags
        start = 0
        while (start := data.find(signature, start)) != -1:
            (flags,) = struct.unpack_from("<H", data, start + at)
            struct.pack_into("<H", data, start + at, flags & ~0x800)
            start += 4
    path.write_bytes(bytes(data))
    assert "z├⌐ro un/1.wav" in zipfile.ZipFile(path).namelist()  # the premise: zipfile reads the name as cp437
    members = {m.name: m.open().read() for m in iter_members(path)}
    assert members == {"zéro un/1.wav": b"RIFF", "plain/2.wav": b"RIFF"}
