"""cifar_binary: CIFAR-10 (data_batch_N.bin + test_batch.bin, 1 label byte + 3072 pixel bytes per record)
and CIFAR-100 (train.bin + test.bin, coarse and fine label bytes: the fine one is used). The pickled Python
version is refused, never unpickled."""

from __future__ import annotations

import re

import numpy as np

from onn.errors import UserError
from onn.modalities.image.formats.arrays import by_base, label_of, nbytes, text_lines
from onn.modalities.image.formats.common import (
    CIFAR_URL,
    Arr,
    ArrayFetch,
    Listing,
    Split,
    base,
    is_pickled,
    refuse_pickled,
)

CIFAR10_BIN = re.compile(r"(data_batch_\d+|test_batch)\.bin")
CIFAR100_BIN = re.compile(r"(train|test)\.bin")


def is_cifar_name(name: str) -> bool:
    """Whether a file name is one of CIFAR's binary batches."""
    return bool(CIFAR10_BIN.fullmatch(base(name)) or CIFAR100_BIN.fullmatch(base(name)))


def wanted(name: str) -> bool:
    """The members of an archive that list_cifar reads."""
    return is_cifar_name(name) or base(name).endswith("_names.txt") or base(name) == "batches.meta.txt"


def list_cifar(files, only: str | None, where: str, key: str):
    named = by_base(files)
    if any(is_pickled(n) for n in files) or ({"meta"} <= set(named) and {"train", "test"} & set(named)):
        refuse_pickled(where, key)
    bins = [b for b in named if CIFAR10_BIN.fullmatch(b)]
    fine = False
    if only is not None:
        bins = [only.lower()] if is_cifar_name(only) else []
        fine = bool(CIFAR100_BIN.fullmatch(only.lower()))
    elif not bins:
        bins = [b for b in named if CIFAR100_BIN.fullmatch(b)]
        fine = True
    if not bins:
        raise UserError(
            f"{key}: found no CIFAR binary files (data_batch_N.bin + test_batch.bin, or train.bin + test.bin) "
            f"in {where}; get cifar-10-binary.tar.gz or cifar-100-binary.tar.gz from {CIFAR_URL}."
        )
    rec = 3074 if fine else 3073
    meta = named.get("fine_label_names.txt" if fine else "batches.meta.txt")
    classes = text_lines(meta[1]) if meta else None
    groups: dict[str, list[str]] = {}
    for b in sorted(bins, key=lambda b: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", b)]):
        split = "all" if only is not None else ("train" if b.startswith(("data_batch", "train")) else "test")
        groups.setdefault(split, []).append(b)
    splits = {}
    for split, bs in groups.items():
        blocks, labels, names = [], [], []
        for b in bs:
            name, src = named[b] if only is None else (only, files[only])
            size = nbytes(src)
            if size == 0 or size % rec:
                raise UserError(
                    f"{key}: {label_of(where, name, src)} is {size} bytes, not a multiple of the {rec}-byte "
                    f"CIFAR-{'100' if fine else '10'} record ({rec - 3072} label byte{'s' if fine else ''} + 3072 "
                    "pixel bytes); it is truncated or not the binary version."
                )
            n = size // rec
            raw = np.frombuffer(src, np.uint8) if isinstance(src, bytes) else np.memmap(src, np.uint8, "r")
            labels.append(raw.reshape(n, rec)[:, rec - 3073].astype(np.int64))
            blocks.append(Arr(src, (n, rec), "records", skip=rec - 3072))
            names += [f"{base(name)}#{i}" for i in range(n)]
        splits[split] = Split(names, np.concatenate(labels), ArrayFetch(blocks))
    return Listing(splits, classes)
