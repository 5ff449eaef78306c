"""Reading files at the disk's speed: whole files into reused, aligned buffers, bypassing the page cache.

O_DIRECT lets the disk's DMA fill the caller's buffer: no copy through the page cache, and no page
cache filled with data that a model larger than RAM would evict again (other processes' pages with
it). Large requests keep the disk's queue full (on this project's virtual disks 1 GiB requests read
~15% faster than 64 MiB ones). Where a file system refuses O_DIRECT the file is read normally and
dropped from the page cache after. `read_mb_s` measures the same path on a fresh file, which is what
the hardware profile reports as the disk's bandwidth. Cache files (profiles, timings, tuning results) are
written whole or not at all, and one that is damaged reads as absent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from onn.errors import write_refused
from onn.hardware.memory import pinned_empty

log = logging.getLogger(__name__)

MB = 1024**2
ALIGN = 4096  # O_DIRECT wants buffer address, offset and length aligned to the disk's block size
READ_REQUEST = 1024 * MB  # bytes per read call


def write_text_atomically(path: Path, text: str, what: str = "it") -> None:
    """Whole or not at all: a run killed mid-write, a power loss, or two writers at once (processes, or threads of
    one: serve's requests, Lightning's callbacks) never leave a cut-short file. Each call writes its own temporary
    name (a name per process let one thread rename another's half-written file into place), synced before the
    rename and its folder synced after, so the rename outlives a power loss; the last rename wins. Any failure
    removes the temporary file; a write the disk refuses (full, read-only) is one sentence naming `path` (`what`:
    where to write it instead)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:16]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x") as f:  # "x": created here, never another writer's (mode 0o666 less the umask)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # its folder may be what could not be made
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_refused(e, path, len(text.encode(errors="replace")), what) from None
        raise
    try:  # the file is in place: a folder that will not sync leaves only its rename to the OS
        _sync_folder(path.parent)
    except OSError as e:
        log.warning("%s is written, but its folder could not be synced (%s): a power loss may undo the rename", path, e)


def _sync_folder(folder: Path) -> None:
    """Sync a folder's entries, so a rename into it survives a power loss. Windows cannot open a folder
    (PermissionError), and some file systems refuse to sync one (EINVAL): there the rename is left to the OS."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """A cache file's JSON, or None when it is absent or damaged: a cache is measured again, never half-trusted."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def buffer(size: int, pin: bool = False):
    """A uint8 tensor for `size` bytes of file, its start and length aligned for O_DIRECT."""
    import torch

    length = aligned(size)
    raw = pinned_empty(length + ALIGN) if pin else torch.empty(length + ALIGN, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % ALIGN
    return raw[offset : offset + length]


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def read_file(path: str | os.PathLike, into, size: int, direct: bool = True) -> bool:
    """Read the first `size` bytes of a file into the front of `into` (a buffer from `buffer`). With
    `direct` the page cache is bypassed (O_DIRECT); a file system that refuses it is read normally and
    its pages dropped after. Returns whether O_DIRECT was used (callers keep it for the next read)."""
    direct_fd = _open_direct(path) if direct else None
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return _read_opened(direct_fd, fd, into, size, path)
        finally:
            os.close(fd)
    finally:
        if direct_fd is not None:
            os.close(direct_fd)


def _read_all(fd: int, view: memoryview, length: int, size: int, path) -> None:
    pos = 0
    while pos < size:
        n = os.preadv(fd, [view[pos : min(length, pos + READ_REQUEST)]], pos)
        if n == 0:
            raise OSError(errno.EIO, f"{path} ended at byte {pos} of {size}")
        pos += n


def evict(path: str | os.PathLike) -> None:
    """Drop a file's pages from the OS page cache (Linux); a no-op where that is not possible."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_mb_s(folder: str | os.PathLike, size_mb: int = 1024) -> tuple[float, int]:
    """Cold sequential read bandwidth of the disk under `folder`, as the layer store reads, and the MB read: write a
    fresh file of `size_mb` (at most a twentieth of the free space, down to 1 MB: a floor of 16 MB ended a nearly full
    disk's run in ENOSPC), sync it, drop it from the page cache, read it whole with O_DIRECT into one buffer
    already touched (a fresh buffer's first-touch page faults read 3-4x slower than the disk). A file
    that large means the disk, not a cache. Its name is removed once its descriptors are open, so the kernel frees
    it however the run ends: removed in `finally`, a run killed with SIGKILL (or by the OOM killer) left up to 1 GB
    behind for good. A probe the disk refuses even so raises its OSError."""
    import shutil

    Path(folder).mkdir(parents=True, exist_ok=True)
    size_mb = max(1, min(size_mb, int(shutil.disk_usage(folder).free / MB / 20)))
    chunk = os.urandom(MB)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".onn-disk-probe-")
    try:
        direct_fd = _open_direct(path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(path)  # the file lives on while its descriptors are open, and no longer
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            for _ in range(size_mb):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = size_mb * MB
        into = buffer(size).fill_(0)  # touched first: the store reads into reused buffers, not fresh pages
        start = time.perf_counter()
        _read_opened(direct_fd, fd, into, size, path)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
    return size / MB / max(elapsed, 1e-9), size_mb


def _open_direct(path: str | os.PathLike) -> int | None:
    """An O_DIRECT descriptor reading `path`, or None where the file system (or OS) refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return None


def _read_opened(direct_fd: int | None, fd: int, into, size: int, path) -> bool:
    """read_file on descriptors already open (`direct_fd` O_DIRECT or None, `fd` a plain one of the same file): the
    disk probe's file has no name left to open by. Returns whether O_DIRECT was used."""
    view = memoryview(into.numpy())
    if direct_fd is not None:
        try:
            _read_all(direct_fd, view, aligned(size), size, path)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    _read_all(fd, view, size, size, path)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return False
