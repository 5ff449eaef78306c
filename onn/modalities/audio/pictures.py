"""A picture of audio predictions: each clip's log-mel spectrogram, captioned with its predicted (and true) class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onn.modalities.image.pictures import write_grid


def spectrograms(waves: torch.Tensor, transform) -> torch.Tensor:
    """float waveforms [N, C, samples] -> uint8 images [N, 1, n_mels, frames] of their first channel's
    log-mels in dB (each scaled from its floor to its peak), low frequencies at the bottom."""
    with torch.no_grad():
        db = transform(waves, train=False, normalize=False)[:, :1]
    low = db.amin(dim=(-2, -1), keepdim=True)
    high = db.amax(dim=(-2, -1), keepdim=True)
    scaled = (db - low) / (high - low).clamp_min(1e-6) * 255
    return scaled.flip(-2).round().to(torch.uint8).cpu()


def write(
    waves: torch.Tensor,
    predicted: list[str],
    true: list[str | None],
    path: Path,
    transform,
    inputs: dict[str, Any],
) -> None:
    images = spectrograms(waves, transform)
    height = images.shape[-2]
    scale = max(1, min(4, 96 // max(height, 1)))  # tall enough to read: 24 mels drawn 4x, 128 mels 1x
    write_grid(images, predicted, true, path, columns=4, scale=scale)
