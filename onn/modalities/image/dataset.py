"""Image datasets for Lightning: decoded once into a uint8 cache, held on the compute device.

A source in any of the formats onn.modalities.image.formats reads is decoded once into uint8
tensors [N, C, H, W], cached as safetensors (onn.data.cache) and moved to the compute device
whole (onn.data.resident). Augmentation and normalisation run on the batch, on the device
(onn.modalities.image.augment, applied by the LightningModule). A dataset whose decoded size is
over data.resident_max_mb is streamed instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from onn.config import ONNConfig
from onn.config.data import ImageData
from onn.data.cache import cached_decode
from onn.data.files import existing_source
from onn.data.resident import ClassificationData, Decoded
from onn.errors import UserError
from onn.modalities.image.formats import list_items, read_splits, source_digest
from onn.modalities.image.formats.decode import READER_VERSION
from onn.models.zoo.sizes import image_sides

STREAM_SETTINGS = ("channels", "image_size", "resize")
STATS_ELEMENTS = 1 << 22  # pixel values per chunk when measuring mean/std: 32 MB in float64, whatever the image size

log = logging.getLogger("onn")


def decode_settings(data: ImageData) -> dict[str, Any]:
    """The keyword arguments of formats.read_splits that the data config sets (plain values: a cache key)."""
    return {
        "channels": data.channels or "auto",
        "image_size": [int(v) for v in data.image_size] if data.image_size else None,
        "resize": data.resize,
        "max_bad_fraction": float(data.max_bad_fraction),
        "num_classes": data.num_classes if isinstance(data.num_classes, int) else None,
    }


def as_trained(data: ImageData, saved: dict[str, Any] | None, ckpt: str | None) -> ImageData:
    """The data config that decodes images as the checkpoint's model was trained (`saved`: its run config, None
    without one): its channels and image size, another size resized as task=infer does. A colour data.source given to
    evaluate a greyscale model was decoded in colour, and the first batch a conv's raw channel error."""
    if saved is None:
        return data
    inputs = saved["inputs"]
    channels, height, width = (int(v) for v in inputs.get("input_shape") or inputs["image_shape"])
    size = [height, width]
    given = None if data.image_size is None else list(image_sides(data.image_size))
    if data.channels not in ("auto", channels) or (given is not None and given != size):
        log.warning(
            "ckpt %s: decoding the images as its model was trained (channels %d, image_size %s), not as the data "
            "config says (channels %s, image_size %s)",
            ckpt,
            channels,
            size,
            data.channels,
            data.image_size,
        )
    return dataclasses.replace(data, channels=channels, image_size=size, resize=trained_resize(data, saved, ckpt))


def trained_resize(data: ImageData, saved: dict[str, Any], ckpt: str | None) -> str:
    """How images of another size are brought to the model's: the checkpoint's data.resize unless the data config
    chose one (it defaults to "error"). Images given with `data=image` were stretched where training centre-cropped
    them. A model trained on images of one size ("error") has them resized. A choice that differs is said."""
    trained = saved["data"]["resize"]
    if data.resize == "error":
        return trained if trained != "error" else "resize"
    if trained not in ("error", data.resize):
        log.warning(
            "ckpt %s: its model was trained with data.resize=%s, and these images are decoded with data.resize=%s as "
            "the data config says; leave data.resize out to decode them as trained.",
            ckpt,
            trained,
            data.resize,
        )
    return data.resize


def read_cached(
    source: str, data_cfg: ImageData, cache_dir: str | os.PathLike, key: str = "data.source"
) -> dict[str, Decoded]:
    """{split: Decoded} for a source, decoded once and then read from the safetensors cache."""
    path = existing_source(source, key, "see the data config's comment")  # a link loop, a device: named as such
    settings = decode_settings(data_cfg)
    fmt = data_cfg.format or "auto"

    def decode() -> dict[str, Decoded]:
        return {
            name: Decoded(s.images, s.labels, s.classes, s.names, s.skipped)
            for name, s in read_splits(path, fmt, key=key, **settings).items()
        }

    digest = {"reader": READER_VERSION, "digest": source_digest(path, fmt), "format": fmt, **settings}
    return cached_decode("images", digest, cache_dir, decode, str(path))


class ImageDataModule(ClassificationData):
    """train / val / test splits of an image dataset, resident on the device or streamed."""

    cfg: ImageData
    same_shape_hint = "set data.image_size=[H,W]"

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.input_shape

    def read(self, source: str, key: str) -> dict[str, Decoded]:
        return read_cached(source, self.cfg, self.cache_dir, key)

    def list_items(self, source: str):
        items = list_items(source, self.cfg.format or "auto")
        for v in items.values():
            v.configure(**self._settings())
        if len({v.channels for v in items.values()}) > 1:  # grey in one split, colour in another: all in colour,
            self._colour(items)  # as a resident read widens them
        return items

    def checked(self, items, found) -> None:
        """Colour in any item (not only the first 16, which chose the channels) makes every item colour."""
        if 3 in found:
            self._colour(items)

    def _colour(self, items) -> None:
        for v in items.values():
            if v.channels != 3:
                v.configure(**{**self._settings(), "channels": 3})

    def _settings(self) -> dict[str, Any]:
        return {k: v for k, v in decode_settings(self.cfg).items() if k in STREAM_SETTINGS}


def input_stats(config: ONNConfig, dm: ImageDataModule) -> tuple[list[float], list[float]]:
    """data.mean / data.std: each as given (one number, or one per channel), or measured on the training images
    where `auto` (0.5 for streamed data). A mean given beside std=auto was replaced by the measured one."""
    channels = dm.input_shape[0]
    mean, std = given_stat(config.data.mean, "data.mean", channels), given_stat(config.data.std, "data.std", channels)
    if mean is not None and std is not None:
        return mean, std
    measured = measured_stats(dm)
    return mean or measured[0], std or measured[1]


def given_stat(value: Any, key: str, channels: int) -> list[float] | None:
    """A data.mean or data.std value as one number per channel (one number given: every channel's); None for auto
    (or null). The normalisation broadcasts one number, but an export's config (timm's mean/std) wants one per
    channel, and a count that is neither broadcast to a wrong shape or failed mid-run."""
    if value is None or value == "auto":
        return None
    values = list(value) if isinstance(value, list | tuple) else [value]
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        numbers = []
    if len(numbers) == 1:
        numbers *= channels
    if len(numbers) != channels:
        raise UserError(
            f"{key}={value!r}: give auto, one number, or {channels} numbers (one per channel of the images)."
        )
    return numbers


def measured_stats(dm: ImageDataModule) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of (up to 10,000 of) the training images in [0, 1]; 0.5 for streamed data."""
    import torch

    if dm.streamed:
        channels = dm.input_shape[0]
        return [0.5] * channels, [0.5] * channels
    images = dm.splits["train"].inputs
    picks = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:10_000].to(images.device)
    total = torch.zeros(images.shape[1], dtype=torch.float64, device=images.device)
    squares, count = torch.zeros_like(total), 0
    # 500 photos of 512 px in float64 were 3 GB a copy: chunks of a fixed size in values
    rows = max(1, STATS_ELEMENTS // max(1, images.shape[1:].numel()))
    for chunk in picks.split(rows):  # float64 sums over chunks: no float copy of the whole sample
        x = images[chunk].to(torch.float64).transpose(0, 1).flatten(1) / 255
        total += x.sum(1)
        squares += (x * x).sum(1)
        count += x.shape[1]
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(1e-6).sqrt()
    return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in std]
