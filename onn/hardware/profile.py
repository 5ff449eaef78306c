"""Measure this machine (hardware=auto) or read a preset describing another one.

A profile (Profile) has the same fields either way, so the planner never asks where it
came from. Measuring takes half a minute on two cores; the result is cached under the cache folder,
keyed by a fingerprint of the machine (CPU model, core count, RAM, accelerators, torch version), with a disk
figure for each disk probed (a paths.cache on another disk measures that disk alone).
What changes from run to run is measured every time: memory (a cgroup limit) and free memory, free disk, and how
busy the cores are (other processes' CPU use over half a second), from which the planner sizes torch's
thread count.

What the planner predicts from (CPUs):
  matmul_gflops     {size: {dtype: {threads: {rows: GFLOP/s}}}}: a size x size weight (256 and 4096)
                    times `rows` rows, float32 and bfloat16, on one thread and on every core; best of
                    short trials, so a neighbour's burst does not count
  block_call_s      framework time of one decoder block per call (no FLOPs to speak of): forward
                    without grad, a full-training step and a LoRA step, from tiny Llamas of 2 and 10
                    blocks (the difference, so embeddings, loss and the rest cancel), and `step` the rest
  memory_gb_s       one thread copying a large buffer (bytes read + written per second)
  decode_gvalues_s  one thread turning stored values into compute values: {"int8->bfloat16": ...}
  norm_gb_s         {threads: GB/s} of a BatchNorm, LeakyReLU and max pool forward and backward over 16 MB, in
                    bytes as the planner counts a classifier network's memory-bound ops (OpBytes), on one
                    thread and on every core
  activation_ns     GPUs: a bf16 decoder block's kernels besides its matmuls (norms, rotary embedding,
                    attention, activation function, residuals, casts), in ns per activation value the
                    planner counts (10h + 4kv + 4i a token): without grad (`forward`), and forward and
                    backward of a frozen block (`train`, as a streamed step recomputes and back-propagates)
  disk_read_mb_s    cold sequential reads with O_DIRECT of a fresh file of `disk_probe_mb` under paths.cache,
                    as the layer store reads there (onn/hardware/disk.py)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path, PurePosixPath
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import psutil

from onn.config import HardwareConfig, as_dict
from onn.errors import UserError
from onn.hardware.cast import cast_scaled, fused_scale
from onn.hardware.disk import read_json, read_mb_s, write_text_atomically
from onn.hardware.locks import held
from onn.hardware.memory import pinned_empty

log = logging.getLogger("onn")
MB = 1024**2
PROFILE_KEYS = (
    "name", "accelerator", "device_name", "device_count", "device_memory_mb", "device_memory_free_mb",
    "host_memory_mb", "host_memory_available_mb", "cpu_cores", "matmul_tflops", "disk_read_mb_s", "h2d_mb_s", "bf16",
    "matmul_gflops", "block_call_s", "memory_gb_s", "decode_gvalues_s", "cuda_context_mb", "cuda_workspace_mb",
)  # fmt: skip
MATMUL_ROWS = (1, 16, 128, 1024)
MATMUL_SIZES = (256, 4096)
GPU_MATMUL_ROWS = (1, 16, 128, 1024, 8192)  # a token at a time up to a large micro-batch's tokens
VERSION = 11  # what `measure` records; a cached profile of another version is measured again
# A profile measured on busy cores is measured again once they are free, but not sooner than this after the last
# measurement: on a machine that is busy in bursts (a test suite, a sweep) every quiet moment would measure again.
REMEASURE_BUSY_AFTER_S = 1800.0
MEASURE_LOCK = ".hardware.lock"  # the lock file, in the hardware cache's folder, of the process that measures
# A disk probe cut below this (and below hardware.disk_probe_mb) by a nearly full disk or little memory times mostly
# latency: its figure plans this run but is not cached under the full probe's key, and the next run probes again.
SMALLEST_CACHED_PROBE_MB = 64


@dataclass
class Profile:
    """What the planner knows of a machine, measured or given by a preset: the same fields either way, so the
    planner never asks where they came from. A measurement a preset (or this machine) lacks is None."""

    name: str  # the preset's name, or "auto" for this machine measured
    accelerator: str  # cuda, mps or cpu
    device_name: str | None = None  # the GPU's name, or the CPU model
    device_count: int | None = None  # devices of that kind on this node
    device_memory_mb: float | None = None  # the device's total memory (the host's on CPUs and MPS)
    device_memory_free_mb: float | None = None  # free on the device now
    host_memory_mb: float | None = None  # the host's total memory
    host_memory_available_mb: float | None = None  # available on the host now
    cpu_cores: int | None = None  # the cores this process may use
    matmul_tflops: float | None = None  # the best dense matmul rate, TFLOP/s
    disk_read_mb_s: float | None = None  # cold sequential reads, as the layer store reads (disk.py)
    disk_read_by_device: dict[str, float] | None = None  # measured: {disk_key(): MB/s} of each disk probed
    h2d_mb_s: float | None = None  # pinned host memory to the GPU
    bf16: bool | None = None  # bf16 math the device runs fast
    matmul_gflops: dict[str, Any] | None = None  # {size: {dtype: {threads: {rows: GFLOP/s}}}}
    block_call_s: dict[str, float] | None = None  # framework time per decoder block and call
    memory_gb_s: float | None = None  # one thread's (or the GPU's) copy bandwidth
    norm_gb_s: dict[str, float] | None = None  # CPUs: {threads: GB/s} of norms, activations, pooling (norm_gb_s())
    decode_gvalues_s: dict[str, float] | None = None  # {"int8->bfloat16": G values/s, ...}
    activation_ns: dict[str, float] | None = None  # GPUs: a block's time besides matmuls, per activation value
    cuda_context_mb: float | None = None  # the CUDA context's own memory
    cuda_workspace_mb: float | None = None  # cuBLAS's workspaces, allocated once per process
    source: str | None = None  # preset, measured, or cache (<path>)
    budget_mb: float | None = None  # hardware.budget_mb: the memory the run may hold, as given
    version: int | None = None  # what `measure` recorded (VERSION); None for a preset
    fingerprint: str | None = None  # machine_fingerprint() of the machine measured
    busy_while_measuring: float | None = None  # cores other processes kept busy while measuring
    measure_s: float | None = None  # how long measuring took
    cpu_share: float | None = None  # the share of a core each of our threads gets now
    disk_free_mb: float | None = None  # free under the cache folder now (None: a preset's, taken as enough)
    cpu_busy_cores: float | None = None  # cores other processes keep busy now
    cpu_runnable_threads: float | None = None  # their threads that want a core, on average
    thread_limit: int | None = None  # OMP_NUM_THREADS, when the user set it
    gpus_hidden: bool = False  # CUDA_VISIBLE_DEVICES hides every GPU: the run plans for the CPU

    def as_dict(self) -> dict[str, Any]:
        """The profile as the cache file holds it (plain values)."""
        return asdict(self)

    @classmethod
    def from_cache(cls, values: dict[str, Any]) -> Profile | None:
        """A cached profile read back, or None when its fields are not this version's or not of their types (measure
        it again): a hand-edited value ("cpu_cores": "two", a rate of "fast") passed here and failed in the planner,
        or in every later run's check of the cache, with a traceback until someone deleted the file."""
        names = {f.name for f in fields(cls)}
        if values.get("version") != VERSION or set(values) - names:
            return None
        try:
            profile = cls(**values)
        except TypeError:  # a field without a default is missing
            return None
        hints = get_type_hints(cls)
        if profile.accelerator not in ACCELERATORS or not all(_of_type(values[k], hints[k]) for k in values):
            return None
        return profile


def _of_type(value: Any, hint: Any) -> bool:
    """Whether a cached value is of its field's type (`hint`: str, int, float, bool, a dict of numbers, or a union of
    them with None); a number is finite and not below 0, a dict's values (nested dicts too) are such numbers."""
    if get_origin(hint) in (Union, UnionType):
        return any(_of_type(value, option) for option in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        number = isinstance(value, int if hint is int else int | float) and not isinstance(value, bool)
        return number and math.isfinite(value) and value >= 0
    if get_origin(hint) is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _of_type(v, dict[str, Any] if isinstance(v, dict) else float)
            for k, v in value.items()
        )
    return isinstance(value, hint)


def resolve(
    hw_cfg: HardwareConfig, cache_dir: str | os.PathLike, probe_dir: str | os.PathLike | None = None
) -> Profile:
    """The hardware profile for this run: a preset as written, or this machine measured (cached). `cache_dir`:
    paths.cache, the disk the layer stores live on, whose read bandwidth the profile measures unless `probe_dir`
    names another folder (paths.outputs was measured, while the stores were read from another disk)."""
    check_settings(hw_cfg)
    if not hw_cfg.measure:
        preset = as_dict(hw_cfg)
        profile = Profile(**{k: preset[k] for k in PROFILE_KEYS})
        profile.device_memory_free_mb = profile.device_memory_free_mb or profile.device_memory_mb
        profile.host_memory_available_mb = profile.host_memory_available_mb or profile.host_memory_mb
        profile.source, profile.budget_mb = "preset", hw_cfg.budget_mb
        # a machine one does not have: its cores are taken to be free, its disk to be large enough
        profile.cpu_busy_cores, profile.cpu_runnable_threads, profile.cpu_share = 0.0, 0.0, 1.0
        return profile

    cache = cache_file(hw_cfg, cache_dir)
    probe = probe_dir if probe_dir is not None else cache_dir
    disk = disk_key(probe, int(hw_cfg.disk_probe_mb))
    cached = None if hw_cfg.refresh else _cached(cache)
    profile = cached and _with_disk(cached, disk)
    if profile is None:
        profile = _measured(hw_cfg, cache, probe, disk)
    profile = replace(profile, **now(profile.accelerator, cache_dir))  # what changes from run to run
    profile.budget_mb = hw_cfg.budget_mb
    return profile


def _measured(hw_cfg: HardwareConfig, cache: Path, probe_dir: str | os.PathLike, disk: str) -> Profile:
    """This machine measured and saved as `cache`, or only the disk under `probe_dir` (`disk`, disk_key) where the
    cached profile has no figure for it. One process measures at a time: runs started together (a sweep's
    jobs, test workers) would each measure (tens of seconds of every core) on cores the others keep busy; the ones
    that waited read its profile. A cache folder that cannot be written (read-only, a path under a file) measures
    without saving, in one line: a traceback ended the run, and a profile need not be saved to plan with."""
    with contextlib.ExitStack() as stack:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # a lock file of its own: hardware.cache naming a run's folder (or its sweep's), whose .onn.lock the run
            # holds for its life, had the process wait on itself forever (flock locks per open file)
            stack.enter_context(held(cache.parent, name=MEASURE_LOCK))  # a folder refusing a new file: not saved
            saves = True
        except OSError as e:
            _not_saved(cache, e)
            saves = False
        cached = None if hw_cfg.refresh else _cached(cache)
        profile = cached and _with_disk(cached, disk)
        if profile is None:
            if cached is None:
                profile = _measure_now(hw_cfg, cache, probe_dir, disk)
            else:
                profile = _disk_measured(hw_cfg, cached, probe_dir, disk)
            if saves:
                _save(cache, profile)
        return profile


def _save(cache: Path, profile: Profile) -> None:
    try:
        write_text_atomically(cache, json.dumps({**profile.as_dict(), "source": None}, indent=2))
    except (OSError, UserError) as e:  # a full disk (UserError: write_text_atomically's own sentence for it)
        _not_saved(cache, e)


def disk_key(folder: str | os.PathLike, probe_mb: int) -> str:
    """Which disk a probe under `folder` measures, and with what probe: "<disk>:<MB>", the file system of `folder`
    (or of the nearest folder above it that exists, as the probe makes it). A cached profile keeps a figure per key:
    keyed by the machine alone, a paths.cache on another disk read the first disk's bandwidth."""
    where = _existing(folder).resolve()
    return f"{_file_system(where) or where.stat().st_dev}:{probe_mb}"


def _existing(folder: str | os.PathLike) -> Path:
    path = Path(folder).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def _file_system(path: Path) -> str | None:
    """The file system `path` lies on as "<type> <source>" (ext4 /dev/nvme0n1p2, overlay overlay, tmpfs tmpfs), from
    /proc/self/mountinfo (Linux; else None). st_dev numbers an overlay or a tmpfs anew at each mount, so a
    container's every start would probe its disk again under a key of its own."""
    try:
        return mounted_under(path, Path("/proc/self/mountinfo").read_text().splitlines())
    except OSError:
        return None


def mounted_under(path: Path, mountinfo: list[str]) -> str | None:
    """The "<type> <source>" of the mount over `path` in `mountinfo`'s lines: the deepest mount point above it, the
    later of two at one point (it hides the earlier), never an automount's autofs placeholder."""
    found, longest = None, -1
    for line in mountinfo:
        mount, _, right = line.partition(" - ")
        fields, described = mount.split(), right.split()
        if len(fields) < 5 or len(described) < 2 or described[0] == "autofs":
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))  # the kernel's \040 and kin
        if (point == path or point in path.parents) and len(point.parts) >= longest:
            found, longest = f"{described[0]} {described[1]}", len(point.parts)
    return found


def _with_disk(profile: Profile, disk: str) -> Profile | None:
    """The cached profile with its figure for `disk` (disk_key), or None where it has none for that disk. A profile
    without a table of disks (written by hand, or from a preset's fields) keeps its one figure."""
    table = profile.disk_read_by_device
    if table is None:
        return profile
    if disk not in table:
        return None
    profile.disk_read_mb_s = table[disk]
    return profile


def _disk_measured(hw_cfg: HardwareConfig, profile: Profile, probe_dir: str | os.PathLike, disk: str) -> Profile:
    """A cached profile with the disk under `probe_dir` measured now and added to its table: the CPU's and the
    GPU's rates do not depend on where paths.cache is, and take half a minute to measure."""
    figure, read_mb = disk_probe(probe_dir, int(hw_cfg.disk_probe_mb))
    profile.disk_read_by_device = disk_table(profile.disk_read_by_device, disk, figure, read_mb, probe_dir)
    profile.disk_read_mb_s = figure
    profile.source = f"{profile.source}, its disk under {probe_dir} measured"
    return profile


def _not_saved(cache: Path, error: Exception) -> None:
    log.warning(
        "hardware.cache (ONN_HARDWARE_CACHE) %s cannot be written (%s): this machine is measured without saving its "
        "profile, so the next run measures it again; set hardware.cache or ONN_HARDWARE_CACHE to a folder you can "
        "write",
        cache.parent,
        getattr(error, "strerror", None) or error,
    )


def _measure_now(hw_cfg: HardwareConfig, cache: Path, probe_dir: str | os.PathLike, disk: str) -> Profile:
    profile = measure(probe_dir, int(hw_cfg.disk_probe_mb), disk)
    profile.fingerprint = cache.stem
    profile.source = "measured"
    return profile


def disk_table(
    table: dict[str, float] | None, disk: str, figure: float, read_mb: int, probe_dir: str | os.PathLike
) -> dict[str, float]:
    """The cached table of disk figures with `figure` for `disk` (disk_key: "<disk>:<probe MB asked>"), unless its
    probe read `read_mb`, cut below SMALLEST_CACHED_PROBE_MB and the size asked: a nearly full disk's few-MB probe
    times mostly latency, and was cached under the full probe's key for good, even after space was freed."""
    asked_mb = int(disk.rsplit(":", 1)[1])
    if read_mb >= min(asked_mb, SMALLEST_CACHED_PROBE_MB):
        return {**(table or {}), disk: figure}
    log.info(
        "the disk probe under %s read %d MB of the %d MB asked (hardware.disk_probe_mb; little free space or memory): "
        "its %.1f MB/s plans this run but is not cached, so the next run measures the disk again",
        probe_dir,
        read_mb,
        asked_mb,
        figure,
    )
    return dict(table or {})


ACCELERATORS = ("cpu", "cuda", "mps")
PRESET_NEEDS = ("accelerator", "host_memory_mb", "cpu_cores", "matmul_tflops")  # what the planner reads of a preset


def check_settings(hw_cfg: HardwareConfig) -> None:
    """A preset describes its machine whole and sensibly; a measured machine takes none of a preset's keys (they
    would be dropped without a word: the measurement fills them)."""
    name = f"hardware={hw_cfg.name}"
    if hw_cfg.budget_mb is not None and not math.isfinite(hw_cfg.budget_mb):
        raise UserError(f"hardware.budget_mb={hw_cfg.budget_mb}: give a number of MB, or null for all the machine has.")
    for key in ("interconnect_gb_s", "network_gb_s"):  # a link of 0 or less gave a negative all-reduce time
        speed = getattr(hw_cfg, key)
        if speed is not None and not (math.isfinite(speed) and speed > 0):
            raise UserError(
                f"hardware.{key}={speed}: give the link's speed in GB/s, a number above 0, or null (not known: the "
                "plan then leaves that link's time out and says so)."
            )
    given = {k: getattr(hw_cfg, k) for k in PROFILE_KEYS if k != "name" and getattr(hw_cfg, k) is not None}
    if hw_cfg.measure:
        if hw_cfg.disk_probe_mb < 1:  # a probe of 1 MB instead: its latency, cached as this disk's bandwidth
            raise UserError(
                f"hardware.disk_probe_mb={hw_cfg.disk_probe_mb}: give the probe file's size in MB, 1 or more (1024 "
                "measures the disk rather than its cache)."
            )
        if given:
            key, value = next(iter(given.items()))
            raise UserError(
                f"hardware.{key}={value}: {name} measures this machine, so a preset's keys do not apply; give "
                "hardware.budget_mb to plan for less memory, or a preset (hardware=cpu_16gb, ...) to plan for another."
            )
        return
    needs = PRESET_NEEDS + (("device_memory_mb",) if hw_cfg.accelerator in ("cuda", "mps") else ())
    if missing := [k for k in needs if k not in given]:
        raise UserError(f"{name} is a preset (measure: false) without {', '.join(missing)}: give them, or measure.")
    if hw_cfg.accelerator not in ACCELERATORS:
        raise UserError(f"hardware.accelerator={hw_cfg.accelerator}: give one of {', '.join(ACCELERATORS)}.")
    for key, value in given.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and not (math.isfinite(value) and value > 0):
            raise UserError(f"hardware.{key}={value} in {name}: give a number above 0.")


def cache_file(hw_cfg: HardwareConfig, cache_dir: str | os.PathLike) -> Path:
    """Where this machine's measured profile is cached (hardware.cache, else under paths.cache)."""
    return Path(hw_cfg.cache or Path(cache_dir) / "hardware") / f"{machine_fingerprint()}.json"


def _cached(cache: Path) -> Profile | None:
    """The cached profile, or None when there is none (or a damaged one), it is another version's, or it is due
    to be measured again."""
    values = read_json(cache)
    profile = Profile.from_cache(values) if isinstance(values, dict) else None
    if profile is None or _measure_again(profile, cache):
        return None  # a busy machine's profile, the machine quiet now: measure it properly
    profile.source = f"cache ({cache})"
    return profile


def _measure_again(profile: Profile, cache: Path) -> bool:
    """A cached profile measured on busy cores, long enough ago, while the cores are free now."""
    if (profile.busy_while_measuring or 0) < 0.5 or time.time() - cache.stat().st_mtime < REMEASURE_BUSY_AFTER_S:
        return False
    return cpu_busy_cores(0.3) < 0.25


def now(accelerator: str, folder: str | os.PathLike) -> dict[str, Any]:
    """Free memory, free disk under `folder` (or the nearest folder above it that exists), the cores other processes
    keep busy, and a thread limit the user set (OMP_NUM_THREADS): what changes between runs on one machine."""
    import shutil

    with contextlib.suppress(OSError):  # a folder that cannot be made (read-only, under a file) fails where it is used
        Path(folder).mkdir(parents=True, exist_ok=True)
    disk = _existing(folder)
    limit = os.getenv("OMP_NUM_THREADS")
    thread_limit = int(limit) if limit and limit.isdigit() and int(limit) > 0 else None
    busy, runnable = cpu_load()
    cores = usable_cores()
    # read now: a cgroup memory limit lowered within the fingerprint's 256 MB bucket kept the cached, higher figure
    host_mb = host_memory_mb()
    visible = os.getenv("CUDA_VISIBLE_DEVICES")
    threads = max(1, min(cores, int(cores - busy + 0.5)))
    share = cpu_share(threads, 1.0) if busy >= 0.25 else 1.0
    return {
        "cpu_share": round(min(share, quota_share(min(threads, thread_limit or threads))), 3),
        "host_memory_mb": host_mb,
        **({} if accelerator == "cuda" else {"device_memory_mb": host_mb}),  # the host's memory on CPUs and MPS
        **_free_memory(accelerator),
        "disk_free_mb": int(shutil.disk_usage(disk).free // MB),
        "cpu_busy_cores": round(busy, 2),
        "cpu_runnable_threads": round(runnable, 2),
        "thread_limit": thread_limit,
        # the user hid every GPU: the run plans for the CPU, and says why (where there is a GPU to hide)
        "gpus_hidden": accelerator == "cpu" and visible is not None and hides_every_gpu(visible, gpu_count()),
    }


def quota_share(threads: int) -> float:
    """The share of a core each of `threads` busy threads gets under a cgroup's CPU quota: 2 threads under
    `--cpus=1.5` get 0.75 each, 1 under `--cpus=0.5` half of one (1 where the quota leaves every thread a core). The
    rates are the best of trials shorter than the quota's period (100 ms), which a throttled thread never sees."""
    quota = cpu_quota()
    return 1.0 if quota is None else min(1.0, quota / threads)


def hides_every_gpu(visible: str, gpus: int) -> bool:
    """Whether CUDA_VISIBLE_DEVICES=`visible` leaves CUDA none of this machine's `gpus` NVIDIA GPUs: CUDA reads its
    list up to the first entry that names no GPU, so "", "-1", SLURM's "NoDevFiles" or an index past the last GPU
    ("7" on a machine of 2) as the first hide every one. A GPU's UUID (GPU-..., MIG-...) is taken to name one."""
    first = visible.split(",", 1)[0].strip()
    if gpus == 0 or first.startswith(("GPU-", "MIG-")):
        return False
    return not (first.isdigit() and int(first) < gpus)


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the NVIDIA driver's folder per GPU (Linux)
DEVICES = Path("/dev")  # where the driver's device files /dev/nvidia0, /dev/nvidia1, ... are


def gpu_count() -> int:
    """This machine's NVIDIA GPUs, whatever CUDA_VISIBLE_DEVICES hides from CUDA: the driver's list of GPUs, else
    its device files (Linux; 0 elsewhere)."""
    try:
        listed = len(list(NVIDIA_GPUS.iterdir()))
    except OSError:
        listed = 0
    return listed or len([f for f in DEVICES.glob("nvidia[0-9]*") if f.name[6:].isdigit()])


def cpu_busy_cores(seconds: float = 0.5) -> float:
    """CPU time other processes (and the hypervisor, as steal) took over `seconds`, in cores."""
    return cpu_load(seconds)[0]


PROC_STAT = Path("/proc/stat")  # the kernel's CPU time counters, the whole machine's and each CPU's


def steal_s() -> float | None:
    """CPU time the hypervisor has taken from this virtual machine's cores since boot (steal), in seconds summed
    over the cores; None where the kernel does not say (not Linux, or no steal column in /proc/stat)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
        return float(fields[7]) / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    except (OSError, ValueError, IndexError):
        return None


def own_cpus() -> set[int] | None:
    """The CPUs this process may run on where they are fewer than the machine's (taskset, a container's or a SLURM
    job's cpuset), else None (every CPU)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = os.sched_getaffinity(0)
    return cpus if len(cpus) < (os.cpu_count() or 0) else None


def cpu_ticks(stat: str, cpus: set[int] | None = None) -> tuple[float, float]:
    """(busy, all) CPU time since boot in /proc/stat's `stat`, in ticks: of the CPUs in `cpus` (their own lines), or
    of the whole machine (None, or a /proc/stat that lists other CPUs than `cpus`, as LXCFS's renumbered one does).
    Other processes busy on CPUs this one may not use take no core from it: counted as a share of the whole machine,
    62 busy CPUs of a 64-CPU node read as 1.9 of the 2 idle ones a job is pinned to, which then ran one thread."""
    lines = stat.splitlines()
    names = {f"cpu{cpu}" for cpu in cpus or ()}
    rows = [line for line in lines if line.split(" ", 1)[0] in names]
    if not rows or len(rows) < len(names):
        rows = lines[:1]  # the first line sums every CPU's
    busy = total = 0.0
    for row in rows:
        fields = [float(x) for x in row.split()[1:9]]  # user nice system idle iowait irq softirq steal
        total += sum(fields)
        busy += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)  # less idle and iowait
    return busy, total


def cpu_load(seconds: float = 0.5) -> tuple[float, float]:
    """(busy cores, runnable threads) of other processes over `seconds`: the CPU time they took (and
    the hypervisor, as steal), in cores; and how many of their threads wanted a core, on average, which
    says how a fair scheduler will share the cores once they are all busy. Linux only (/proc/stat);
    elsewhere (0, 0)."""

    cpus = own_cpus()

    def read() -> tuple[float, float, int]:
        text = PROC_STAT.read_text()
        running = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("procs_running"))
        return (*cpu_ticks(text, cpus), running)

    try:
        own0, (busy0, all0, _) = time.process_time(), read()
        runnable, samples, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            time.sleep(seconds / 10)
            runnable += read()[2] - 1  # less this thread, which is reading
            samples += 1
        own1, (busy1, all1, _) = time.process_time(), read()
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    cores = usable_cores()
    elapsed = time.perf_counter() - start
    total_cores = (all1 - all0) / ticks / elapsed  # the CPUs counted (cpu_ticks), busy or idle
    busy = (busy1 - busy0) / ticks / elapsed - (own1 - own0) / elapsed
    # scaled to the cores this process may use (a CPU quota may give it fewer than the CPUs it may run on)
    busy = max(0.0, busy * cores / max(total_cores, 1e-9))
    return busy, max(busy, runnable / max(samples, 1))


def cpu_share(threads: int, seconds: float = 0.3) -> float:
    """The share of a core each of `threads` busy threads of ours gets right now: as many forked
    processes spin for `seconds` and report their CPU time over the wall time. It measures what the
    scheduler does (fair shares per thread, or per session with autogroup; cgroup quotas; steal), which
    counting other processes' threads cannot. Linux (fork); elsewhere 1."""
    if not hasattr(os, "fork") or sys.platform != "linux":
        return 1.0
    readers, pids = [], []
    for _ in range(threads):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: spin, report, leave without running any cleanup of the parent's
            try:  # (and never return into the parent's stack: an error here ran the rest of a test run twice)
                os.close(r)
                start, cpu0 = time.perf_counter(), time.process_time()
                while time.perf_counter() - start < seconds:
                    pass
                os.write(w, f"{(time.process_time() - cpu0) / (time.perf_counter() - start)}".encode())
            finally:
                os._exit(0)
        os.close(w)
        readers.append(r)
        pids.append(pid)
    shares = []
    for r, pid in zip(readers, pids):
        with os.fdopen(r) as f:
            text = f.read()
        os.waitpid(pid, 0)
        shares.append(float(text) if text else 1.0)
    return max(0.05, min(1.0, sum(shares) / len(shares)))


class CoreWatch:
    """Sizes torch's threads to the cores other processes leave free, again and again while a run goes
    on: other processes start and stop, and threads that oversubscribe a busy core wait on each other
    (a Phi-4 block took twice as long on 2 threads as on 1 with the other core busy). `look` compares
    /proc/stat's counters and this process's CPU time with the previous look; at most every `every_s`."""

    def __init__(self, threads: int, every_s: float = 2.0):
        self.most, self.every_s = max(1, int(threads)), every_s
        self.cores, self.cpus = usable_cores(), own_cpus()
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._read()
        self.threads = self.most

    def _read(self) -> tuple[float, float, float, float] | None:
        try:
            busy, total = cpu_ticks(PROC_STAT.read_text(), self.cpus)
        except (OSError, ValueError, IndexError):
            return None
        return busy, total, time.process_time(), time.perf_counter()

    def restart(self) -> None:
        """Count from now: what the machine did before (another process's turn while this one waited for it) is
        no load to leave cores to, nor is it the reason for fewer threads (a benchmark's harness building its block
        copies while the run validated left the run's 20 steps on 1 of 2 cores, 60% slower)."""
        self.last = self._read()
        self._use(self.most)

    def _use(self, threads: int) -> None:
        """Set torch's thread count only when it changes: each set resizes its thread pool."""
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads

    def look(self) -> int:
        """The thread count for now (set in torch when it changes)."""
        now = self._read()
        if now is None or self.last is None or now[3] - self.last[3] < self.every_s:
            return self.threads
        busy_ticks, all_ticks, own, wall = (a - b for a, b in zip(now, self.last))
        self.last = now
        machine = all_ticks / self.ticks / wall  # cores of the whole machine
        busy = max(0.0, (busy_ticks / self.ticks - own) / wall) * self.cores / max(machine, 1e-9)
        self._use(max(1, min(self.most, int(self.cores - busy + 0.5))))
        return self.threads


def use_threads(threads: int | None) -> int | None:
    """Run torch on the thread count the plan sized to the free cores (CPU plans; None elsewhere), never on more
    than this machine lets this process use (a plan for a preset machine of more cores than this one: 8 threads
    on 2 cores made a small CNN's step 5x slower) nor than OMP_NUM_THREADS. Returns the count before, or None."""
    if not threads:
        return None
    import torch

    before = torch.get_num_threads()
    cores = usable_cores()
    limit = os.getenv("OMP_NUM_THREADS", "")
    most = min(cores, int(limit)) if limit.isdigit() and int(limit) > 0 else cores
    torch.set_num_threads(max(1, min(int(threads), most)))
    return before


CGROUP = Path("/sys/fs/cgroup")  # the cgroups (v2) as this process sees them; v1 keeps a folder per controller
OWN_CGROUP = Path("/proc/self/cgroup")  # which cgroup of each hierarchy this process is in


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset), under a cgroup's CPU quota where one is set
    (a container's --cpus), which the scheduler would otherwise enforce by stalling every thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else min(cores, max(1, math.ceil(quota)))


def cpu_quota() -> float | None:
    """The CPUs' worth of time a cgroup's quota lets this process use (`--cpus=1.5`: 1.5), the lowest set on any of
    its cgroups (a parent's quota holds every cgroup under it); None where none sets one."""
    quotas = []
    for quota, folder, v2 in _cgroup_limits("cpu.max", "cpu/cpu.cfs_quota_us"):
        period = _number(folder / "cpu.max", 1) if v2 else _number(folder / "cpu.cfs_period_us")
        if period:
            quotas.append(quota / period)
    return min(quotas, default=None)


def host_memory_mb() -> int:
    """The host's memory, or a cgroup's memory limit where it is lower (a container's --memory, a SLURM job's
    --mem): the lowest set on any of this process's cgroups, since the kernel holds a cgroup to its parents' limits
    too (a systemd slice's MemoryMax above a scope that sets a higher one)."""
    limits = [limit for limit, _, _ in _cgroup_limits("memory.max", "memory/memory.limit_in_bytes")]
    return int(min([psutil.virtual_memory().total, *limits]) // MB)


def available_memory_mb() -> int:
    """Memory available now: the host's, or what a cgroup's limit leaves beside its usage where that is less, for
    each limited cgroup that holds this process (past any of them the kernel's OOM killer ends the run, with no
    out-of-memory error to back off from)."""
    available = psutil.virtual_memory().available
    for limit, folder, v2 in _cgroup_limits("memory.max", "memory/memory.limit_in_bytes"):
        used = _number(folder / ("memory.current" if v2 else "memory.usage_in_bytes")) or 0
        used -= _reclaimable(folder / "memory.stat", "inactive_file" if v2 else "total_inactive_file")
        available = min(available, max(0, limit - used))
    return int(available // MB)


def _reclaimable(stat: Path, key: str) -> int:
    """The cgroup's inactive file cache (the kernel reclaims it before it kills), which its usage counts: `key` of
    its memory.stat (v2's inactive_file, v1's total_inactive_file), as `docker stats` reads it."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        field, _, value = line.partition(" ")
        if field == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_folders(v1_controller: str) -> list[tuple[Path, bool]]:
    """The folders of the cgroups that hold this process, innermost first, each with whether it is v2's: its own
    cgroup (OWN_CGROUP) and each above it up to the root, v2's, then v1's `v1_controller`'s. A container's
    namespace makes its own cgroup the root; without one (a SLURM job's --mem, a systemd slice's MemoryMax) the
    limit is in the own cgroup's folder, which reading the root alone missed: the plan took the whole node's
    memory, and the kernel's OOM killer ended the run."""
    own: dict[str, str] = {}
    try:
        for line in OWN_CGROUP.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own.update({name: path for name in (controllers.split(",") if controllers else [""])})
    except (OSError, ValueError):
        pass
    folders = []
    for base, key, v2 in ((CGROUP, "", True), (CGROUP / v1_controller, v1_controller, False)):
        inner = PurePosixPath("/", own.get(key, "/")).relative_to("/")
        folders += [(base / folder, v2) for folder in (inner, *inner.parents)]
    return folders


def _cgroup_limits(v2: str, v1: str, field: int = 0) -> list[tuple[int, Path, bool]]:
    """Every limit set on this process's cgroups, innermost first: a number from file `v2` (its `field`-th value) or
    `v1` ("controller/file"), the folder that holds it and whether that is v2's; none where none sets one ("max",
    v1's -1 or huge "unlimited"). The kernel enforces each of them, so the lowest is what this process gets: the
    innermost alone would take a scope's 8 GB for the 4 GB its slice allows."""
    controller, _, v1_file = v1.partition("/")
    limits = []
    for folder, is_v2 in _cgroup_folders(controller):
        value = _number(folder / v2, field) if is_v2 else _number(folder / v1_file)
        if value is not None and value < 2**60:
            limits.append((value, folder, is_v2))
    return limits


def _number(path: Path, field: int = 0) -> int | None:
    """The `field`-th space-separated value of a cgroup file as a whole number, or None (no file, "max", -1)."""
    try:
        parts = path.read_text().split()
    except OSError:
        return None
    value = parts[field] if field < len(parts) else ""
    return int(value) if value.isdigit() else None


def machine_fingerprint() -> str:
    """Changes when the hardware or the torch build changes, not from run to run. On a node of GPUs of several
    models it names the current GPU's too: the profile measures that one (its memory, bf16, matmul rates), and a
    rank on a T4 read the profile an A100's rank had measured (80 GB, bf16) and planned with it."""
    import torch

    parts = [
        platform.node(),
        platform.machine(),
        _cpu_model(),
        str(os.cpu_count()),
        str(usable_cores()),  # a taskset or a container's CPU quota: another machine to plan for
        str(host_memory_mb() // 256),  # a container's memory limit, likewise
    ]
    parts.append(torch.__version__)
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        parts += names
        if len(set(names)) > 1:  # GPUs of several models: the profile measures the current one (this rank's)
            parts.append(f"current {names[torch.cuda.current_device()]}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cuda_has_bf16() -> bool:
    """bf16 the current GPU computes in its own units (Ampere and later, ROCm). torch's is_bf16_supported() also says
    yes to a card that only emulates it (a GTX 1650, a T4), where the plan then chose bf16-mixed at a fraction of
    16-mixed's speed, against the gtx1650_4gb preset's `bf16: false`."""
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False)


def measure(probe_dir: str | os.PathLike, disk_probe_mb: int = 1024, disk: str | None = None) -> Profile:
    """Measure accelerator, memory, cores, matmul throughput and disk / host-to-device bandwidth; `disk` (disk_key)
    names the disk figure in the table a cache keeps (disk_table)."""
    import torch

    t0 = time.perf_counter()
    disk_figure, read_mb = disk_probe(probe_dir, disk_probe_mb)
    if torch.cuda.is_available():
        accelerator, count = "cuda", torch.cuda.device_count()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())  # this rank's GPU
        name, total_mb = props.name, props.total_memory // MB
        bf16 = cuda_has_bf16()
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        accelerator, count, name = "mps", 1, f"Apple {platform.processor() or 'GPU'}"
        total_mb, bf16 = host_memory_mb(), False
    else:
        accelerator, count, name = "cpu", 1, _cpu_model()
        total_mb, bf16 = host_memory_mb(), _cpu_has_fast_bf16()
    profile: dict[str, Any] = {
        "name": "auto",
        "version": VERSION,
        "accelerator": accelerator,
        "device_name": name,
        "device_count": count,
        "device_memory_mb": int(total_mb),
        "host_memory_mb": host_memory_mb(),
        "host_memory_available_mb": available_memory_mb(),
        "cpu_cores": usable_cores(),
        "matmul_tflops": round(_matmul_tflops(accelerator), 4) if accelerator != "cuda" else None,
        "disk_read_mb_s": disk_figure,
        "disk_read_by_device": disk_table(None, disk, disk_figure, read_mb, probe_dir) if disk else None,
        "h2d_mb_s": round(h2d_mb_s(), 1) if accelerator == "cuda" else None,
        "bf16": bool(bf16),
    }
    if accelerator == "cuda":
        profile.update(gpu_rates())
        profile["activation_ns"] = activation_ns(profile["matmul_gflops"])
        profile["cuda_workspace_mb"] = round(cuda_workspace_mb(), 1)
    busy = cpu_busy_cores(0.3)
    if accelerator == "cpu":
        profile["matmul_gflops"] = matmul_table(profile["cpu_cores"])
        best = max(max(rates.values()) for rates in profile["matmul_gflops"]["4096"]["float32"].values())
        profile["matmul_tflops"] = round(best / 1000, 4)
        profile["memory_gb_s"], profile["decode_gvalues_s"] = memory_rates()
        profile["norm_gb_s"] = norm_gb_s(profile["cpu_cores"])
    profile["block_call_s"] = block_call_s("cuda" if accelerator == "cuda" else "cpu")
    if accelerator == "cuda":  # after every kind of work above: the context holds the kernels a run loads
        profile["cuda_context_mb"] = round(cuda_context_mb(), 1)
    # measured while other processes kept cores busy: the rates on every core are too low, so the
    # profile is measured again the next time the machine is quiet (see resolve)
    profile["busy_while_measuring"] = round(max(busy, cpu_busy_cores(0.3)), 2)
    profile.update(_free_memory(accelerator))
    profile["measure_s"] = round(time.perf_counter() - t0, 2)
    return Profile(**profile)


PROBE_MEMORY_SHARE = 4  # the disk probe's read buffer takes at most 1/4 of the memory available


def disk_read_mb_s(probe_dir: str | os.PathLike, size_mb: int, measurer: str = "hardware=auto") -> float:
    """The disk's cold read bandwidth under `probe_dir` (disk_probe's figure)."""
    return disk_probe(probe_dir, size_mb, measurer)[0]


def disk_probe(probe_dir: str | os.PathLike, size_mb: int, measurer: str = "hardware=auto") -> tuple[float, int]:
    """The disk's cold read bandwidth under `probe_dir` and the MB its probe read (disk.read_mb_s), or one sentence
    where its probe file cannot be written there: a nearly full disk (ENOSPC) is told to free space, a folder that
    cannot be written (read-only, under a file) to move paths.cache; `measurer` is what the sentence says measures it
    (task=bench_giant too). The probe is read whole into memory, so it takes at most a quarter of the memory
    available: in a container of 1 GB, a probe of 1 GB had the OOM killer end the run while it was profiled."""
    size_mb = max(1, min(size_mb, available_memory_mb() // PROBE_MEMORY_SHARE))
    try:
        figure, read_mb = read_mb_s(probe_dir, size_mb)
        return round(figure, 1), read_mb
    except OSError as e:
        fix = "free some space on that disk, or set" if e.errno == errno.ENOSPC else "set"
        raise UserError(
            f"{measurer} measures the disk under {probe_dir} (paths.cache, where layer stores are built) by writing "
            f"a probe file there, which failed ({e.strerror or e}): {fix} paths.cache (ONN_CACHE) to a folder you can "
            "write on a disk with room."
        ) from None


def _free_memory(accelerator: str) -> dict[str, int]:
    import torch

    out = {"host_memory_available_mb": available_memory_mb()}
    if accelerator == "cuda":
        free, _ = torch.cuda.mem_get_info()  # the current device: this rank's GPU
        out["device_memory_free_mb"] = int(free // MB)
    else:
        out["device_memory_free_mb"] = out["host_memory_available_mb"]
    return out


def _matmul_tflops(accelerator: str, seconds: float = 0.4) -> float:
    """Sustained dense matmul throughput (fp32 on CPU, bf16/fp16 on GPUs) over a short loop."""
    import torch

    device = "cuda" if accelerator == "cuda" else ("mps" if accelerator == "mps" else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.float16
    n = 1024 if device == "cpu" else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    _sync(device)
    a @ b  # warm-up
    _sync(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
        if device != "cpu" and iters % 10 == 0:
            _sync(device)
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed / 1e12


def _best_rate(
    work: float, fn, trials: int = 5, min_s: float = 0.02, clock=time.perf_counter, budget_s: float | None = None
) -> float:
    """work per second of `fn`, the best of short trials (each repeats fn for at least min_s): a
    neighbour's burst slows some trials, not all, so the best is the machine's own rate. Work done on
    one thread is timed by the process's CPU clock (`clock=time.process_time`), which does not run
    while other processes hold the core: the rate of a core, whatever the load. With `budget_s` (in
    `clock`'s seconds), trials longer than budget_s / trials are fewer, and a call longer than budget_s
    is a trial itself: its own length averages a burst out (a large bf16 matmul on cores without bf16
    units takes seconds a call, and five trials of it half a minute)."""
    start = clock()
    fn()  # warm-up, and how long one call takes
    first = clock() - start
    best = 0.0
    if budget_s is not None:
        best = work / first if first >= budget_s else 0.0
        trials = max(1, min(trials, int(budget_s / max(first, min_s, 1e-9))))
    for _ in range(trials):
        calls, start = 0, clock()
        while True:
            fn()
            calls += 1
            elapsed = clock() - start
            if elapsed >= min_s:
                break
        best = max(best, work * calls / elapsed)
    return best


def matmul_table(cores: int) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """GFLOP/s of rows x size by a size x size weight, for a small weight (256, cache-resident, where
    call overhead weighs) and a large one (4096, the regime of large models, whose weights stream from
    memory), float32 and bfloat16, on one thread and on every core: {size: {dtype: {threads: {rows: rate}}}}."""
    import torch

    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    before = torch.get_num_threads()
    try:
        for size in MATMUL_SIZES:
            table[str(size)] = {}
            for dtype in ("float32", "bfloat16"):
                weight = torch.randn(size, size).to(getattr(torch, dtype))
                table[str(size)][dtype] = {}
                for threads in sorted({1, cores}):
                    torch.set_num_threads(threads)
                    rates = {}
                    for rows in MATMUL_ROWS:
                        x = torch.randn(rows, size).to(weight.dtype)
                        flops = 2 * rows * size * size
                        clock = time.process_time if threads == 1 else time.perf_counter
                        rate = _best_rate(
                            flops, lambda x=x, w=weight: torch.nn.functional.linear(x, w), clock=clock, budget_s=1.0
                        )
                        rates[str(rows)] = round(rate / 1e9, 2)
                    table[str(size)][dtype][str(threads)] = rates
    finally:
        torch.set_num_threads(before)
    return table


def _tiny_llama(layers: int, lora: bool, device: str):
    """block_call_s's model: a Llama of width 32 with `layers` blocks, LoRA-adapted or not, on `device`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    m = LlamaForCausalLM(config).to(device)
    if lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        m = get_peft_model(m, LoraConfig(r=4, target_modules=targets))
    return m


def block_call_s(device: str = "cpu", repeats: int = 9) -> dict[str, float]:
    """Framework time per decoder block and call, where FLOPs are negligible: tiny Llamas (width 32,
    8 tokens) of 2 and 10 blocks, timed without grad (`forward`), for a full-training step (AdamW
    included, `full`) and a LoRA step (`lora`); on CPUs also under bf16 autocast (`forward_bf16`, the same
    plain model as `forward`: timed on the LoRA-adapted one it read 1.8x a plain block's bf16 cost; and
    `lora_bf16`). The difference over 8 blocks is one block's share; `step` is what a step costs
    besides its blocks (embeddings, loss, optimizer, zero_grad). One thread: this is serial work. Each
    figure is the fastest of several runs, which a neighbour's burst cannot make faster."""
    import contextlib
    import logging

    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)

    def model(layers: int, lora: bool):
        return _tiny_llama(layers, lora, device)

    ids = torch.randint(0, 64, (1, 8), device=device)
    batch = {"input_ids": ids, "labels": ids}

    clock = time.process_time if device == "cpu" else time.perf_counter  # one thread: its CPU time ignores the load

    def fastest(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            times.append(clock() - start)
        return min(times)

    def costs(layers: int) -> dict[str, float]:
        plain, adapted = model(layers, False), model(layers, True)
        opt_full = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        opt_lora = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-3)

        def train(m, opt, bf16: bool = False):
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with autocast:
                loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out = {}
        with torch.no_grad():
            out["forward"] = fastest(lambda: plain(**batch))
        out["full"] = fastest(lambda: train(plain, opt_full))
        out["lora"] = fastest(lambda: train(adapted, opt_lora))
        if device == "cpu":  # `forward`'s call under autocast: the planner reads the two as one cost by dtype
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                out["forward_bf16"] = fastest(lambda: plain(**batch))
            out["lora_bf16"] = fastest(lambda: train(adapted, opt_lora, bf16=True))
        return out

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small, large = costs(2), costs(10)
    finally:
        torch.set_num_threads(before)
    out = {k: round(max(large[k] - small[k], 0.0) / 8, 6) for k in small}
    out["step"] = round(max(small["full"] - 2 * out["full"], 0.0), 6)
    return out


class OpBytes:
    """Bytes the ops run under it read and write (every tensor argument and result), the matmuls and convolutions
    aside (their time is their FLOPs at the measured matmul rate), and views and allocations (no traffic)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.add(func, (args, kwargs, out), flop_registry)
                return out

        self.total = 0
        self.mode = Mode()

    def add(self, func, tensors, flop_registry) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        name = func.overloadpacket.__name__
        if func.is_view or func.overloadpacket in flop_registry or name.startswith(("empty", "new_empty")):
            return
        self.total += sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


NORM_PROBE_SHAPE = (16, 64, 64, 64)  # 16 MB of float32: past a core's cache, as a training batch's activations are


def norm_gb_s(cores: int) -> dict[str, float]:
    """{threads: GB/s} of a convolution block's memory-bound ops, a BatchNorm, a LeakyReLU and a 2 x 2 max pool,
    forward and backward, on one thread and on every core, in bytes as the planner counts a network's (OpBytes:
    every tensor each op reads and writes). Such ops pass over their tensors several times and compute per value:
    at the copy bandwidth (memory_gb_s) a classifier's step was predicted 1.3-2x too fast on one thread."""
    import torch

    before = torch.get_num_threads()
    x = torch.randn(NORM_PROBE_SHAPE, requires_grad=True)
    norm = torch.nn.BatchNorm2d(NORM_PROBE_SHAPE[1])
    block = torch.nn.Sequential(norm, torch.nn.LeakyReLU(0.1), torch.nn.MaxPool2d(2))
    grad = torch.ones(block(x).shape)

    def step() -> None:
        torch.autograd.grad(block(x), [x, norm.weight, norm.bias], grad)

    counter = OpBytes()
    with counter.mode:
        step()
    rates = {}
    try:
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            clock = time.process_time if threads == 1 else time.perf_counter
            rates[str(threads)] = round(_best_rate(counter.total, step, trials=2, clock=clock) / 1e9, 2)
    finally:
        torch.set_num_threads(before)
    return rates


def memory_rates() -> tuple[float, dict[str, float]]:
    """One thread's memory copy bandwidth (GB/s, bytes read + written) and its rate of turning stored
    values into compute values (G values/s) as the layer store decodes them into reused buffers."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 32 * MB
        src, dst = torch.empty(n, dtype=torch.uint8).fill_(1), torch.empty(n, dtype=torch.uint8)
        copy = _best_rate(2 * n, lambda: dst.copy_(src), clock=time.process_time) / 1e9
        decode = {}
        values = 16 * MB
        codes = torch.randint(-127, 127, (values,), dtype=torch.int8)
        for target in (
            "bfloat16",
            "float32",
        ):  # int8 is cast only: its row scales apply to the layer's output
            out = torch.empty(codes.shape, dtype=getattr(torch, target))
            rate = _best_rate(values, lambda out=out: out.copy_(codes), clock=time.process_time)
            decode[f"int8->{target}"] = round(rate / 1e9, 3)
        for source, target in (("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float32")):
            a = torch.empty(values, dtype=getattr(torch, source)).fill_(1)
            b = torch.empty(values, dtype=getattr(torch, target))
            rate = _best_rate(values, lambda a=a, b=b: b.copy_(a), clock=time.process_time)
            decode[f"{source}->{target}"] = round(rate / 1e9, 3)
    finally:
        torch.set_num_threads(before)
    return round(copy, 2), decode


def h2d_mb_s(size_mb: int = 512) -> float:
    """Pinned host memory to the GPU, as the layer store's copies go (memory registered as the store's is,
    pinned_empty): the best of five copies."""
    import torch

    src = pinned_empty(size_mb * MB)
    dst = torch.empty_like(src, device="cuda")
    return size_mb / gpu_seconds(lambda: dst.copy_(src, non_blocking=True), trials=5)


def gpu_seconds(fn, trials: int = 5, min_s: float = 0.01) -> float:
    """Seconds per call of `fn` on the current CUDA stream: the best of `trials` timings (CUDA events
    around enough calls to last `min_s`), after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    calls, best = 1, float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
        best = min(best, seconds / calls)
        if seconds < min_s:
            calls = max(calls + 1, int(calls * min_s / max(seconds, 1e-6)))
    return best


def gpu_rates() -> dict[str, Any]:
    """What the planner predicts a GPU step from: matmul GFLOP/s by dtype and row count through a 4096 x
    4096 weight (`matmul_gflops`, the CPU table's layout with one "thread"), the device memory's copy
    bandwidth (`memory_gb_s`, bytes read + written) and its rate of casting int8 codes to the compute dtype
    (`decode_gvalues_s`: an int8 store's weights are cast on the device, a tile at a time)."""
    import torch

    size, table = 4096, {}
    for dtype in ("bfloat16", "float16", "float32"):
        weight = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
        rates = {}
        for rows in GPU_MATMUL_ROWS:
            x = torch.randn(rows, size, device="cuda", dtype=weight.dtype)
            seconds = gpu_seconds(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
            rates[str(rows)] = round(2 * rows * size * size / seconds / 1e9, 1)
        table[dtype] = {"1": rates}
    n = 256 * MB
    src, dst = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    copy = 2 * n / gpu_seconds(lambda: dst.copy_(src)) / 1e9
    codes = torch.randint(-127, 127, (16 * 1024, 4096), dtype=torch.int8, device="cuda")
    decode = {}
    for target in ("bfloat16", "float16", "float32"):
        out = torch.empty(codes.shape, dtype=getattr(torch, target), device="cuda")
        scale = torch.rand(codes.shape[0], dtype=out.dtype, device="cuda")
        if fused_scale(codes.device):  # the cast a streamed step runs: scaled in the same pass, or a plain copy

            def decode_once(o=out, s=scale):
                return cast_scaled(codes, s, o)
        else:

            def decode_once(o=out):
                return o.copy_(codes)

        decode[f"int8->{target}"] = round(codes.numel() / gpu_seconds(decode_once) / 1e9, 2)
    best = max(max(r.values()) for r in table["bfloat16"].values())
    return {
        "matmul_gflops": {str(size): table},
        "memory_gb_s": round(copy, 1),
        "decode_gvalues_s": decode,
        "matmul_tflops": round(best / 1000, 1),
    }


def activation_ns(matmul_gflops: dict[str, Any], hidden: int = 2048, tokens: int = 8192) -> dict[str, float]:
    """A frozen bf16 Llama decoder block's GPU time besides its matmuls, per activation value the planner
    counts (10h + 4kv + 4i per token): `forward` without grad, `train` forward and backward to its input.
    The matmuls' share is their FLOPs at the rate just measured (`matmul_gflops`), so what remains is the
    memory-bound work a model's block does around them, at a size that keeps the GPU busy."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 512,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(config, layer_idx=0).to("cuda", torch.bfloat16).requires_grad_(False)
    seq = 64
    x = torch.randn(tokens // seq, seq, hidden, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(seq, device="cuda")[None]
    rotary = LlamaRotaryEmbedding(config).to("cuda")(x, positions)
    kv = config.num_key_value_heads * 128

    def forward(inputs):
        out = block(inputs, position_embeddings=rotary, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    def train():
        inputs = x.detach().requires_grad_(True)
        forward(inputs).sum().backward()

    with torch.no_grad():
        forward_s = gpu_seconds(lambda: forward(x), trials=3)
    train_s = gpu_seconds(train, trials=3)
    weights = hidden * (2 * hidden + 2 * kv) + 3 * hidden * config.intermediate_size  # q, o, k, v; the MLP
    flops = 2 * weights * tokens + 4 * seq * hidden * tokens
    rates = matmul_gflops[next(iter(matmul_gflops))]["bfloat16"]["1"]
    rate = max(float(v) for v in rates.values()) * 1e9
    values = (10 * hidden + 4 * kv + 4 * config.intermediate_size) * tokens
    return {
        "forward": round(max(forward_s - flops / rate, 0.0) / values * 1e9, 5),
        "train": round(max(train_s - 2 * flops / rate, 0.0) / values * 1e9, 5),
    }


def cuda_workspace_mb() -> float:
    """What stays allocated once every tensor of ours is gone: cuBLAS's workspaces, which a run holds too."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / MB


def cuda_context_mb() -> float:
    """The CUDA context this process holds beside what PyTorch allocates (driver state, the kernels loaded,
    cuBLAS's handles): the process's GPU memory, from NVML where it can name this process, else the
    device's used memory less what others held before this process started (assumed none), less what
    PyTorch's allocator reserved. It counts against a budget before any model is built."""
    import torch

    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved() / MB
    return max(0.0, process_gpu_mb() - reserved)


def process_gpu_mb() -> float:
    """This process's GPU memory, context included: NVML's figure for this process when it has one, else
    nvidia-smi's (pynvml is not always installed), else the device's used memory (exact only when no other
    process uses the GPU: under pytest the parent's context and cache counted as the child's)."""
    import torch

    uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    try:
        import pynvml

        pynvml.nvmlInit()  # NVML numbers every GPU; CUDA only the visible ones: match them by UUID
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return proc.usedGpuMemory / MB
    except Exception:  # noqa: BLE001 - NVML missing, not permitted, or not naming processes in a container
        pass
    smi_mb = nvidia_smi_process_mb(_nvidia_smi_apps(), os.getpid(), uuid)
    if smi_mb is not None:
        return smi_mb
    free, total = torch.cuda.mem_get_info()
    return (total - free) / MB


NVIDIA_SMI_APPS = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]


def _nvidia_smi_apps(timeout_s: float = 5.0) -> str:
    """nvidia-smi's compute processes as CSV text; empty where it is absent, fails or hangs."""
    try:
        done = subprocess.run(NVIDIA_SMI_APPS, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def nvidia_smi_process_mb(text: str, pid: int, uuid: str) -> float | None:
    """`pid`'s memory (MB, as nvidia-smi's MiB) on the GPU `uuid` from NVIDIA_SMI_APPS' output; None where no
    line names them with a number (not listed, "[N/A]", a container's other pid namespace)."""
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or parts[0] != uuid or parts[1] != str(pid):
            continue
        try:
            used = float(parts[2])
        except ValueError:
            return None
        return used if used > 0 else None
    return None


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_has_fast_bf16() -> bool:
    """bf16 autocast only pays on CPUs with native bf16 math (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
