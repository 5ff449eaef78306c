"""Clip batches on the compute device: temporal sampling, augmentation the same for every frame, normalising.

The stored batch is uint8 [B, C, T, H, W] with T = data.decode_frames. The model sees data.frames of them:
evenly spaced for evaluation; for training with data.sampling=random, one random frame from each of
data.frames equal segments (TSN's sampling), each clip its own. Augmentation is the image track's
per-sample batch augmentation (onn.modalities.image.augment: crop with padding, flip, colour jitter,
random erasing), run once per frame with its random generator reset to the same seed, so every frame of
a clip gets the same crop, flip, jitter and erased box while different clips get different ones.
Output: float32 [B, C, frames, H, W], normalised by the per-channel mean and std.
"""

from __future__ import annotations

import torch

from onn.config.data import ImageAugment
from onn.errors import UserError
from onn.modalities.image.augment import BatchAugment

SAMPLING = ("uniform", "random")
STATS_ELEMENTS = 1 << 22  # pixel values per chunk when measuring mean/std: 32 MB in float64, whatever the clip size


class ClipTransform:
    def __init__(self, augment: ImageAugment | None, mean: list[float], std: list[float], frames: int, sampling: str):
        if sampling not in SAMPLING:
            raise UserError(
                f"data.sampling={sampling!r}: use uniform or random (training picks random frames, one per segment)."
            )
        self.augment = BatchAugment(augment, mean, std)
        self.random_augment = self.augment.random
        self.frames, self.sampling = int(frames), sampling

    def __call__(self, clips: torch.Tensor, train: bool) -> torch.Tensor:
        if clips.dtype != torch.uint8 or clips.dim() != 5:
            raise ValueError(
                f"ClipTransform expects a uint8 [B, C, T, H, W] batch, got {clips.dtype} {tuple(clips.shape)}"
            )
        clips = self._sample(clips, train)
        b, c, t, h, w = clips.shape
        if not (train and self.random_augment):
            frames = clips.transpose(1, 2).reshape(b * t, c, h, w)
            return self.augment(frames, train=False).view(b, t, c, h, w).transpose(1, 2)
        seed = int(torch.randint(0, 2**62, (1,)))  # from the run's seeded generator
        generator = torch.Generator(device=clips.device)
        out = []
        for i in range(t):
            generator.manual_seed(seed)  # the same draws for every frame: one crop/flip/jitter per clip
            out.append(self.augment(clips[:, :, i], train=True, generator=generator))
        return torch.stack(out, dim=2)

    def _sample(self, clips: torch.Tensor, train: bool) -> torch.Tensor:
        b, _, stored = clips.shape[:3]
        n = self.frames
        if stored == n:
            return clips
        if train and self.sampling == "random":
            edges = torch.linspace(0, stored, n + 1, device=clips.device)
            width = (edges[1:] - edges[:-1]).clamp_min(1)
            index = (edges[:-1] + torch.rand(b, n, device=clips.device) * width).floor().long().clamp_max(stored - 1)
        else:
            index = torch.linspace(0, stored - 1, n, device=clips.device).round().long().expand(b, n)
        shape = clips.shape
        gather = index.view(b, 1, n, 1, 1).expand(b, shape[1], n, shape[3], shape[4])
        return clips.gather(2, gather)


def measure_stats(clips: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 clips [N, C, T, H, W] in [0, 1], over up to 500 clips."""
    picks = torch.randperm(len(clips), generator=torch.Generator().manual_seed(0))[:500].to(clips.device)
    total = torch.zeros(clips.shape[1], dtype=torch.float64, device=clips.device)
    squares, count = torch.zeros_like(total), 0
    # 50 clips of 16 x 224 px in float64 were 1 GB a copy: chunks of a fixed size in values
    rows = max(1, STATS_ELEMENTS // max(1, clips.shape[1:].numel()))
    for chunk in picks.split(rows):
        x = clips[chunk].to(torch.float64).transpose(0, 1).flatten(1) / 255
        total += x.sum(1)
        squares += (x * x).sum(1)
        count += x.shape[1]
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(1e-6).sqrt()
    return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in std]
