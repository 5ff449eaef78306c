"""BatchAugment: exact normalisation, per-sample random parameters, torchvision's ranges, determinism."""

from __future__ import annotations

import re

import pytest
import torch

from onn.config import typed
from onn.config.data import ImageAugment
from onn.errors import UserError
from onn.modalities.image.augment import BatchAugment

MEAN, STD = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
FULL = {
    "crop_padding": 4,
    "hflip": 0.5,
    "color_jitter": {"brightness": 0.3, "contrast": 0.3, "saturation": 0.3, "hue": 0},
    "random_erasing": {"p": 0.5},
}


def _aug(values: dict | None) -> ImageAugment | None:
    """data.augment as a run gets it: the schema's block (its unset keys off), or None for null."""
    return None if values is None else typed(ImageAugment, values, "data.augment")


def _images(b=8, c=3, h=32, w=32, seed=0):
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _positions(b, h=16, w=16):
    """1-channel images whose pixel value is its position (r * w + c), so a crop's source can be read back."""
    return torch.arange(h * w, dtype=torch.uint8).view(1, 1, h, w).repeat(b, 1, 1, 1)


def _raw(aug_cfg, images, seed=0):
    """The augmented batch back in uint8 units (mean 0, std 1 makes the output x / 255)."""
    out = BatchAugment(_aug(aug_cfg), [0.0], [1.0])(images, True, torch.Generator().manual_seed(seed))
    return out * 255


@pytest.mark.parametrize("cfg", [None, {}, FULL])
def test_normalisation_is_exact_without_augmentation(cfg):
    images = _images()
    expected = (images.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    out = BatchAugment(_aug(cfg), MEAN, STD)(images, train=cfg is not FULL)  # FULL with train=False: no augmentation
    assert out.dtype == torch.float32 and out.shape == images.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["reflect", "zeros"])
def test_crop_shifts_each_sample_by_its_own_offset(mode):
    b, h, w, pad = 256, 16, 16, 3
    out = _raw({"crop_padding": pad, "padding_mode": mode}, _positions(b, h, w)).round().long()[:, 0]
    offsets = set()
    for i in range(b):
        src = out[i, h // 2, w // 2].item()  # the centre never leaves the image for |shift| <= pad
        dy, dx = src // w - h // 2, src % w - w // 2
        assert -pad <= dy <= pad and -pad <= dx <= pad
        offsets.add((dy, dx))
        rows, cols = torch.arange(h) + dy, torch.arange(w) + dx
        if mode == "reflect":
            rows, cols = rows.abs(), cols.abs()
            rows, cols = (
                torch.where(rows > h - 1, 2 * (h - 1) - rows, rows),
                torch.where(cols > w - 1, 2 * (w - 1) - cols, cols),
            )
            expected = rows[:, None] * w + cols[None, :]
        else:
            inside = ((rows >= 0) & (rows < h))[:, None] & ((cols >= 0) & (cols < w))[None, :]
            expected = torch.where(inside, rows[:, None] * w + cols[None, :], 0)
        assert torch.equal(out[i], expected), (i, dy, dx)
    assert len(offsets) > 30  # 49 possible offsets over 256 samples: per-sample draws, not one per batch


def test_flip_probability_per_sample():
    b, w = 4000, 8
    images = torch.arange(w, dtype=torch.uint8).view(1, 1, 1, w).repeat(b, 1, 2, 1)
    out = _raw({"hflip": 0.3}, images).round().long()[:, 0, 0]
    flipped = (out == torch.arange(w).flip(0)).all(dim=1)
    kept = (out == torch.arange(w)).all(dim=1)
    assert bool((flipped | kept).all())
    assert 0.27 < flipped.float().mean().item() < 0.33


def test_color_jitter_factors_stay_in_torchvision_ranges():
    b = 600
    # brightness: a constant image scales by the factor
    out = _raw({"color_jitter": {"brightness": 0.5}}, torch.full((b, 3, 4, 4), 100, dtype=torch.uint8))
    f = out[:, 0, 0, 0] / 100
    assert f.min() >= 0.5 - 1e-4 and f.max() <= 1.5 + 1e-4 and f.min() < 0.6 and f.max() > 1.4
    assert torch.allclose(out, f.view(b, 1, 1, 1) * 100 * torch.ones_like(out), atol=1e-3)  # one factor per image
    # contrast: a 1-channel image of 50s and 150s blends towards its mean (100) by the factor
    images = torch.tensor([50, 150], dtype=torch.uint8).repeat(8).view(1, 1, 4, 4).repeat(b, 1, 1, 1)
    out = _raw({"color_jitter": {"contrast": 0.5}}, images)
    f = (out[:, 0, 0, 1] - 100) / 50
    assert f.min() >= 0.5 - 1e-4 and f.max() <= 1.5 + 1e-4 and f.min() < 0.6 and f.max() > 1.4
    # saturation: a coloured image blends towards its luminance by the factor
    rgb = torch.tensor([200.0, 100.0, 50.0])
    images = rgb.to(torch.uint8).view(1, 3, 1, 1).repeat(b, 1, 4, 4)
    out = _raw({"color_jitter": {"saturation": 0.5}}, images)
    f = (out[:, 0, 0, 0] - out[:, 1, 0, 0]) / (rgb[0] - rgb[1])
    assert f.min() >= 0.5 - 1e-4 and f.max() <= 1.5 + 1e-4 and f.min() < 0.6 and f.max() > 1.4
    gray = (0.2989 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]).item()
    torch.testing.assert_close(out[:, 2, 0, 0], f * rgb[2] + (1 - f) * gray, atol=1e-3, rtol=0)


def test_hue_is_refused():
    with pytest.raises(UserError, match=r"data\.augment\.color_jitter\.hue is not supported"):
        BatchAugment(_aug({"color_jitter": {"hue": 0.1}}), MEAN, STD)


@pytest.mark.parametrize("value", [0, 2.5])
def test_random_erasing_boxes_follow_scale_and_ratio(value):
    b, h, w = 400, 32, 32
    cfg = {"random_erasing": {"p": 1.0, "scale": [0.02, 0.33], "ratio": [0.3, 3.3], "value": value}}
    out = BatchAugment(_aug(cfg), [0.0], [1.0])(
        torch.full((b, 1, h, w), 255, dtype=torch.uint8), True, torch.Generator().manual_seed(0)
    )
    erased = out[:, 0] != 1.0
    assert bool((out[:, 0][erased] == value).all())
    rows, cols = erased.any(dim=2), erased.any(dim=1)
    eh, ew = rows.sum(1), cols.sum(1)
    assert bool((erased.sum((1, 2)) == eh * ew).all())  # one solid rectangle per sample
    area = (eh * ew).float() / (h * w)
    assert bool((eh > 0).all()), "p=1 erases every sample"
    # torchvision rounds the box sides, so the area can leave [0.02, 0.33] by about a side's rounding
    assert area.min() >= 0.01 and area.max() <= 0.38 and area.min() < 0.05 and area.max() > 0.25
    aspect = eh.float() / ew.float()
    assert aspect.min() >= 0.25 and aspect.max() <= 4.0
    tops = rows.float().argmax(1)
    assert len(set(zip(tops.tolist(), eh.tolist()))) > 50  # every sample its own box


def test_random_erasing_probability():
    out = BatchAugment(_aug({"random_erasing": {"p": 0.25}}), [0.0], [1.0])(
        torch.full((2000, 1, 16, 16), 255, dtype=torch.uint8), True, torch.Generator().manual_seed(1)
    )
    frac = (out != 1.0).flatten(1).any(1).float().mean().item()
    assert 0.21 < frac < 0.29


def test_same_seed_same_batch_and_layout_kept():
    aug, images = BatchAugment(_aug(FULL), MEAN, STD), _images(16)
    a = aug(images, True, torch.Generator().manual_seed(7))
    b = aug(images, True, torch.Generator().manual_seed(7))
    c = aug(images, True, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    cl = aug(images.contiguous(memory_format=torch.channels_last), True, torch.Generator().manual_seed(7))
    assert cl.is_contiguous(memory_format=torch.channels_last) and not cl.is_contiguous()
    assert torch.equal(cl, a)


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"crop_pad": 4}, "'crop_pad' not in 'ImageAugment'"),
        ({"color_jitter": {"brightnes": 0.2}}, "'brightnes' not in 'ColorJitter'"),
        ({"random_erasing": {"prob": 0.2}}, "'prob' not in 'RandomErasing'"),
    ],
)
def test_unknown_key_is_named(cfg, key):
    """The schema refuses a key it does not have (Hydra at compose time; typed() for a saved config)."""
    with pytest.raises(UserError, match="data.augment: Key " + re.escape(key)):
        _aug(cfg)


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"crop_padding": -1}, "data.augment.crop_padding"),
        ({"padding_mode": "edge"}, "data.augment.padding_mode"),
        ({"hflip": 1.5}, "data.augment.hflip"),
        ({"color_jitter": {"contrast": -0.1}}, "data.augment.color_jitter.contrast"),
        ({"random_erasing": {"scale": [0.5, 0.1]}}, "data.augment.random_erasing.scale"),
        ({"random_erasing": {"value": "noise"}}, "data.augment.random_erasing.value"),
    ],
)
def test_wrong_value_is_named(cfg, key):
    with pytest.raises(UserError, match=re.escape(key)):
        BatchAugment(_aug(cfg), MEAN, STD)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_its_own_seed_and_cpu_normalisation():
    aug, images = BatchAugment(_aug(FULL), MEAN, STD), _images(64).cuda()
    a = aug(images, True, torch.Generator("cuda").manual_seed(3))
    b = aug(images, True, torch.Generator("cuda").manual_seed(3))
    assert a.is_cuda and torch.equal(a, b)
    torch.testing.assert_close(aug(images, False).cpu(), aug(images.cpu(), False), rtol=0, atol=1e-6)


def test_one_key_of_a_block_is_set_on_the_command_line_also_over_a_recipe_without_augmentation():
    """color_jitter and random_erasing were null until given whole, and recipe=cifar10_v28 set augment: null: Hydra
    then failed with a raw AssertionError (or AttributeError) on data.augment.color_jitter.brightness=0.2."""
    from conftest import compose

    given = ("data.augment.color_jitter.brightness=0.2", "data.augment.random_erasing.p=0.5")
    aug = compose("data=cifar10", "model=v28_cnn", *given).data.augment
    assert aug.color_jitter.brightness == 0.2 and aug.random_erasing.p == 0.5 and aug.crop_padding == 4
    assert BatchAugment(aug, MEAN, STD).jitter == {"brightness": (0.8, 1.2)}
    aug = compose("data=cifar10", "model=v28_cnn", "data.augment.color_jitter={contrast: 0.1}").data.augment
    assert aug.color_jitter.contrast == 0.1
    baseline = compose("recipe=cifar10_v28").data.augment
    assert not BatchAugment(baseline, MEAN, STD).random  # the baseline still trains on the images as they are
    assert compose("recipe=cifar10_v28", "data.augment.hflip=0.5").data.augment.hflip == 0.5
    assert not BatchAugment(compose("data=image", "model=v28_cnn").data.augment, MEAN, STD).random
