"""One process at a time in a folder: an advisory lock file (flock) that the kernel releases when its holder
exits, however it exits (kill -9 included), so a dead holder never blocks the next run and no stale-lock
guess is needed. Run folders take it without waiting (a second run into the same folder is refused); a
layer store's build waits for it (a second build finds the blocks the first wrote).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".onn.lock"


def try_hold(folder: str | os.PathLike) -> int | None:
    """Hold `folder`'s lock for the rest of this process (its file descriptor), or None if another process
    holds it now; the holder's pid is written into the lock file for the message that names it."""
    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def holder(folder: str | os.PathLike) -> str:
    """The pid written by the process that holds `folder`'s lock ("another process" if unreadable)."""
    try:
        return f"process {int((Path(folder) / LOCK_NAME).read_text())}"
    except (OSError, ValueError):
        return "another process"


@contextlib.contextmanager
def held(folder: str | os.PathLike, on_wait=None) -> Iterator[None]:
    """`folder`'s lock for the block, waiting for another holder to finish first (`on_wait()` is called once
    before waiting)."""
    fd = try_hold(folder)
    if fd is None:
        if on_wait is not None:
            on_wait()
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
