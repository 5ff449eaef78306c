"""Image-classification datasets in the formats they ship in (read.py: the entry points, the layout)."""

from onn.modalities.image.formats.common import FORMATS, IMAGE_EXTS, ImageSet, image_kind
from onn.modalities.image.formats.decode import ItemList
from onn.modalities.image.formats.detect import detect_format
from onn.modalities.image.formats.read import list_items, read_splits, source_digest

__all__ = [
    "image_kind",
    "FORMATS",
    "IMAGE_EXTS",
    "ImageSet",
    "ItemList",
    "detect_format",
    "list_items",
    "read_splits",
    "source_digest",
]
