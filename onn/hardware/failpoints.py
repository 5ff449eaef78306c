"""Kill points for the fault harness (bench_chaos): ONN_FAILPOINT=NAME[:N] makes this process kill itself with
SIGKILL the N-th time (default 1) it reaches the point named NAME, as a failing machine would at that very
moment. Random kill times rarely land inside a short window (a checkpoint's rename, a layer store's block
write); a named point lands there every time. Unset, a point costs one dictionary lookup.

Points: checkpoint_write (the new checkpoint written beside the old, before the renames), store_write (a layer
store block written to its temporary file, before the rename that makes it whole), export_write (an ONNX or .omny
export's weights file moved beside the earlier export, before the rename of its graph; a folder export's new folder
written whole beside the earlier one, before the swap).
"""

from __future__ import annotations

import os
import re
import signal

from onn.errors import UserError

POINTS = ("checkpoint_write", "store_write", "export_write")
_counts: dict[str, int] = {}


def check() -> None:
    """ONN_FAILPOINT read once at a run's start: a mistyped one failed the run at its first checkpoint instead
    (its count read only there), or never fired without a word (an unknown point, or N of 0)."""
    wanted = os.environ.get("ONN_FAILPOINT")
    if wanted and not re.fullmatch(rf"({'|'.join(POINTS)})(:[1-9][0-9]*)?", wanted):
        raise UserError(f"ONN_FAILPOINT={wanted}: give {' or '.join(POINTS)}, each with :N (N 1 or more) or without.")


def reached(name: str) -> None:
    """Kill this process here when ONN_FAILPOINT names this point (and this is the N-th time it is reached)."""
    wanted = os.environ.get("ONN_FAILPOINT")
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
