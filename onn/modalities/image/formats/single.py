"""image: one picture file, unlabelled (for inference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onn.errors import UserError
from onn.modalities.image.formats.common import Listing, PathFetch, Split


def list_single(path: Path, key: str) -> Listing:
    if path.is_dir():
        raise UserError(f"data.format image needs one image file, but {key} {path} is a folder.")
    return Listing({"all": Split([path.name], np.array([-1], np.int64), PathFetch([path]))}, [])
