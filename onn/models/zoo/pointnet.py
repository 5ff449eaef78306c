"""The ONN zoo's PointNet: a shared per-point MLP, a symmetric max pool, a dense head (Qi et al. 2017).

Input [batch, points, channels] (xyz, or xyz + normals): every point goes through the same MLP (1x1
convolutions with BatchNorm and ReLU); the max over the points (`pooling` may add their mean, whose
densities tell apart shapes whose extremes agree) makes the result independent of the points' order;
an MLP head with dropout gives the classes (no BatchNorm there: it must run on a batch of one, as the
planner runs it). The paper's input and feature transform networks (T-Nets) are left out: rotation
augmentation, or turning shapes onto their principal axes (data.align=pca), does their work at a
fraction of the cost. It follows timm's small contract (`num_features`, `reset_classifier`,
`pretrained_cfg`) so a linear probe and the exporter treat it like the image networks.
"""

from __future__ import annotations

import torch
from torch import nn

from onn.errors import UserError

POOLS = ("max", "mean")


class PointBlock(nn.Sequential):
    """A per-point layer: 1x1 conv (no bias) -> BatchNorm -> ReLU, on [batch, channels, points]."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            nn.Conv1d(in_channels, out_channels, 1, bias=False),
            nn.BatchNorm1d(out_channels),
            nn.ReLU(inplace=True),
        )


class PointPool(nn.Module):
    """[batch, channels, points] -> [batch, channels x len(pooling)]: max and/or mean over the points,
    symmetric functions, so the order of the points does not matter."""

    def __init__(self, pooling: tuple[str, ...] | str):
        super().__init__()
        pooling = (pooling,) if isinstance(pooling, str) else tuple(pooling)  # `pooling: mean` names one, not 4 letters
        if not pooling or set(pooling) - set(POOLS):
            raise UserError(f"zoo:pointnet: pooling {list(pooling)} must name one or more of {', '.join(POOLS)}.")
        self.pooling = tuple(pooling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [x.amax(dim=2) if pool == "max" else x.mean(dim=2) for pool in self.pooling]
        return torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]


class PointNet(nn.Module):
    """points [B, P, C] -> shared MLP (widths) -> max (and mean) over points -> head (hidden) -> classes."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        num_points: int = 1024,
        widths: tuple[int, ...] = (64, 128, 256),
        hidden: tuple[int, ...] = (128,),
        dropout: float = 0.3,
        pooling: tuple[str, ...] | str = ("max",),
    ):
        super().__init__()
        blocks, channels = [], in_channels
        for width in widths:
            blocks.append(PointBlock(channels, width))
            channels = width
        self.features = nn.Sequential(*blocks)
        # a module of its own (no parameters) between the two Sequentials: LayerMap discovery would
        # otherwise take [features, pre_logits] as a run of two blocks
        self.pool = PointPool(pooling)
        channels *= len(self.pool.pooling)
        layers = []
        for width in hidden:
            layers += [nn.Linear(channels, width), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            channels = width
        self.pre_logits = nn.Sequential(*layers)
        self.num_features = channels
        self.head = nn.Linear(channels, num_classes) if num_classes > 0 else nn.Identity()
        self.pretrained_cfg = {"input_size": (num_points, in_channels), "classifier": "head"}

    def forward_features(self, points: torch.Tensor) -> torch.Tensor:
        """[B, P, C] -> the pooled, pre-logits features [B, num_features]."""
        return self.pre_logits(self.pool(self.features(points.transpose(1, 2))))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(points))

    def reset_classifier(self, num_classes: int) -> None:
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
