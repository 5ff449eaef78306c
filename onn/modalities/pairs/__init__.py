"""Paired data learned as a dual encoder, CLIP-style (the modality in modality.py)."""

from onn.modalities.pairs.modality import PairsModality
from onn.modalities.registry import register

__all__ = ["PairsModality"]

register(PairsModality())
