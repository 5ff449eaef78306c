"""Video datasets for Lightning: decoded once into a uint8 clip store, held on the compute device.

Every clip is decoded (onn.modalities.video.decode) to data.decode_frames frames (data.frames when null)
sampled evenly in time at data.image_size: uint8 [N, C, T, H, W], cached as safetensors keyed by the
source's content and these settings (onn.data.cache). Temporal sampling, augmentation and normalisation
run on the batch, on the device (onn.modalities.video.transform). A dataset too big to hold is streamed.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from typing import Any

import torch

from onn.data.cache import cached_decode
from onn.data.files import content_digest, existing_source
from onn.data.labelled import list_labelled
from onn.data.media import ListedItems, MediaReader, decode_listing
from onn.data.resident import ClassificationData, Decoded
from onn.modalities.video import SUFFIXES
from onn.modalities.video.decode import BadFile, Fit, fit_settings, load

DTYPE = torch.uint8
HINT = "a folder of video clips (one folder per class), an archive of one, or one file"


def resolve(source: str, data_cfg: dict[str, Any], cache_dir: str | os.PathLike) -> str:
    """The path of a source; `builtin:motion` is generated (once) under the cache folder."""
    if str(source).startswith("builtin:"):
        from onn.modalities.video.builtin import generated

        return str(generated(str(source), data_cfg, cache_dir))
    return os.path.expanduser(str(source))


def listing(source: str, data_cfg: dict[str, Any], key: str, allow_unlabelled: bool = False):
    return list_labelled(source, SUFFIXES, label_from=data_cfg["label_from"], label_column=data_cfg["label_column"],
                         kind="video", key=key, allow_unlabelled=allow_unlabelled)  # fmt: skip


def read(source: str, data_cfg: dict[str, Any], fit: Fit, key: str = "data.source", allow_unlabelled: bool = False,
         workers: int = 1) -> tuple[dict[str, Decoded], float]:  # fmt: skip
    """{split: Decoded} of a source and the seconds of video decoded, from the files (no cache)."""
    found = listing(source, data_cfg, key, allow_unlabelled)
    return decode_listing(found, functools.partial(load, fit=fit), BadFile, dtype=DTYPE,
                          max_bad_fraction=float(data_cfg["max_bad_fraction"]), path=source, key=key, kind="video",
                          workers=workers)  # fmt: skip


def read_cached(
    source: str, data_cfg: dict[str, Any], cache_dir: str | os.PathLike, key: str = "data.source"
) -> dict[str, Decoded]:
    """{split: Decoded} for a source, decoded once and then read from the safetensors cache."""
    path = resolve(source, data_cfg, cache_dir)
    existing_source(path, key, HINT)
    fit = fit_settings(data_cfg)
    settings = {"fit": asdict(fit), "label_from": data_cfg["label_from"], "label_column": data_cfg["label_column"],
                "max_bad_fraction": data_cfg["max_bad_fraction"]}  # fmt: skip
    return cached_decode("video", {"digest": content_digest(path), **settings}, cache_dir,
                         lambda: read(path, data_cfg, fit, key, workers=int(data_cfg["num_workers"]) or 1)[0], path)  # fmt: skip


def fit_of(inputs: dict[str, Any]) -> Fit:
    """The decoding settings a checkpoint's `inputs` hold."""
    return Fit(**{**inputs["fit"], "size": tuple(inputs["fit"]["size"])})


class VideoDataModule(ClassificationData):
    """train / val / test splits of a video dataset, resident on the device or streamed."""

    same_shape_hint = "every split is decoded with the same data.frames, data.image_size and data.channels"

    def read(self, source: str, key: str) -> dict[str, Decoded]:
        return read_cached(source, self.cfg, self.cache_dir, key)

    def list_items(self, source: str):
        found = listing(resolve(source, self.cfg, self.cache_dir), self.cfg, "data.source")
        loader = functools.partial(load, fit=fit_settings(self.cfg))
        return {
            split: ListedItems(files, found.classes, loader, BadFile, DTYPE)
            for split, files in found.splits.items()
        }


READER = MediaReader(read, read_cached, listing, load, fit_of, BadFile, DTYPE)
