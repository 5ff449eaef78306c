"""Listed media files (onn.data.labelled) decoded into tensors: all at once for the resident store, or one
at a time for streaming. The modality brings the decoder: `load(source) -> (tensor, seconds)`, raising its
`bad` exception type for a file it cannot use; such files are skipped, counted and named."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from onn.data.labelled import Listing, MediaFile, check_bad, report_left_out
from onn.data.resident import Decoded

log = logging.getLogger("onn")

Loader = Callable[[object], tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class MediaReader:
    """A media modality's decoding entry points (what task=bench_media times, and inference reads with)."""

    read: Callable  # (source, data_cfg, fit, key=, allow_unlabelled=, workers=) -> ({split: Decoded}, seconds decoded)
    read_cached: (
        Callable  # (source, data_cfg, cache_dir, key=) -> {split: Decoded}, through the decoded cache
    )
    listing: Callable  # (source, data_cfg, key) -> onn.data.labelled.Listing
    load: Callable  # (file source, fit) -> (stored tensor, seconds): one file
    fit: Callable  # inputs -> the decoding settings a checkpoint's inputs hold
    bad: type[Exception]  # what `load` raises for a file it cannot use
    dtype: torch.dtype  # the stored dtype


def decode_listing(listing: Listing, load: Loader, bad: type[Exception], *, dtype: torch.dtype, max_bad_fraction: float,
                   path: str, key: str, kind: str, workers: int = 1) -> tuple[dict[str, Decoded], float]:  # fmt: skip
    """{split: Decoded} of every listed file, and the seconds of media decoded. The decoders release the
    GIL (libsndfile, FFmpeg), so `workers` threads decode side by side."""
    report_left_out(listing, path, key, kind)
    index = {c: i for i, c in enumerate(listing.classes)}
    files = [f for split in listing.splits.values() for f in split]

    def one(f: MediaFile):
        try:
            x, seconds = load(f.source.open())
            return x.to(dtype), seconds, None
        except bad as e:
            return None, 0.0, f"{f.name}: {e}"
        except OSError as e:  # unreadable (permissions, a file that vanished)
            return None, 0.0, f"{f.name}: cannot be read ({e.strerror or e})"

    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = dict(zip((id(f) for f in files), pool.map(one, files)))
    skipped = list(listing.refused) + [r[2] for r in results.values() if r[2]]
    check_bad(skipped, len(files) + len(listing.refused), max_bad_fraction, path, key, kind)
    out, seconds = {}, 0.0
    for n, (split, members) in enumerate(listing.splits.items()):
        good = [(f, results[id(f)]) for f in members if results[id(f)][0] is not None]
        if not good:
            continue
        seconds += sum(r[1] for _, r in good)
        labels = np.array([index[f.label] if f.label is not None else -1 for f, _ in good], np.int64)
        out[split] = Decoded(torch.stack([r[0] for _, r in good]), torch.from_numpy(labels), list(listing.classes),
                             [f.name for f, _ in good],
                             [r[2] for f, r in ((f, results[id(f)]) for f in members) if r[2]] + (listing.refused if n == 0 else []))  # fmt: skip
    return out, seconds


class ListedItems:
    """One split of a listing, decoded item by item (the streamed fallback: DataLoader workers call load)."""

    def __init__(
        self,
        files: list[MediaFile],
        classes: list[str],
        load: Loader,
        bad: type[Exception],
        dtype: torch.dtype,
    ):
        self.files, self.classes, self._load, self._bad, self._dtype = files, classes, load, bad, dtype
        index = {c: i for i, c in enumerate(classes)}
        self.labels = np.array([index[f.label] if f.label is not None else -1 for f in files], np.int64)

    def __len__(self) -> int:
        return len(self.files)

    def load(self, i: int) -> torch.Tensor | None:
        f = self.files[i]
        try:
            return self._load(f.source.open())[0].to(self._dtype)
        except (self._bad, OSError) as e:
            log.warning("skipped %s: %s", f.name, e)
            return None
