"""Measured peak memory of a piece of work: CUDA allocations on GPUs, anonymous RSS on CPUs.

Anonymous RSS (heap, tensors) is what training grows; file-backed pages of shared libraries
are not counted, so the figure compares with the planner's prediction plus the process baseline.
"""

from __future__ import annotations

import threading

MB = 1024**2


def anon_rss_mb() -> float:
    """This process's anonymous resident memory now (Linux), else its whole RSS."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / MB


class PeakMemory:
    """Context manager: `.peak_mb` after exit (CUDA max allocated, or sampled anonymous RSS on CPU)."""

    def __init__(self, device: str = "cpu", interval_s: float = 0.02):
        self.device, self.interval_s = device, interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_mb = anon_rss_mb()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, anon_rss_mb())

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            import torch

            self.peak_mb = torch.cuda.max_memory_allocated() / MB
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, anon_rss_mb())


def return_large_frees_to_os() -> None:
    """Make glibc give every freed buffer of 64 KB or more (a block's weight matrices) straight back to the OS.

    By default glibc raises its mmap threshold after a large buffer is freed, so later block-sized
    buffers come from heaps that never shrink: streaming 32 blocks through memory then grew a
    step's resident memory by ~450 MB instead of ~100 MB. Fixing the threshold keeps streamed
    weights from piling up. Process-wide; a no-op where libc is not glibc."""
    import contextlib
    import ctypes
    import sys

    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
