"""What every format shares: the names and types of a listing, the options, the checks and reports, and
the fetchers that give item i's bytes (or pixels) from wherever the source keeps them."""

from __future__ import annotations

import bisect
import logging
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onn.data.files import existing_source, read_file
from onn.errors import UserError

log = logging.getLogger("onn")

FORMATS = ("folder", "archive", "idx", "cifar_binary", "svhn_mat", "stl10_binary", "parquet", "csv", "image")
# The usual extensions: named in messages as examples.
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
# Every extension that says "this is a picture": such a file in a dataset is decoded, or counted and named
# when nothing here can decode it (HEIC without its plugin, camera RAW), never passed over in silence.
IMAGE_LIKE_EXTS = IMAGE_EXTS | {
    *(".jfif", ".jpe", ".apng", ".avif", ".avifs", ".heic", ".heif", ".hif", ".jxl", ".jp2", ".j2k"),
    *(".jpx", ".jpf", ".j2c", ".qoi", ".tga", ".ico", ".icns", ".dds", ".psd", ".pbm", ".pnm", ".pcx"),
    *(".sgi", ".rgb", ".ras", ".xbm", ".xpm", ".dib"),
}
# Never pictures, so never sniffed: image folders often hold a sidecar .json or .txt per image.
NOT_IMAGE_EXTS = frozenset(
    {".txt", ".csv", ".tsv", ".json", ".jsonl", ".xml", ".yaml", ".yml", ".md", ".html", ".log", ".py"}
    | {".npy", ".npz", ".pt", ".pth", ".safetensors", ".pkl", ".h5", ".mat", ".parquet", ".pdf"}
    | {".mp4", ".mov", ".avi", ".mkv", ".wav", ".mp3", ".flac", ".zip", ".tar", ".gz"}
)
RAW_EXTS = frozenset({".dng", ".cr2", ".cr3", ".nef", ".nrw", ".arw", ".orf", ".rw2", ".raf", ".pef", ".srw"})
SNIFF_BYTES = 64  # enough of a file's head for image_kind
SPLITS = {"train": "train", "test": "test", "val": "val", "valid": "val", "validation": "val"}
RESIZE_MODES = ("error", "resize", "center_crop")
HELP = (
    "supported formats: folder (CLASS/IMAGE or train/CLASS/IMAGE + test/CLASS/IMAGE), archive (a .tar, .tar.gz "
    "or .zip of that layout), idx (MNIST-style *-images-idx3-ubyte[.gz] + *-labels-idx1-ubyte[.gz]), "
    "cifar_binary (CIFAR-10/100 binary version: data_batch_N.bin + test_batch.bin, or train.bin + test.bin), "
    "svhn_mat (train_32x32.mat, test_32x32.mat), stl10_binary (train_X.bin + train_y.bin, ...), parquet "
    "(Hugging Face export: an image column and a label column), csv (path,label rows) and image (one image file)"
)
LAYOUT = "CLASS/IMAGE (e.g. cat/0001.jpg) or train/CLASS/IMAGE and test/CLASS/IMAGE"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"

_PICKLED_CIFAR = re.compile(r"data_batch_\d+|test_batch|batches\.meta|cifar-10(0)?-python\.tar\.gz")
_PICKLED_DIRS = frozenset({"cifar-10-batches-py", "cifar-100-python"})
_BMP_HEADERS = (12, 40, 52, 56, 64, 108, 124)
_SPLIT_TOKEN = re.compile(r"(?<![a-z])(train|test|validation|valid|val)(?![a-z])")


@dataclass
class ImageSet:
    """One split, decoded."""

    images: torch.Tensor  # uint8 [N, C, H, W], contiguous
    labels: torch.Tensor  # int64 [N]; -1 where the label is unknown (unlabelled images for inference)
    classes: list[str]  # class names, index = label
    names: list[str]  # where each image came from, e.g. "train/cat/0001.jpg" or "data_batch_1.bin#17"
    skipped: list[str] = field(default_factory=list)  # items that could not be decoded, each "name: reason"


@dataclass
class Split:
    """One split, listed: what each format's lister returns per split."""

    names: list[str]
    labels: np.ndarray  # int64, -1 = unknown
    fetch: Any  # an encoded-bytes fetcher (get(i) -> bytes) or an ArrayFetch
    origin: list[str] | None = None  # where each item is, for messages ("labels.csv row 3")


@dataclass
class Listing:
    """A whole source, listed: its splits, its class names (None: numbers), and the items refused while
    listing ("name: reason"), which count with the undecodable ones."""

    splits: dict[str, Split]
    classes: list[str] | None
    rejected: list[str] = field(default_factory=list)


@dataclass
class Options:
    """How decoded images are brought to one shape: data.channels, data.image_size, data.resize."""

    channels: int | str
    image_size: tuple[int, int] | None
    resize: str


def options(channels: int | str, image_size: Any, resize: str) -> Options:
    """The checked Options, or a UserError naming the config key."""
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
    return Options(channels, size, resize)


def existing(source: str | Path, key: str) -> Path:
    """The source as a Path if it is a regular file or folder; else one sentence that lists the formats."""
    return existing_source(source, key, HELP)


# ---------------------------------------------------------------------------------------------------------
# Names


def base(name: str) -> str:
    """The lower-cased last part of a posix name."""
    return name.rsplit("/", 1)[-1].lower()


def extension(name: str) -> str:
    return os.path.splitext(name)[1].lower()


def is_image_name(name: str) -> bool:
    """Whether a name's extension says it is a picture (IMAGE_LIKE_EXTS or a camera RAW)."""
    ext = extension(name)
    return ext in IMAGE_LIKE_EXTS or ext in RAW_EXTS


def needs_sniffing(name: str) -> bool:
    """Whether only a file's magic bytes can tell if it is a picture: its extension is neither an image's
    (is_image_name) nor one of NOT_IMAGE_EXTS (no extension, photo.dat, scan.img, ...)."""
    ext = extension(name)
    return not (is_image_name(name) or ext in NOT_IMAGE_EXTS)


def split_of(name: str) -> str | None:
    """train, test or val when a file name says so (train-00000-of-00002.parquet, val.csv), else None."""
    m = _SPLIT_TOKEN.search(base(name).rsplit(".", 1)[0])
    return SPLITS[m.group(1)] if m else None


def image_kind(head: bytes) -> str | None:
    """The picture format that a file's first SNIFF_BYTES announce, or None: for files whose extension does
    not say (a scan saved without one, photo.dat), and to say which plugin an undecodable picture needs."""
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if head[:2] == b"BM" and head[6:10] == bytes(4) and int.from_bytes(head[14:18], "little") in _BMP_HEADERS:
        return "BMP"  # "BM", zero reserved bytes, a known header size: text that starts with BM is not
    if head[:2] == b"\xff\x0a" or head[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return "JPEG XL"
    if head[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or head[:4] == b"\xff\x4f\xff\x51":
        return "JPEG 2000"
    if head[:4] in (b"qoif", b"8BPS", b"DDS "):
        return {b"qoif": "QOI", b"8BPS": "PSD", b"DDS ": "DDS"}[head[:4]]
    if head[4:8] == b"ftyp":  # ISO-BMFF: the brands say HEIF (phones' .heic) or AVIF, or a video
        size = int.from_bytes(head[:4], "big")
        brands = {head[8:12]} | {head[i : i + 4] for i in range(16, min(size, len(head)) - 3, 4)}
        if brands & {b"avif", b"avis"}:
            return "AVIF"
        if brands & {
            b"heic",
            b"heix",
            b"hevc",
            b"hevx",
            b"heim",
            b"heis",
            b"hevm",
            b"hevs",
            b"mif1",
            b"msf1",
        }:
            return "HEIC"
    return None


def is_pickled(name: str) -> bool:
    """Whether a name is a file of CIFAR's pickled Python version (never unpickled: it can run code)."""
    parts = name.lower().split("/")
    return any(p in _PICKLED_DIRS for p in parts) or bool(_PICKLED_CIFAR.fullmatch(parts[-1]))


def refuse_pickled(where: str, key: str = "data.source"):
    raise UserError(
        f"{key} {where} is the pickled Python version of CIFAR, which ONN does not unpickle (loading a pickle "
        "can run arbitrary code); download the binary version instead (cifar-10-binary.tar.gz or "
        f"cifar-100-binary.tar.gz from {CIFAR_URL}) and point {key} at it."
    )


# ---------------------------------------------------------------------------------------------------------
# Checks and reports


def finish_classes(listing: Listing, num_classes: int | None, key: str) -> list[str]:
    """Class names (numbers as strings when the format has none) and the label range check."""
    splits, classes = listing.splits, listing.classes
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
                label = int(split.labels[i])
                shown = (
                    f"label {classes[label]!r} (class {label} of {len(classes)} names: "
                    f"{', '.join(classes[:6])}{' ...' if len(classes) > 6 else ''})"
                    if classes
                    else f"label {label}"
                )
                raise UserError(f"{key}: {where} has {shown}, outside [0, {limit}): {said}.")
    if classes is None:
        classes = [str(i) for i in range(max(top + 1, num_classes or 0))]
    return classes


def mixed_sizes(a: str, a_hw: tuple[int, int], b: str, b_hw: tuple[int, int]) -> str:
    return (
        f"images have different sizes: {a} is {a_hw[0]}x{a_hw[1]} but {b} is {b_hw[0]}x{b_hw[1]} (HxW); set "
        "data.image_size=[H,W] with data.resize=resize (stretch) or data.resize=center_crop."
    )


def same_size(ref: dict[str, Any], name: str, hw: tuple[int, int], key: str) -> None:
    """Remember the first image's size in ref; refuse a later image of another size."""
    if "hw" not in ref:
        ref["hw"], ref["name"] = hw, name
    elif ref["hw"] != hw:
        raise UserError(f"{key}: " + mixed_sizes(ref["name"], ref["hw"], name, hw))


# ---------------------------------------------------------------------------------------------------------
# Where the bytes come from: each fetcher gives item i; file handles open lazily, once per process.


class Lazy:
    """Drops open handles when pickled (into DataLoader workers), and reopens them in the new process."""

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


class MemFetch:
    """Encoded images held in memory (a compressed tar, read in one pass)."""

    def __init__(self, items: list[bytes | None]):
        self.items = items

    def get(self, i: int) -> bytes | None:
        return self.items[i]


class PathFetch:
    """Encoded images as files; a FIFO or a device is refused (read_file), not read forever."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def get(self, i: int) -> bytes:
        return read_file(self.paths[i])


class ZipFetch(Lazy):
    def __init__(self, path: Path, members: list[str]):
        self.path, self.members = path, members

    def _open(self):
        return zipfile.ZipFile(self.path)

    def get(self, i: int) -> bytes:
        return self._handle().read(self.members[i])


class TarFetch(Lazy):
    """An uncompressed tar: each member's bytes sit at a fixed offset."""

    def __init__(self, path: Path, offsets: list[int], sizes: list[int]):
        self.path, self.offsets, self.sizes = path, offsets, sizes

    def _open(self):
        return open(self.path, "rb")

    def get(self, i: int) -> bytes:
        f = self._handle()
        f.seek(self.offsets[i])
        return f.read(self.sizes[i])


class Arr(Lazy):
    """A block of uint8 images viewed as [N, C, H, W]: a memmap of a file region (reopened after pickling),
    bytes in memory, or an array. Layouts: nchw, nchw_t (H and W stored swapped), records (CIFAR: `skip`
    label bytes before each 3x32x32 image)."""

    def __init__(self, src: Path | bytes | np.ndarray, shape: tuple[int, ...], layout: str = "nchw", offset=0, skip=0):
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


class ArrayFetch:
    """Decoded images of an array format (idx, CIFAR, SVHN, STL-10), in one or more blocks."""

    def __init__(self, blocks: list[Arr]):
        self.blocks = blocks
        self.starts = list(np.cumsum([0] + [len(b) for b in blocks[:-1]]))

    def all(self) -> np.ndarray:
        views = [b.view() for b in self.blocks]
        return views[0] if len(views) == 1 else np.concatenate(views)

    def get(self, i: int) -> np.ndarray:
        b = bisect.bisect_right(self.starts, i) - 1
        return self.blocks[b].view()[i - self.starts[b]]
