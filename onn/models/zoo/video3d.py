"""The ONN zoo's tiny 3-D CNN for clips: a few C3D-style blocks, global pooling, a linear head.

A block is 3x3x3 conv + BatchNorm + ReLU, then max pooling: over space only in the first block (motion
is read from neighbouring frames before time is pooled), over time and space after it, on each axis only
while it is longer than 1. Input [B, C, T, H, W], as torchvision's video ResNets take it. Small enough to
train on CPUs in minutes (the synthetic motion recipe); the video ResNets are for real footage on GPUs.
"""

from __future__ import annotations

from torch import nn

from onn.models.zoo.sizes import image_sides


class Conv3dBlock(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int, pool: tuple[int, int, int]):
        super().__init__(
            nn.Conv3d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm3d(out_channels),
            nn.ReLU(inplace=True),
            nn.MaxPool3d(pool),
        )


class C3DTiny(nn.Module):
    """3-D conv blocks (16, 32, 64 filters) -> global average pool -> dropout -> classes."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        frames: int = 8,
        image_size: int | list[int] = 32,
        widths: tuple[int, ...] = (16, 32, 64),
        dropout: float = 0.2,
    ):
        super().__init__()
        size = image_sides(image_size)
        t, h, w = int(frames), size[0], size[1]
        blocks, channels = [], in_channels
        for i, width in enumerate(widths):
            pool = (2 if i > 0 and t >= 2 else 1, 2 if h >= 2 else 1, 2 if w >= 2 else 1)
            blocks.append(Conv3dBlock(channels, width, pool))
            channels, t, h, w = width, t // pool[0], h // pool[1], w // pool[2]
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential()
        self.classifier.add_module("drop", nn.Dropout(dropout))
        self.classifier.add_module("head", nn.Linear(channels, num_classes))
        self.num_classes = num_classes
        self.num_features = channels
        self.pretrained_cfg = {
            "first_conv": "features.0.0",
            "classifier": "classifier.head",
            "input_size": (in_channels, int(frames), *size),
        }

    def forward(self, x):
        return self.classifier(self.flatten(self.pool(self.features(x))))

    def reset_classifier(self, num_classes: int = 0) -> None:
        """timm's contract: a new head for num_classes, or none (the model returns features) for 0."""
        self.num_classes = num_classes
        self.classifier.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
