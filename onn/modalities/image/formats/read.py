"""The entry points: read a whole source decoded (read_splits), list it for decoding item by item
(list_items), and key its decoded cache (source_digest).

read_splits decodes a whole source into one preallocated array per split; list_items lists a source and
decodes item by item, for datasets too big to hold decoded. Archives are read in place (never unpacked),
pickled files are refused (unpickling runs code), and every problem with the input is a UserError that
names the file and says what to do.

One module per format (folder: folders and archives of class folders; csvfile, parquet, idx, cifar_binary,
svhn_mat, stl10_binary, single), what they share in common (names, listings, fetchers) and decode (pixels),
detect for data.format=auto, and this module for the entry points.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onn.data.files import archive_kind, content_digest, update_hash
from onn.data.labelled import check_bad
from onn.errors import UserError
from onn.modalities.image.formats import cifar_binary, idx, stl10_binary, svhn_mat
from onn.modalities.image.formats.arrays import gather
from onn.modalities.image.formats.common import (
    FORMATS,
    ArrayFetch,
    ImageSet,
    Listing,
    existing,
    finish_classes,
    log,
    options,
)
from onn.modalities.image.formats.csvfile import TABLE_SUFFIXES, csv_path, csv_rows, list_csv, split_tables
from onn.modalities.image.formats.decode import ItemList, array_split, decode_split, strict_pil
from onn.modalities.image.formats.detect import detect
from onn.modalities.image.formats.folder import list_tree
from onn.modalities.image.formats.parquet import list_parquet
from onn.modalities.image.formats.single import list_single

ARRAY_FORMATS = {"idx": idx, "cifar_binary": cifar_binary, "svhn_mat": svhn_mat, "stl10_binary": stl10_binary}


def source_digest(source: str | Path, fmt: str = "auto") -> str:
    """A hex digest of the source's content, to key the decoded cache. Files (archives, idx, .bin, .mat,
    parquet, csv and the images a csv names): sha256 of the bytes; one array file (an IDX images file) also
    over the files beside it that its reader is given (its labels file). Folders: sha256 over (relative
    path, size, mtime_ns) of every file, sorted — reading 60k small files' bytes is too slow; a folder of
    train.csv / test.csv also over each table's images, which may live outside it (../img/x.jpg)."""
    path = existing(source, "data.source")
    if path.is_dir() and _resolve(path, fmt, "data.source") == "csv":
        h = hashlib.sha256(content_digest(path).encode())
        for table in split_tables(path).values():
            _table_digest(h, table)
        return h.hexdigest()
    if path.is_file() and path.suffix.lower() not in TABLE_SUFFIXES and archive_kind(path) is None:
        module = ARRAY_FORMATS.get(_resolve(path, fmt, "data.source"))
        if module is not None:
            return _gathered_digest(path, module.wanted)
    if path.is_dir() or path.suffix.lower() not in TABLE_SUFFIXES:
        return content_digest(path)
    h = hashlib.sha256()
    _table_digest(h, path)
    return h.hexdigest()


def _gathered_digest(path: Path, wanted: Callable[[str], bool]) -> str:
    """One array file's digest with those of the files beside it that its reader is given (IDX labels,
    STL-10's train_y.bin, CIFAR's batches.meta.txt): a rewritten labels file must not reuse the cache."""
    files, _, _ = gather(path, wanted, "data.source")
    h = hashlib.sha256()
    for name, src in sorted(files.items()):
        h.update(f"{name}\0{content_digest(src)}\n".encode())
    return h.hexdigest()


def _table_digest(h: Any, path: Path) -> None:
    """Hash a csv's bytes and those of every image it names."""
    update_hash(h, path)
    try:
        rows = csv_rows(path, "data.source", labelled=False)
    except UserError:
        rows = []  # a malformed csv still gets a digest; reading it will say what is wrong
    for _, name, _ in rows:
        image = csv_path(path, name)
        h.update(f"\n{name}\0".encode())
        if image.is_file():
            update_hash(h, image)
        else:
            h.update(b"<missing>")


def read_splits(
    source: str | Path,
    fmt: str = "auto",
    *,
    channels: int | str = "auto",
    image_size: list[int] | None = None,
    resize: str = "error",
    max_bad_fraction: float = 0.01,
    num_classes: int | None = None,
    allow_unlabelled: bool = False,
    key: str = "data.source",
) -> dict[str, ImageSet]:
    """Every split of a source, decoded: {"train", "test", "val"} as the source has them, else {"all"}."""
    path = existing(source, key)
    opts = options(channels, image_size, resize)
    listing = _listing(path, _resolve(path, fmt, key), key, allow_unlabelled, stream=False)
    classes = finish_classes(listing, num_classes, key)
    splits = listing.splits
    ref: dict[str, Any] = {}
    decoded: dict[str, tuple[np.ndarray, list[int], list[str]]] = {}
    with strict_pil():
        for name, split in splits.items():
            if isinstance(split.fetch, ArrayFetch):
                decoded[name] = (array_split(split, opts, ref, key), list(range(len(split.names))), [])
            else:
                decoded[name] = decode_split(split, opts, ref, key)
    skipped = listing.rejected + [s for _, _, bad in decoded.values() for s in bad]
    total = len(listing.rejected) + sum(len(s.names) for s in splits.values())
    check_bad(skipped, total, max_bad_fraction, path, key, "images")
    width = max(x.shape[1] for x, _, _ in decoded.values())
    out = {}
    for k, (name, (x, keep, bad)) in enumerate(decoded.items()):
        if x.shape[1] != width:  # auto channels: a gray split next to a colour one
            x = np.repeat(x, width, axis=1)
        split = splits[name]
        out[name] = ImageSet(
            images=torch.from_numpy(np.ascontiguousarray(x)),
            labels=torch.from_numpy(np.ascontiguousarray(split.labels[keep], dtype=np.int64)),
            classes=list(classes),
            names=[split.names[i] for i in keep],
            skipped=(listing.rejected if k == 0 else []) + bad,  # members refused by path: with the first
        )
    return out


def list_items(source: str | Path, fmt: str = "auto", *, key: str = "data.source") -> dict[str, ItemList]:
    """Every split of a source, listed but not decoded: ItemList.load(i) decodes one item on demand."""
    path = existing(source, key)
    listing = _listing(path, _resolve(path, fmt, key), key, allow_unlabelled=False, stream=True)
    classes = finish_classes(listing, None, key)
    if listing.rejected:
        log.warning("Skipped %d items of %s: %s", len(listing.rejected), path, "; ".join(listing.rejected[:3]))
    return {
        name: ItemList(s.fetch, torch.from_numpy(s.labels.astype(np.int64)), classes, s.names)
        for name, s in listing.splits.items()
    }


def _resolve(path: Path, fmt: str, key: str) -> str:
    if fmt == "auto":
        return detect(path, key)
    if fmt not in FORMATS:
        raise UserError(f"data.format '{fmt}' is not one of auto, {', '.join(FORMATS)}.")
    return fmt


def _listing(path: Path, fmt: str, key: str, allow_unlabelled: bool, stream: bool) -> Listing:
    if fmt in ("folder", "archive"):
        return list_tree(path, key, allow_unlabelled, stream)
    if fmt == "csv":
        return list_csv(path, key, allow_unlabelled)
    if fmt == "parquet":
        return list_parquet(path, key, allow_unlabelled)
    if fmt == "image":
        return list_single(path, key)
    module = ARRAY_FORMATS[fmt]
    files, only, where = gather(path, module.wanted, key)
    if fmt == "idx":
        return idx.list_idx(files, only, where, key, allow_unlabelled)
    if fmt == "cifar_binary":
        return cifar_binary.list_cifar(files, only, where, key)
    if fmt == "svhn_mat":
        return svhn_mat.list_svhn(files, only, where, key)
    return stl10_binary.list_stl10(files, only, where, key)
