"""ONN's own small models, by name (model.source `zoo:NAME`)."""

from __future__ import annotations

from torch import nn

from onn.errors import UserError
from onn.models.zoo.pointnet import PointNet
from onn.models.zoo.text_encoder import TextEncoder
from onn.models.zoo.v28 import V28CNN

ZOO = {"v28_cnn": V28CNN, "pointnet": PointNet, "text_encoder": TextEncoder}


def build_zoo(name: str, **kwargs) -> nn.Module:
    """The zoo model `name` built with kwargs (the model config's `kwargs` plus the data's shape)."""
    if name not in ZOO:
        raise UserError(f"model.source zoo:{name}: no such zoo model; the zoo has: {', '.join(sorted(ZOO))}.")
    return ZOO[name](**kwargs)
