"""ONN's own small models by name (model.source `zoo:NAME`): ZOO, and build_zoo to build one."""

from __future__ import annotations

import inspect

from torch import nn

from onn.errors import UserError
from onn.models.zoo.audio_cnn import AudioCNN
from onn.models.zoo.pointnet import PointNet
from onn.models.zoo.recurrent import AudioRNN
from onn.models.zoo.text_encoder import TextEncoder
from onn.models.zoo.v28 import V28CNN
from onn.models.zoo.video3d import C3DTiny

ZOO = {
    "v28_cnn": V28CNN,
    "audio_cnn": AudioCNN,
    "audio_rnn": AudioRNN,
    "c3d_tiny": C3DTiny,
    "pointnet": PointNet,
    "text_encoder": TextEncoder,
}
VIDEO = frozenset({"c3d_tiny"})  # zoo models that take clips [B, C, T, H, W]
PICTURES = frozenset({"v28_cnn", "audio_cnn", "audio_rnn"})  # zoo models that take [B, C, H, W]: images, spectrograms


def build_zoo(name: str, **kwargs) -> nn.Module:
    """The zoo model `name` built with kwargs (the model config's `kwargs` plus the data's shape). A key the
    constructor does not take, or a value its own checks refuse (a ValueError), is a mistake in model.kwargs, said
    in one sentence; any other error passes through as it is (a bug keeps its traceback)."""
    if name not in ZOO:
        raise UserError(f"model.source zoo:{name}: no such zoo model; the zoo has: {', '.join(sorted(ZOO))}.")
    model = ZOO[name]
    try:
        inspect.signature(model).bind(**kwargs)
    except TypeError as e:
        raise UserError(
            f"model.kwargs does not fit zoo:{name}: {e} (it takes {', '.join(inspect.signature(model).parameters)}); "
            "fix or remove that key."
        ) from e
    try:
        return model(**kwargs)
    except ValueError as e:
        raise UserError(f"model.kwargs does not build zoo:{name}: {e}.") from e
