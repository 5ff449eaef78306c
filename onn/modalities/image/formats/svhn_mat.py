"""svhn_mat: SVHN's cropped digits, train_32x32.mat / test_32x32.mat (MATLAB v5: X is H x W x C x N, y holds
1..10 with 10 for the digit 0), read by scipy without pickle."""

from __future__ import annotations

import io

import numpy as np

from onn.errors import UserError
from onn.modalities.image.formats.arrays import by_base, label_of
from onn.modalities.image.formats.common import Arr, ArrayFetch, Listing, Split, base


def wanted(name: str) -> bool:
    """The members of an archive that list_svhn reads."""
    return base(name).endswith(".mat")


def list_svhn(files, only: str | None, where: str, key: str):
    from scipy.io import loadmat

    named = by_base(files)
    if only is not None:
        chosen = {"all": (only, files[only])}
    else:
        chosen = {s: named[f"{s}_32x32.mat"] for s in ("train", "test") if f"{s}_32x32.mat" in named}
        if not chosen:
            raise UserError(f"{key}: found no SVHN train_32x32.mat or test_32x32.mat in {where}.")
    splits = {}
    for split, (name, src) in chosen.items():
        label = label_of(where, name, src)
        try:
            mat = loadmat(io.BytesIO(src) if isinstance(src, bytes) else src, variable_names=["X", "y"])
        except NotImplementedError as e:
            raise UserError(f"{key}: {label} is a MATLAB v7.3 (HDF5) file; save it as MAT v5, as SVHN ships.") from e
        except Exception as e:  # scipy raises several types for damaged files
            raise UserError(f"{key}: {label} is not a readable .mat file: {e}") from e
        x, y = mat.get("X"), mat.get("y")
        if x is None or y is None or x.ndim != 4 or x.shape[2] not in (1, 3) or y.size != x.shape[3]:
            raise UserError(
                f"{key}: {label} must hold X (H x W x C x N uint8) and y (N labels) as SVHN's cropped-digit "
                f"files do; it holds X {None if x is None else x.shape}, y {None if y is None else y.shape}."
            )
        labels = y.reshape(-1).astype(np.int64)
        labels[labels == 10] = 0  # SVHN writes digit 0 as 10
        images = np.asarray(x, dtype=np.uint8).transpose(3, 2, 0, 1)
        splits[split] = Split(
            [f"{base(name)}#{i}" for i in range(len(labels))],
            labels,
            ArrayFetch([Arr(images, images.shape)]),
        )
    return Listing(splits, [str(i) for i in range(10)])
