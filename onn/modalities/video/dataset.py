"""Video datasets for Lightning: decoded once into a uint8 clip store, held on the compute device.

Every clip is decoded (onn.modalities.video.decode) to data.decode_frames frames (data.frames when null)
sampled evenly in time at data.image_size: uint8 [N, C, T, H, W], cached as safetensors keyed by the
source's content and these settings (onn.data.cache). Temporal sampling, augmentation and normalisation
run on the batch, on the device (onn.modalities.video.transform). A dataset too big to hold is streamed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from onn.config.data import VideoData
from onn.data.media import MediaDataModule, MediaReader
from onn.modalities.video.decode import SUFFIXES, BadFile, Fit, fit_settings, load

DTYPE = torch.uint8
HINT = "a folder of video clips (one folder per class), an archive of one, or one file"


def resolve(source: str, data_cfg: VideoData, cache_dir: str | os.PathLike) -> str:
    """The path of a source; `builtin:motion` is generated (once) under the cache folder."""
    if str(source).startswith("builtin:"):
        from onn.modalities.video.builtin import generated

        return str(generated(str(source), data_cfg, cache_dir))
    return os.path.expanduser(str(source))


def fit_of(inputs: dict[str, Any]) -> Fit:
    """The decoding settings a checkpoint's `inputs` hold."""
    return Fit(**{**inputs["fit"], "size": tuple(inputs["fit"]["size"])})


# version 2: mirrored display matrices, cover art and transport streams cut mid-GOP decode to other clips (a512600)
READER = MediaReader("video", SUFFIXES, load, fit_settings, fit_of, BadFile, DTYPE, HINT, resolve, version=2)


class VideoDataModule(MediaDataModule):
    """train / val / test splits of a video dataset, resident on the device or streamed."""

    same_shape_hint = "every split is decoded with the same data.frames, data.image_size and data.channels"
    reader = READER
