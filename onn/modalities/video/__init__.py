"""Video: clip classification from folders of videos (the modality in modality.py)."""

from onn.modalities.registry import register
from onn.modalities.video.modality import VideoModality

__all__ = ["VideoModality"]

register(VideoModality())
