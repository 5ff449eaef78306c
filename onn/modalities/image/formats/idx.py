"""idx: the MNIST family (MNIST, Fashion-MNIST, KMNIST, EMNIST): *-images-idx3-ubyte[.gz] with
*-labels-idx1-ubyte[.gz], split by train / t10k / test in the names. EMNIST stores images transposed."""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path

import numpy as np

from onn.data.files import read_file
from onn.errors import UserError
from onn.modalities.image.formats.arrays import head_bytes, label_of, nbytes
from onn.modalities.image.formats.common import Arr, ArrayFetch, Listing, Split, base


def is_idx_name(name: str) -> bool:
    """Whether a file name is an IDX file's (train-images-idx3-ubyte.gz)."""
    b = base(name)
    return bool(re.search(r"idx[13]", b)) and "ubyte" in b


wanted = is_idx_name  # the members of an archive that list_idx reads


def _idx_read(name: str, src: Path | bytes, images: bool, where: str, key: str):
    """(count, dims, Arr of images or int64 labels) from one IDX file, raw or gzip."""
    label = label_of(where, name, src)
    if name.lower().endswith(".gz"):
        try:
            src = gzip.decompress(src if isinstance(src, bytes) else read_file(src))
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"{key}: {label} is not a readable gzip file: {e}") from e
    want = (0x0803, 3) if images else (0x0801, 1)
    head = head_bytes(src, 4 + 4 * want[1])
    magic = int.from_bytes(head[:4], "big") if len(head) >= 4 else -1
    if magic != (want[0] << 0) or len(head) < 4 + 4 * want[1]:
        what = "images (magic 0x00000803: uint8, 3 dims)" if images else "labels (magic 0x00000801: uint8, 1 dim)"
        raise UserError(f"{key}: {label} is not an IDX {what} file; its first bytes are {head[:4].hex() or 'missing'}.")
    dims = [int.from_bytes(head[4 + 4 * i : 8 + 4 * i], "big") for i in range(want[1])]
    offset = 4 + 4 * want[1]
    expected = offset + int(np.prod(dims))
    total = nbytes(src)
    if total != expected:
        shape = " x ".join(map(str, dims))
        raise UserError(
            f"{key}: {label}: the IDX header says {shape} ({expected} bytes with the header) but the file holds "
            f"{total} bytes (after gunzip); it is truncated or damaged, download it again."
        )
    if not images:
        raw = (
            np.frombuffer(src, np.uint8, dims[0], offset)
            if isinstance(src, bytes)
            else np.fromfile(src, np.uint8, dims[0], offset=offset)
        )
        return dims[0], dims, raw.astype(np.int64)
    n, h, w = dims
    if "emnist" in base(name):  # EMNIST stores each image transposed
        return n, dims, Arr(src, (n, 1, h, w), "nchw_t", offset)
    return n, dims, Arr(src, (n, 1, h, w), "nchw", offset)


def list_idx(files, only: str | None, where: str, key: str, allow_unlabelled: bool):
    entries: dict[tuple[str, str], dict[str, str]] = {}
    for name in sorted(files, key=lambda n: (n.lower().endswith(".gz"), n)):  # raw before .gz: faster
        fname = base(name)
        if not is_idx_name(fname):
            continue
        kind = "images" if ("idx3" in fname or "images" in fname) else "labels"
        split = "train" if "train" in fname else "test" if ("t10k" in fname or "test" in fname) else "all"
        norm = re.sub(r"images|labels", "*", fname.removesuffix(".gz"))
        group = re.sub(r"idx[13]", "idx", re.sub(r"train|t10k|test", "", norm))
        if "/" in name:
            group = name.rsplit("/", 1)[0] + "/" + group
        entries.setdefault((group, split), {}).setdefault(kind, name)
    if only is not None:
        low = only.lower()
        if head_bytes(files[only], 4) == b"\0\0\x08\x01" or "labels" in low or "idx1" in low:
            raise UserError(f"{key}: {where}/{only} is an IDX labels file; point {key} at the images file.")
        stem = low.removesuffix(".gz")
        partners = {stem.replace("images", "labels").replace("idx3", "idx1")} - {stem}
        lower = {n.lower(): n for n in files}
        pair = {"images": only}
        for cand in sorted(partners) + sorted(p + ".gz" for p in partners):
            if cand in lower:
                pair["labels"] = lower[cand]
                break
        entries = {("", "all"): pair}
    if not entries:
        raise UserError(f"{key}: found no IDX files (*-images-idx3-ubyte[.gz]) in {where}.")
    groups = sorted({g for g, _ in entries})
    if len(groups) > 1:
        imgs = sorted(v["images"] for v in entries.values() if "images" in v)
        raise UserError(
            f"{key}: {where} holds several IDX datasets ({', '.join(imgs[:6])}); point {key} at one images file."
        )
    splits = {}
    for (_, split), pair in sorted(entries.items(), key=lambda e: e[0][1]):
        if "images" not in pair:
            raise UserError(f"{key}: {where} has the labels file {pair['labels']} but no images file next to it.")
        n, dims, arr = _idx_read(pair["images"], files[pair["images"]], True, where, key)
        if "labels" in pair:
            m, _, labels = _idx_read(pair["labels"], files[pair["labels"]], False, where, key)
            if m != n:
                raise UserError(
                    f"{key}: {label_of(where, pair['images'], files[pair['images']])} holds {n} images but "
                    f"{label_of(where, pair['labels'], files[pair['labels']])} holds {m} labels; they must match."
                )
        elif allow_unlabelled:
            labels = np.full(n, -1, np.int64)
        else:
            raise UserError(
                f"{key}: no labels file next to {pair['images']} (expected "
                f"{base(pair['images']).replace('images', 'labels').replace('idx3', 'idx1')})."
            )
        stem = base(pair["images"])
        splits[split] = Split([f"{stem}#{i}" for i in range(n)], labels, ArrayFetch([arr]))
    return Listing(splits, None)
