"""Image-classification datasets in the formats they ship in, decoded to uint8 tensors.

read_splits decodes a whole source into one preallocated array per split; list_items lists a source and
decodes item by item, for datasets too big to hold decoded. Archives are read in place (never unpacked),
pickled files are refused (unpickling runs code), and every problem with the input is a UserError that
names the file and says what to do.

One module per format (folder: folders and archives of class folders; csvfile, parquet, idx, cifar_binary,
svhn_mat, stl10_binary, single), what they share in common (names, listings, fetchers) and decode (pixels),
detect for data.format=auto, and read for the entry points.
"""

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
