"""The ONN zoo's audio CNN: conv blocks on a log-mel spectrogram, global pooling, a linear head.

Sized for short sounds (spoken words, sound events: tens of mel bands, tens to hundreds of frames).
Each block is v28's ConvBlock (two 3x3 conv + BatchNorm + LeakyReLU, then 2x2 max pooling); a pooling
step is skipped on an axis that is already down to 1. Global average pooling over frequency and time
makes the network indifferent to where in the clip the sound sits and to the clip's length. It follows
timm's small contract (`pretrained_cfg`, `num_features`, `reset_classifier`) like v28.
"""

from __future__ import annotations

from torch import nn

from onn.models.zoo.sizes import image_sides
from onn.models.zoo.v28 import ConvBlock


class AudioCNN(nn.Module):
    """conv blocks (16, 32, 64, 128 filters) -> global average pool -> dropout -> classes."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int | list[int] = 64,
        widths: tuple[int, ...] = (16, 32, 64, 128),
        convs_per_block: int = 2,
        dropout: float = 0.3,
        negative_slope: float = 0.01,
    ):
        super().__init__()
        blocks, channels = [], in_channels
        for width in widths:
            blocks.append(ConvBlock(channels, width, convs_per_block, negative_slope))
            channels = width
        self.features = nn.Sequential(*blocks)
        given = image_sides(image_size)
        size = list(given)
        for block in self.features:  # 2x2 pooling, on each axis only while it is 2 or longer
            pool = block[-1]
            kernel = (2 if size[0] >= 2 else 1, 2 if size[1] >= 2 else 1)
            pool.kernel_size = pool.stride = kernel
            size = [size[0] // kernel[0], size[1] // kernel[1]]
        # parameter-free modules between the two Sequentials, so LayerMap discovery finds the conv blocks
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential()
        self.classifier.add_module("drop", nn.Dropout(dropout))
        self.classifier.add_module("head", nn.Linear(channels, num_classes))
        self.num_classes = num_classes
        self.num_features = channels
        self.pretrained_cfg = {
            "first_conv": "features.0.0",
            "classifier": "classifier.head",
            "input_size": (in_channels, *given),
        }

    def forward(self, x):
        return self.classifier(self.flatten(self.pool(self.features(x))))

    def reset_classifier(self, num_classes: int = 0) -> None:
        """timm's contract: a new head for num_classes, or none (the model returns features) for 0."""
        self.num_classes = num_classes
        self.classifier.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
