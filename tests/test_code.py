"""The code's own house rules, checked: no function over 80 lines in the package, and no pickle in the repository."""

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

# what torch.save, Lightning's default checkpoint and pickle write: ONN writes safetensors only
PICKLED = (".ckpt", ".pt", ".pth", ".pkl", ".pickle")


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "onn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(
                    f"{Path(path).relative_to(ROOT)}:{node.lineno} {node.name} "
                    f"({node.end_lineno - node.lineno + 1} lines)"
                )
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_repository_tracks_no_pickled_file():
    """A Trainer left at its defaults writes pickled checkpoints where it runs (a test once did, and they were
    committed): the repository holds none."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pickled = [name for name in tracked.splitlines() if name.endswith(PICKLED)]
    assert not pickled, f"pickled files are tracked: {pickled}"
