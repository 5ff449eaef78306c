"""Review of the video, mesh and paired-data modalities as a user meets them (round 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "module, args",
    [
        ("onn.modalities.pairs.demo", ["shapes", "OUT", "abc"]),
        ("onn.modalities.pairs.demo", ["shapes", "OUT", "0"]),
        ("onn.modalities.mesh.primitives", ["OUT", "x"]),
    ],
)
def test_demo_writers_refuse_a_count_that_is_not_a_number_with_their_usage(tmp_path, module, args):
    """The documented generators (`python -m onn.modalities.pairs.demo shapes DIR 450`, `... mesh.primitives DIR
    20`) answered a count of `abc` with a ValueError traceback; they now print their usage line and write nothing."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", module, *[str(out) if a == "OUT" else a for a in args]]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and result.stderr.strip().startswith("usage: python -m " + module)
    assert not out.exists()
