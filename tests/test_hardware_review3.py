"""The hardware layer as a third review found it: lock files on a full disk, lock files another user made or the umask
should have shaped, and a disk probe of no size."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from onn.config.hardware import HardwareConfig
from onn.errors import UserError
from onn.hardware.locks import LOCK_NAME, held, holder, try_hold
from onn.hardware.profile import resolve

NOBODY = 65534


def _in_child(work: Callable[[], str], as_nobody: bool = False) -> str:
    """What `work` returns in a forked child (or the error it raised, named): a process of its own, so that its file
    size limit, its user and the lock descriptors it leaves open end with it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            os.close(read)
            if as_nobody and os.geteuid() == 0:  # root reads and writes any file: be a user who cannot
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            try:
                answer = work()
            except Exception as error:  # noqa: BLE001 - the parent asserts on what happened
                answer = f"{type(error).__name__}: {error}"
            os.write(write, answer.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        answer = f.read()
    os.waitpid(pid, 0)
    return answer


def test_a_disk_that_refuses_the_holders_pid_still_locks_and_lets_go(tmp_path: Path) -> None:
    """A full disk refuses even the few bytes of the holder's pid: try_hold raised after taking the lock and left it
    held by a descriptor nothing closed, so the layer store's build failed, and the next run in the same process (a
    sweep's job measuring the machine again, its profile unsaved on that disk) waited for the lock forever. A file
    size limit of 0 makes the kernel refuse the write as a full disk does."""

    def hold_twice() -> str:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the child
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        with held(tmp_path):
            pass
        again = try_hold(tmp_path)  # released: this process takes it again at once
        return "held, released, held again" if again is not None else "still held after the block"

    assert _in_child(hold_twice) == "held, released, held again"
    assert (tmp_path / LOCK_NAME).read_text() == ""  # no pid: the holder reads as "another process"


@contextlib.contextmanager
def _shared_folder() -> Iterator[Path]:
    """A folder every user may write (a team's shared cache), outside pytest's own temporary folders (which only
    their owner may enter)."""
    folder = Path(tempfile.mkdtemp(prefix="onn-shared-"))
    try:
        folder.chmod(0o777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a process of another user")
def test_a_lock_file_this_user_may_only_read_still_locks_its_folder() -> None:
    """Another user's run made the lock file of a shared layer store (or hardware cache), which this user may read but
    not write: opening it for writing raised PermissionError, and the store's build was refused as unusable. flock
    needs no write access, and the lock still keeps a second holder out."""
    with _shared_folder() as folder:
        (folder / LOCK_NAME).write_text("12345")
        (folder / LOCK_NAME).chmod(0o444)

        def hold() -> str:
            first = try_hold(folder)
            second = try_hold(folder)  # another descriptor, as another process would open it
            return f"first {'held' if first is not None else 'refused'}, second {'held' if second else 'refused'}"

        assert _in_child(hold, as_nobody=True) == "first held, second refused"


def test_a_lock_file_is_made_with_the_mode_the_umask_leaves(tmp_path: Path) -> None:
    """A team sharing a cache under umask 002 writes each other's files: the lock file was made 0o644 whatever the
    umask, and the next user of the group could not open it for writing."""
    before = os.umask(0o002)
    try:
        fd = try_hold(tmp_path)
    finally:
        os.umask(before)
    assert fd is not None
    os.close(fd)
    assert stat.S_IMODE((tmp_path / LOCK_NAME).stat().st_mode) == 0o664


@pytest.mark.parametrize("size", [0, -5])
def test_a_disk_probe_of_no_size_is_one_sentence(tmp_path: Path, size: int) -> None:
    """hardware.disk_probe_mb=0 (to skip the probe, say) measured the disk with a 1 MB file, whose latency was then
    cached as this disk's bandwidth and planned from; a sentence before anything is measured."""
    hardware = HardwareConfig(name="auto", measure=True, budget_mb=None, disk_probe_mb=size, cache=str(tmp_path))
    with pytest.raises(UserError, match=rf"hardware.disk_probe_mb={size}: give"):
        resolve(hardware, tmp_path, tmp_path)


def test_the_holder_named_is_a_running_process_not_an_earlier_holders_stale_pid(tmp_path: Path) -> None:
    """A holder that could not write its pid (a read-only lock file, a full disk) leaves an earlier holder's there:
    the message named that process, which a user told to stop it might kill. A pid that runs no process is not named."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that ran and is gone
    (tmp_path / LOCK_NAME).write_text(str(child.pid))
    assert holder(tmp_path) == "another process"
    (tmp_path / LOCK_NAME).write_text(str(os.getpid()))
    assert holder(tmp_path) == f"process {os.getpid()}"
    (tmp_path / LOCK_NAME).write_text("0")
    assert holder(tmp_path) == "another process"


@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="the kernel's lock table (/proc/locks) is Linux's")
def test_the_holder_named_is_the_one_the_kernel_names_not_a_live_earlier_holders_pid(tmp_path: Path) -> None:
    """A holder that could not write its pid leaves an earlier holder's there, which may still run (a sweep's parent,
    a notebook) and hold nothing: the message named it. The kernel's lock table names the process that holds it."""
    (tmp_path / LOCK_NAME).write_text(str(os.getpid()))  # this process held it once, and runs on
    script = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / LOCK_NAME)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"  # held without writing its pid, as over a read-only lock file
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert try_hold(tmp_path) is None
        assert holder(tmp_path) == f"process {child.pid}"
    finally:
        child.kill()
        child.wait()
