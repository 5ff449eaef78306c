"""Point clouds drawn as small pictures: each one seen from above and aside, shaded by depth.

Inference captions these with their predicted (and true) classes in the image track's grid
(onn/modalities/image/pictures.py), so a mesh run's predictions.png reads like an image run's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

SIZE = 96  # pixels of one drawing
AZIMUTH, ELEVATION = (
    math.radians(35),
    math.radians(25),
)  # the view: turned about the up (y) axis, then tilted down
NEAR, FAR = (
    np.array([255, 196, 80]),
    np.array([70, 60, 140]),
)  # colours of the nearest and the farthest points


def view() -> np.ndarray:
    """The 3x3 rotation from the data's frame (y up) to the camera's (x right, y up, z towards the viewer)."""
    ca, sa, ce, se = math.cos(AZIMUTH), math.sin(AZIMUTH), math.cos(ELEVATION), math.sin(ELEVATION)
    turn = np.array([[ca, 0, sa], [0, 1, 0], [-sa, 0, ca]])
    tilt = np.array([[1, 0, 0], [0, ce, -se], [0, se, ce]])
    return tilt @ turn


def render(points: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    """float [N, P, 3|6] point sets (in the unit sphere) -> uint8 [N, 3, size, size] pictures."""
    clouds = points[..., :3].detach().float().cpu().numpy() @ view().T
    out = np.zeros((len(clouds), size, size, 3), np.uint8)
    for i, p in enumerate(clouds):
        p = p[np.isfinite(p).all(axis=1)]
        radius = max(float(np.abs(p[:, :2]).max()) if len(p) else 1.0, 1e-6)
        u = np.clip(((p[:, 0] / radius + 1) / 2 * (size - 3)).astype(int) + 1, 1, size - 2)
        v = np.clip(((1 - p[:, 1] / radius) / 2 * (size - 3)).astype(int) + 1, 1, size - 2)
        near = (p[:, 2] - p[:, 2].min()) / max(float(np.ptp(p[:, 2])), 1e-6)
        colour = (FAR + (NEAR - FAR) * near[:, None]).astype(np.uint8)
        order = np.argsort(near)  # far first: nearer points are drawn over them
        for du in (0, 1):  # 2x2 splats
            for dv in (0, 1):
                out[i, v[order] + dv, u[order] + du] = colour[order]
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def write_picture(points: torch.Tensor, predicted: list[str], true: list[str | None], path: Path) -> None:
    """One PNG of the point sets drawn (render) and captioned with their predicted and true classes."""
    from onn.modalities.image.pictures import write_grid

    write_grid(render(points), predicted, true, path, scale=1)
