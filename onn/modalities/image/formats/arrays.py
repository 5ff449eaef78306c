"""What the array formats (idx, cifar_binary, svhn_mat, stl10_binary) share: gathering their files from a
folder, from next to the one file named, or from an archive (read into memory), and small readers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from onn.data.files import (
    ARCHIVE_ERRORS,
    archive_kind,
    is_hidden,
    iter_members,
    read_file,
    read_head,
    walk_files,
)
from onn.errors import UserError
from onn.modalities.image.formats.common import base, is_pickled, log, refuse_pickled


def gather(path: Path, wanted: Callable[[str], bool], key: str):
    """The candidate files of an array format as {relative name: Path or bytes}, the one file asked for
    when the source is a file (else None), and a description of where they are, for messages. From an
    archive, only the members `wanted` accepts are read; beside one file, only it and the files `wanted`
    accepts (its IDX labels, STL-10's train_y.bin, CIFAR's batches.meta.txt) are given: exactly what the
    reader may read, so source_digest keys the cache on them too."""
    if path.is_dir():
        return dict(walk_files(path, max_depth=2)), None, str(path)
    kind = archive_kind(path)
    if kind is None:
        beside = {p.name: p for p in path.parent.iterdir() if p.is_file() and not is_hidden(p.name) and wanted(p.name)}
        return {**beside, path.name: path}, path.name, str(path.parent)
    files: dict[str, Path | bytes] = {}
    unsafe: list[str] = []
    try:
        for m in iter_members(path, kind):
            if is_pickled(m.name or m.raw):
                refuse_pickled(str(path), key)
            if m.name is None:
                unsafe.append(f"{m.raw} ({m.problem})")
            elif not is_hidden(m.name) and wanted(m.name):
                with m.open() as f:
                    files[m.name] = f.read()
    except ARCHIVE_ERRORS as e:
        raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    if unsafe:
        log.warning("Ignored %d members of %s: %s", len(unsafe), path, "; ".join(unsafe[:3]))
    return files, None, str(path)


def label_of(where: str, name: str, src: Path | bytes) -> str:
    """How messages name a gathered file: its path, or archive:member."""
    return str(src) if isinstance(src, Path) else f"{where}:{name}"


def nbytes(src: Path | bytes) -> int:
    return src.stat().st_size if isinstance(src, Path) else len(src)


def head_bytes(src: Path | bytes, n: int) -> bytes:
    return src[:n] if isinstance(src, bytes) else read_head(src, n)


def text_lines(src: Path | bytes) -> list[str]:
    """The non-empty lines of a small text file (class names)."""
    data = read_file(src) if isinstance(src, Path) else src
    return [ln.strip() for ln in data.decode("utf-8", errors="replace").splitlines() if ln.strip()]


def by_base(files: dict[str, Path | bytes]) -> dict[str, tuple[str, Path | bytes]]:
    """{lower-cased file name: (relative name, file)}, the shallowest first when a name repeats."""
    out: dict[str, tuple[str, Path | bytes]] = {}
    for name in sorted(files, key=lambda n: (n.count("/"), n)):
        out.setdefault(base(name), (name, files[name]))
    return out
