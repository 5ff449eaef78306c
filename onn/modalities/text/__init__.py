"""Text: prompt/answer records and plain text for causal language models (the modality in modality.py)."""

from onn.modalities.registry import register
from onn.modalities.text.modality import TextModality

__all__ = ["TextModality"]

register(TextModality())
