"""One process at a time in a folder: an advisory lock file (flock) that the kernel releases when its holder
exits, however it exits (kill -9 included), so a dead holder never blocks the next run and no stale-lock
guess is needed. Run folders take it without waiting (a second run into the same folder is refused); a
layer store's build waits for it (a second build finds the blocks the first wrote).

A file system without locks (NFS mounted `nolock`, some FUSE and SMB mounts: flock raises ENOLCK, EOPNOTSUPP or
ENOSYS) gets no lock: the run goes on, said once per folder, and a second run there is not kept out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_NAME = ".onn.lock"
# what flock raises where the file system has no locks, as opposed to a lock another process holds
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}

log = logging.getLogger("onn")
_unlocked_said: set[str] = set()  # the lock files already said to be unsupported, each said once
# this process's lock descriptors and the file each is open on, which a forked child closes (_close_in_child)
_open_locks: dict[int, tuple[int, int]] = {}


def _opened(fd: int) -> None:
    st = os.fstat(fd)
    _open_locks[fd] = (st.st_dev, st.st_ino)


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) shares its parent's open lock files, and a flock lock lasts while any
    descriptor of it is open: a child forked while a decode held its lock kept it until the child ended. The
    child closes its copies; the parent's hold is unchanged. Only a descriptor still open on its lock file is
    closed: one its holder closed itself (os.close on try_hold's) may since name another file, such as the pipe
    the child was forked to write to."""
    for fd, file in list(_open_locks.items()):
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == file:
                os.close(fd)
    _open_locks.clear()


os.register_at_fork(after_in_child=_close_in_child)


def try_hold(folder: str | os.PathLike, name: str = LOCK_NAME) -> int | None:
    """Hold `folder`'s lock (the lock file `name` in it) for the rest of this process (its file descriptor), or
    None if another process holds it now; the holder's pid is written into the lock file for the message that
    names it."""
    fd = _open(Path(folder) / name)
    try:
        _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, Path(folder) / name)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    _write_pid(fd)
    _opened(fd)
    return fd


def _open(path: Path) -> int:
    """The lock file's descriptor, the file made where missing with the mode the umask leaves (a team's shared cache
    under umask 002 lets the group lock it too: a fixed 0o644 left another user's run refused with "Permission
    denied" in a folder it may write). A lock file this process may only read (another user's, a read-only mount) is
    opened read-only: flock locks through any descriptor."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS) or not path.is_file():
            raise
    return os.open(path, os.O_RDONLY)


def _write_pid(fd: int) -> None:
    """The holder's pid, for the message that names it (`holder`). A disk that refuses even these bytes (full, or a
    read-only lock file) leaves the lock held without it: raising here left the lock held by a descriptor nothing
    closed, and the next run in this process (a sweep's job) waited for it forever."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())


def _flock(fd: int, operation: int, path: Path) -> None:
    """flock, or nothing where the file system has no locks (said once for `path`); BlockingIOError when another
    process holds the lock and `operation` does not wait, any other OSError as flock raised it."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise
        if str(path) not in _unlocked_said:
            _unlocked_said.add(str(path))
            log.warning(
                "%s cannot be locked (%s: the file system has no file locks, e.g. NFS mounted nolock): going on "
                "without the lock, so another run or layer store build in %s at the same time is not kept out; "
                "set paths.outputs and paths.cache (ONN_CACHE) to a local disk to have it.",
                path,
                e.strerror or errno.errorcode.get(e.errno, e.errno),
                path.parent,
            )


def holder(folder: str | os.PathLike) -> str:
    """The process that holds `folder`'s lock: the one the kernel names (/proc/locks), else the pid its holder wrote
    while that pid runs; "another process" where neither is known. A holder that could not write its own pid (a
    read-only lock file, a full disk) leaves an earlier holder's there, which names a process that holds nothing: a
    user told to stop it could stop an unrelated process."""
    path = Path(folder) / LOCK_NAME
    if (pid := kernel_holder(path)) is not None:
        return f"process {pid}"
    try:
        pid = int(path.read_text())
        if pid <= 0:  # (0 and below name process groups)
            return "another process"
        os.kill(pid, 0)  # PermissionError: running, as another user
    except PermissionError:
        return f"process {pid}"
    except (OSError, ValueError, OverflowError):
        return "another process"
    return f"process {pid}"


def kernel_holder(path: Path) -> int | None:
    """The pid Linux's /proc/locks names as holding `path`'s flock (its device and inode), None where there is no such
    file (another system) or line, or the holder's pid is not visible from here (another pid namespace)."""
    try:
        info = path.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    file = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for words in (line.split() for line in lines):  # `1: FLOCK  ADVISORY  WRITE 22015 fe:00:2146714 0 EOF`
        if len(words) > 5 and words[1] == "FLOCK" and words[5] == file and words[4].isdigit() and int(words[4]) > 0:
            return int(words[4])
    return None


@contextlib.contextmanager
def held(folder: str | os.PathLike, on_wait: Callable[[], None] | None = None, name: str = LOCK_NAME) -> Iterator[None]:
    """`folder`'s lock (the lock file `name` in it) for the block, waiting for another holder to finish first
    (`on_wait()` is called once before waiting)."""
    fd = try_hold(folder, name)
    if fd is None:
        if on_wait is not None:
            on_wait()
        fd = _open(Path(folder) / name)
        try:
            _flock(fd, fcntl.LOCK_EX, Path(folder) / name)
        except OSError:
            os.close(fd)
            raise
        _opened(fd)
    try:
        yield
    finally:
        _open_locks.pop(fd, None)
        with contextlib.suppress(OSError):  # for every copy: one a child forked while this waited shares it
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
