"""Folders an export replaces whole: written beside their place, then renamed into it, so a failed export leaves
no half folder and an earlier export intact (hf.py's Hugging Face folder and adapter, a pipeline's pieces)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onn.errors import UserError


def stage(output: Path, marker: str, write: Callable[[Path], Any]) -> tuple[Path, Any]:
    """Run `write` into a temporary sibling of `output`; return it (for swap_in) and what `write` returned.
    `output` may be missing, empty, or an earlier export (it holds `marker`): anything else is refused first."""
    output = output.expanduser()
    if not output.parent.is_dir():
        raise UserError(
            f"export output {output}: its folder {output.parent} does not exist; create it or choose another path."
        )
    if output.exists() and not (output.is_dir() and (not any(output.iterdir()) or (output / marker).is_file())):
        raise UserError(
            f"export output {output} exists and is not an earlier export (no {marker}); "
            "choose another path or remove it."
        )
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        return tmp, write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(tmp: Path, output: Path) -> None:
    """Put the staged folder at `output`, the earlier one (if any) removed only once the new one is there."""
    output = output.expanduser()
    old = output.parent / f".{output.name}.old-{os.getpid()}" if output.exists() else None
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


def write_atomically(output: Path, marker: str, write: Callable[[Path], Any]) -> Any:
    """`write` into a temporary sibling folder, renamed to `output` only when it succeeded."""
    tmp, result = stage(output, marker, write)
    swap_in(tmp, output)
    return result
