"""stl10_binary: STL-10's train_X.bin + train_y.bin and test_X.bin + test_y.bin (3 x 96 x 96 images stored
column-major, labels 1..10); unlabeled_X.bin is left out."""

from __future__ import annotations

import re

import numpy as np

from onn.errors import UserError
from onn.modalities.image.formats.arrays import by_base, label_of, nbytes, text_lines
from onn.modalities.image.formats.common import Arr, ArrayFetch, Listing, Split, base

STL_BIN = re.compile(r"(train|test)_[xy]\.bin")


def wanted(name: str) -> bool:
    """The members of an archive that list_stl10 reads."""
    return bool(STL_BIN.fullmatch(base(name))) or base(name) == "class_names.txt"


def list_stl10(files, only: str | None, where: str, key: str):
    named = by_base(files)
    wanted = ("train", "test")
    if only is not None:
        m = re.fullmatch(r"(train|test)_x\.bin", only.lower())
        if not m:
            raise UserError(f"{key}: point {key} at the STL-10 folder or at train_X.bin / test_X.bin, not {only}.")
        wanted = (m.group(1),)
    size = 3 * 96 * 96
    splits = {}
    for split in wanted:
        if f"{split}_x.bin" not in named:
            continue
        xname, xsrc = named[f"{split}_x.bin"]
        if f"{split}_y.bin" not in named:
            raise UserError(f"{key}: {label_of(where, xname, xsrc)} has no {split}_y.bin next to it.")
        yname, ysrc = named[f"{split}_y.bin"]
        xbytes = nbytes(xsrc)
        if xbytes == 0 or xbytes % size:
            raise UserError(
                f"{key}: {label_of(where, xname, xsrc)} is {xbytes} bytes, not a multiple of {size} "
                "(3 x 96 x 96 per image); it is truncated or not STL-10."
            )
        n = xbytes // size
        y = (np.frombuffer(ysrc, np.uint8) if isinstance(ysrc, bytes) else np.fromfile(ysrc, np.uint8)).astype(np.int64)
        if len(y) != n:
            raise UserError(
                f"{key}: {label_of(where, xname, xsrc)} holds {n} images but "
                f"{label_of(where, yname, ysrc)} holds {len(y)} labels; they must match."
            )
        if n and y.min() < 1:
            raise UserError(f"{key}: {label_of(where, yname, ysrc)} has label 0; STL-10 labels run from 1.")
        splits["all" if only else split] = Split(
            [f"{split}_X.bin#{i}" for i in range(n)],
            y - 1,
            ArrayFetch([Arr(xsrc, (n, 3, 96, 96), "nchw_t")]),
        )
    if not splits:
        raise UserError(f"{key}: found no STL-10 train_X.bin or test_X.bin in {where}.")
    names = named.get("class_names.txt")
    return Listing(splits, text_lines(names[1]) if names else None)
