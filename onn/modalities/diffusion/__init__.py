"""Diffusion: denoisers (diffusers' UNet2DModel and DiT) that learn to generate images (the modality in modality.py)."""

from onn.modalities.diffusion.modality import DiffusionModality
from onn.modalities.registry import register

__all__ = ["DiffusionModality"]

register(DiffusionModality())
