"""Audio datasets for Lightning: decoded once into a float16 waveform store, held on the compute device.

Every file is decoded (onn.modalities.audio.decode), resampled to data.sample_rate, mixed down or
channel-matched to data.channels and centre-cropped or padded to data.store_seconds (data.clip_seconds
when null): float16 [N, channels, samples], cached as safetensors keyed by the source's content and these
settings (onn.data.cache). Features (log-mels) and augmentation run on the batch, on the device
(onn.modalities.audio.features). A dataset too big to hold is streamed instead.
"""

from __future__ import annotations

from typing import Any

import torch

from onn.data.media import MediaDataModule, MediaReader
from onn.modalities.audio.decode import SUFFIXES, BadFile, Fit, fit_settings, load

DTYPE = (
    torch.float16
)  # 16-bit samples: half the memory of float32, and more precision than 16-bit PCM needs at the scale of a log-mel


def fit_of(inputs: dict[str, Any]) -> Fit:
    """The decoding settings a checkpoint's `inputs` hold."""
    return Fit(**inputs["fit"])


READER = MediaReader(
    "audio",
    SUFFIXES,
    load,
    fit_settings,
    fit_of,
    BadFile,
    DTYPE,
    "a folder of audio files, an archive of one, or one file",
    # 2: float files beyond float16's range scaled (decode_audio): caches of before hold infinities; 3: a long MP3
    # or MP2 centred on its decoded length, a WAV whose header lengths were never written read (decode_audio)
    version=3,
)


class AudioDataModule(MediaDataModule):
    """train / val / test splits of an audio dataset, resident on the device or streamed."""

    same_shape_hint = "every split is decoded with the same data.sample_rate, data.channels and data.clip_seconds"
    reader = READER
