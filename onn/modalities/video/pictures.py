"""A picture of video predictions: a strip of each clip's sampled frames, captioned with its predicted (and true)
class."""

from __future__ import annotations

from pathlib import Path

import torch

from onn.modalities.image.pictures import write_grid

MAX_FRAMES = 8  # frames drawn per strip


def strips(clips: torch.Tensor, gap: int = 2) -> torch.Tensor:
    """uint8 [N, C, T, H, W] -> uint8 [N, C, H, k*W + (k-1)*gap]: up to MAX_FRAMES evenly spaced frames side
    by side, a grey gap between them."""
    n, c, t, h, w = clips.shape
    index = torch.linspace(0, t - 1, min(t, MAX_FRAMES)).round().long()
    chosen = torch.nn.functional.pad(clips[:, :, index], (0, gap), value=128)  # [N, C, k, H, W + gap]
    return chosen.permute(0, 1, 3, 2, 4).reshape(n, c, h, len(index) * (w + gap))[..., :-gap].contiguous()


def write(clips: torch.Tensor, predicted: list[str], true: list[str | None], path: Path) -> None:
    images = strips(clips.cpu())
    height = images.shape[-2]
    write_grid(images, predicted, true, path, columns=2, scale=max(1, min(3, 96 // max(height, 1))))
