"""Bytes and arrays to uint8 pixels, with the channel and size rules applied: the one place images are
decoded, whether a whole split at once (decode_split, array_split) or item by item (ItemList)."""

from __future__ import annotations

import contextlib
import functools
import io
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from onn.data.files import NotRegularFileError
from onn.errors import UserError
from onn.modalities.image.formats.common import (
    RAW_EXTS,
    SNIFF_BYTES,
    ArrayFetch,
    Options,
    Split,
    extension,
    image_kind,
    mixed_sizes,
    options,
    same_size,
)

# The decoded-image cache's key holds this: raise it on every change to the pixels decode gives, or caches
# filled before serve the old pixels. 1: EXIF orientation applied, 16-bit grey+alpha read as grey, an EXIF block
# PIL cannot parse read as stored; 2: transparency laid on white, as the export pipeline does; 3: class folders
# named by numbers sort as numbers (0, 1, 2, ..., 10), where the cache held their text order (0, 1, 10, ...)
READER_VERSION = 3
GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
# What to install when Pillow cannot open a picture of a kind it needs a plugin for, by image_kind; the
# first item is the format name the plugin registers in PIL.Image.OPEN.
PLUGINS = {
    "HEIC": ("HEIF", "HEIC needs the pillow-heif plugin (pip install pillow-heif)"),
    "JPEG XL": ("JXL", "JPEG XL needs the pillow-jxl-plugin (pip install pillow-jxl-plugin)"),
    "AVIF": (
        "AVIF",
        "AVIF needs Pillow 11.3 or newer built with libavif, or the pillow-avif-plugin (pip install "
        "pillow-avif-plugin)",
    ),
}


class Undecodable(ValueError):
    """A picture that nothing here can decode; the message says what would."""


@contextmanager
def strict_pil() -> Iterator[None]:
    """Truncated images must fail to load, whatever another module set PIL to."""
    from PIL import ImageFile

    before = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = before


@functools.cache
def _register_plugins() -> None:
    """Pillow plugins for phone and web formats, used when the user has installed them."""
    from PIL import Image

    with contextlib.suppress(ImportError):
        from pillow_heif import register_heif_opener

        register_heif_opener()
    with contextlib.suppress(ImportError):
        import pillow_jxl  # noqa: F401  (registers itself)
    Image.init()
    if "AVIF" not in Image.OPEN:  # Pillow < 11.3
        with contextlib.suppress(ImportError):
            import pillow_avif  # noqa: F401


def plugin_hint(head: bytes) -> str | None:
    """What to install to read a picture Pillow could not open, when its magic bytes say what it is."""
    from PIL import Image

    _register_plugins()
    need = PLUGINS.get(image_kind(head) or "")
    return need[1] if need and need[0] not in Image.OPEN else None


def decode(data: bytes | None, channels: int | str, name: str = "") -> np.ndarray:
    """Encoded image bytes -> uint8 [H, W] (a gray image under channels=auto, or channels=1) or [H, W, 3].

    JPEGs go to torchvision's libjpeg-turbo decoder: the same pixels as Pillow, about twice as fast. When it
    refuses a file (damaged, truncated, CMYK, 12-bit) Pillow decides, so what counts as damaged is as before.
    Either turns a picture by its EXIF orientation, as a viewer shows it.
    """
    if data is None:
        raise ValueError("no image bytes")
    if extension(name) in RAW_EXTS:
        raise Undecodable("a camera RAW file, which is not decoded here; convert it to PNG or JPEG")
    if data[:3] == b"\xff\xd8\xff":
        a = _jpeg(data, channels)
        if a is not None:
            return a
    from PIL import UnidentifiedImageError

    try:
        img = _open_raw(data)
    except UnidentifiedImageError as e:
        hint = plugin_hint(data[:SNIFF_BYTES])
        if hint:
            raise Undecodable(hint) from e
        raise
    return np.asarray(_convert(img, channels))


def _jpeg(data: bytes, channels: int | str) -> np.ndarray | None:
    from torchvision.io import decode_jpeg

    try:
        t = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), apply_exif_orientation=True)
    except RuntimeError:
        return None
    a = t.numpy()
    if a.shape[0] == 1:
        return np.repeat(a[0][..., None], 3, axis=2) if channels == 3 else a[0]
    if a.shape[0] == 3:
        return luma(a[None])[0, 0] if channels == 1 else a.transpose(1, 2, 0)
    return None  # CMYK: Pillow converts it


# Pillow reads a 16-bit grey+alpha PNG as RGBA (three equal channels), which would count it as colour
GREY_ALPHA_16 = ("LA;16B", "LA;16")


def _open_raw(data: bytes):
    """The picture as a viewer shows it: turned by its EXIF orientation (a phone's portrait photo is stored
    sideways). A 16-bit grey+alpha picture is mode LA, as an 8-bit one is."""
    from PIL import Image, ImageOps

    _register_plugins()
    img = Image.open(io.BytesIO(data))
    grey_alpha = img.mode == "RGBA" and any(len(tile) > 3 and tile[3] in GREY_ALPHA_16 for tile in img.tile)
    img.load()
    if grey_alpha:
        img = img.convert("LA")  # exact: the three channels are equal
    if _orientation(img) != 1:
        img = ImageOps.exif_transpose(img)
    return img


def _orientation(img) -> int:
    """The picture's EXIF orientation (1: as stored). An EXIF block PIL cannot parse (a PNG's or WebP's without its
    TIFF header) says none: viewers show such a picture as stored, and reading it failed the whole picture."""
    try:
        return img.getexif().get(0x0112, 1)
    except (SyntaxError, struct.error):
        return 1


def _convert(img, channels: int | str):
    """To mode L (gray images under auto, or channels=1: ITU-R 601 luma) or RGB."""
    img = _on_white(img)
    if channels == 1 or (channels == "auto" and img.mode in GRAY_MODES):
        return _to_l(img)
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return _to_l(img).convert("RGB")  # PIL's own convert clips 16-bit and float samples to white or black
    return img if img.mode == "RGB" else img.convert("RGB")


def _on_white(img):
    """A picture with transparency laid on white (grey kept grey), as a viewer shows it and the export pipeline
    (onn.export.pipelines.images) reads it: dropping alpha kept the colour hidden pixels happen to hold, so a
    trained model saw other pixels than its exported pipeline gives it. 16-bit and float samples: as they are."""
    from PIL import Image

    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return img
    if img.mode not in ("RGBA", "LA", "PA") and "transparency" not in img.info:
        return img
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, img.convert("RGBA")).convert("L" if img.mode in GRAY_MODES else "RGB")


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


def fit(a: np.ndarray, opts: Options, name: str) -> np.ndarray:
    """Bring [H, W] or [H, W, 3] pixels to data.image_size (nothing to do when they have it already)."""
    if opts.image_size is None:
        return a
    from PIL import Image

    th, tw = opts.image_size
    h, w = a.shape[:2]
    if (h, w) == (th, tw):
        return a
    if opts.resize == "error":
        raise UserError(
            f"{name} is {h}x{w}, not data.image_size=[{th},{tw}]; set data.resize=resize (stretch) or "
            "data.resize=center_crop to bring every image to that size."
        )
    img = Image.fromarray(np.ascontiguousarray(a))
    if opts.resize == "resize":
        return np.asarray(img.resize((tw, th), Image.Resampling.BILINEAR))
    scale = max(th / h, tw / w)  # the short side (relative to the target) lands on the target
    nw, nh = max(tw, round(w * scale)), max(th, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - tw) // 2, (nh - th) // 2
    return np.asarray(img.crop((left, top, left + tw, top + th)))


def reason(e: BaseException) -> str:
    """Why an item could not be decoded, in a few words for the skip report."""
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "not an image PIL can read (damaged, or another format)"
    if isinstance(e, NotRegularFileError):
        return e.strerror  # "a FIFO (named pipe), not a regular file": the item's name is said already
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def decode_split(split: Split, opts: Options, ref: dict[str, Any], key: str):
    """Decode into one preallocated [N, C, H, W] array; items that fail are skipped and reported."""
    n = len(split.names)
    out: np.ndarray | None = None
    keep: list[int] = []
    skipped: list[str] = []
    for i, name in enumerate(split.names):
        try:
            a = decode(split.fetch.get(i), opts.channels, name)
        except Exception as e:  # PIL raises many types for damaged files
            skipped.append(f"{name}: {reason(e)}")
            continue
        a = fit(a, opts, name)
        if opts.image_size is None:
            same_size(ref, name, a.shape[:2], key)
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


def luma(x: np.ndarray) -> np.ndarray:
    """RGB [N,3,H,W] -> [N,1,H,W] with ITU-R 601 weights, rounded as PIL's convert("L") does."""
    out = np.empty((x.shape[0], 1, *x.shape[2:]), np.uint8)
    for s in range(0, x.shape[0], 4096):
        b = x[s : s + 4096].astype(np.uint32)
        out[s : s + 4096, 0] = (b[:, 0] * 19595 + b[:, 1] * 38470 + b[:, 2] * 7471 + 0x8000) >> 16
    return out


def array_image(chw: np.ndarray, opts: Options, name: str) -> np.ndarray:
    """One [C,H,W] image of an array format, with the channel and size rules applied."""
    x = chw[None]
    if opts.channels == 1 and x.shape[1] == 3:
        x = luma(x)
    elif opts.channels == 3 and x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    if opts.image_size is not None and x.shape[2:] != opts.image_size:
        x = resize_all(x, opts, [name])
    return np.array(x[0], dtype=np.uint8)


def resize_all(x: np.ndarray, opts: Options, names: list[str]) -> np.ndarray:
    """[N, C, H, W] -> [N, C, *data.image_size], image by image (fit says so if resize=error)."""
    out = np.empty((x.shape[0], x.shape[1], *opts.image_size), np.uint8)
    for i in range(x.shape[0]):
        a = fit(x[i, 0] if x.shape[1] == 1 else x[i].transpose(1, 2, 0), opts, names[min(i, len(names) - 1)])
        out[i] = a if a.ndim == 2 else a.transpose(2, 0, 1)
    return out


def array_split(split: Split, opts: Options, ref: dict[str, Any], key: str) -> np.ndarray:
    """The whole split in memory: a copy, never a view of a memmap or of read-only bytes."""
    x = split.fetch.all()
    if opts.channels == 1 and x.shape[1] == 3:
        x = luma(x)
    elif opts.channels == 3 and x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    elif len(split.fetch.blocks) == 1:
        x = np.array(x, order="C")  # (np.concatenate of several blocks has copied already)
    hw = tuple(x.shape[2:])
    if opts.image_size is not None and hw != opts.image_size:
        return resize_all(x, opts, split.names)  # with resize=error, fit says so on the first image
    if opts.image_size is None and len(x):
        same_size(ref, split.names[0], hw, key)
    return x


class ItemList:
    """One split, listed: labels and names up front, pixels decoded by load(i) (in DataLoader workers).

    Archive handles are opened on first use in each process, so a list survives pickling into workers.
    With channels="auto" on encoded images, the first 16 items decide (1 if all are gray, else 3) until a pass
    over every item (check) finds colour, and with no image_size every image must have the size of the first one.
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
        self._opts = options(channels, image_size, resize)
        self._probed: tuple[int | str, tuple[str, tuple[int, int]] | None] | None = None
        return self

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"ItemList({len(self)} items, {len(self.classes)} classes)"

    def load(self, i: int) -> torch.Tensor | None:
        """Item i as uint8 [C, H, W], or None when it cannot be decoded."""
        opts = self._opts
        if isinstance(self._fetch, ArrayFetch):
            return torch.from_numpy(array_image(self._fetch.get(i), opts, self.names[i]))
        a = self._pixels(i, self._probe()[0])
        if a is None:
            return None
        return torch.from_numpy(np.array(a[None] if a.ndim == 2 else a.transpose(2, 0, 1), dtype=np.uint8))

    def check(self, i: int) -> int | None:
        """The channels item i has (under channels=auto 1 when it is grey, else 3), or None when it cannot be
        decoded: for the one pass over every streamed item (ClassificationData._decodable), so that a colour
        image after the first 16 makes the data colour, as a resident read does."""
        if isinstance(self._fetch, ArrayFetch):
            return int(self.load(i).shape[0])
        a = self._pixels(i, self._opts.channels)
        return None if a is None else 1 if a.ndim == 2 else 3

    def _pixels(self, i: int, channels: int | str) -> np.ndarray | None:
        """Item i decoded to [H, W] or [H, W, 3] and fitted to data.image_size, or None when it cannot be."""
        ref = self._probe()[1]
        with strict_pil():
            try:
                a = decode(self._fetch.get(i), channels, self.names[i])
            except Exception:  # PIL raises many types for damaged files
                return None
        a = fit(a, self._opts, self.names[i])
        if self._opts.image_size is None and ref is not None and a.shape[:2] != ref[1]:
            raise UserError(mixed_sizes(ref[0], ref[1], self.names[i], a.shape[:2]))
        return a

    @property
    def channels(self) -> int | str:
        """The channels load() gives: data.channels, or under auto 1 when the first items are all grey, else 3."""
        return self._opts.channels if isinstance(self._fetch, ArrayFetch) else self._probe()[0]

    def _probe(self) -> tuple[int | str, tuple[str, tuple[int, int]] | None]:
        """Channels and reference size (HxW) from the first items that decode."""
        if self._probed is None:
            gray, ref = True, None
            with strict_pil():
                for i in range(min(16, len(self))):
                    try:
                        a = decode(self._fetch.get(i), "auto", self.names[i])
                    except Exception:
                        continue
                    gray &= a.ndim == 2
                    hw = fit(a, self._opts, self.names[i]).shape[:2]
                    if ref is None:
                        ref = (self.names[i], hw)
                    elif self._opts.image_size is None and hw != ref[1]:
                        raise UserError(mixed_sizes(ref[0], ref[1], self.names[i], hw))
            channels = self._opts.channels
            if channels == "auto":
                channels = 1 if gray else 3
            self._probed = (channels, ref)
        return self._probed
