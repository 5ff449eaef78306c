"""A picture of predictions: the images in a grid, each captioned with its predicted (and true) label."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_IMAGES = 64
PAD = 4  # pixels around each image
LINE = 12  # caption line height for PIL's default font
BACKGROUND = (0, 0, 0)
COLORS = {True: (80, 220, 80), False: (255, 70, 70), None: (255, 255, 255)}  # correct, wrong, true unknown


def write_grid(
    images: torch.Tensor,
    predicted: list[str],
    true: list[str | None],
    path: Path,
    columns: int = 8,
    scale: int = 3,
) -> None:
    """uint8 [N,C,H,W] (C = 1 or 3) -> one PNG at path: the first 64 images only (a bigger grid is
    unreadable), scaled up `scale` times (nearest), `columns` to a row, each captioned with its
    predicted label and `(true: X)` when known: green when right, red when wrong, white when unknown."""
    from PIL import Image, ImageDraw, ImageFont

    if images.dim() != 4 or images.shape[1] not in (1, 3) or images.dtype != torch.uint8:
        raise ValueError(f"write_grid needs uint8 [N,1|3,H,W] images, got {images.dtype} {tuple(images.shape)}")
    if len(predicted) < len(images) or len(true) < len(images):
        raise ValueError(
            f"write_grid got {len(images)} images but {len(predicted)} predicted / {len(true)} true labels"
        )
    images = images[:MAX_IMAGES].detach().cpu()
    n, _, h, w = images.shape
    images = images.expand(n, 3, h, w) if images.shape[1] == 1 else images
    images = images.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    cell_w, cell_h = w * scale + 2 * PAD, h * scale + 2 * LINE + 2 * PAD
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    canvas = Image.new("RGB", (columns * cell_w, rows * cell_h), BACKGROUND)
    draw, font = ImageDraw.Draw(canvas), ImageFont.load_default()
    for i in range(n):
        x, y = (i % columns) * cell_w + PAD, (i // columns) * cell_h + PAD
        canvas.paste(Image.fromarray(images[i].permute(1, 2, 0).contiguous().numpy()), (x, y))
        label, truth = str(predicted[i]), true[i]
        color = COLORS[None if truth is None else label == str(truth)]
        lines = [label] if truth is None else [label, f"(true: {truth})"]
        for k, text in enumerate(lines):
            draw.text((x, y + h * scale + k * LINE), _fit(draw, text, font, w * scale), fill=color, font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG")


def _fit(draw, text: str, font, width: int) -> str:
    """text, cut with an ellipsis to fit `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"
