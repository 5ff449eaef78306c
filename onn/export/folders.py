"""Folders an export replaces whole: written beside their place, then renamed into it, so a failed export leaves
no half folder and an earlier export intact (hf.py's Hugging Face folder and adapter, a pipeline's pieces, a dual
encoder's towers, a network's safetensors).

Every such folder holds MARKER, and only a folder holding it (or empty, or missing) is replaced: a folder of the
user's own (a Hugging Face model they downloaded, their notes beside it) is never taken for an earlier export, and
an export of another kind or model (MARKER's `kind` and `model`) is not replaced by this one."""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onn.errors import UserError
from onn.hardware import failpoints

MARKER = "onn_export.json"  # written into every folder an export replaces whole
# what an export leaves beside OUTPUT while it runs: .OUTPUT.tmp-PID[...] (temp_prefix) and .OUTPUT.old-PID (swap_in)
STARTED = time.time()  # (imported before this process writes any export) what is older is another process's
LEFTOVER = re.compile(r"(?P<kind>tmp|old)-(?P<pid>\d{1,7})(?:[.-].*)?")
PIPELINE = ("pipeline.json", "omny-pipeline")  # a pipeline folder written before MARKER existed: its file, format
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # Linux's renameat2: paths from the working folder; swap the two


def is_export(folder: Path) -> bool:
    """Whether `folder` is one ONN wrote (MARKER, or an earlier pipeline's own pipeline.json)."""
    if (folder / MARKER).is_file():
        return True
    try:
        return json.loads((folder / PIPELINE[0]).read_text()).get("format") == PIPELINE[1]
    except (OSError, ValueError, AttributeError):
        return False


def replaceable(output: Path) -> bool:
    """Whether an export may take `output`: missing, an empty folder, or an earlier export."""
    return not output.exists() or output.is_dir() and (not any(output.iterdir()) or is_export(output))


def held(folder: Path) -> tuple[str | None, str | None]:
    """(kind, model) of the export `folder` holds, as its MARKER says; a pipeline folder written before MARKER
    existed is a pipeline of the model its pipeline.json names; None where the folder does not say (an earlier ONN
    wrote no model into MARKER)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        return marker.get("kind"), marker.get("model")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return "pipeline", json.loads((folder / PIPELINE[0]).read_text())["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def check_replaceable(output: Path, kind: str | None = None, model: str | None = None) -> None:
    """Refuse, before anything is written, an `output` that is neither missing, empty nor an earlier export; and,
    given the `kind` and `model` of the export to write, an earlier export of another kind or model (a typo in
    export.output must not replace another model's export)."""
    output = output.expanduser()
    if not output.parent.is_dir():
        raise UserError(
            f"export output {output}: its folder {output.parent} does not exist; create it or choose another path."
        )
    if not replaceable(output):
        raise UserError(
            f"export output {output} exists and is not an earlier export (no {MARKER}, which ONN writes into every "
            "export folder); choose another path or remove it."
        )
    if kind is None or not output.is_dir():
        return
    their_kind, their_model = held(output)
    if (their_kind or kind) != kind or (model and their_model and their_model != model):
        theirs = (f"a {their_kind} export" if their_kind else "an export") + (
            f" of {their_model}" if their_model else ""
        )
        ours = f"this {kind} export" + (f" of {model}" if model else "")
        raise UserError(
            f"export output {output} holds {theirs}, not {ours}; choose another path or remove that folder."
        )


def temp_prefix(output: Path) -> str:
    """The path an export's temporary file or folder beside `output` starts with: it names this process, so a later
    export can tell the leftovers of one that was killed (`sweep_leftovers`) from those of one still running."""
    return str(output.parent / f".{output.name}.tmp-{os.getpid()}")


def sweep_leftovers(output: Path) -> None:
    """Remove what an export to `output` killed half-way left beside it (its temporary folder or file, which may
    hold gigabytes of weights, and was never removed), and put back an earlier export it had moved aside to swap
    in the new one. Only a dead process's leftovers are touched: another export to the same place may be running.
    One named with this process's id is an earlier process's (a container starts each run with the same id) when
    it is older than this process: newer, it is an export of this process still writing."""
    for path in output.parent.glob(f".{glob.escape(output.name)}.*-*"):
        found = LEFTOVER.fullmatch(path.name[len(output.name) + 2 :])
        if found is None or not ownerless(path, int(found["pid"])):
            continue
        if found["kind"] == "old" and not os.path.lexists(output):
            path.rename(output)  # killed between moving the earlier export aside and putting the new one there
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def ownerless(path: Path, pid: int) -> bool:
    """Whether `path`, named with process `pid`, is a leftover no running export writes: that process has ended, or
    it is this process's id and `path` is older than this process (an earlier one's, in a container)."""
    return process_gone(pid) or earlier_own(path, pid)


def earlier_own(path: Path, pid: int) -> bool:
    """Whether `path`, named with this process's id, is older than this process: an earlier one's, of that id."""
    return pid == os.getpid() and path.lstat().st_mtime < STARTED


def process_gone(pid: int) -> bool:
    """Whether process `pid` has ended. This process runs: a temporary of its own may belong to an export still
    writing (omny's writer sweeps while onnx_export's traced folder is open); its own ends clean up after themselves."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (PermissionError) another user's process, which is running
        return False
    return False


def stage(output: Path, kind: str, write: Callable[[Path], Any], model: str | None = None) -> tuple[Path, Any]:
    """Run `write` into a temporary sibling of `output` and mark it as a `kind` export of `model` (its config's
    name); return it (for swap_in) and what `write` returned. `output` may be missing, empty, or an earlier export
    of this kind and model: anything else is refused first."""
    output = output.expanduser()
    sweep_leftovers(output)
    check_replaceable(output, kind, model)
    tmp = Path(temp_prefix(output))
    tmp.mkdir()
    try:
        result = write(tmp)
        marker = {"written_by": "onn", "kind": kind, "model": model, "version": onn_version()}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        return tmp, result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(tmp: Path, output: Path) -> None:
    """Put the staged folder at `output`, the earlier one (if any) removed only once the new one is there. Swapped
    with the earlier one in one step where the system can (`exchange`), so `output` is at every moment one export
    whole; elsewhere the earlier one is renamed aside first, and a kill before the second rename leaves it beside
    `output`, which the next export puts back (sweep_leftovers)."""
    output = output.expanduser()
    failpoints.reached("export_write")  # the new folder whole beside the earlier one, before the swap
    try:
        swapped = output.is_dir() and exchange(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # not swapped: the staged export; or swapped: the earlier one
        raise
    if swapped:
        shutil.rmtree(tmp, ignore_errors=True)  # the earlier export, now under the staged name (or sweep_leftovers')
        return
    old = output.parent / f".{output.name}.old-{os.getpid()}" if output.exists() else None  # (LEFTOVER's name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    try:
        tmp.rename(output)
    except BaseException:
        if old is not None:
            old.rename(output)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Swap the folders at `a` and `b` in one rename (Linux's renameat2 with RENAME_EXCHANGE), so neither path is
    ever missing; False where the system has no such rename or refuses it. A refused swap changes nothing, whatever
    the reason (a file system without it, a sandbox whose seccomp profile predates it answers EPERM), so the caller's
    two renames run instead and say what is wrong, if anything is."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28 and later
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def write_atomically(
    output: Path,
    kind: str,
    write: Callable[[Path], Any],
    model: str | None = None,
    before_swap: Callable[[], None] | None = None,
) -> Any:
    """`write` into a temporary sibling folder, renamed to `output` (marked as a `kind` export of `model`) only when
    it succeeded. `before_swap` runs once the new folder is whole, right before the swap (hf.save_export takes the
    earlier adapter away there, so it is never beside weights it was not trained with)."""
    tmp, result = stage(output, kind, write, model)
    if before_swap is not None:
        try:
            before_swap()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    swap_in(tmp, output)
    return result


def onn_version() -> str:
    """ONN's version as pip installed it; "unknown" for a checkout used without `pip install -e`."""
    try:
        return importlib.metadata.version("onn")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
