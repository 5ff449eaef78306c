"""Audio datasets for Lightning: decoded once into a float16 waveform store, held on the compute device.

Every file is decoded (onn.modalities.audio.decode), resampled to data.sample_rate, mixed down or
channel-matched to data.channels and centre-cropped or padded to data.store_seconds (data.clip_seconds
when null): float16 [N, channels, samples], cached as safetensors keyed by the source's content and these
settings (onn.data.cache). Features (log-mels) and augmentation run on the batch, on the device
(onn.modalities.audio.features). A dataset too big to hold is streamed instead.
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
from onn.modalities.audio import SUFFIXES
from onn.modalities.audio.decode import BadFile, Fit, fit_settings, load

DTYPE = torch.float16  # 16-bit samples: half the memory of float32, and more precision than 16-bit PCM needs at the scale of a log-mel


def listing(source: str, data_cfg: dict[str, Any], key: str, allow_unlabelled: bool = False):
    return list_labelled(source, SUFFIXES, label_from=data_cfg["label_from"], label_column=data_cfg["label_column"],
                         kind="audio", key=key, allow_unlabelled=allow_unlabelled)  # fmt: skip


def read(source: str, data_cfg: dict[str, Any], fit: Fit, key: str = "data.source", allow_unlabelled: bool = False,
         workers: int = 1) -> tuple[dict[str, Decoded], float]:  # fmt: skip
    """{split: Decoded} of a source and the seconds of audio decoded, from the files (no cache)."""
    found = listing(source, data_cfg, key, allow_unlabelled)
    return decode_listing(found, functools.partial(load, fit=fit), BadFile, dtype=DTYPE,
                          max_bad_fraction=float(data_cfg["max_bad_fraction"]), path=source, key=key, kind="audio",
                          workers=workers)  # fmt: skip


def read_cached(
    source: str, data_cfg: dict[str, Any], cache_dir: str | os.PathLike, key: str = "data.source"
) -> dict[str, Decoded]:
    """{split: Decoded} for a source, decoded once and then read from the safetensors cache."""
    path = os.path.expanduser(source)
    fit = fit_settings(data_cfg)
    settings = {"fit": asdict(fit), "label_from": data_cfg["label_from"], "label_column": data_cfg["label_column"],
                "max_bad_fraction": data_cfg["max_bad_fraction"]}  # fmt: skip
    existing_source(path, key, "a folder of audio files, an archive of one, or one file")
    return cached_decode("audio", {"digest": content_digest(path), **settings}, cache_dir,
                         lambda: read(path, data_cfg, fit, key, workers=int(data_cfg["num_workers"]) or 1)[0], path)  # fmt: skip


def fit_of(inputs: dict[str, Any]) -> Fit:
    """The decoding settings a checkpoint's `inputs` hold."""
    return Fit(**inputs["fit"])


class AudioDataModule(ClassificationData):
    """train / val / test splits of an audio dataset, resident on the device or streamed."""

    same_shape_hint = (
        "every split is decoded with the same data.sample_rate, data.channels and data.clip_seconds"
    )

    def read(self, source: str, key: str) -> dict[str, Decoded]:
        return read_cached(source, self.cfg, self.cache_dir, key)

    def list_items(self, source: str):
        found = listing(source, self.cfg, "data.source")
        loader = functools.partial(load, fit=fit_settings(self.cfg))
        return {
            split: ListedItems(files, found.classes, loader, BadFile, DTYPE)
            for split, files in found.splits.items()
        }


READER = MediaReader(read, read_cached, listing, load, fit_of, BadFile, DTYPE)
