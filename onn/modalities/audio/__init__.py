"""Audio: sound classification from folders of recordings (the modality in modality.py)."""

from onn.modalities.audio.modality import AudioModality
from onn.modalities.registry import register

__all__ = ["AudioModality"]

register(AudioModality())
