"""Pictures in and out of the pipelines: an image file read as RGB (or refused in one sentence), resized and
normalised for a piece, and the results drawn over it as a PNG."""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from onn.errors import UserError

COLOURS = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240)]
# Modes that hold colour or grey levels PIL converts to RGB (16-bit grey, I;16*, is scaled to 8 bits first); others
# (32-bit integer, float) need a choice we leave to the user.
CONVERTIBLE = {"RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1", "RGBX", "LAB", "HSV"}


def load_rgb(path: str | Path):
    """The image at `path` as an RGB PIL image, upright as its EXIF orientation says (a phone's photograph is
    stored sideways), transparency laid on white; a file PIL cannot read, one over PIL's pixel limit, a mode
    without one RGB reading, or a document of several pages (load_pages reads those), is one sentence."""
    with _open(path) as image:
        pages = _pages(image)
        if len(pages) > 1:
            raise UserError(
                f"image {path} is a document of {len(pages)} pages and this pipeline reads one picture; save the "
                "page to read as a file of its own (the OCR pipeline reads every page)."
            )
        return _page(image, pages[0], path)


def load_pages(path: str | Path) -> list:
    """Every page of a multi-page TIFF (a scanned document; its reduced-resolution previews are not pages) as
    load_rgb reads a picture; any other picture as its one page. Reading only the first was a silent loss."""
    with _open(path) as image:
        return [_page(image, index, path) for index in _pages(image)]


def _page(image, index: int, path: str | Path):
    """Frame `index` of an opened picture, as load_rgb reads it (a new image: exif_transpose and convert copy the
    frame). PIL checks its pixel limit when it opens a file, on the first frame: a later page is checked here."""
    from PIL import Image

    image.seek(index)
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and image.width * image.height > 2 * limit:
        raise UserError(_too_many_pixels(path))
    return _rgb(image, path)


def _too_many_pixels(path: str | Path) -> str:
    from PIL import Image

    return (
        f"image {path} has more pixels than PIL opens ({2 * Image.MAX_IMAGE_PIXELS:,} at most, its guard against "
        "decompression bombs); scale it down first."
    )


def _open(path: str | Path):
    """The picture at `path`, loaded (its first frame); what PIL cannot open is one sentence."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if path.is_dir():
        raise UserError(f"image {path} is a folder; give the picture file in it.")
    if not path.is_file():
        raise UserError(f"image {path} does not exist.")
    try:
        image = Image.open(path)
        image.load()
    except Image.DecompressionBombError:
        raise UserError(_too_many_pixels(path)) from None
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"image {path} cannot be read as a picture ({e}); give a PNG, JPEG or other image.") from None
    return image


def _pages(image) -> list[int]:
    """The frame indices that are pages: a TIFF's full-resolution images (NewSubfileType without its
    reduced-resolution bit); any other format's first frame alone (a GIF's frames are an animation, an MPO's
    second a camera's preview)."""
    if image.format != "TIFF" or getattr(image, "n_frames", 1) == 1:
        return [0]
    pages = []
    for index in range(image.n_frames):
        image.seek(index)
        if not int(image.tag_v2.get(254, 0)) & 1:  # NewSubfileType bit 0: a reduced-resolution preview
            pages.append(index)
    image.seek(0)
    return pages or [0]


def _rgb(image, path: str | Path):
    """One loaded picture as RGB: upright, 16-bit grey scaled to 8, transparency on white."""
    from PIL import Image, ImageOps

    with contextlib.suppress(SyntaxError, struct.error):  # a PNG's or WebP's EXIF PIL cannot parse: no orientation
        image = ImageOps.exif_transpose(image)
    if image.mode not in CONVERTIBLE and not image.mode.startswith("I;16"):
        raise UserError(
            f"image {path} is in mode {image.mode} ({'x'.join(map(str, image.size))}), which has no one RGB "
            "reading; convert it to an 8-bit RGB or grey image first."
        )
    if image.mode.startswith("I;16"):  # I;16, and I;16B (a big-endian TIFF's), I;16L, I;16N
        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        return _on_white(image)
    return image.convert("RGB")


def _on_white(image):
    """A picture with transparency laid on white, as a page prints and a viewer shows it: dropping the alpha
    channel keeps the colour the hidden pixels happen to hold, and black text on a transparent PNG (whose hidden
    pixels are 0, 0, 0) became a black page."""
    from PIL import Image

    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def normalised(image, size: tuple[int, int], mean: list[float], std: list[float]) -> np.ndarray:
    """[1, 3, height, width] float32: the image resized to `size` (height, width), scaled to 0-1, normalised."""
    from PIL import Image

    resized = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(resized, dtype=np.float32) / 255.0
    array = (array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return array.transpose(2, 0, 1)[None].astype(np.float32)


def letterboxed(image, side: int, mean: list[float], std: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The image scaled to fit a `side` x `side` canvas (aspect kept), normalised, zero-padded; and the pixel
    mask (1 on the picture)."""
    scale = side / max(image.size)
    width, height = max(1, round(image.width * scale)), max(1, round(image.height * scale))
    pixels = np.zeros((1, 3, side, side), np.float32)
    pixels[:, :, :height, :width] = normalised(image, (height, width), mean, std)
    mask = np.zeros((1, side, side), np.int64)
    mask[:, :height, :width] = 1
    return pixels, mask


def overlay(image, masks: list[np.ndarray], alpha: float = 0.45):
    """The image with each boolean mask (image-sized) tinted in its own colour."""
    array = np.asarray(image, dtype=np.float32).copy()
    for k, mask in enumerate(masks):
        colour = np.asarray(COLOURS[k % len(COLOURS)], np.float32)
        array[mask] = (1 - alpha) * array[mask] + alpha * colour
    from PIL import Image

    return Image.fromarray(array.clip(0, 255).astype(np.uint8))


def annotate(image, boxes: list[tuple[list[float], str]] = (), points: list[tuple[float, float]] = ()):
    """Boxes (x0, y0, x1, y1) with their labels, and points, drawn on a copy of the image."""
    from PIL import ImageDraw

    image = image.copy()
    draw = ImageDraw.Draw(image)
    for k, (box, label) in enumerate(boxes):
        colour = COLOURS[k % len(COLOURS)]
        draw.rectangle(box, outline=colour, width=max(1, image.width // 300))
        if label:
            draw.text((box[0] + 2, box[1] + 2), label, fill=colour)
    for x, y in points:
        r = max(3, image.width // 150)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=(255, 255, 0), outline=(0, 0, 0))
    return image


def stacked(pictures: list):
    """The pictures one below the other on white (a document's pages drawn as one PNG); one picture as it is."""
    from PIL import Image

    if len(pictures) == 1:
        return pictures[0]
    sheet = Image.new("RGB", (max(p.width for p in pictures), sum(p.height for p in pictures)), (255, 255, 255))
    top = 0
    for picture in pictures:
        sheet.paste(picture, (0, top))
        top += picture.height
    return sheet


def upsampled(logits: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A low-resolution mask's logits resized to `size` (width, height), bilinear, then thresholded at 0."""
    from PIL import Image

    return np.asarray(Image.fromarray(logits.astype(np.float32), mode="F").resize(size, Image.Resampling.BILINEAR)) > 0


def save(image, path: Path) -> Path:
    """The PNG written beside `path` and renamed into place: a failed write leaves no cut-short file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def describe_mask(mask: np.ndarray) -> dict[str, Any]:
    ys, xs = np.nonzero(mask)
    box = [int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())] if len(xs) else None
    return {"area": int(mask.sum()), "box": box}
