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
