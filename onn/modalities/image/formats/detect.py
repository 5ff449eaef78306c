"""Which of FORMATS a source is, from file names and magic bytes (data.format: auto)."""

from __future__ import annotations

from pathlib import Path

from onn.data.files import ARCHIVE_ERRORS, archive_kind, is_hidden, iter_members, read_head, walk_files
from onn.errors import UserError
from onn.modalities.image.formats.cifar_binary import is_cifar_name
from onn.modalities.image.formats.common import (
    HELP,
    SNIFF_BYTES,
    base,
    existing,
    image_kind,
    is_image_name,
    is_pickled,
    needs_sniffing,
    refuse_pickled,
    split_of,
)
from onn.modalities.image.formats.csvfile import TABLE_SUFFIXES
from onn.modalities.image.formats.folder import image_files
from onn.modalities.image.formats.idx import is_idx_name
from onn.modalities.image.formats.stl10_binary import STL_BIN

_PRIORITY = ("cifar_binary", "stl10_binary", "idx", "svhn_mat", "parquet")


def detect_format(source: str | Path) -> str:
    """Which of FORMATS a source is, from file names and magic bytes (a folder is looked at two levels deep)."""
    return detect(existing(source, "data.source"), "data.source")


def detect(path: Path, key: str) -> str:
    """detect_format of a checked path (see common.existing); messages name `key`."""
    return _detect_dir(path, key) if path.is_dir() else _detect_file(path, key)


def name_kind(name: str) -> str | None:
    """What one file name inside a folder or archive says about the format."""
    b = base(name)
    if is_pickled(name):
        return "pickled"
    if is_cifar_name(b):
        return "cifar_binary"
    if STL_BIN.fullmatch(b):
        return "stl10_binary"
    if is_idx_name(b):
        return "idx"
    if b.endswith(".mat"):
        return "svhn_mat"
    if b.endswith(".parquet"):
        return "parquet"
    if is_image_name(b):
        return "image"
    return None


def _classify(names: list[str], where: str, key: str) -> str | None:
    kinds = {name_kind(n) for n in names}
    bare = {base(n) for n in names if "." not in base(n)}
    if "pickled" in kinds or ("meta" in bare and bare & {"train", "test"}):
        refuse_pickled(where, key)
    return next((k for k in _PRIORITY if k in kinds), None)


def _detect_dir(path: Path, key: str) -> str:
    unreadable: list[str] = []  # said only when nothing is found: the listing that follows names them
    names = [rel for rel, _ in walk_files(path, max_depth=2, unreadable=unreadable)]
    fmt = _classify(names, str(path), key)
    if fmt:
        return fmt
    if any("/" not in n and n.lower().endswith((".csv", ".tsv")) and split_of(n) for n in names):
        return "csv"
    if any(True for _ in image_files(path, unreadable=[])):
        return "folder"
    named = [f"{path / rel}/: {why}" for rel, _, why in (e.partition("/: ") for e in unreadable[:3])]
    unread = f" (not read: {'; '.join(named)})" if named else ""
    raise UserError(f"{key} {path} holds no images or dataset files I recognise{unread}; {HELP}.")


def _detect_file(path: Path, key: str) -> str:
    name = path.name.lower()
    if is_pickled(name):
        refuse_pickled(str(path), key)
    head = read_head(path, 512)
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:4] in (b"\0\0\x08\x03", b"\0\0\x08\x01") or (head[:2] == b"\x1f\x8b" and is_idx_name(name)):
        return "idx"
    if name.endswith(".mat") or head.startswith(b"MATLAB"):
        return "svhn_mat"
    kind = name_kind(name)
    if kind in ("cifar_binary", "stl10_binary"):
        return kind
    if name.endswith(TABLE_SUFFIXES):
        return "csv"
    if kind == "image":
        return "image"
    archive = archive_kind(path)
    if archive:
        return _detect_archive(path, archive, key)
    if head[:1] == b"\x80" and "." not in name:
        if name in ("train", "test", "meta"):  # CIFAR-100's python version
            refuse_pickled(str(path), key)
        raise UserError(f"{key} {path} looks like a Python pickle, which ONN does not load (it can run code).")
    if image_kind(head[:SNIFF_BYTES]):
        return "image"
    try:
        from PIL import Image

        with Image.open(path):
            return "image"
    except Exception:
        pass
    raise UserError(f"{key} {path}: cannot tell its format; {HELP}.")


def _detect_archive(path: Path, kind: str, key: str) -> str:
    names = []
    images = False
    members = iter_members(path, kind)
    try:
        for m in members:
            if m.name is None or is_hidden(m.name):
                continue
            names.append(m.name)
            k = name_kind(m.name)
            if k == "pickled":
                refuse_pickled(str(path), key)
            if k is None and not images and needs_sniffing(m.name):  # a picture without an image extension?
                with m.open() as f:
                    k = "image" if image_kind(f.read(SNIFF_BYTES)) else None
            images |= k == "image"
            if (kind != "zip" and k is not None) or len(names) >= 200_000:
                break  # a tar is read in order: the first telling member decides
    except ARCHIVE_ERRORS as e:
        raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    finally:
        members.close()
    fmt = _classify(names, str(path), key)
    if fmt:
        return fmt
    if images:
        return "archive"
    raise UserError(f"{key} {path} is an archive holding no images or dataset files I recognise; {HELP}.")
