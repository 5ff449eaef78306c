"""Images: classification datasets in the formats they ship in (the modality in modality.py)."""

from onn.modalities.image.modality import ImageModality
from onn.modalities.registry import register

__all__ = ["ImageModality"]

register(ImageModality())
