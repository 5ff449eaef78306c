"""Shared helpers: compose ONN configs in-process, and run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onn.config import register

register()  # the config schema, as run.py registers it before Hydra composes
ROOT = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout; ONN_SHARED_DATA points elsewhere (a git worktree one level deeper)
SHARED_DATA = Path(os.environ.get("ONN_SHARED_DATA") or ROOT.parent / "shared" / "data")
# A sweep whose jobs write a bench record and whose Hydra callback writes the grid (tests' stand-in apps)
GRID_SWEEP_CONFIG = """x: 0
task:
  name: bench
hydra:
  callbacks:
    grid:
      _target_: onn.bench.grid.GridCallback
"""


def compose(*overrides: str, root: Path | None = None) -> dict:
    """The resolved config `python run.py OVERRIDES` would get (paths.root set, since no Hydra run exists)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={root or ROOT}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 600, python_warnings: str = "ignore"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": python_warnings}
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def hardware_profile_once(tmp_path_factory) -> None:
    """One hardware profile for the whole session, shared by its xdist workers: measuring one takes tens of
    seconds of both cores, and every run with a fresh outputs folder would measure it again."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hardware"
    os.environ.setdefault("ONN_HARDWARE_CACHE", str(folder))  # run_cli's subprocesses inherit it


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    return tmp_path / "outputs"
