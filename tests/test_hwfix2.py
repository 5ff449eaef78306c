"""The machine profile as a hardware review found it: hardware.cache naming the run's own folder hung the run, a killed
run's disk probe file stayed on disk, a cgroup memory limit lowered within one fingerprint bucket kept the cached
higher figure, and a probe cut short by a nearly full disk (or little memory) was cached under the full probe's key."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from onn.config.hardware import HardwareConfig
from onn.hardware import profile
from onn.hardware.disk import read_mb_s
from onn.hardware.profile import VERSION, Profile, disk_key, machine_fingerprint, resolve

MiB = 2**20


def _auto(cache: Path, probe_mb: int) -> HardwareConfig:
    return HardwareConfig(name="auto", measure=True, budget_mb=None, cache=str(cache), disk_probe_mb=probe_mb)


def _cache(folder: Path, table: dict[str, float], **fields: float) -> Path:
    """This machine's cached profile in `folder`, with `table` as its disk figures (a disk it lacks is probed)."""
    values = Profile(name="auto", accelerator="cpu", version=VERSION, busy_while_measuring=0.0, **fields).as_dict()
    values.update(fingerprint=machine_fingerprint(), disk_read_by_device=table)
    cache = folder / f"{machine_fingerprint()}.json"
    folder.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(values))
    return cache


def _in_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit_mb: int) -> Path:
    """A cgroup v2 tree under tmp_path holding this process, its memory.max `limit_mb`."""
    (tmp_path / "self_cgroup").write_text("0::/job\n")
    monkeypatch.setattr(profile, "CGROUP", tmp_path / "fs")
    monkeypatch.setattr(profile, "OWN_CGROUP", tmp_path / "self_cgroup")
    folder = tmp_path / "fs" / "job"
    folder.mkdir(parents=True)
    (folder / "memory.max").write_text(f"{limit_mb * MiB}\n")
    return folder


SELF_LOCK = """
import json, sys
from pathlib import Path
from onn.config.hardware import HardwareConfig
from onn.hardware.profile import VERSION, Profile, machine_fingerprint, resolve
from onn.tasks.record import hold_folder

run = Path(sys.argv[1])
hold_folder(run, "hydra.run.dir")  # held for the process's life, as a run holds its folder
values = Profile(name="auto", accelerator="cpu", version=VERSION, busy_while_measuring=0.0).as_dict()
values.update(fingerprint=machine_fingerprint(), disk_read_by_device={})  # no figure for this disk: measured
(run / f"{machine_fingerprint()}.json").write_text(json.dumps(values))
hw = HardwareConfig(name="auto", measure=True, budget_mb=None, cache=str(run), disk_probe_mb=1)
print("resolved", resolve(hw, run).disk_read_mb_s > 0)
"""


@pytest.mark.slow  # a fresh interpreter importing torch: about 12 s on two busy cores
def test_a_hardware_cache_in_the_runs_own_folder_does_not_wait_on_the_runs_lock(tmp_path):
    """The profile took the folder's .onn.lock through a second descriptor while the run held it through its first:
    flock locks per open file, so the run waited on itself forever. The measuring lock has a file of its own."""
    run = subprocess.run(
        [sys.executable, "-c", SELF_LOCK, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=Path.cwd()
    )
    assert run.returncode == 0, run.stderr
    assert "resolved True" in run.stdout


def test_the_disk_probe_file_has_no_name_while_its_data_is_written(tmp_path):
    """Removed only in `finally`, a probe killed with SIGKILL (or by the OOM killer) stayed in paths.cache for good.
    Its name is removed before any byte is written, so a listing during the probe never shows a probe with data."""
    seen_with_data: list[str] = []
    polls = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal polls
        while not done.is_set():
            polls += 1
            for entry in os.scandir(tmp_path):
                try:
                    if entry.stat().st_size > 0:
                        seen_with_data.append(entry.name)
                except FileNotFoundError:  # removed between the listing and the stat
                    pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = read_mb_s(tmp_path, 64)
    finally:
        done.set()
        watcher.join()
    assert polls > 1 and seen_with_data == []
    assert list(tmp_path.iterdir()) == []
    figure, read_mb = result
    assert figure > 0 and read_mb == 64


def test_a_cgroup_limit_lowered_within_one_bucket_is_read_now(tmp_path, monkeypatch):
    """The fingerprint holds host_memory_mb // 256: a limit lowered from 1224 to 1034 MB kept the cached profile,
    whose 1224 MB the planner budgeted the host (and on CPUs the device) from. now() reads it each run."""
    job = _in_cgroup(tmp_path, monkeypatch, 1224)
    fingerprint = machine_fingerprint()
    cache = _cache(tmp_path / "hw", {disk_key(tmp_path, 1): 500.0}, host_memory_mb=1224, device_memory_mb=1224)
    (job / "memory.max").write_text(f"{1034 * MiB}\n")
    assert machine_fingerprint() == fingerprint  # the same bucket: the cached profile is read
    hw = resolve(_auto(cache.parent, 1), tmp_path)
    assert hw.source.startswith("cache") and hw.disk_read_mb_s == 500.0
    assert hw.host_memory_mb == 1034 and hw.device_memory_mb == 1034


def test_a_disk_probe_cut_below_the_floor_plans_this_run_but_is_not_cached(tmp_path, monkeypatch, caplog):
    """A probe cut to a quarter of the memory available (here 50 MB of the 128 asked) times mostly latency: cached
    under the full probe's key, it stayed for good. It plans this run, and the next run probes again."""
    _in_cgroup(tmp_path, monkeypatch, 200)  # a quarter of 200 MB available: a 50 MB probe
    cache = _cache(tmp_path / "hw", {})
    with caplog.at_level(logging.INFO, logger="onn"):
        hw = resolve(_auto(cache.parent, 128), tmp_path)
    assert hw.disk_read_mb_s > 0 and hw.source.endswith("measured")
    assert json.loads(cache.read_text())["disk_read_by_device"] == {}
    assert "read 50 MB of the 128 MB asked" in caplog.text and "not cached" in caplog.text
