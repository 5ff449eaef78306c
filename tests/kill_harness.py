"""The kill harness of the fault tests: work run in a forked child that is SIGKILLed just before its n-th change to
the file system, as a failing machine would kill it, so a test can check what each step leaves behind."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

CHANGES = {"os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "ctypes.call_function"}
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def changes_fs(event: str, args: tuple) -> bool:
    """Whether an audit event is a change to the file system: a rename, a removal, a folder made, a file opened for
    writing, or a foreign call (renameat2 through ctypes)."""
    if event == "open":
        mode, flags = args[1], args[2]
        return isinstance(mode, str) and any(c in mode for c in "wax+") or bool((flags or 0) & WRITES)
    return event in CHANGES


def killed_at(step: int, work: Callable[[], object], env: dict[str, str] | None = None) -> bool:
    """Run `work` in a forked child, SIGKILLed just before its `step`-th change to the file system (0: never; `env`
    set in it first); True where it was killed, False where `work` finished first."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(env or {})
            seen = 0

            def hook(event: str, args: tuple) -> None:
                nonlocal seen
                if step and changes_fs(event, args):
                    seen += 1
                    if seen == step:
                        os.kill(os.getpid(), signal.SIGKILL)

            sys.addaudithook(hook)
            work()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the work failed in the child"
    return False
