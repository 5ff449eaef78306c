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


def test_docs_config_lists_every_option_task_recipe_and_top_level_key():
    """docs/config.md's lists drifted from conf/: twelve models, seven tasks, six recipes and two top-level keys
    were missing while the README used some of them."""
    from dataclasses import fields

    from onn.config.run import ONNConfig

    doc = (ROOT / "docs" / "config.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| ")}
    missing = [
        f"{group}={path.stem}"
        for group in ("model", "task", "data", "strategy", "export", "tracking", "hardware")
        for path in sorted((ROOT / "conf" / group).glob("*.yaml"))
        if f"`{path.stem}`" not in rows[group]
    ]
    missing += [f"recipe={p.stem}" for p in sorted((ROOT / "recipes").glob("*.yaml")) if f"| `{p.stem}` |" not in doc]
    groups = {"model", "task", "data", "strategy", "export", "tracking", "hardware", "trainer"}
    missing += [f.name for f in fields(ONNConfig) if f.name not in groups and f"`{f.name}`" not in rows]
    assert not missing, f"docs/config.md does not list: {', '.join(missing)}"
