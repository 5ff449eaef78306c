"""Measured peak memory of a piece of work: CUDA allocations on GPUs, resident memory on CPUs.

On CPUs the figure is anonymous RSS (heap, tensors: what training grows) plus the pages of memory-mapped
safetensors files that became resident during the work: transformers maps a safetensors model's weights from their
file, so they are resident as file pages, not anonymous ones. Other file pages (shared libraries' code run for the
first time, a dataset read through np.memmap) are reclaimable page cache the planner does not predict, and are left
out, so the figure compares with the planner's prediction plus the process baseline (`anon_rss_mb`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from onn.errors import UserError

log = logging.getLogger("onn")

if TYPE_CHECKING:
    import torch

MB = 1024**2
PAGE = 4096  # CUDA page-locks host memory in whole pages


def anon_rss_mb() -> float:
    """This process's anonymous resident memory now (Linux: one small read of /proc/self/status, cheap to sample
    every 20 ms), else its whole RSS: its baseline, without the shared libraries' pages."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / MB


def mapped_weights_mb() -> float:
    """Resident MB of this process's memory-mapped safetensors files (Linux's /proc/self/smaps; elsewhere 0). One
    read costs tens of milliseconds in a process of a thousand mappings, so it is read at a measurement's ends only:
    mapped weights stay mapped while the model lives."""
    total, counting = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if not key.endswith(":"):  # a mapping's header: address range, permissions, ..., its file
                    counting = line.rstrip().endswith(".safetensors")
                elif counting and key == "Rss:":
                    total += int(rest.split()[0])
    except OSError:
        return 0.0
    return total / 1024


class PeakMemory:
    """Context manager: `.peak_mb` after exit (CUDA max allocated; on CPU, sampled anonymous RSS plus the
    safetensors weights' pages that became resident since entry)."""

    def __init__(self, device: str = "cpu", interval_s: float = 0.02):
        self.device, self.interval_s = device, interval_s
        self.cuda = str(device).startswith("cuda")  # "cuda", or "cuda:N": this process's GPU
        self.peak_mb = 0.0
        self._weights_mb = 0.0  # mapped weights resident at entry: the baseline's
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_mb, self._weights_mb = anon_rss_mb(), mapped_weights_mb()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, anon_rss_mb())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self.peak_mb = torch.cuda.max_memory_allocated() / MB
        else:
            self._stop.set()
            self._thread.join()
            weights = max(0.0, mapped_weights_mb() - self._weights_mb)
            self.peak_mb = max(self.peak_mb, anon_rss_mb()) + weights


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator's failure told as a RuntimeError (the CPU's; Triton's launch of a
    kernel on a full GPU)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def cap_gpu_memory(mb: float) -> None:
    """Hold PyTorch's CUDA allocator to `mb` (hardware.budget_mb less the context): a run planned for a
    smaller card than this one allocates as that card would let it, and an allocation beyond it is an
    out-of-memory error (which the training step's back-off handles) rather than a quiet overshoot. A budget the
    context alone fills is one sentence: a cap of nothing failed every allocation, and the back-off with them."""
    if mb <= 0:
        raise UserError(
            f"hardware.budget_mb is {-mb:,.0f} MB short of the CUDA context this process holds beside its tensors "
            "(plan.yaml's context_mb), which leaves PyTorch nothing to allocate: give a budget above the context, or "
            "null for the whole GPU."
        )
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, mb * MB / total)))


def release_gpu() -> None:
    """Give back what a run left on the GPU and lift the allocator's cap, for the next run in this process (a
    sweep's job, a notebook's cell): the cap is process-wide, so a job planned without a budget would allocate
    under the last one's, and memory the allocator keeps cached reads as used to the next profile, which would
    plan with less."""
    import gc

    import torch

    if not torch.cuda.is_initialized():
        return
    gc.collect()  # a Trainer and its module refer to each other: only the collector frees them
    try:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    except RuntimeError as error:  # a CUDA error the run raised stays with the device: the run's own is what to say
        log.debug("the GPU's memory was not given back: %s", error)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of `nbytes`, page-locked, so that the GPU's copy engine reads it at the link's speed
    while the GPU computes. torch's pinned allocator (`pin_memory=True`, `.pin_memory()`) rounds every
    allocation up to a power of two: a Phi-4 block's int8 tensors would lock 480 MiB of host memory for 325, and
    the store half as much again as the plan counts. This registers ordinary memory with CUDA instead, as torch's
    own checkpoint stager does: the whole pages inside one allocation of `nbytes` and two pages (CUDA locks
    whole pages, and two registrations may not share one), unregistered when the last tensor viewing it is
    freed. `is_pinned()` asks about the allocation's first byte, outside the locked pages, and says False; copies
    from the buffer run asynchronously all the same."""
    import torch
    from torch.cuda import _pin_memory_utils as pins

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE
    start, length = raw.data_ptr() + offset, -(-nbytes // PAGE) * PAGE
    try:
        pins.pin_memory(start, length)
    except RuntimeError as e:  # no fallback: CUDA keeps the failed call's error for the next kernel launch
        raise UserError(
            f"CUDA could not page-lock {nbytes / MB:,.0f} MB of host memory for the GPU's copies ({e}); free host "
            "memory, or keep the layer store on disk with fewer blocks in host memory (strategy.streaming.store=disk "
            "strategy.streaming.cache_blocks=N)."
        ) from None
    # the storage object lives as long as any tensor views it
    unregister = weakref.finalize(raw.untyped_storage(), _unpin, start)
    unregister.atexit = False  # at exit the CUDA context may be gone before the storage
    return raw[offset : offset + nbytes]


def _unpin(start: int) -> None:
    """Unregister what pinned_empty registered at `start`. A CUDA context that failed (a device-side assert is
    sticky) refuses every call: the run reports that error once, where torch's own unpin raised an AssertionError
    that Python printed as a traceback for every freed buffer (a layer store frees one per tensor)."""
    from torch.cuda import _pin_memory_utils as pins

    try:
        pins.unpin_memory(start)
    except (AssertionError, RuntimeError) as error:
        log.debug("page-locked host memory was not unregistered: %s", error)


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into page-locked host memory of its own (pinned_empty)."""
    buffer = pinned_empty(tensor.numel() * tensor.element_size())
    return buffer.view(tensor.dtype).reshape(tensor.shape).copy_(tensor)


MMAP_MIN, MMAP_MAX = 1 << 20, 32 << 20  # the threshold's floor, and glibc's own largest dynamic one
_held: list[int] = []  # the thresholds this process set (release_mmap_threshold undoes them)
GLIBC_MMAP_START = 128 << 10  # glibc's mmap threshold before anything raises it
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters


def hold_mmap_threshold(size: int = GLIBC_MMAP_START) -> None:
    """Fix glibc's mmap threshold at `size` bytes, and its trim threshold at twice that (glibc's own pairing):
    every buffer that large or larger is mapped on its own and unmapped when freed, the thresholds no longer
    rise, and the heap's free top goes back to the OS. By default glibc raises the mmap threshold to the size of
    every mapped buffer freed (up to 32 MiB) and the trim threshold to twice it: after a model's weights (MBs
    each) are freed, activations of the same sizes come from heaps that keep their freed pages. A DiT of 24
    blocks of width 512 streamed at batch 16 then peaked 330 MB above its process's baseline, with the thresholds
    held from before the model's build ~100 MB, held only after it 175-179 MB (onn/bench/streamed_arch.py): hold
    them before a streamed network's weights are built. Process-wide until `release_mmap_threshold`; a no-op where
    libc is not glibc."""
    _mallopt(M_MMAP_THRESHOLD, size)
    _mallopt(M_TRIM_THRESHOLD, 2 * size)
    _held.append(size)


def release_mmap_threshold() -> None:
    """Undo `hold_mmap_threshold` and `return_large_frees_to_os` for what this process runs next (the runner calls
    it when a run ends): glibc's thresholds at the largest its own rule raises them to (32 MiB, trim 64 MiB), since
    glibc has no call that brings its rule back. A run in a long-lived process (a notebook, a test worker) left
    the next run's activations mapped and unmapped at every step: a CNN trained 10x slower after a streamed DiT's
    run in the same process. Nothing when nothing was held."""
    if _held:
        _mallopt(M_MMAP_THRESHOLD, MMAP_MAX)
        _mallopt(M_TRIM_THRESHOLD, 2 * MMAP_MAX)
        _held.clear()


def _mallopt(param: int, value: int) -> None:
    import contextlib
    import ctypes
    import sys

    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").mallopt(param, int(value))


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): a streamed network's weights, built in
    memory and then moved to the layer store, leave their freed pages in the heap where the build allocated them
    there (before the thresholds were held). A no-op where libc is not glibc."""
    import contextlib
    import ctypes
    import gc
    import sys

    gc.collect()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def return_large_frees_to_os(smallest: int = MMAP_MIN) -> None:
    """Make glibc give every freed buffer of `smallest` bytes or more (within 1 .. 32 MiB) straight back to
    the OS: the streaming engine passes its smallest streamed weight matrix when it decodes weights (a
    zero-copy stream keeps glibc's own threshold, see StreamingEngine).

    By default glibc raises its mmap threshold after a large buffer is freed, so later block-sized
    buffers come from heaps that never shrink: streaming 32 blocks through memory then grew a
    step's resident memory by ~450 MB instead of ~100 MB. Fixing the threshold keeps streamed
    weights from piling up. Below it, activations stay in the heap: a threshold of 64 KiB (earlier) sent
    every activation through mmap and its page faults, which made Phi-4's streamed step 10% slower and a
    tiny model's 2.5x slower. The setting is process-wide until `release_mmap_threshold`. A no-op where libc
    is not glibc."""
    _mallopt(M_MMAP_THRESHOLD, min(max(int(smallest), MMAP_MIN), MMAP_MAX))
    _held.append(int(smallest))


@contextlib.contextmanager
def large_frees_returned(smallest: int = MMAP_MIN) -> Iterator[None]:
    """`return_large_frees_to_os` for the with-block only (a model's build, block after block), then glibc's
    largest thresholds (`release_mmap_threshold`) where nothing held them before it. Held on, the 1 MiB
    threshold sent the training step's activations of 1 MiB and more through mmap: llama_small's streamed
    backward took 220,000 page faults a step and ran 1.5x the time of the same step in a process that never held
    it (task=bench, whose measuring process builds the model so)."""
    fresh = not _held
    return_large_frees_to_os(smallest)
    try:
        yield
    finally:
        if fresh:
            release_mmap_threshold()
