"""Measure this machine (hardware=auto) or read a preset describing another one.

A profile is a flat dict with the same keys either way, so the planner never asks where it
came from. Measuring takes about two seconds; the result is cached under the cache folder,
keyed by a fingerprint of the machine (CPU model, core count, RAM, accelerators, torch version).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

MB = 1024**2
PROFILE_KEYS = (
    "name", "accelerator", "device_name", "device_count", "device_memory_mb", "device_memory_free_mb",
    "host_memory_mb", "host_memory_available_mb", "cpu_cores", "matmul_tflops", "disk_read_mb_s", "h2d_mb_s", "bf16",
)  # fmt: skip


def resolve(
    hw_cfg: dict[str, Any], cache_dir: str | os.PathLike, probe_dir: str | os.PathLike
) -> dict[str, Any]:
    """The hardware profile for this run: a preset as written, or this machine measured (cached)."""
    if not hw_cfg["measure"]:
        profile = {k: hw_cfg.get(k) for k in PROFILE_KEYS}
        profile["device_memory_free_mb"] = profile["device_memory_free_mb"] or profile["device_memory_mb"]
        profile["host_memory_available_mb"] = profile["host_memory_available_mb"] or profile["host_memory_mb"]
        profile["source"] = "preset"
        profile["budget_mb"] = hw_cfg.get("budget_mb")
        return profile

    fingerprint = machine_fingerprint()
    cache = Path(cache_dir) / "hardware" / f"{fingerprint}.json"
    if cache.exists() and not hw_cfg["refresh"]:
        profile = json.loads(cache.read_text())
        profile.update(_free_memory(profile["accelerator"]))  # free memory changes; measure it now
        profile["source"] = f"cache ({cache})"
        profile["budget_mb"] = hw_cfg.get("budget_mb")
        return profile

    profile = measure(probe_dir)
    profile["fingerprint"] = fingerprint
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(cache)
    profile["source"] = "measured"
    profile["budget_mb"] = hw_cfg.get("budget_mb")
    return profile


def machine_fingerprint() -> str:
    """Changes when the hardware or the torch build changes, not from run to run."""
    import torch

    parts = [
        platform.node(),
        platform.machine(),
        _cpu_model(),
        str(os.cpu_count()),
        str(psutil.virtual_memory().total // (256 * MB)),
    ]
    parts.append(torch.__version__)
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure(probe_dir: str | os.PathLike) -> dict[str, Any]:
    """Measure accelerator, memory, cores, matmul throughput and disk / host-to-device bandwidth."""
    import torch

    t0 = time.perf_counter()
    if torch.cuda.is_available():
        accelerator, count = "cuda", torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        name, total_mb = props.name, props.total_memory // MB
        bf16 = torch.cuda.is_bf16_supported()
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        accelerator, count, name = "mps", 1, f"Apple {platform.processor() or 'GPU'}"
        total_mb, bf16 = psutil.virtual_memory().total // MB, False
    else:
        accelerator, count, name = "cpu", 1, _cpu_model()
        total_mb, bf16 = psutil.virtual_memory().total // MB, _cpu_has_fast_bf16()
    vm = psutil.virtual_memory()
    profile = {
        "name": "auto",
        "accelerator": accelerator,
        "device_name": name,
        "device_count": count,
        "device_memory_mb": int(total_mb),
        "host_memory_mb": int(vm.total // MB),
        "host_memory_available_mb": int(vm.available // MB),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "matmul_tflops": round(_matmul_tflops(accelerator), 4),
        "disk_read_mb_s": round(_disk_read_mb_s(probe_dir), 1),
        "h2d_mb_s": round(_h2d_mb_s(), 1) if accelerator == "cuda" else None,
        "bf16": bool(bf16),
    }
    profile.update(_free_memory(accelerator))
    profile["measure_s"] = round(time.perf_counter() - t0, 2)
    return profile


def _free_memory(accelerator: str) -> dict[str, int]:
    import torch

    out = {"host_memory_available_mb": int(psutil.virtual_memory().available // MB)}
    if accelerator == "cuda":
        free, _ = torch.cuda.mem_get_info(0)
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


def _disk_read_mb_s(probe_dir: str | os.PathLike, size_mb: int = 64) -> float:
    """Cold read bandwidth of the folder runs write to: write a file, evict it from the page cache, read it."""
    Path(probe_dir).mkdir(parents=True, exist_ok=True)
    block = os.urandom(MB)
    fd, path = tempfile.mkstemp(dir=probe_dir, prefix=".onn-disk-probe-")
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(size_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while f.read(8 * MB):
                pass
            elapsed = time.perf_counter() - start
    finally:
        os.unlink(path)
    return size_mb / max(elapsed, 1e-9)


def _h2d_mb_s(size_mb: int = 256) -> float:
    import torch

    src = torch.empty(size_mb * MB, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * size_mb / (time.perf_counter() - start)


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
