"""Video classifiers by name, for clips [B, C, T, H, W], adapted to the data's channels, classes and size.

    torchvision:r3d_18 | r2plus1d_18 | mc3_18   torchvision's video ResNets (3-D, (2+1)-D and mixed
                                                convolutions), random init; model.weights loads a local
                                                safetensors state dict (e.g. Kinetics-400), head excepted
    zoo:c3d_tiny                                 ONN's tiny 3-D CNN (onn/models/zoo/video3d.py)
    timm:NAME                                    any timm image model run on every frame, its features
                                                 pooled over time (model.temporal_pool: mean, or tconv: a
                                                 1-D convolution over time first, so the order of frames
                                                 counts); model.weights loads the image model's weights

Each gets timm's small contract (`pretrained_cfg`, `num_features`, `reset_classifier`), so the weight
loader, the linear probe and the exporter treat them as they treat image models.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from onn.config.model import NetworkConfig
from onn.errors import UserError
from onn.models.vision import build_classifier, load_weights

TORCHVISION = ("r3d_18", "r2plus1d_18", "mc3_18")
POOLS = ("mean", "tconv")


def build_video_classifier(
    model_cfg: NetworkConfig, channels: int, num_classes: int, frames: int, image_size: list[int]
) -> nn.Module:
    source = str(model_cfg.source or "")
    kind, _, name = source.partition(":")
    kwargs = dict(model_cfg.kwargs or {})
    if kind == "torchvision":
        model = _torchvision(name, source, channels, num_classes, kwargs)
        if model_cfg.weights:
            load_weights(model, model_cfg.weights)
    elif kind == "zoo":
        from onn.models.zoo.registry import VIDEO, build_zoo

        if name not in VIDEO:
            raise UserError(
                f"model.source {source} is not a video model; the zoo's video models are {', '.join(sorted(VIDEO))}."
            )
        try:
            model = build_zoo(
                name,
                in_channels=channels,
                num_classes=num_classes,
                frames=frames,
                image_size=image_size,
                **kwargs,
            )
        except TypeError as e:
            raise UserError(f"model.kwargs does not fit {source}: {e}; fix or remove that key.") from e
        if model_cfg.weights:
            load_weights(model, model_cfg.weights)
    elif kind == "timm":
        pool = model_cfg.temporal_pool
        if pool not in POOLS:
            raise UserError(f"model.temporal_pool={pool!r}: use mean or tconv.")
        backbone = build_classifier(model_cfg, channels, num_classes, image_size)  # weights loaded, head fresh
        model = FrameClassifier(backbone, num_classes, pool)
    else:
        raise UserError(
            f"model.source {source or '(empty)'}: a video classifier is torchvision:NAME "
            f"({', '.join(TORCHVISION)}), zoo:c3d_tiny, or timm:NAME (an image model run per frame)."
        )
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (channels, frames, *image_size)}
    return model


def _torchvision(name: str, source: str, channels: int, num_classes: int, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision.models.video as video

    if name not in TORCHVISION:
        raise UserError(f"model.source {source}: torchvision's video classifiers here are {', '.join(TORCHVISION)}.")
    try:
        model = getattr(video, name)(weights=None, num_classes=num_classes, **kwargs)
    except TypeError as e:
        raise UserError(f"model.kwargs does not fit {source}: {e}; fix or remove that key.") from e
    stem = model.stem[0]
    if channels != stem.in_channels:
        model.stem[0] = nn.Conv3d(channels, stem.out_channels, stem.kernel_size, stem.stride, stem.padding, bias=False)
    model.pretrained_cfg = {"first_conv": "stem.0", "classifier": "fc"}
    model.num_features = model.fc.in_features
    model.reset_classifier = types.MethodType(_reset_fc, model)
    return model


def _reset_fc(model: nn.Module, num_classes: int = 0) -> None:
    model.fc = nn.Linear(model.num_features, num_classes) if num_classes else nn.Identity()


class FrameClassifier(nn.Module):
    """An image model on every frame, its features pooled over time, then a linear head."""

    def __init__(self, backbone: nn.Module, num_classes: int, pool: str = "mean"):
        super().__init__()
        backbone.reset_classifier(0)
        self.backbone = backbone
        self.num_features = int(getattr(backbone, "head_hidden_size", None) or backbone.num_features)
        self.temporal = (
            nn.Sequential(nn.Conv1d(self.num_features, self.num_features, 3, padding=1), nn.ReLU())
            if pool == "tconv"
            else nn.Identity()
        )
        self.head = nn.Linear(self.num_features, num_classes)
        first = (getattr(backbone, "pretrained_cfg", None) or {}).get("first_conv")
        self.pretrained_cfg = {"first_conv": f"backbone.{first}" if first else None, "classifier": "head"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        features = self.backbone(x.transpose(1, 2).reshape(b * t, c, h, w)).view(b, t, -1)
        features = self.temporal(features.transpose(1, 2)).mean(dim=2)  # [B, F, T] -> [B, F]
        return self.head(features)

    def reset_classifier(self, num_classes: int = 0) -> None:
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
