"""Image classifiers by name (`zoo:NAME` or `timm:NAME`), adapted to the data's channels, classes and size.

Small images (CIFAR's 32 px, Fashion-MNIST's 28 px) would be shrunk to almost nothing by an ImageNet
stem, so `model.small_input` (auto: min(image_size) <= 64) adapts the model by inspecting it, not by
name: an overlapping strided stem conv (ResNet's 7x7/2 conv) becomes a 3x3/1 conv, a stride-2 3x3 stem
(EfficientNet, MobileNet) keeps its weights at stride 1, a max pool directly on the model (ResNet's
stem pool) goes, max pools that would shrink the map below 1 px go (VGG at 28 px), and timm's VGG
ConvMlp head (a 7x7 conv that timm feeds a 1x1 map up-sampled to 7x7) becomes the exact 1x1 conv.
"""

from __future__ import annotations

import difflib
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onn.config.model import GraphNetworkConfig, NetworkConfig
from onn.errors import UserError
from onn.models.load import CONVERT_HINT, PICKLE_SUFFIXES
from onn.models.zoo.registry import PICTURES, ZOO, build_zoo

log = logging.getLogger("onn")

DATA_KWARGS = ("in_channels", "in_chans", "num_classes", "image_size", "pretrained")


def check_image_classifier(model_cfg) -> None:
    """The model takes pictures [B, C, H, W]: a classifier network (not a graph network, denoiser or dual encoder),
    and, from the zoo, one of its picture networks; another is one sentence, not a kwargs or attribute error."""
    source = str(getattr(model_cfg, "source", "") or "")
    kind, _, name = source.partition(":")
    takes = isinstance(model_cfg, NetworkConfig) and not isinstance(model_cfg, GraphNetworkConfig)
    if not takes or (kind == "zoo" and name in ZOO and name not in PICTURES):
        raise UserError(
            f"model={model_cfg.name} ({source or type(model_cfg).__name__}) does not take images: image data trains "
            "a picture network from ONN's zoo (model=v28_cnn), one from timm (e.g. model=resnet18) or your own "
            "file.py:function."
        )


def build_classifier(model_cfg: NetworkConfig, in_channels: int, num_classes: int, image_size: list[int]) -> nn.Module:
    """The model named by model_cfg.source, for images of in_channels x image_size and num_classes classes."""
    check_image_classifier(model_cfg)
    source = str(model_cfg.source or "")
    kind, _, name = source.partition(":")
    kwargs = dict(model_cfg.kwargs or {})
    for key in DATA_KWARGS:
        if key in kwargs:
            raise UserError(
                f"model.kwargs.{key} is set by ONN from the data (channels, classes, image size) "
                "and pretrained weights come from model.weights; remove it."
            )
    image_size = [int(s) for s in image_size]
    if kind == "zoo":
        model = _construct(
            build_zoo,
            name,
            source,
            in_channels=in_channels,
            num_classes=num_classes,
            image_size=image_size,
            **kwargs,
        )
    elif kind == "timm":
        model = _timm(name, source, in_channels, num_classes, image_size, kwargs)
    elif ".py:" in source:
        model = _user_network(source, kwargs, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
    else:
        raise UserError(
            f"model.source {source or '(empty)'}: an image classifier is zoo:NAME (ONN's zoo, e.g. zoo:v28_cnn), "
            "timm:NAME (any timm model, e.g. timm:resnet18) or file.py:function (your own builder)."
        )
    changed: set[str] = set()
    if kind == "timm" and _small_input(model_cfg.small_input, image_size):
        changed = adapt_small_input(model, image_size)
    if model_cfg.weights:
        load_weights(model, model_cfg.weights, changed)
    # where timm keeps the input size: the ONNX exporter traces at the data's shape, not ImageNet's
    model.pretrained_cfg = {
        **(getattr(model, "pretrained_cfg", None) or {}),
        "input_size": (in_channels, *image_size),
    }
    return model


def feature_extractor(model: nn.Module) -> tuple[nn.Module, int]:
    """`model` without its classifier head (changed in place) and the width of the features it then returns:
    a frozen backbone for a linear probe (cached features -> a dense head)."""
    width = feature_width(model)
    model.reset_classifier(0)
    return model, width


def feature_width(model: nn.Module) -> int:
    """The width of the features `model` returns without its head, read without removing it: planning sizes a
    linear probe's head while it still counts the whole network."""
    if not hasattr(model, "reset_classifier"):
        raise UserError(
            f"{type(model).__name__} has no classifier head ONN can remove; a linear probe needs "
            "model.source timm:NAME or zoo:NAME."
        )
    # timm: num_features is the last feature map's width, head_hidden_size what comes out of the
    # pre-logits (VGG's 4096-wide ConvMlp); with no classifier the model returns the latter.
    return int(getattr(model, "head_hidden_size", None) or model.num_features)


def _construct(builder, name: str, source: str, **kwargs) -> nn.Module:
    try:
        return builder(name, **kwargs)
    except TypeError as e:  # an unknown or misspelled entry in model.kwargs
        raise UserError(f"model.kwargs does not fit {source}: {e}; fix or remove that key.") from e


def _user_network(source: str, kwargs: dict[str, Any], **data: Any) -> nn.Module:
    """A user's builder `file.py:function`, called with model.kwargs and those of the data's in_channels,
    num_classes and image_size its signature names."""
    import inspect

    from onn.models.load import user_function

    builder = user_function(source, "model.source")
    named = inspect.signature(builder).parameters
    model = _construct(
        lambda _, **kw: builder(**kw), source, source, **{k: v for k, v in data.items() if k in named}, **kwargs
    )
    if not isinstance(model, nn.Module):
        raise UserError(f"model.source {source} returned {type(model).__name__}, not a torch nn.Module.")
    return model


def _timm(
    name: str, source: str, in_channels: int, num_classes: int, image_size: list[int], kwargs: dict[str, Any]
) -> nn.Module:
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; close names: {', '.join(close)}" if close else "; see timm.list_models() for the names"
        raise UserError(f"model.source {source}: timm has no model '{name}'{hint}.")
    return _construct(
        timm.create_model,
        name,
        source,
        pretrained=False,
        num_classes=num_classes,
        in_chans=in_channels,
        **_fixed_size(name, image_size, kwargs),
        **kwargs,
    )


def _fixed_size(name: str, image_size: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
    """img_size for a timm model built for one input size (ViT, DeiT, Swin, ...): built for ImageNet's 224 px, its
    first forward on the data's size fails an assertion. Empty where model.kwargs sets img_size itself."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    if "img_size" in kwargs or cfg is None or not cfg.fixed_input_size:
        return {}
    return {} if list(cfg.input_size[1:]) == list(image_size) else {"img_size": tuple(image_size)}


def _small_input(value: Any, image_size: list[int]) -> bool:
    if value in (True, False):
        return bool(value)
    text = str(value).lower()
    if value is None or text == "auto":
        return min(image_size) <= 64
    if text in ("true", "false"):
        return text == "true"
    raise UserError(f"model.small_input must be auto, true or false (got {value!r}).")


def adapt_small_input(model: nn.Module, image_size: list[int]) -> set[str]:
    """Adapt a timm CNN to small images in place (see the module docstring); returns the names of the
    modules that were replaced (their pretrained weights may no longer fit)."""
    changed = set()
    stem_name = (getattr(model, "pretrained_cfg", None) or {}).get("first_conv")
    stem = _get(model, stem_name) if isinstance(stem_name, str) else None
    if isinstance(stem, nn.Conv2d) and max(stem.stride) > 1 and max(stem.kernel_size) > max(stem.stride):
        # (a patchify stem, kernel == stride as in ViT or ConvNeXt, is left alone)
        if max(stem.kernel_size) > 3:
            new = nn.Conv2d(stem.in_channels, stem.out_channels, 3, padding=1, bias=stem.bias is not None)
            model.set_submodule(stem_name, new)
            changed.add(stem_name)
        else:
            stem.stride = (1, 1)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.MaxPool2d):  # a stem pool directly on the model (ResNet's maxpool)
            model.set_submodule(name, nn.Identity())
            changed.add(name)

    pools = [n for n, m in model.named_modules() if isinstance(m, nn.MaxPool2d)]
    allowed = int(math.log2(min(image_size)))  # halvings before the map is below 1 px
    for name in pools[allowed:]:  # the last ones (VGG's 5th pool at 28 px)
        model.set_submodule(name, nn.Identity())
        changed.add(name)

    for name, module in list(model.named_modules()):
        fc1 = getattr(module, "fc1", None)
        if hasattr(module, "input_kernel_size") and isinstance(fc1, nn.Conv2d) and max(fc1.kernel_size) > 1:
            # timm's ConvMlp up-samples a smaller map to its kernel size, so on the 1-2 px maps of small
            # images its 7x7 conv is (exactly, at 1 px) a 1x1 conv with the kernel summed: 49x fewer weights.
            module.fc1 = nn.Conv2d(fc1.in_channels, fc1.out_channels, 1, bias=fc1.bias is not None)
            module.input_kernel_size = 1
            changed.add(f"{name}.fc1" if name else "fc1")
    return changed


def load_weights(model: nn.Module, path: str | Path, changed: set[str] = frozenset()) -> None:
    """Load a .safetensors state dict into model; the head may differ (another number of classes), the
    first conv is adapted to the channel count, and any other mismatch is a UserError."""
    path = Path(str(path)).expanduser()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UserError(
            f"model.weights {path} is a pickle checkpoint. " + CONVERT_HINT.format(p=path, stem=path.with_suffix(""))
        )
    if path.suffix.lower() != ".safetensors" or not path.is_file():
        raise UserError(f"model.weights {path} is not an existing .safetensors file; check the path.")
    if any(p.is_meta for p in model.parameters()):
        return  # a model on the meta device (the planner sizing it) has no values to load
    state = _read_state(path)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    heads = cfg.get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    wrong, fresh, shapes = _fit_shapes(model, state, heads, cfg.get("first_conv"), changed)
    result = model.load_state_dict(state, strict=False)
    missing = [
        k
        for k in result.missing_keys
        if not _under(k, heads + tuple(changed) + tuple(wrong)) and not k.endswith("num_batches_tracked")
    ]
    unexpected = list(result.unexpected_keys)
    if wrong or missing or unexpected:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
            for label, keys in (
                ("wrong shapes", [shapes[k] for k in wrong]),
                ("missing", missing),
                ("unexpected", unexpected),
            )
            if keys
        ]
        raise UserError(
            f"model.weights {path} does not fit this {type(model).__name__}: {'; '.join(parts)}. "
            "Give the state dict of the same architecture and model.small_input (only the classifier head may differ)."
        )
    if fresh:
        log.warning(
            "model.weights: %s kept a fresh init, as model.small_input replaced these layers for small "
            "images (set model.small_input=false to keep the pretrained ones).",
            ", ".join(fresh),
        )


def _read_state(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"model.weights {path} is not a readable safetensors file (truncated or corrupt?): {e}."
        ) from None


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _fit_shapes(model: nn.Module, state: dict, heads: tuple, first_conv: str | None, changed: set[str]):
    """The state's tensors whose shape differs from the model's, made to fit where that is meant: a head of
    another number of classes keeps its fresh init, the first conv is adapted to the channel count, a layer
    model.small_input changed collapses its kernel (ConvMlp for a 1 px map) or keeps a fresh init. Returns the
    keys of the wrong shapes, those left fresh, and the wrong ones' shapes said. A ViT's position embeddings are
    interpolated to its grid of patches, and a Swin's relative position bias tables to its windows, as timm does for
    pretrained weights at another img_size."""
    own = model.state_dict()
    wrong, fresh, shapes = [], [], {}
    for key, value in list(state.items()):
        target = own.get(key)
        if target is None or target.shape == value.shape:
            continue
        if _under(key, heads):
            del state[key]
        elif (
            key == f"{first_conv}.weight" and value.shape[0] == target.shape[0] and value.shape[2:] == target.shape[2:]
        ):
            state[key] = _adapted_first_conv(target.shape[1], value)
        elif key == "pos_embed" and (resampled := _resampled_pos_embed(model, value)).shape == target.shape:
            state[key] = resampled  # a ViT's weights of 224 px for the data's size
        elif (resized := _resized_rel_pos_bias(model, key, value, target.shape)) is not None:
            state[key] = resized  # a Swin's table of 7 x 7 windows for the smaller window of a small feature map
        elif (
            _under(key, changed)
            and value.dim() == 4
            and target.shape[:2] == value.shape[:2]
            and target.shape[2:] == (1, 1)
        ):
            state[key] = value.sum(dim=(2, 3), keepdim=True)
        elif _under(key, changed):
            del state[key]
            fresh.append(key)
        else:
            del state[key]  # (load_state_dict raises on a wrong shape even when not strict)
            wrong.append(key)
            shapes[key] = f"{key} {tuple(value.shape)} vs {tuple(target.shape)}"
    return wrong, fresh, shapes


def _adapted_first_conv(channels: int, weight):
    """timm's adapt_input_conv (a grey model's first conv sums the RGB kernels), for a 3-D conv too: a video ResNet's
    Kinetics weights for greyscale clips (timm's takes 4-D weights only)."""
    from timm.models import adapt_input_conv

    flat = weight.flatten(3) if weight.dim() == 5 else weight  # [O, I, T, H*W]: adapted over I alone
    adapted = adapt_input_conv(channels, flat, base_chans=weight.shape[1])
    return adapted.view(adapted.shape[0], channels, *weight.shape[2:])


def _resampled_pos_embed(model: nn.Module, value):
    """ViT position embeddings [1, tokens, dim] interpolated to the model's grid of patches (unchanged where the
    model has no such grid)."""
    from timm.layers import resample_abs_pos_embed

    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None or value.dim() != 3:
        return value
    prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 1))
    return resample_abs_pos_embed(value, list(grid), num_prefix_tokens=prefix, verbose=False)


def _resized_rel_pos_bias(model: nn.Module, key: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """A windowed attention's relative position bias table [(2h-1)(2w-1), heads] (Swin) resampled to the window its
    module has, or None where `key` is no such table. timm shrinks a Swin's 7 x 7 window to a feature map smaller
    than it (the last stages at 64-112 px), so ImageNet weights of 224 px were refused as of the wrong shape."""
    from timm.layers import resize_rel_pos_bias_table, to_2tuple

    owner = _get(model, key.rpartition(".")[0]) if key.endswith(".relative_position_bias_table") else None
    window = getattr(owner, "window_size", None)
    if window is None or value.dim() != 2 or len(shape) != 2 or value.shape[1] != shape[1]:
        return None
    with warnings.catch_warnings():  # timm's interpolation, without scipy, warns of torch indexing notes
        warnings.simplefilter("ignore", UserWarning)
        resized = resize_rel_pos_bias_table(value.float(), to_2tuple(window), tuple(shape))
    return resized.to(value.dtype) if tuple(resized.shape) == tuple(shape) else None


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
