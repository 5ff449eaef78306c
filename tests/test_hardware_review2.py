"""The machine profile in containers and on shared nodes, as a second review found it: a cgroup limit above a lower one
of its parent's, a fractional CPU quota, CPUs this process may not use counted as its own, a hand-edited profile
cache, CUDA_VISIBLE_DEVICES naming no GPU of the machine, a paths.cache that cannot be made, and a disk probe larger
than the memory a container leaves."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from conftest import compose

from onn.errors import UserError
from onn.hardware import profile
from onn.hardware.memory import PeakMemory, anon_rss_mb
from onn.hardware.profile import VERSION, Profile, machine_fingerprint, now, resolve

MiB = 2**20


def _in_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own: str) -> Path:
    """A cgroup v2 tree under tmp_path, with this process in its cgroup `own` (as /proc/self/cgroup would say)."""
    (tmp_path / "self_cgroup").write_text(f"0::{own}\n")
    monkeypatch.setattr(profile, "CGROUP", tmp_path / "fs")
    monkeypatch.setattr(profile, "OWN_CGROUP", tmp_path / "self_cgroup")
    folder = tmp_path / "fs" / own.lstrip("/")
    folder.mkdir(parents=True)
    return folder


def test_a_parents_lower_cgroup_limit_holds_below_a_higher_one_of_its_own(tmp_path, monkeypatch):
    """The kernel holds a cgroup to every limit above it: a systemd slice's MemoryMax and CPUQuota under a scope that
    sets higher ones. Only the innermost was read, so the plan took 2 GB and 4 cores where the slice allowed 1 GB and 1
    core, and the OOM killer (or the quota's stalls) had the last word."""
    host_mb, cores = profile.host_memory_mb(), profile.usable_cores()
    scope = _in_cgroup(tmp_path, monkeypatch, "/user.slice/run.scope")
    slice_ = scope.parent
    (slice_ / "memory.max").write_text(f"{1024 * MiB}\n")
    (slice_ / "memory.current").write_text(f"{900 * MiB}\n")  # the slice's other scopes hold most of it
    (slice_ / "cpu.max").write_text("100000 100000\n")
    (scope / "memory.max").write_text(f"{2048 * MiB}\n")
    (scope / "memory.current").write_text(f"{100 * MiB}\n")
    (scope / "cpu.max").write_text("400000 100000\n")
    assert profile.host_memory_mb() == min(1024, host_mb)
    assert profile.available_memory_mb() <= 124
    assert profile.usable_cores() == 1 <= cores


def test_a_fractional_cpu_quota_gives_each_thread_its_share(tmp_path, monkeypatch):
    """Under `--cpus=0.1` the one thread runs a tenth of the time, but the profile's rates are the best of trials
    shorter than the quota's 100 ms period, and the share was 1 unless other processes kept the cores busy: the plan
    predicted a step ten times too fast."""
    folder = _in_cgroup(tmp_path, monkeypatch, "/")
    (folder / "cpu.max").write_text("10000 100000\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert profile.usable_cores() == 1
    assert now("cpu", tmp_path / "cache")["cpu_share"] <= 0.1


def _stat(idle_cpu: int, cpus: int, seconds: int) -> str:
    """/proc/stat after `seconds` of 100 ticks: `idle_cpu` idle, each of the other `cpus` busy (user time)."""
    rows = [[0 if i == idle_cpu else 100 * seconds, 0, 0, 100 * seconds if i == idle_cpu else 0, 0, 0, 0, 0, 0, 0]
            for i in range(cpus)]  # fmt: skip
    total = [sum(column) for column in zip(*rows)]
    lines = ["cpu  " + " ".join(map(str, total))] + [f"cpu{i} " + " ".join(map(str, r)) for i, r in enumerate(rows)]
    return "\n".join([*lines, "procs_running 1", "procs_blocked 0"]) + "\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs taskset")
def test_other_processes_on_cpus_this_one_may_not_use_take_none_of_its_cores(tmp_path, monkeypatch):
    """A process pinned to one CPU (taskset, a SLURM job's or a container's cpuset) of a node whose other CPUs are
    busy: /proc/stat's machine-wide line, scaled to its one core, read that core as 3/4 busy (62 busy CPUs of 64 left
    a job pinned to 2 idle ones one thread). Its own CPU's line says it is free."""
    before = os.sched_getaffinity(0)
    mine = min(before)
    cpus = max(4, mine + 2)
    stat = tmp_path / "stat"
    stat.write_text(_stat(mine, cpus, 1000))
    monkeypatch.setattr(profile, "PROC_STAT", stat)

    def later() -> None:  # the counters move on while cpu_load samples them
        time.sleep(0.25)
        (tmp_path / "stat.new").write_text(_stat(mine, cpus, 1001))
        (tmp_path / "stat.new").replace(stat)

    os.sched_setaffinity(0, {mine})
    writer = threading.Thread(target=later)
    try:
        writer.start()
        busy, _ = profile.cpu_load(1.0)
    finally:
        writer.join()
        os.sched_setaffinity(0, before)
    assert busy < 0.1


def _profile_fields(path: Path) -> dict:
    """A profile as a measured one is cached: every kind of field (numbers, nested rate tables) filled."""
    hw = resolve(compose("hardware=cpu_16gb").hardware, path, path)
    rates = {"4096": {"float32": {"1": {"1": 20.5, "16": 60.0}, "2": {"1": 30.0, "16": 110.0}}}}
    return {
        **hw.as_dict(),
        "name": "auto",
        "version": VERSION,
        "fingerprint": machine_fingerprint(),
        "source": None,
        "busy_while_measuring": 0.0,
        "matmul_gflops": rates,
        "block_call_s": {"forward": 0.0001, "full": 0.0004, "lora": 0.0003, "step": 0.0},
        "decode_gvalues_s": {"int8->bfloat16": 1.5},
    }


@pytest.mark.parametrize(
    "edit",
    [
        {"cpu_cores": "two"},
        {"matmul_gflops": {"4096": "fast"}},
        {"busy_while_measuring": "0.2"},  # compared with 0.5 at every later run's read: a TypeError
        {"block_call_s": {"forward": -1.0}},
        {"host_memory_available_mb": None, "disk_read_mb_s": float("nan")},
        {"accelerator": "gpu"},
    ],
)
def test_a_cached_value_not_of_its_fields_type_is_not_read(tmp_path, edit):
    """A hand-edited cache file was read as this machine's profile whatever its values, and failed in the planner."""
    values = _profile_fields(tmp_path)
    assert Profile.from_cache(values) is not None  # a well-formed one is read
    assert Profile.from_cache(json.loads(json.dumps({**values, **edit}))) is None


def test_a_hand_edited_profile_cache_is_measured_again_not_a_traceback(tmp_path, monkeypatch):
    """A cache file whose values are not of their fields' types failed with a traceback in every later run (here the
    check of the cache itself: "0.2" < 0.5) until someone deleted the file; it is measured again and rewritten."""
    values = _profile_fields(tmp_path)
    cache = tmp_path / "hardware" / f"{machine_fingerprint()}.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({**values, "busy_while_measuring": "0.2", "cpu_cores": "two"}))
    measured = Profile(**values)
    monkeypatch.setattr(profile, "measure", lambda *args: measured)  # measuring itself is another test's
    auto = compose("hardware=auto", f"hardware.cache={cache.parent}").hardware
    assert resolve(auto, tmp_path / "cache", tmp_path).source == "measured"
    assert Profile.from_cache(json.loads(cache.read_text())) is not None  # written again, well-formed


def test_cuda_visible_devices_that_names_no_gpu_of_the_machine_says_so(tmp_path, monkeypatch):
    """CUDA stops at the first entry of CUDA_VISIBLE_DEVICES that names no GPU: "7" on a machine of two, or SLURM's
    "NoDevFiles", hides them all, and the run trained on the CPU without a word (only "" and "-1" were said)."""
    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (gpus / bus).mkdir(parents=True)
    monkeypatch.setattr(profile, "NVIDIA_GPUS", gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert now("cpu", tmp_path / "cache")["gpus_hidden"] is True
    hidden = {
        v: profile.hides_every_gpu(v, profile.gpu_count()) for v in ("NoDevFiles", "-1", "", "1", "0,7", "GPU-8d")
    }
    assert hidden == {"NoDevFiles": True, "-1": True, "": True, "1": False, "0,7": False, "GPU-8d": False}


def test_a_disk_probe_in_a_folder_that_cannot_be_written_is_not_told_to_free_space(tmp_path):
    """paths.cache under a file (or on a read-only disk) was told to "free some space on that disk"."""
    (tmp_path / "a_file").write_text("")
    stores = tmp_path / "a_file" / "cache"
    auto = compose("hardware=auto", "hardware.disk_probe_mb=1", f"hardware.cache={tmp_path / 'hardware'}").hardware
    with pytest.raises(UserError, match=r"paths\.cache \(ONN_CACHE\) to a folder you can write") as refused:
        resolve(auto, stores)
    assert "free some space" not in str(refused.value)


def test_a_cached_profile_plans_where_paths_cache_cannot_be_made(tmp_path):
    """With this machine's profile cached in hardware.cache, a paths.cache that cannot be made (under a file, on a
    read-only disk) ended every run, `task=plan` included, in a NotADirectoryError traceback while reading free disk."""
    folder = tmp_path / "hardware"
    folder.mkdir()
    (folder / f"{machine_fingerprint()}.json").write_text(json.dumps(_profile_fields(tmp_path)))
    (tmp_path / "a_file").write_text("")
    auto = compose("hardware=auto", f"hardware.cache={folder}").hardware
    hw = resolve(auto, tmp_path / "a_file" / "cache")
    assert hw.source.startswith("cache") and hw.disk_free_mb > 0


def test_the_disk_probe_fits_the_memory_a_container_leaves(tmp_path, monkeypatch):
    """The disk probe reads its whole file (1 GB by default) into one buffer: in a container of 1 GB the OOM killer
    ended the run while it was being profiled, without a word. It takes at most a quarter of the available memory."""
    folder = _in_cgroup(tmp_path, monkeypatch, "/")
    (folder / "memory.max").write_text(f"{256 * MiB}\n")
    (folder / "memory.current").write_text("0\n")
    with PeakMemory("cpu", interval_s=0.005) as peak:
        before = anon_rss_mb()
        assert profile.disk_read_mb_s(tmp_path / "cache", 1024) > 0
    assert peak.peak_mb - before < 200
