"""What the GPU did during a profiled step: busy copying over the host link, busy computing, and both at once.

A streamed step copies the next chunk to the device on the engine's copy stream while the current chunk's
kernels run on the compute stream. How much of the copying is hidden is the time both were busy together,
which only the GPU's own clock shows: a host thread waiting for a copy also waits for every kernel queued
before it, so the engine's host timings count compute as I/O. torch.profiler records each kernel and copy
the GPU ran, with its start and end; this reads them as intervals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.autograd import DeviceType

LINK_COPIES = ("Memcpy HtoD", "Memcpy DtoH")  # CUPTI's names for copies across the host link


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals` as sorted, disjoint (start, end) pairs."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where two unions (each sorted and disjoint, as `merged` gives) are both busy."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gpu_timeline(events: Iterable[Any]) -> dict[str, float]:
    """Seconds of a profiled region's GPU activity (torch.profiler's `events()`): `io_s` busy copying across
    the host link (either way), `compute_s` busy with anything else (kernels, copies within the device),
    `overlap_s` both at once, `idle_s` neither between the first activity and the last (`span_s`), and
    `copies_hidden` the share of the copying done under compute. Empty where the profiler saw no GPU activity."""
    device = [
        e
        for e in events  # a user annotation's range on the GPU's timeline is no work of its own
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.time_range.end > e.time_range.start
    ]
    if not device:
        return {}
    link = merged((e.time_range.start, e.time_range.end) for e in device if e.name.startswith(LINK_COPIES))
    work = merged((e.time_range.start, e.time_range.end) for e in device if not e.name.startswith(LINK_COPIES))
    busy = merged(link + work)
    io, compute, both = total(link), total(work), total(intersection(link, work))
    span = busy[-1][1] - busy[0][0]
    us = 1e-6  # the profiler's clock is in microseconds
    return {
        "io_s": io * us,
        "compute_s": compute * us,
        "overlap_s": both * us,
        "idle_s": (span - total(busy)) * us,
        "span_s": span * us,
        "copies_hidden": both / io if io else 0.0,
    }
