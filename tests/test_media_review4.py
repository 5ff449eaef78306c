"""Review of the video, mesh and paired-data modalities as a user meets them (round 4)."""

from __future__ import annotations

import importlib.util
import runpy
import sys

import pytest


@pytest.mark.parametrize(
    "module, args",
    [
        ("onn.modalities.pairs.demo", ["shapes", "OUT", "abc"]),
        ("onn.modalities.pairs.demo", ["shapes", "OUT", "0"]),
        ("onn.modalities.mesh.primitives", ["OUT", "x"]),
    ],
)
def test_demo_writers_refuse_a_count_that_is_not_a_number_with_their_usage(tmp_path, monkeypatch, module, args):
    """The documented generators (`python -m onn.modalities.pairs.demo shapes DIR 450`, `... mesh.primitives DIR
    20`) answered a count of `abc` with a ValueError traceback; they now print their usage line and write nothing."""
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [module, *[str(out) if a == "OUT" else a for a in args]])
    with pytest.raises(SystemExit) as ended:  # `python -m MODULE ARGS`, in this interpreter (its imports are warm)
        runpy.run_path(importlib.util.find_spec(module).origin, run_name="__main__")
    assert str(ended.value.code).startswith("usage: python -m " + module)  # sys.exit(message): printed, exit 1
    assert not out.exists()
