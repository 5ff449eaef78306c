"""The image size a zoo model is built for, as the data group gives it."""

from __future__ import annotations


def image_sides(image_size: int | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """(height, width) of `image_size`: one number or a one-element list is a square (data.image_size=[32] decodes
    32x32 images), two are [H, W]. Any other length is a ValueError, which build_zoo says in one sentence."""
    sides = [image_size] if isinstance(image_size, int) else [int(v) for v in image_size]
    if len(sides) == 1:
        sides *= 2
    if len(sides) != 2:
        raise ValueError(f"image_size={list(sides)} is not [H, W] (or one side of a square)")
    return sides[0], sides[1]
