"""Image batch augmentation on the compute device, with random parameters drawn per sample.

Hand-written because torchvision.transforms.v2 draws one set of random parameters per call, so a
whole batch would share one crop, one flip and one jitter; here every sample gets its own.

Everything is vectorised over the batch and draws its randomness from an optional torch.Generator
(on the images' device), so a seeded generator reproduces a batch exactly. Order: crop + flip (one
gather on the uint8 batch) -> float in [0, 1] -> color jitter -> normalise -> random erasing.
The work runs in NCHW; a channels_last input gets a channels_last output (one extra copy at the end;
a channels_last model would make that copy in its first conv anyway).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onn.config.data import ColorJitter, ImageAugment
from onn.errors import UserError

GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def _probability(value: Any, key: str) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise UserError(f"{key} is a probability: give a number between 0 and 1 (got {value}).")
    return p


class BatchAugment:
    """Per-sample random crop (with padding), horizontal flip, color jitter and random erasing.
    data.augment=null (None) augments nothing; a block's unset keys are the schema's, which turn them off."""

    def __init__(self, cfg: ImageAugment | None, mean: list[float], std: list[float]):
        cfg = cfg if cfg is not None else ImageAugment()
        self.mean = [float(m) for m in mean]
        self.std = [float(s) for s in std]
        if len(self.mean) != len(self.std) or not self.mean or any(s <= 0 for s in self.std):
            raise UserError(f"the normalisation mean {mean} and std {std} need one value per channel, with std > 0.")

        self.pad = int(cfg.crop_padding)
        if self.pad < 0:
            raise UserError(f"data.augment.crop_padding must be 0 or more pixels (got {self.pad}).")
        self.padding_mode = str(cfg.padding_mode)
        if self.padding_mode not in ("zeros", "reflect"):
            raise UserError(f"data.augment.padding_mode must be zeros or reflect (got {self.padding_mode}).")
        self.hflip = _probability(cfg.hflip, "data.augment.hflip")

        jitter = cfg.color_jitter if cfg.color_jitter is not None else ColorJitter()
        if float(jitter.hue) > 0:
            raise UserError("data.augment.color_jitter.hue is not supported; set it to 0.")
        self.jitter = {}
        factors = {
            "brightness": jitter.brightness,
            "contrast": jitter.contrast,
            "saturation": jitter.saturation,
        }
        for key, x in factors.items():
            x = float(x)
            if x < 0:
                raise UserError(f"data.augment.color_jitter.{key} must be 0 or more (got {x}).")
            if x > 0:  # torchvision: factor uniform in [max(0, 1 - x), 1 + x]
                self.jitter[key] = (max(0.0, 1.0 - x), 1.0 + x)

        erasing = cfg.random_erasing
        self.erase_p = 0.0
        if erasing is not None:
            self.erase_p = _probability(erasing.p, "data.augment.random_erasing.p")
            self.erase_scale = tuple(float(s) for s in erasing.scale)
            self.erase_ratio = tuple(float(r) for r in erasing.ratio)
            if not (len(self.erase_scale) == 2 and 0 < self.erase_scale[0] <= self.erase_scale[1] <= 1):
                raise UserError(
                    "data.augment.random_erasing.scale must be [min, "
                    f"max] with 0 < min <= max <= 1 (got {self.erase_scale})."
                )
            if not (len(self.erase_ratio) == 2 and 0 < self.erase_ratio[0] <= self.erase_ratio[1]):
                raise UserError(
                    "data.augment.random_erasing.ratio must be [min, "
                    f"max] with 0 < min <= max (got {self.erase_ratio})."
                )
            value = erasing.value
            if value != "random" and not isinstance(value, int | float):
                raise UserError(f"data.augment.random_erasing.value must be a number or `random` (got {value!r}).")
            self.erase_value = value
        self._stats: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def random(self) -> bool:
        """Whether training batches are augmented at all (every setting off: only normalised)."""
        return bool(self.pad or self.hflip or self.jitter or self.erase_p > 0)

    def __call__(self, images: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 [B,C,H,W] -> normalised float32 [B,C,H,W]; augmentation only when train is True."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"BatchAugment expects a uint8 [B,C,H,W] batch, got {images.dtype} {tuple(images.shape)}")
        channels_last = _is_channels_last(images)  # the work runs in NCHW, the output gets the input's layout
        images, g = images.contiguous(), generator
        if train and (self.pad or self.hflip):
            images = self._crop_flip(images, g)
        mean, std, gray = self._constants(images)
        x = self._color_jitter(images, gray, g) if train and self.jitter else images.float().div_(255)
        x = x.sub_(mean).div_(std)
        if train and self.erase_p > 0:
            x = self._erase(x, g)
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    def _constants(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, std, luminance weights) on x's device, made once: no host-to-device copy per batch."""
        channels = x.shape[1]
        if len(self.mean) not in (1, channels):
            raise UserError(
                f"the normalisation mean/std have {len(self.mean)} values but the images have {channels} channels; "
                "give one value per channel."
            )
        key = (x.device, channels)
        if key not in self._stats:
            shape = (1, len(self.mean), 1, 1)
            self._stats[key] = (
                torch.tensor(self.mean, device=x.device).view(shape),
                torch.tensor(self.std, device=x.device).view(shape),
                torch.tensor([GRAY], device=x.device),
            )
        return self._stats[key]

    def _crop_flip(self, images: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        """Random crop of the original size from the (virtually) padded batch, then a random flip.

        No padded copy is made: each output pixel's source index is computed as if the batch were
        padded (reflected, or zero-filled), and one gather reads every sample at its own offset.
        """
        b, c, h, w = images.shape
        dev, p = images.device, self.pad
        if p and self.padding_mode == "reflect" and p >= min(h, w):
            raise UserError(
                f"data.augment.crop_padding={p} is too large for reflect padding of {h}x{w} images; "
                "use less than the image size or padding_mode=zeros."
            )
        rows = torch.arange(h, device=dev).expand(b, h)
        cols = torch.arange(w, device=dev).expand(b, w)
        if self.hflip:
            flip = torch.rand(b, 1, device=dev, generator=g) < self.hflip
            cols = torch.where(flip, w - 1 - cols, cols)
        valid = None
        if p:
            shift = torch.randint(-p, p + 1, (b, 2, 1), device=dev, generator=g)
            rows, cols = rows + shift[:, 0], cols + shift[:, 1]
            if self.padding_mode == "reflect":  # -1 -> 1, h -> h - 2 (edge not repeated, like torch's reflect)
                rows = (h - 1) - ((h - 1) - rows.abs()).abs()
                cols = (w - 1) - ((w - 1) - cols.abs()).abs()
            else:
                valid = ((rows >= 0) & (rows < h))[:, None, :, None] & ((cols >= 0) & (cols < w))[:, None, None, :]
                rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
        index = (rows[:, :, None] * w + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
        out = images.view(b, c, h * w).gather(2, index).view(b, c, h, w)
        return out if valid is None else out.mul_(valid)

    def _color_jitter(self, images: torch.Tensor, gray: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        """uint8 -> float in [0, 1] with brightness, contrast, saturation applied in that fixed order
        (torchvision shuffles the order per call)."""
        b, c = images.shape[:2]

        def factor(key: str) -> torch.Tensor:
            lo, hi = self.jitter[key]
            return lo + (hi - lo) * torch.rand(b, 1, 1, 1, device=images.device, generator=g)

        x = images.float()
        # brightness is folded into the conversion to [0, 1]: x * f / 255
        x = x.mul_(factor("brightness").div_(255)).clamp_(max=1) if "brightness" in self.jitter else x.div_(255)
        if "contrast" in self.jitter:  # the mean of the luminance is the luminance of the channel means
            f = factor("contrast")
            mean = _gray(x.mean(dim=(2, 3), keepdim=True), gray)
            x = x.mul_(f).add_((1 - f) * mean).clamp_(0, 1)
        if "saturation" in self.jitter:
            f = factor("saturation")
            if c == 3:  # torchvision leaves 1-channel images unchanged (the factor is still drawn)
                x = x.lerp_(_gray(x, gray), 1 - f).clamp_(0, 1)  # f * x + (1 - f) * gray
        return x

    def _erase(self, x: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        """torchvision RandomErasing per sample: up to 10 tries for a box that fits, the first that fits wins."""
        b, c, h, w = x.shape
        dev, tries = x.device, 10
        u = torch.rand(b, tries, 4, device=dev, generator=g)
        area = h * w * (self.erase_scale[0] + (self.erase_scale[1] - self.erase_scale[0]) * u[..., 0])
        lo, hi = math.log(self.erase_ratio[0]), math.log(self.erase_ratio[1])
        aspect = torch.exp(lo + (hi - lo) * u[..., 1])
        eh = torch.sqrt(area * aspect).round_()
        ew = torch.sqrt(area / aspect).round_()
        fits = (eh < h) & (ew < w)
        first = fits.byte().argmax(dim=1, keepdim=True)  # the first try that fits (0 when none does)
        eh, ew, u = (
            eh.gather(1, first),
            ew.gather(1, first),
            u.gather(1, first[..., None].expand(b, 1, 4))[:, 0],
        )
        top = (u[:, 2:3] * (h - eh + 1)).floor_()
        left = (u[:, 3:4] * (w - ew + 1)).floor_()
        erase = fits.any(dim=1, keepdim=True) & (torch.rand(b, 1, device=dev, generator=g) < self.erase_p)
        eh = eh * erase  # a zero-height box erases nothing
        r = torch.arange(h, device=dev, dtype=x.dtype)
        k = torch.arange(w, device=dev, dtype=x.dtype)
        in_rows = ((r >= top) & (r < top + eh)).to(x.dtype)
        in_cols = ((k >= left) & (k < left + ew)).to(x.dtype)
        box = (in_rows[:, :, None] * in_cols[:, None, :])[:, None]  # [B, 1, H, W]: 1 inside the box
        if self.erase_value == "random":
            return x.lerp_(torch.randn(x.shape, device=dev, generator=g, dtype=x.dtype), box)
        if self.erase_value:
            return x.lerp_(torch.full_like(box, float(self.erase_value)), box)
        return x.mul_(box.neg_().add_(1))


def _gray(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[B,1,H,W] luminance of an RGB batch (a 1-channel batch is its own); one batched matmul, the fast path."""
    b, c, h, w = x.shape
    if c == 1:
        return x
    return torch.matmul(weights, x.reshape(b, c, h * w)).view(b, 1, h, w)


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
