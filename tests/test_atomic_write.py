"""write_text_atomically under threads of one process, failures, and power loss (its syncs)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from onn.hardware import disk

THREADS, WRITES, SIZE = 8, 50, 64 * 1024


def test_threads_writing_one_path_each_leave_a_whole_text(tmp_path: Path) -> None:
    """The temporary file was named by the process only: threads writing the same path shared it, so one renamed
    another's half-written text into place, or found it gone (FileNotFoundError, as a 'cannot write' UserError)."""
    path = tmp_path / "profile.json"
    first = "start:" + "s" * SIZE
    disk.write_text_atomically(path, first)
    texts = {first} | {f"{t}-{i}:" + chr(ord("a") + t) * (SIZE + i) for t in range(THREADS) for i in range(WRITES)}
    errors: list[BaseException] = []
    torn: list[int] = []
    done = threading.Event()

    def write(t: int) -> None:
        try:
            for i in range(WRITES):
                disk.write_text_atomically(path, f"{t}-{i}:" + chr(ord("a") + t) * (SIZE + i))
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    def read() -> None:
        while not done.is_set():
            seen = path.read_text()
            if seen not in texts:
                torn.append(len(seen))

    writers = [threading.Thread(target=write, args=(t,)) for t in range(THREADS)]
    reader = threading.Thread(target=read)
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    done.set()
    reader.join()
    assert errors == [] and torn == []
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left


def test_a_text_that_cannot_be_encoded_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    """A failure that is not the disk's (here a lone surrogate no encoder writes) left the temporary file behind."""
    path = tmp_path / "plan.yaml"
    disk.write_text_atomically(path, "old: 1\n")
    with pytest.raises(UnicodeEncodeError):
        disk.write_text_atomically(path, "new: \ud800\n")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"] and path.read_text() == "old: 1\n"


def test_the_file_and_then_its_folder_are_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the file synced before the rename, or the folder after it, a power loss could leave an empty file
    or the old one. os.fsync still syncs; the test only notes what each call synced and what the path held then."""
    path = tmp_path / "sub" / "config.yaml"
    synced: list[tuple[bool, int, str | None]] = []
    real_fsync = os.fsync

    def noting_fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino, path.read_text() if path.exists() else None))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", noting_fsync)
    disk.write_text_atomically(path, "a: 1\n")
    file_ino, folder_ino = path.stat().st_ino, path.parent.stat().st_ino
    assert synced == [(False, file_ino, None), (True, folder_ino, "a: 1\n")]
