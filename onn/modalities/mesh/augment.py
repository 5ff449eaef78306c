"""Point-cloud batch augmentation on the compute device, with random parameters drawn per sample.

In training every point set of the batch gets its own random rotation about the up axis (or, for
shapes with no up, a uniformly random 3D rotation), its own scale and per-point Gaussian jitter (clipped),
as PointNet and its successors train; normals (when the data has them) turn with their points and are not
scaled or jittered. In evaluation the batch passes unchanged (as float32).
"""

from __future__ import annotations

import math

import torch

from onn.config.data import MeshAugment
from onn.errors import UserError

ROTATIONS = ("up", "any", "none")
AXES = {"x": 0, "y": 1, "z": 2}


class PointAugment:
    """rotate (up: about data.augment.up_axis; any: uniformly in 3D), scale (uniform in [low, high]),
    jitter (sigma, clipped). data.augment=null (None) augments nothing; unset keys are the schema's (off)."""

    def __init__(self, cfg: MeshAugment | None):
        cfg = cfg if cfg is not None else MeshAugment()
        self.rotate = cfg.rotate
        if self.rotate not in ROTATIONS:
            raise UserError(
                f"data.augment.rotate={self.rotate!r}: give up (a random turn about the up axis), any (a random "
                "3D rotation, for shapes with no up) or none."
            )
        axis = str(cfg.up_axis).lower()
        if axis not in AXES:
            raise UserError(f"data.augment.up_axis={axis!r}: give x, y or z (the axis that points up in your files).")
        self.up = AXES[axis]
        scale = cfg.scale
        self.scale = None
        if scale is not None:
            values = list(scale)
            if (
                len(values) != 2
                or not all(isinstance(v, int | float) for v in values)
                or not 0 < values[0] <= values[1]
            ):
                raise UserError(f"data.augment.scale={scale!r}: give [low, high] with 0 < low <= high, or null.")
            self.scale = (float(values[0]), float(values[1]))
        self.jitter = float(cfg.jitter)
        self.clip = float(cfg.jitter_clip)
        if self.jitter < 0 or self.clip < 0:
            raise UserError(f"data.augment.jitter and jitter_clip must be 0 or more (got {self.jitter}, {self.clip}).")

    def __call__(self, points: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        """float [B, P, 3|6] -> float32 [B, P, 3|6]; augmented only when train is True."""
        if points.dim() != 3 or points.shape[-1] not in (3, 6):
            raise ValueError(f"PointAugment expects a [B, points, 3|6] batch, got {tuple(points.shape)}")
        x = points.float()
        if not train:
            return x
        xyz, normals = x[..., :3], x[..., 3:]
        b, device, g = x.shape[0], x.device, generator
        if self.rotate != "none":
            if self.rotate == "up":
                turn = _turn(torch.rand(b, device=device, generator=g) * (2 * math.pi), self.up)
            else:
                turn = _any_turn(torch.randn(b, 4, device=device, generator=g))
            xyz = xyz @ turn
            normals = normals @ turn if normals.shape[-1] else normals
        if self.scale is not None:
            low, high = self.scale
            xyz = xyz * (low + (high - low) * torch.rand(b, 1, 1, device=device, generator=g))
        if self.jitter > 0:
            noise = torch.randn(xyz.shape, device=device, generator=g) * self.jitter
            xyz = xyz + (noise.clamp(-self.clip, self.clip) if self.clip > 0 else noise)
        return torch.cat([xyz, normals], dim=-1) if normals.shape[-1] else xyz


def _turn(angle: torch.Tensor, up: int) -> torch.Tensor:
    """[B, 3, 3] rotations by `angle` about axis `up`, for row vectors (points @ R)."""
    cos, sin = angle.cos(), angle.sin()
    a, b = [i for i in range(3) if i != up]
    turn = torch.zeros(angle.shape[0], 3, 3, device=angle.device)
    turn[:, up, up] = 1
    turn[:, a, a], turn[:, a, b], turn[:, b, a], turn[:, b, b] = cos, sin, -sin, cos
    return turn


def _any_turn(q: torch.Tensor) -> torch.Tensor:
    """[B, 3, 3] uniformly random rotations from Gaussian quaternions [B, 4], for row vectors (points @ R)."""
    w, x, y, z = (q / q.norm(dim=1, keepdim=True)).unbind(1)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]
    return torch.stack([torch.stack(r, dim=1) for r in rows], dim=1).transpose(1, 2)
