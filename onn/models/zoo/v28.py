"""The ONN zoo's v28 CNN: three conv blocks and a small MLP head, sized for 28-96 px images.

Built as features (an nn.Sequential of identical ConvBlocks) -> flatten -> classifier so that the
LayerMap discovery finds the three conv blocks as the model's repeated blocks (streaming, the
planner and the .omny exporter cut there). It follows timm's small contract (`pretrained_cfg`,
`num_features`, `reset_classifier`) so onn/models/vision.py treats zoo and timm models alike.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from onn.errors import UserError
from onn.models.zoo.sizes import image_sides


class ConvBlock(nn.Sequential):
    """convs x [3x3 conv (no bias) -> BatchNorm -> LeakyReLU], then a 2x2 max pool."""

    def __init__(self, in_channels: int, out_channels: int, convs: int, negative_slope: float):
        layers = []
        for i in range(convs):
            layers += [
                nn.Conv2d(in_channels if i == 0 else out_channels, out_channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(out_channels),
                nn.LeakyReLU(negative_slope, inplace=True),
            ]
        super().__init__(*layers, nn.MaxPool2d(2))


class V28CNN(nn.Module):
    """conv blocks (32, 64, 128 filters) -> flatten -> 512 -> 256 -> classes."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int | list[int] = 32,
        widths: tuple[int, ...] = (32, 64, 128),
        convs_per_block: int = 2,
        hidden: tuple[int, ...] = (512, 256),
        dropout: float = 0.3,
        negative_slope: float = 0.1,
    ):
        super().__init__()
        size = image_sides(image_size)
        h, w = size
        blocks, channels = [], in_channels
        for width in widths:
            blocks.append(ConvBlock(channels, width, convs_per_block, negative_slope))
            channels, h, w = width, h // 2, w // 2  # each block's max pool floors: 28 -> 14 -> 7 -> 3
        if h < 1 or w < 1:
            raise UserError(
                f"zoo:v28_cnn: {image_size} px images are too small for {len(widths)} pooling blocks; "
                "give fewer model.kwargs.widths."
            )
        self.features = nn.Sequential(*blocks)
        # A parameter-free module between the two Sequentials: without it discovery would take
        # [features, classifier] as a run of two same-typed blocks holding every parameter.
        self.flatten = nn.Flatten()
        layers, width = OrderedDict(), channels * h * w
        for i, out in enumerate(hidden):
            layers[f"fc{i}"] = nn.Linear(width, out)
            layers[f"act{i}"] = nn.LeakyReLU(negative_slope, inplace=True)
            layers[f"drop{i}"] = nn.Dropout(dropout)
            width = out
        layers["head"] = nn.Linear(width, num_classes)
        self.classifier = nn.Sequential(layers)
        self.num_classes = num_classes
        self.num_features = width  # the width before the head, what a linear probe sees
        # timm's names for the first conv and the head (the weight loader) and the input size (the exporter)
        self.pretrained_cfg = {
            "first_conv": "features.0.0",
            "classifier": "classifier.head",
            "input_size": (in_channels, *size),
        }

    def forward(self, x):
        return self.classifier(self.flatten(self.features(x)))

    def reset_classifier(self, num_classes: int = 0) -> None:
        """timm's contract: a new head for num_classes, or none (the model returns features) for 0."""
        self.num_classes = num_classes
        self.classifier.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
