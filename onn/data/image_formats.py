"""Image-classification datasets in the formats they ship in, decoded to uint8 tensors.

read_splits decodes a whole source into one preallocated array per split; list_items lists a source and
decodes item by item, for datasets too big to hold decoded. Archives are read in place (never unpacked),
pickled files are refused (unpickling runs code), and every problem with the input is a UserError that
names the file and says what to do.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onn.errors import UserError

log = logging.getLogger("onn")

FORMATS = ("folder", "archive", "idx", "cifar_binary", "svhn_mat", "stl10_binary", "parquet", "csv", "image")
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
SPLITS = {"train": "train", "test": "test", "val": "val", "valid": "val", "validation": "val"}
RESIZE_MODES = ("error", "resize", "center_crop")

_HELP = (
    "supported formats: folder (CLASS/IMAGE or train/CLASS/IMAGE + test/CLASS/IMAGE), archive (a .tar, .tar.gz "
    "or .zip of that layout), idx (MNIST-style *-images-idx3-ubyte[.gz] + *-labels-idx1-ubyte[.gz]), "
    "cifar_binary (CIFAR-10/100 binary version: data_batch_N.bin + test_batch.bin, or train.bin + test.bin), "
    "svhn_mat (train_32x32.mat, test_32x32.mat), stl10_binary (train_X.bin + train_y.bin, ...), parquet "
    "(Hugging Face export: an image column and a label column), csv (path,label rows) and image (one image file)"
)
_LAYOUT = "CLASS/IMAGE (e.g. cat/0001.jpg) or train/CLASS/IMAGE and test/CLASS/IMAGE"
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
_GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
_SKIP_DIRS = frozenset({"__MACOSX"})

_CIFAR10_BIN = re.compile(r"(data_batch_\d+|test_batch)\.bin")
_CIFAR100_BIN = re.compile(r"(train|test)\.bin")
_STL_BIN = re.compile(r"(train|test)_[xy]\.bin")
_PICKLED_CIFAR = re.compile(r"data_batch_\d+|test_batch|batches\.meta|cifar-10(0)?-python\.tar\.gz")
_PICKLED_DIRS = frozenset({"cifar-10-batches-py", "cifar-100-python"})
_SPLIT_TOKEN = re.compile(r"(?<![a-z])(train|test|validation|valid|val)(?![a-z])")


@dataclass
class ImageSet:
    """One split, decoded."""

    images: torch.Tensor  # uint8 [N, C, H, W], contiguous
    labels: torch.Tensor  # int64 [N]; -1 where the label is unknown (unlabelled images for inference)
    classes: list[str]  # class names, index = label
    names: list[str]  # where each image came from, e.g. "train/cat/0001.jpg" or "data_batch_1.bin#17"
    skipped: list[str] = field(default_factory=list)  # items that could not be decoded, each "name: reason"


# ---------------------------------------------------------------------------------------------------------
# Public entry points


def detect_format(source: str | Path) -> str:
    """Which of FORMATS a source is, from file names and magic bytes (a folder is looked at two levels deep)."""
    return _detect(_existing(source, "data.source"), "data.source")


def _detect(path: Path, key: str) -> str:
    return _detect_dir(path, key) if path.is_dir() else _detect_file(path, key)


def source_digest(source: str | Path) -> str:
    """A hex digest of the source's content, to key the decoded cache. Files (archives, idx, .bin, .mat,
    parquet, csv and the images a csv names): sha256 of the bytes (stream in 1 MB chunks). Folders: sha256 over
    (relative path, size, mtime_ns) of every file, sorted — reading 60k small files' bytes is too slow."""
    path = _existing(source, "data.source")
    h = hashlib.sha256()
    if path.is_dir():
        for rel, full in sorted(_walk_files(path)):
            st = full.stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()
    _hash_file(h, path)
    if path.suffix.lower() in (".csv", ".tsv"):
        try:
            rows = _csv_rows(path, "data.source", labelled=False)
        except UserError:
            rows = []  # a malformed csv still gets a digest; reading it will say what is wrong
        for _, name, _ in rows:
            image = _csv_path(path, name)
            h.update(f"\n{name}\0".encode())
            if image.is_file():
                _hash_file(h, image)
            else:
                h.update(b"<missing>")
    return h.hexdigest()


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
    path = _existing(source, key)
    opts = _options(channels, image_size, resize)
    splits, classes = _listing(path, _resolve(path, fmt, key), key, allow_unlabelled, stream=False)
    classes = _finish_classes(splits, classes, num_classes, key)
    ref: dict[str, Any] = {}
    decoded: dict[str, tuple[np.ndarray, list[int], list[str]]] = {}
    with _strict_pil():
        for name, split in splits.items():
            if isinstance(split.fetch, _ArrayFetch):
                decoded[name] = (_array_split(split, opts, ref, key), list(range(len(split.names))), [])
            else:
                decoded[name] = _decode_split(split, opts, ref, key)
    skipped = [s for _, _, bad in decoded.values() for s in bad]
    _report_skipped(skipped, sum(len(s.names) for s in splits.values()), max_bad_fraction, path, key)
    width = max(x.shape[1] for x, _, _ in decoded.values())
    out = {}
    for name, (x, keep, bad) in decoded.items():
        if x.shape[1] != width:  # auto channels: a gray split next to a colour one
            x = np.repeat(x, width, axis=1)
        split = splits[name]
        out[name] = ImageSet(
            images=torch.from_numpy(np.ascontiguousarray(x)),
            labels=torch.from_numpy(np.ascontiguousarray(split.labels[keep], dtype=np.int64)),
            classes=list(classes),
            names=[split.names[i] for i in keep],
            skipped=bad,
        )
    return out


def list_items(source: str | Path, fmt: str = "auto", *, key: str = "data.source") -> dict[str, ItemList]:
    """Every split of a source, listed but not decoded: ItemList.load(i) decodes one item on demand."""
    path = _existing(source, key)
    splits, classes = _listing(path, _resolve(path, fmt, key), key, allow_unlabelled=False, stream=True)
    classes = _finish_classes(splits, classes, None, key)
    return {
        name: ItemList(s.fetch, torch.from_numpy(s.labels.astype(np.int64)), classes, s.names)
        for name, s in splits.items()
    }


class ItemList:
    """One split, listed: labels and names up front, pixels decoded by load(i) (in DataLoader workers).

    Archive handles are opened on first use in each process, so a list survives pickling into workers.
    With channels="auto" on encoded images, the first 16 items decide (1 if all are gray, else 3), and with
    no image_size every image must have the size of the first one.
    """

    def __init__(self, fetch: Any, labels: torch.Tensor, classes: list[str], names: list[str]):
        self._fetch = fetch
        self.labels = labels
        self.classes = list(classes)
        self.names = names
        self.configure()

    def configure(
        self, channels: int | str = "auto", image_size: list[int] | None = None, resize: str = "error"
    ) -> ItemList:
        """Set how load() converts images (same rules as read_splits); returns self."""
        self._opts = _options(channels, image_size, resize)
        self._probed: tuple[int | str, Any] | None = None
        return self

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"ItemList({len(self)} items, {len(self.classes)} classes)"

    def load(self, i: int) -> torch.Tensor | None:
        """Item i as uint8 [C, H, W], or None when it cannot be decoded."""
        opts = self._opts
        if isinstance(self._fetch, _ArrayFetch):
            return torch.from_numpy(_array_image(self._fetch.get(i), opts, self.names[i]))
        channels, ref = self._probe()
        with _strict_pil():
            try:
                img = _convert(_open_raw(self._fetch.get(i)), channels)
            except Exception:  # PIL raises many types for damaged files
                return None
        img = _fit(img, opts, self.names[i])
        if opts.image_size is None and ref is not None and img.size != ref[1]:
            raise UserError(_mixed_sizes(ref[0], ref[1][::-1], self.names[i], img.size[::-1]))
        a = np.asarray(img)
        return torch.from_numpy(np.array(a[None] if a.ndim == 2 else a.transpose(2, 0, 1), dtype=np.uint8))

    def _probe(self) -> tuple[int | str, Any]:
        """Channels and reference size from the first items that decode."""
        if self._probed is None:
            gray, ref = True, None
            with _strict_pil():
                for i in range(min(16, len(self))):
                    try:
                        img = _open_raw(self._fetch.get(i))
                    except Exception:
                        continue
                    gray &= img.mode in _GRAY_MODES
                    size = _fit(_convert(img, "auto"), self._opts, self.names[i]).size
                    if ref is None:
                        ref = (self.names[i], size)
                    elif self._opts.image_size is None and size != ref[1]:
                        raise UserError(_mixed_sizes(ref[0], ref[1][::-1], self.names[i], size[::-1]))
            channels = self._opts.channels
            if channels == "auto":
                channels = 1 if gray else 3
            self._probed = (channels, ref)
        return self._probed


# ---------------------------------------------------------------------------------------------------------
# Options, checks and reports shared by the formats


@dataclass
class _Opts:
    channels: int | str
    image_size: tuple[int, int] | None
    resize: str


def _options(channels: int | str, image_size: Any, resize: str) -> _Opts:
    if isinstance(channels, str) and channels.strip().isdigit():
        channels = int(channels)
    if channels not in ("auto", 1, 3) or isinstance(channels, bool):
        raise UserError(f"data.channels is {channels!r}; use auto, 1 or 3.")
    size = None
    if image_size is not None:
        vals = [image_size] if isinstance(image_size, int) else list(image_size)
        vals = vals * 2 if len(vals) == 1 else vals
        if len(vals) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vals):
            raise UserError(f"data.image_size is {image_size!r}; use [H, W] with two positive integers.")
        size = (vals[0], vals[1])
    if resize not in RESIZE_MODES:
        raise UserError(f"data.resize is {resize!r}; use one of {', '.join(RESIZE_MODES)}.")
    return _Opts(channels, size, resize)


def _existing(source: str | Path, key: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"{key} {path} does not exist; point it at a dataset file or folder ({_HELP}).")
    return path


def _resolve(path: Path, fmt: str, key: str) -> str:
    if fmt == "auto":
        return _detect(path, key)
    if fmt not in FORMATS:
        raise UserError(f"data.format '{fmt}' is not one of auto, {', '.join(FORMATS)}.")
    return fmt


def _finish_classes(splits: dict[str, _Split], classes: list[str] | None, num_classes: int | None, key: str):
    """Class names (numbers as strings when the format has none) and the label range check."""
    labels = [s.labels[s.labels >= 0] for s in splits.values()]
    top = max((int(x.max()) for x in labels if x.size), default=-1)
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise UserError(f"data.num_classes is {num_classes!r}; use a positive integer.")
    limit = num_classes if num_classes is not None else (len(classes) if classes else None)
    if limit is not None and top >= limit:
        for split in splits.values():
            bad = np.flatnonzero(split.labels >= limit)
            if bad.size:
                i = int(bad[0])
                where = split.origin[i] if split.origin else split.names[i]
                said = (
                    f"data.num_classes is {num_classes}; raise it or fix the label"
                    if num_classes is not None
                    else f"the source names only {len(classes)} classes"
                )
                raise UserError(
                    f"{key}: {where} has label {int(split.labels[i])}, outside [0, {limit}): {said}."
                )
    if classes is None:
        classes = [str(i) for i in range(max(top + 1, num_classes or 0))]
    return classes


def _report_skipped(skipped: list[str], total: int, max_bad_fraction: float, path: Path, key: str) -> None:
    if not skipped:
        return
    first = "; ".join(skipped[:3])
    if len(skipped) == total or len(skipped) / total > max_bad_fraction:
        raise UserError(
            f"{key} {path}: {len(skipped)} of {total} images could not be decoded (first: {first}); fix or "
            f"remove them, or set data.max_bad_fraction (now {max_bad_fraction}) to accept more."
        )
    log.warning(
        "Skipped %d of %d images in %s that could not be decoded: %s%s",
        len(skipped),
        total,
        path,
        first,
        " ..." if len(skipped) > 3 else "",
    )


def _mixed_sizes(a: str, a_hw: tuple[int, int], b: str, b_hw: tuple[int, int]) -> str:
    return (
        f"images have different sizes: {a} is {a_hw[0]}x{a_hw[1]} but {b} is {b_hw[0]}x{b_hw[1]} (HxW); set "
        "data.image_size=[H,W] with data.resize=resize (stretch) or data.resize=center_crop."
    )


def _same_size(ref: dict[str, Any], name: str, hw: tuple[int, int], key: str) -> None:
    if "hw" not in ref:
        ref["hw"], ref["name"] = hw, name
    elif ref["hw"] != hw:
        raise UserError(f"{key}: " + _mixed_sizes(ref["name"], ref["hw"], name, hw))


# ---------------------------------------------------------------------------------------------------------
# Decoding


@contextmanager
def _strict_pil() -> Iterator[None]:
    """Truncated images must fail to load, whatever another module set PIL to."""
    from PIL import ImageFile

    before = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = before


def _open_raw(data: bytes | None):
    from PIL import Image

    if data is None:
        raise ValueError("no image bytes")
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _convert(img, channels: int | str):
    """To mode L (gray images under auto, or channels=1: ITU-R 601 luma) or RGB."""
    if channels == 1 or (channels == "auto" and img.mode in _GRAY_MODES):
        return _to_l(img)
    return img if img.mode == "RGB" else img.convert("RGB")


def _to_l(img):
    from PIL import Image

    mode = img.mode
    if mode == "L":
        return img
    if mode in ("I", "F") or mode.startswith("I;16"):
        a = np.asarray(img)
        if mode == "F":
            a = np.nan_to_num(a.astype(np.float64))
            a = np.rint(a * 255 if a.size and a.max() <= 1.0 else a)
        elif mode.startswith("I;16") or (a.size and a.max() > 255):
            a = a.astype(np.int64) >> 8  # 16-bit samples
        return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))
    if mode in ("1", "LA", "La", "P", "RGB", "RGBA"):
        return img.convert("L")
    return img.convert("RGB").convert("L")


def _fit(img, opts: _Opts, name: str):
    """Bring a PIL image to data.image_size (nothing to do when it has it already)."""
    if opts.image_size is None:
        return img
    from PIL import Image

    th, tw = opts.image_size
    w, h = img.size
    if (w, h) == (tw, th):
        return img
    if opts.resize == "error":
        raise UserError(
            f"{name} is {h}x{w}, not data.image_size=[{th},{tw}]; set data.resize=resize (stretch) or "
            "data.resize=center_crop to bring every image to that size."
        )
    if opts.resize == "resize":
        return img.resize((tw, th), Image.Resampling.BILINEAR)
    scale = max(th / h, tw / w)  # the short side (relative to the target) lands on the target
    nw, nh = max(tw, round(w * scale)), max(th, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - tw) // 2, (nh - th) // 2
    return img.crop((left, top, left + tw, top + th))


def _reason(e: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "not an image PIL can read (damaged, or another format)"
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _decode_split(split: _Split, opts: _Opts, ref: dict[str, Any], key: str):
    """Decode into one preallocated [N, C, H, W] array; items that fail are skipped and reported."""
    n = len(split.names)
    out: np.ndarray | None = None
    keep: list[int] = []
    skipped: list[str] = []
    for i, name in enumerate(split.names):
        try:
            img = _convert(_open_raw(split.fetch.get(i)), opts.channels)
        except Exception as e:  # PIL raises many types for damaged files
            skipped.append(f"{name}: {_reason(e)}")
            continue
        img = _fit(img, opts, name)
        a = np.asarray(img)
        if opts.image_size is None:
            _same_size(ref, name, a.shape[:2], key)
        k = len(keep)
        if out is None:
            out = np.empty((n, 1 if a.ndim == 2 else 3, *a.shape[:2]), np.uint8)
        elif a.ndim == 3 and out.shape[1] == 1:  # the first colour image: widen what is decoded so far
            wider = np.empty((n, 3, *out.shape[2:]), np.uint8)
            wider[:k] = out[:k]
            out = wider
        if a.ndim == 2:
            out[k] = a  # broadcasts over 1 or 3 channels
        else:
            out[k] = a.transpose(2, 0, 1)
        keep.append(i)
    if out is None:
        hw = opts.image_size or ref.get("hw") or (0, 0)
        out = np.empty((0, 1 if opts.channels in ("auto", 1) else 3, *hw), np.uint8)
    return out[: len(keep)], keep, skipped


def _luma(x: np.ndarray) -> np.ndarray:
    """RGB [N,3,H,W] -> [N,1,H,W] with ITU-R 601 weights, rounded as PIL's convert("L") does."""
    out = np.empty((x.shape[0], 1, *x.shape[2:]), np.uint8)
    for s in range(0, x.shape[0], 4096):
        b = x[s : s + 4096].astype(np.uint32)
        out[s : s + 4096, 0] = (b[:, 0] * 19595 + b[:, 1] * 38470 + b[:, 2] * 7471 + 0x8000) >> 16
    return out


def _array_image(chw: np.ndarray, opts: _Opts, name: str) -> np.ndarray:
    """One [C,H,W] image of an array format, with the channel and size rules applied."""
    x = chw[None]
    if opts.channels == 1 and x.shape[1] == 3:
        x = _luma(x)
    elif opts.channels == 3 and x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    if opts.image_size is not None and x.shape[2:] != opts.image_size:
        x = _resize_all(x, opts, [name])
    return np.array(x[0], dtype=np.uint8)


def _resize_all(x: np.ndarray, opts: _Opts, names: list[str]) -> np.ndarray:
    from PIL import Image

    out = np.empty((x.shape[0], x.shape[1], *opts.image_size), np.uint8)
    for i in range(x.shape[0]):
        img = Image.fromarray(np.ascontiguousarray(x[i, 0] if x.shape[1] == 1 else x[i].transpose(1, 2, 0)))
        a = np.asarray(_fit(img, opts, names[min(i, len(names) - 1)]))
        out[i] = a if a.ndim == 2 else a.transpose(2, 0, 1)
    return out


def _array_split(split: _Split, opts: _Opts, ref: dict[str, Any], key: str) -> np.ndarray:
    """The whole split in memory: a copy, never a view of a memmap or of read-only bytes."""
    x = split.fetch.all()
    if opts.channels == 1 and x.shape[1] == 3:
        x = _luma(x)
    elif opts.channels == 3 and x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    elif len(split.fetch.blocks) == 1:
        x = np.array(x, order="C")  # (np.concatenate of several blocks has copied already)
    hw = tuple(x.shape[2:])
    if opts.image_size is not None and hw != opts.image_size:
        return _resize_all(x, opts, split.names)  # with resize=error, _fit says so on the first image
    if opts.image_size is None and len(x):
        _same_size(ref, split.names[0], hw, key)
    return x


# ---------------------------------------------------------------------------------------------------------
# Where the bytes come from: each fetcher gives item i; file handles open lazily, once per process.


@dataclass
class _Split:
    names: list[str]
    labels: np.ndarray  # int64, -1 = unknown
    fetch: Any  # an encoded-bytes fetcher or an _ArrayFetch
    origin: list[str] | None = None  # where each item is, for messages ("labels.csv row 3")


class _Lazy:
    """Drops open handles when pickled, and reopens them in the new process."""

    _h: Any = None
    _pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_h"], state["_pid"] = None, None
        return state

    def _handle(self):
        if self._h is None or self._pid != os.getpid():
            self._h, self._pid = self._open(), os.getpid()
        return self._h

    def _open(self):
        raise NotImplementedError


class _MemFetch:
    def __init__(self, items: list[bytes | None]):
        self.items = items

    def get(self, i: int) -> bytes | None:
        return self.items[i]


class _PathFetch:
    def __init__(self, paths: list[Path]):
        self.paths = paths

    def get(self, i: int) -> bytes:
        with open(self.paths[i], "rb") as f:
            return f.read()


class _ZipFetch(_Lazy):
    def __init__(self, path: Path, members: list[str]):
        self.path, self.members = path, members

    def _open(self):
        return zipfile.ZipFile(self.path)

    def get(self, i: int) -> bytes:
        return self._handle().read(self.members[i])


class _TarFetch(_Lazy):
    """An uncompressed tar: each member's bytes sit at a fixed offset."""

    def __init__(self, path: Path, offsets: list[int], sizes: list[int]):
        self.path, self.offsets, self.sizes = path, offsets, sizes

    def _open(self):
        return open(self.path, "rb")

    def get(self, i: int) -> bytes:
        f = self._handle()
        f.seek(self.offsets[i])
        return f.read(self.sizes[i])


class _ParquetFetch(_Lazy):
    """Rows of parquet files; a file's image column is read on its first use, then kept."""

    def __init__(self, files: list[Path], column: str, nested: bool, where: list[tuple[int, int]]):
        self.files, self.column, self.nested, self.where = files, column, nested, where

    def _open(self):
        return {}

    def get(self, i: int) -> bytes | None:
        cache = self._handle()
        f, row = self.where[i]
        if f not in cache:
            cache[f] = _parquet_bytes(self.files[f], self.column, self.nested)
        return cache[f][row]


class _Arr(_Lazy):
    """A block of uint8 images viewed as [N, C, H, W]: a memmap of a file region (reopened after pickling),
    bytes in memory, or an array. Layouts: nchw, nchw_t (H and W stored swapped), records (CIFAR: `skip`
    label bytes before each 3x32x32 image)."""

    def __init__(
        self, src: Path | bytes | np.ndarray, shape: tuple[int, ...], layout: str = "nchw", offset=0, skip=0
    ):
        self.src, self.shape, self.layout, self.offset, self.skip = src, shape, layout, offset, skip

    def __len__(self) -> int:
        return self.shape[0]

    def _open(self) -> np.ndarray:
        if isinstance(self.src, np.ndarray):
            return self.src
        count = int(np.prod(self.shape))
        if isinstance(self.src, bytes):
            raw = np.frombuffer(self.src, np.uint8, count, self.offset)
        else:
            raw = np.memmap(self.src, np.uint8, "r", self.offset, (count,))
        raw = raw.reshape(self.shape)
        if self.layout == "nchw_t":
            return raw.transpose(0, 1, 3, 2)
        if self.layout == "records":
            return raw[:, self.skip :].reshape(self.shape[0], 3, 32, 32)
        return raw

    def view(self) -> np.ndarray:
        return self._handle()


class _ArrayFetch:
    def __init__(self, blocks: list[_Arr]):
        self.blocks = blocks
        self.starts = list(np.cumsum([0] + [len(b) for b in blocks[:-1]]))

    def all(self) -> np.ndarray:
        views = [b.view() for b in self.blocks]
        return views[0] if len(views) == 1 else np.concatenate(views)

    def get(self, i: int) -> np.ndarray:
        b = bisect.bisect_right(self.starts, i) - 1
        return self.blocks[b].view()[i - self.starts[b]]


# ---------------------------------------------------------------------------------------------------------
# Format detection


def _base(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower()


def _is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _is_idx_name(name: str) -> bool:
    base = _base(name)
    return bool(re.search(r"idx[13]", base)) and "ubyte" in base


def _pickled(name: str) -> bool:
    parts = name.lower().split("/")
    return any(p in _PICKLED_DIRS for p in parts) or bool(_PICKLED_CIFAR.fullmatch(parts[-1]))


def _refuse_pickled(where: str, key: str = "data.source"):
    raise UserError(
        f"{key} {where} is the pickled Python version of CIFAR, which ONN does not unpickle (loading a pickle "
        "can run arbitrary code); download the binary version instead (cifar-10-binary.tar.gz or "
        f"cifar-100-binary.tar.gz from {_CIFAR_URL}) and point {key} at it."
    )


def _name_kind(name: str) -> str | None:
    """What one file name inside a folder or archive says about the format."""
    base = _base(name)
    if _pickled(name):
        return "pickled"
    if _CIFAR10_BIN.fullmatch(base) or _CIFAR100_BIN.fullmatch(base):
        return "cifar_binary"
    if _STL_BIN.fullmatch(base):
        return "stl10_binary"
    if _is_idx_name(base):
        return "idx"
    if base.endswith(".mat"):
        return "svhn_mat"
    if base.endswith(".parquet"):
        return "parquet"
    if _is_image_name(base):
        return "image"
    return None


_PRIORITY = ("cifar_binary", "stl10_binary", "idx", "svhn_mat", "parquet")


def _classify(names: list[str], where: str, key: str) -> str | None:
    kinds = {_name_kind(n) for n in names}
    bare = {_base(n) for n in names if "." not in _base(n)}
    if "pickled" in kinds or ("meta" in bare and bare & {"train", "test"}):
        _refuse_pickled(where, key)
    return next((k for k in _PRIORITY if k in kinds), None)


def _detect_dir(path: Path, key: str) -> str:
    names = [rel for rel, _ in _shallow_files(path)]
    fmt = _classify(names, str(path), key)
    if fmt:
        return fmt
    if any("/" not in n and n.lower().endswith((".csv", ".tsv")) and _split_of(n) for n in names):
        return "csv"
    if any(True for _ in _walk_files(path, images_only=True)):
        return "folder"
    raise UserError(f"{key} {path} holds no images or dataset files I recognise; {_HELP}.")


def _detect_file(path: Path, key: str) -> str:
    name = path.name.lower()
    if _pickled(name):
        _refuse_pickled(str(path), key)
    with open(path, "rb") as f:
        head = f.read(512)
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:4] in (b"\0\0\x08\x03", b"\0\0\x08\x01") or (head[:2] == b"\x1f\x8b" and _is_idx_name(name)):
        return "idx"
    if name.endswith(".mat") or head.startswith(b"MATLAB"):
        return "svhn_mat"
    kind = _name_kind(name)
    if kind in ("cifar_binary", "stl10_binary"):
        return kind
    if name.endswith((".csv", ".tsv")):
        return "csv"
    if kind == "image":
        return "image"
    archive = _archive_kind(path, head)
    if archive:
        return _detect_archive(path, archive, key)
    if head[:1] == b"\x80" and "." not in name:
        if name in ("train", "test", "meta"):  # CIFAR-100's python version
            _refuse_pickled(str(path), key)
        raise UserError(
            f"{key} {path} looks like a Python pickle, which ONN does not load (it can run code)."
        )
    try:
        from PIL import Image

        with Image.open(path):
            return "image"
    except Exception:
        pass
    raise UserError(f"{key} {path}: cannot tell its format; {_HELP}.")


def _archive_kind(path: Path, head: bytes | None = None) -> str | None:
    """zip, tar (uncompressed: random access possible), targz (any compressed tar) or None."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(512)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    compressed = head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00"
    try:
        if tarfile.is_tarfile(path):
            return "targz" if compressed else "tar"
    except (OSError, EOFError, zlib.error):
        return None
    return None


def _archive_names(path: Path, kind: str) -> Iterator[str]:
    if kind == "zip":
        with zipfile.ZipFile(path) as zf:
            yield from (_clean(i.filename) for i in zf.infolist() if not i.is_dir())
        return
    with tarfile.open(path, "r|*") as tf:
        for m in tf:
            if m.isfile():
                yield _clean(m.name)


def _detect_archive(path: Path, kind: str, key: str) -> str:
    names = []
    members = _archive_names(path, kind)
    try:
        for n in members:
            if _hidden(n):
                continue
            names.append(n)
            k = _name_kind(n)
            if k == "pickled":
                _refuse_pickled(str(path), key)
            if (kind != "zip" and k is not None) or len(names) >= 200_000:
                break  # a tar is read in order: the first telling member decides
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    finally:
        members.close()
    fmt = _classify(names, str(path), key)
    if fmt:
        return fmt
    if any(_is_image_name(n) for n in names):
        return "archive"
    raise UserError(f"{key} {path} is an archive holding no images or dataset files I recognise; {_HELP}.")


# ---------------------------------------------------------------------------------------------------------
# Listing a source: per split the names, labels and where each item's bytes are


def _listing(path: Path, fmt: str, key: str, allow_unlabelled: bool, stream: bool):
    if fmt in ("folder", "archive"):
        return _tree_listing(path, key, allow_unlabelled, stream)
    if fmt == "csv":
        return _csv_listing(path, key, allow_unlabelled)
    if fmt == "parquet":
        return _parquet_listing(path, key, allow_unlabelled)
    if fmt == "image":
        if path.is_dir():
            raise UserError(f"data.format image needs one image file, but {key} {path} is a folder.")
        return {"all": _Split([path.name], np.array([-1], np.int64), _PathFetch([path]))}, []
    files, only, where = _gather(path, fmt, key)
    if fmt == "idx":
        return _idx_listing(files, only, where, key, allow_unlabelled)
    if fmt == "cifar_binary":
        return _cifar_listing(files, only, where, key)
    if fmt == "svhn_mat":
        return _svhn_listing(files, only, where, key)
    return _stl10_listing(files, only, where, key)


def _clean(name: str) -> str:
    name = name.replace("\\", "/")
    while name.startswith(("./", "/")):
        name = name[2:] if name.startswith("./") else name[1:]
    return name


def _hidden(name: str) -> bool:
    return any(p.startswith(".") or p in _SKIP_DIRS for p in name.split("/"))


def _walk_files(root: Path, images_only: bool = False) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every non-hidden file under root, following links."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        rel = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.startswith(".") or (images_only and not _is_image_name(f)):
                continue
            yield (f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")), Path(dirpath, f)


def _shallow_files(root: Path) -> list[tuple[str, Path]]:
    """Files in root and in its direct subfolders (dataset files often sit one folder down)."""
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name in _SKIP_DIRS:
            continue
        if entry.is_file():
            out.append((entry.name, Path(entry.path)))
        elif entry.is_dir():
            for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                if sub.is_file() and not sub.name.startswith("."):
                    out.append((f"{entry.name}/{sub.name}", Path(sub.path)))
    return out


def _split_of(name: str) -> str | None:
    m = _SPLIT_TOKEN.search(_base(name).rsplit(".", 1)[0])
    return SPLITS[m.group(1)] if m else None


# -- folder and archive of CLASS/IMAGE ---------------------------------------------------------------------


def _tree_listing(path: Path, key: str, allow_unlabelled: bool, stream: bool):
    if path.is_dir():
        found = list(_walk_files(path, images_only=True))
        names = [n for n, _ in found]
        paths = [p for _, p in found]

        def make(idx: list[int]):
            return _PathFetch([paths[i] for i in idx])

    else:
        kind = _archive_kind(path)
        if kind is None:
            raise UserError(f"{key} {path} is not a folder or a .tar, .tar.gz or .zip archive; {_HELP}.")
        try:
            names, make = _archive_images(path, kind, stream, key)
        except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    if not names:
        raise UserError(
            f"{key}: found no images ({', '.join(sorted(IMAGE_EXTS))}) in {path}; expected {_LAYOUT}."
        )
    layout, classes = _tree_layout(names, str(path), allow_unlabelled, key)
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for split, entries in layout.items():
        entries.sort(key=lambda e: names[e[0]])
        idx = [i for i, _ in entries]
        labels = np.array([index[c] if c is not None else -1 for _, c in entries], np.int64)
        splits[split] = _Split([names[i] for i in idx], labels, make(idx))
    return splits, classes


def _archive_images(path: Path, kind: str, stream: bool, key: str):
    """Image member names of an archive, and a maker of fetchers for a subset of them."""
    if kind == "zip":
        with zipfile.ZipFile(path) as zf:
            members = [i.filename for i in zf.infolist() if not i.is_dir()]
        members = [m for m in members if _is_image_name(m) and not _hidden(_clean(m))]
        return [_clean(m) for m in members], lambda idx: _ZipFetch(path, [members[i] for i in idx])
    if kind == "tar":
        offsets, sizes, names = [], [], []
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                name = _clean(m.name)
                if m.isfile() and _is_image_name(name) and not _hidden(name):
                    names.append(name)
                    offsets.append(m.offset_data)
                    sizes.append(m.size)
        return names, lambda idx: _TarFetch(path, [offsets[i] for i in idx], [sizes[i] for i in idx])
    if stream:
        raise UserError(
            f"{key} {path} is a compressed tar, which has no random access: streaming (list_items) needs an "
            "uncompressed .tar, a .zip or a folder; unpack it or recompress it as .tar."
        )
    names, blobs = [], []
    with tarfile.open(path, "r|*") as tf:  # one sequential pass: no seeking in the compressed stream
        for m in tf:
            name = _clean(m.name)
            if m.isfile() and _is_image_name(name) and not _hidden(name):
                f = tf.extractfile(m)
                names.append(name)
                blobs.append(f.read() if f else None)
    return names, lambda idx: _MemFetch([blobs[i] for i in idx])


def _tree_layout(names: list[str], where: str, allow_unlabelled: bool, key: str):
    """Split -> [(index, class or None)] and the sorted classes, from CLASS/IMAGE or SPLIT/CLASS/IMAGE."""
    parts = [n.split("/") for n in names]
    firsts = {p[0] for p in parts}
    if len(firsts) == 1 and parts[0][0].lower() not in SPLITS:
        depths = {len(p) for p in parts}
        if min(depths) >= 3 or (allow_unlabelled and depths == {2}):
            parts = [p[1:] for p in parts]  # one wrapping top folder
            where = f"{where}/{names[0].split('/')[0]}"
    tops = {p[0].lower() for p in parts if len(p) >= 2}
    split_tops = {t for t in tops if t in SPLITS}
    if split_tops and split_tops != tops:
        raise UserError(
            f"{key}: {where} mixes split folders ({', '.join(sorted(split_tops))}) with other folders "
            f"({', '.join(sorted(tops - split_tops))}); expected {_LAYOUT}."
        )
    groups: dict[str, list[int]] = {}
    depth = 1 if split_tops else 0
    for i, p in enumerate(parts):
        if depth == 0:
            groups.setdefault("all", []).append(i)
        elif len(p) >= 2:
            groups.setdefault(SPLITS[p[0].lower()], []).append(i)
    out: dict[str, list[tuple[int, str | None]]] = {}
    for split, idx in groups.items():
        labelled = [(i, parts[i][depth]) for i in idx if len(parts[i]) >= depth + 2]
        if labelled:
            out[split] = labelled
        elif allow_unlabelled:
            out[split] = [(i, None) for i in idx]
        else:
            folder = f"{where}/{parts[idx[0]][0]}" if depth else where
            raise UserError(
                f"{key}: found no class folders in {folder}, only images; expected {_LAYOUT}, or set "
                "data.allow_unlabelled=true to read unlabelled images."
            )
    classes = sorted({c for entries in out.values() for _, c in entries if c is not None})
    return out, classes


# -- csv -------------------------------------------------------------------------------------------------

_PATH_HEADERS = ("path", "file", "filename", "file_name", "filepath", "image", "image_path", "img")
_LABEL_HEADERS = ("label", "labels", "class", "class_name", "target", "category", "y")


def _is_int(s: str) -> bool:
    return bool(re.fullmatch(r"[+-]?\d+", s.strip()))


def _csv_rows(path: Path, key: str, labelled: bool = True) -> list[tuple[int, str, str | None]]:
    """(row number, image path, label or None) of a path,label csv; the header is optional."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{key} {path} is not a UTF-8 text csv: {e}") from e
    sample = "\n".join(text.splitlines()[:20])
    try:
        dialect = csv.Sniffer().sniff(sample, delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel_tab if path.suffix.lower() == ".tsv" else csv.excel
    rows = [
        (n, r) for n, r in enumerate(csv.reader(io.StringIO(text), dialect), 1) if any(c.strip() for c in r)
    ]
    if not rows:
        raise UserError(f"{key} {path} holds no rows; expected path,label rows.")
    first = [c.strip() for c in rows[0][1]]
    pcol, lcol = 0, 1 if len(first) > 1 else None
    if len(first) > 1:
        later = {r[1].strip() for _, r in rows[1:] if len(r) > 1}
        header = not _is_int(first[1]) and first[1] not in later and not _is_image_name(first[0])
    else:
        header = first[0].lower() in _PATH_HEADERS or not _is_image_name(first[0])
    if header:
        low = [c.lower() for c in first]
        pcol = next((low.index(h) for h in _PATH_HEADERS if h in low), 0)
        lcol = next((low.index(h) for h in _LABEL_HEADERS if h in low), None)
        if lcol is None:
            lcol = next((i for i in range(len(first)) if i != pcol), None)
        rows = rows[1:]
    out = []
    for n, r in rows:
        if len(r) <= pcol or not r[pcol].strip():
            raise UserError(f"{key}: {path} row {n} has no image path.")
        label = r[lcol].strip() if lcol is not None and len(r) > lcol else None
        out.append((n, r[pcol].strip(), label or None))
    if labelled and not out:
        raise UserError(f"{key} {path} holds a header but no rows.")
    return out


def _csv_path(csv_file: Path, name: str) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else csv_file.parent / p


def _csv_listing(path: Path, key: str, allow_unlabelled: bool):
    if path.is_dir():
        files = {}
        for f in sorted(path.iterdir()):
            if f.suffix.lower() in (".csv", ".tsv") and _split_of(f.name):
                files.setdefault(_split_of(f.name), f)
        if not files:
            raise UserError(
                f"{key} {path} holds no train.csv / test.csv / val.csv; point {key} at a csv file."
            )
    else:
        files = {"all": path}
    tables = {split: _csv_rows(f, key) for split, f in files.items()}
    given = [lab for rows in tables.values() for _, _, lab in rows if lab is not None]
    numeric = all(_is_int(lab) for lab in given)
    classes = None if numeric else sorted(set(given))
    index = {c: i for i, c in enumerate(classes or [])}
    splits = {}
    for split, rows in tables.items():
        f = files[split]
        labels = np.empty(len(rows), np.int64)
        for j, (n, _, lab) in enumerate(rows):
            if lab is None:
                if not allow_unlabelled:
                    raise UserError(
                        f"{key}: {f} row {n} has no label; give every row one, or set "
                        "data.allow_unlabelled=true to read unlabelled images."
                    )
                labels[j] = -1
            elif numeric:
                labels[j] = int(lab)
                if labels[j] < 0 and not (labels[j] == -1 and allow_unlabelled):
                    raise UserError(f"{key}: {f} row {n} has label {lab}; labels must be 0 or more.")
            else:
                labels[j] = index[lab]
        splits[split] = _Split(
            [name for _, name, _ in rows],
            labels,
            _PathFetch([_csv_path(f, name) for _, name, _ in rows]),
            origin=[f"{f.name} row {n} ({name})" for n, name, _ in rows],
        )
    return splits, classes


# -- parquet ---------------------------------------------------------------------------------------------


def _parquet_columns(schema, f: Path, key: str):
    """(image column, whether it is an {bytes, path} struct, label column or None)."""
    import pyarrow as pa

    def is_bin(t):
        return pa.types.is_binary(t) or pa.types.is_large_binary(t)

    images = []
    for fld in schema:
        t = fld.type
        if pa.types.is_struct(t) and any(
            t.field(i).name == "bytes" and is_bin(t.field(i).type) for i in range(t.num_fields)
        ):
            images.append((fld.name, True))
        elif is_bin(t):
            images.append((fld.name, False))
    if not images:
        raise UserError(f"{key}: {f} has no image column (a binary column or a {{bytes, path}} struct).")
    image = next((c for c in images if c[0].lower() in ("image", "img")), images[0])
    ints = [fld.name for fld in schema if pa.types.is_integer(fld.type)]
    label = next((c for c in ("label", "labels", "fine_label") if c in ints), None)
    if label is None and len(ints) == 1:
        label = ints[0]
    elif label is None and len(ints) > 1:
        raise UserError(
            f"{key}: {f} has several integer columns ({', '.join(ints)}); name the label column 'label'."
        )
    return image[0], image[1], label


def _parquet_names(schema, label: str | None) -> list[str] | None:
    """Class names from the Hugging Face `datasets` metadata (a ClassLabel feature), when present."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta or label is None:
        return None
    try:
        doc = json.loads(meta)
    except ValueError:
        return None
    features = (doc.get("info") or {}).get("features") or doc.get("features") or {}
    feat = features.get(label) if isinstance(features, dict) else None
    if isinstance(feat, dict) and isinstance(feat.get("names"), list):
        return [str(n) for n in feat["names"]]
    return None


def _parquet_bytes(f: Path, column: str, nested: bool) -> list[bytes | None]:
    import pyarrow.parquet as pq

    col = pq.read_table(f, columns=[column]).column(0).combine_chunks()
    if not nested:
        return col.to_pylist()
    data = col.field("bytes").to_pylist()
    names = [n.name for n in col.type]
    paths = col.field("path").to_pylist() if "path" in names else [None] * len(data)
    for i, (b, p) in enumerate(zip(data, paths)):
        if b is None and p and (f.parent / p).is_file():
            data[i] = (f.parent / p).read_bytes()  # an image stored by path next to the parquet
    return data


def _parquet_listing(path: Path, key: str, allow_unlabelled: bool):
    import pyarrow.parquet as pq

    if path.is_dir():
        found = sorted(p for rel, p in _walk_files(path) if rel.lower().endswith(".parquet"))
        groups: dict[str, list[Path]] = {}
        for f in found:
            rel = f.relative_to(path).as_posix()
            split = _split_of(f.name) or next(
                (SPLITS[p.lower()] for p in rel.split("/")[:-1] if p.lower() in SPLITS), None
            )
            groups.setdefault(split or "all", []).append(f)
        if not found:
            raise UserError(f"{key} {path} holds no .parquet files.")
        if "all" in groups and len(groups) > 1:
            raise UserError(
                f"{key}: {groups['all'][0]} has no split (train, test, validation) in its name, unlike the "
                "other parquet files next to it; rename it or point at one file."
            )
    elif _archive_kind(path) is not None:
        raise UserError(
            f"{key} {path} is an archive of parquet files; extract it and point {key} at the folder."
        )
    else:
        groups = {"all": [path]}
    classes = None
    splits = {}
    for split, files in groups.items():
        names, labels, where = [], [], []
        column = nested = None
        for k, f in enumerate(files):
            try:
                pf = pq.ParquetFile(f)
                image, nest, label = _parquet_columns(pf.schema_arrow, f, key)
                labs = (
                    pf.read(columns=[label]).column(0).fill_null(-1).to_numpy().astype(np.int64)
                    if label
                    else np.full(pf.metadata.num_rows, -1, np.int64)
                )
            except UserError:
                raise
            except Exception as e:  # pyarrow raises several types for damaged files
                raise UserError(f"{key}: {f} is not a readable parquet file: {e}") from e
            if column is not None and (image, nest) != (column, nested):
                raise UserError(f"{key}: {f} has image column '{image}', but {files[0]} has '{column}'.")
            column, nested = image, nest
            classes = classes or _parquet_names(pf.schema_arrow, label)
            if label is None and not allow_unlabelled:
                raise UserError(
                    f"{key}: {f} has no label column (an integer column named label); add one, or set "
                    "data.allow_unlabelled=true to read unlabelled images."
                )
            neg = np.flatnonzero(labs < (-1 if allow_unlabelled else 0)) if label else np.zeros(0, np.int64)
            if neg.size:
                raise UserError(
                    f"{key}: {f} row {int(neg[0])} has label {int(labs[neg[0]])}; labels must be 0 or more "
                    "(-1 or empty means unlabelled only with data.allow_unlabelled=true)."
                )
            names += [f"{f.name}#{r}" for r in range(len(labs))]
            labels.append(labs)
            where += [(k, r) for r in range(len(labs))]
        splits[split] = _Split(names, np.concatenate(labels), _ParquetFetch(files, column, nested, where))
    return splits, classes


# -- array formats: idx, CIFAR binary, SVHN .mat, STL-10 -------------------------------------------------


def _gather(path: Path, fmt: str, key: str):
    """The candidate files of an array format as {relative name: Path or bytes}, the one file asked for
    when the source is a file (else None), and a description of where they are, for messages."""
    if path.is_dir():
        return dict(_shallow_files(path)), None, str(path)
    kind = _archive_kind(path)
    if kind is None:
        return {p.name: p for p in path.parent.iterdir() if p.is_file()}, path.name, str(path.parent)
    wanted = {
        "idx": _is_idx_name,
        "cifar_binary": lambda n: (
            _name_kind(n) == "cifar_binary"
            or _base(n).endswith("_names.txt")
            or _base(n) == "batches.meta.txt"
        ),
        "svhn_mat": lambda n: _base(n).endswith(".mat"),
        "stl10_binary": lambda n: bool(_STL_BIN.fullmatch(_base(n))) or _base(n) == "class_names.txt",
    }[fmt]
    files: dict[str, Path | bytes] = {}
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    name = _clean(info.filename)
                    if _pickled(name):
                        _refuse_pickled(str(path), key)
                    if not info.is_dir() and not _hidden(name) and wanted(name):
                        files[name] = zf.read(info)
        else:
            with tarfile.open(path, "r|*") as tf:
                for m in tf:
                    name = _clean(m.name)
                    if _pickled(name):
                        _refuse_pickled(str(path), key)
                    if m.isfile() and not _hidden(name) and wanted(name):
                        files[name] = tf.extractfile(m).read()
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    return files, None, str(path)


def _label_of(where: str, name: str, src: Path | bytes) -> str:
    return str(src) if isinstance(src, Path) else f"{where}:{name}"


def _nbytes(src: Path | bytes) -> int:
    return src.stat().st_size if isinstance(src, Path) else len(src)


def _head(src: Path | bytes, n: int) -> bytes:
    if isinstance(src, bytes):
        return src[:n]
    with open(src, "rb") as f:
        return f.read(n)


def _text_lines(src: Path | bytes) -> list[str]:
    data = src.read_bytes() if isinstance(src, Path) else src
    return [ln.strip() for ln in data.decode("utf-8", errors="replace").splitlines() if ln.strip()]


def _by_base(files: dict[str, Path | bytes]) -> dict[str, tuple[str, Path | bytes]]:
    out: dict[str, tuple[str, Path | bytes]] = {}
    for name in sorted(files, key=lambda n: (n.count("/"), n)):
        out.setdefault(_base(name), (name, files[name]))
    return out


def _idx_read(name: str, src: Path | bytes, images: bool, where: str, key: str):
    """(count, dims, _Arr of images or int64 labels) from one IDX file, raw or gzip."""
    label = _label_of(where, name, src)
    if name.lower().endswith(".gz"):
        try:
            src = gzip.decompress(src if isinstance(src, bytes) else src.read_bytes())
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"{key}: {label} is not a readable gzip file: {e}") from e
    want = (0x0803, 3) if images else (0x0801, 1)
    head = _head(src, 4 + 4 * want[1])
    magic = int.from_bytes(head[:4], "big") if len(head) >= 4 else -1
    if magic != (want[0] << 0) or len(head) < 4 + 4 * want[1]:
        what = (
            "images (magic 0x00000803: uint8, 3 dims)"
            if images
            else "labels (magic 0x00000801: uint8, 1 dim)"
        )
        raise UserError(
            f"{key}: {label} is not an IDX {what} file; its first bytes are {head[:4].hex() or 'missing'}."
        )
    dims = [int.from_bytes(head[4 + 4 * i : 8 + 4 * i], "big") for i in range(want[1])]
    offset = 4 + 4 * want[1]
    expected = offset + int(np.prod(dims))
    total = _nbytes(src)
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
    if "emnist" in _base(name):  # EMNIST stores each image transposed
        return n, dims, _Arr(src, (n, 1, h, w), "nchw_t", offset)
    return n, dims, _Arr(src, (n, 1, h, w), "nchw", offset)


def _idx_listing(files, only: str | None, where: str, key: str, allow_unlabelled: bool):
    entries: dict[tuple[str, str], dict[str, str]] = {}
    for name in sorted(files, key=lambda n: (n.lower().endswith(".gz"), n)):  # raw before .gz: faster
        base = _base(name)
        if not _is_idx_name(base):
            continue
        kind = "images" if ("idx3" in base or "images" in base) else "labels"
        split = "train" if "train" in base else "test" if ("t10k" in base or "test" in base) else "all"
        norm = re.sub(r"images|labels", "*", base.removesuffix(".gz"))
        group = re.sub(r"idx[13]", "idx", re.sub(r"train|t10k|test", "", norm))
        if "/" in name:
            group = name.rsplit("/", 1)[0] + "/" + group
        entries.setdefault((group, split), {}).setdefault(kind, name)
    if only is not None:
        low = only.lower()
        if _head(files[only], 4) == b"\0\0\x08\x01" or "labels" in low or "idx1" in low:
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
            raise UserError(
                f"{key}: {where} has the labels file {pair['labels']} but no images file next to it."
            )
        n, dims, arr = _idx_read(pair["images"], files[pair["images"]], True, where, key)
        if "labels" in pair:
            m, _, labels = _idx_read(pair["labels"], files[pair["labels"]], False, where, key)
            if m != n:
                raise UserError(
                    f"{key}: {_label_of(where, pair['images'], files[pair['images']])} holds {n} images but "
                    f"{_label_of(where, pair['labels'], files[pair['labels']])} holds {m} labels; they must match."
                )
        elif allow_unlabelled:
            labels = np.full(n, -1, np.int64)
        else:
            raise UserError(
                f"{key}: no labels file next to {pair['images']} (expected "
                f"{_base(pair['images']).replace('images', 'labels').replace('idx3', 'idx1')})."
            )
        base = _base(pair["images"])
        splits[split] = _Split([f"{base}#{i}" for i in range(n)], labels, _ArrayFetch([arr]))
    return splits, None


def _cifar_listing(files, only: str | None, where: str, key: str):
    named = _by_base(files)
    if any(_pickled(n) for n in files) or ({"meta"} <= set(named) and {"train", "test"} & set(named)):
        _refuse_pickled(where, key)
    bins = [b for b in named if _CIFAR10_BIN.fullmatch(b)]
    fine = False
    if only is not None:
        bins = [only.lower()] if _name_kind(only) == "cifar_binary" else []
        fine = bool(_CIFAR100_BIN.fullmatch(only.lower()))
    elif not bins:
        bins = [b for b in named if _CIFAR100_BIN.fullmatch(b)]
        fine = True
    if not bins:
        raise UserError(
            f"{key}: found no CIFAR binary files (data_batch_N.bin + test_batch.bin, or train.bin + test.bin) "
            f"in {where}; get cifar-10-binary.tar.gz or cifar-100-binary.tar.gz from {_CIFAR_URL}."
        )
    rec = 3074 if fine else 3073
    meta = named.get("fine_label_names.txt" if fine else "batches.meta.txt")
    classes = _text_lines(meta[1]) if meta else None
    groups: dict[str, list[str]] = {}
    for b in sorted(bins, key=lambda b: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", b)]):
        split = "all" if only is not None else ("train" if b.startswith(("data_batch", "train")) else "test")
        groups.setdefault(split, []).append(b)
    splits = {}
    for split, bs in groups.items():
        blocks, labels, names = [], [], []
        for b in bs:
            name, src = named[b] if only is None else (only, files[only])
            size = _nbytes(src)
            if size == 0 or size % rec:
                raise UserError(
                    f"{key}: {_label_of(where, name, src)} is {size} bytes, not a multiple of the {rec}-byte "
                    f"CIFAR-{'100' if fine else '10'} record ({rec - 3072} label byte{'s' if fine else ''} + 3072 "
                    "pixel bytes); it is truncated or not the binary version."
                )
            n = size // rec
            raw = np.frombuffer(src, np.uint8) if isinstance(src, bytes) else np.memmap(src, np.uint8, "r")
            labels.append(raw.reshape(n, rec)[:, rec - 3073].astype(np.int64))
            blocks.append(_Arr(src, (n, rec), "records", skip=rec - 3072))
            names += [f"{_base(name)}#{i}" for i in range(n)]
        splits[split] = _Split(names, np.concatenate(labels), _ArrayFetch(blocks))
    return splits, classes


def _svhn_listing(files, only: str | None, where: str, key: str):
    from scipy.io import loadmat

    named = _by_base(files)
    if only is not None:
        chosen = {"all": (only, files[only])}
    else:
        chosen = {s: named[f"{s}_32x32.mat"] for s in ("train", "test") if f"{s}_32x32.mat" in named}
        if not chosen:
            raise UserError(f"{key}: found no SVHN train_32x32.mat or test_32x32.mat in {where}.")
    splits = {}
    for split, (name, src) in chosen.items():
        label = _label_of(where, name, src)
        try:
            mat = loadmat(io.BytesIO(src) if isinstance(src, bytes) else src, variable_names=["X", "y"])
        except NotImplementedError as e:
            raise UserError(
                f"{key}: {label} is a MATLAB v7.3 (HDF5) file; save it as MAT v5, as SVHN ships."
            ) from e
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
        splits[split] = _Split(
            [f"{_base(name)}#{i}" for i in range(len(labels))],
            labels,
            _ArrayFetch([_Arr(images, images.shape)]),
        )
    return splits, [str(i) for i in range(10)]


def _stl10_listing(files, only: str | None, where: str, key: str):
    named = _by_base(files)
    wanted = ("train", "test")
    if only is not None:
        m = re.fullmatch(r"(train|test)_x\.bin", only.lower())
        if not m:
            raise UserError(
                f"{key}: point {key} at the STL-10 folder or at train_X.bin / test_X.bin, not {only}."
            )
        wanted = (m.group(1),)
    size = 3 * 96 * 96
    splits = {}
    for split in wanted:
        if f"{split}_x.bin" not in named:
            continue
        xname, xsrc = named[f"{split}_x.bin"]
        if f"{split}_y.bin" not in named:
            raise UserError(f"{key}: {_label_of(where, xname, xsrc)} has no {split}_y.bin next to it.")
        yname, ysrc = named[f"{split}_y.bin"]
        nbytes = _nbytes(xsrc)
        if nbytes == 0 or nbytes % size:
            raise UserError(
                f"{key}: {_label_of(where, xname, xsrc)} is {nbytes} bytes, not a multiple of {size} "
                "(3 x 96 x 96 per image); it is truncated or not STL-10."
            )
        n = nbytes // size
        y = (
            np.frombuffer(ysrc, np.uint8) if isinstance(ysrc, bytes) else np.fromfile(ysrc, np.uint8)
        ).astype(np.int64)
        if len(y) != n:
            raise UserError(
                f"{key}: {_label_of(where, xname, xsrc)} holds {n} images but "
                f"{_label_of(where, yname, ysrc)} holds {len(y)} labels; they must match."
            )
        if n and y.min() < 1:
            raise UserError(f"{key}: {_label_of(where, yname, ysrc)} has label 0; STL-10 labels run from 1.")
        splits["all" if only else split] = _Split(
            [f"{split}_X.bin#{i}" for i in range(n)],
            y - 1,
            _ArrayFetch([_Arr(xsrc, (n, 3, 96, 96), "nchw_t")]),
        )
    if not splits:
        raise UserError(f"{key}: found no STL-10 train_X.bin or test_X.bin in {where}.")
    names = named.get("class_names.txt")
    return splits, _text_lines(names[1]) if names else None


def _hash_file(h, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
