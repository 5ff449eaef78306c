"""The eleventh review of the .omny pipelines: OCR finds no line on a blank page (it read the whole page and made
up text), reads a page of columns column after column (a line ran across the gutter and mixed two texts), and
reads a line far longer than high in parts cut at word gaps (squeezed into the encoder's square it was a smear)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_pipelines_review2 import _export

from onn.export.pipelines import Request, run_pipeline
from onn.export.pipelines.ocr import LONGEST_LINE, line_parts, lines

FONT_SIZE = 24
LEFT_COLUMN = ("Left column one", "second on the left", "third left line")
RIGHT_COLUMN = ("Right column one", "the second right", "and the third.")
LONG_LINE = "a line of print that runs on and on across the whole width of a wide page"


def _picture(size: tuple[int, int], texts: list[tuple[int, int, str]]):
    """A white RGB picture of `size` with each (x, y, text) printed in black."""
    from PIL import Image, ImageDraw, ImageFont

    picture = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default(size=FONT_SIZE)
    for x, y, text in texts:
        draw.text((x, y), text, fill="black", font=font)
    return picture


def _gray(picture) -> np.ndarray:
    return np.asarray(picture.convert("L"), np.float32)


def _columns(heading: str = ""):
    """Two columns of three lines each, 280 pixels apart: a gutter of some 50 pixels (the left's longest line
    ends near x 245), its lines level with the right's; under a heading across both, when given."""
    top = 90 if heading else 20
    left = [(20, top + 50 * k, text) for k, text in enumerate(LEFT_COLUMN)]
    right = [(300, top + 50 * k, text) for k, text in enumerate(RIGHT_COLUMN)]
    return _picture((560, top + 160), left + right + ([(20, 20, heading)] if heading else []))


def _blank_scan(dust: int = 0):
    """A blank page as a scanner gives it: paper a little off white, with noise, and `dust` black specks."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = (236 + rng.normal(0, 4, (300, 400, 3))).clip(0, 255).astype(np.uint8)
    for y, x in zip(rng.integers(0, 298, dust), rng.integers(0, 398, dust)):
        pixels[y : y + 2, x : x + 2] = 20
    return Image.fromarray(pixels)


def test_a_blank_page_has_no_lines():
    """A blank page (white, one grey, a scanner's noisy paper, specks of dust on it) had one line, the whole page
    (or lines of noise), which TrOCR read into made-up text; it has none now. A page of print keeps its lines."""
    assert lines(np.full((30, 30), 255.0)) == []
    assert lines(np.full((40, 60), 128.0)) == []
    assert lines(_gray(_blank_scan())) == []
    assert lines(_gray(_blank_scan(dust=12))) == []
    page = _picture((400, 120), [(20, 20, "The first line"), (20, 70, "and a second.")])
    assert len(lines(_gray(page))) == 2


def test_a_page_of_two_columns_is_read_column_after_column():
    """The two columns' lines were three boxes, each running across the gutter (the left line and the right one
    read as one); now six, the left column's three top to bottom, then the right column's."""
    gray = _gray(_columns())
    found = lines(gray)
    assert len(found) == 6, found
    left, right = found[:3], found[3:]
    assert all(x1 < 280 for _, _, x1, _ in left) and all(x0 > 285 for x0, _, _, _ in right), found
    assert [y0 for _, y0, _, _ in left] == sorted(y0 for _, y0, _, _ in left)
    assert [y0 for _, y0, _, _ in right] == sorted(y0 for _, y0, _, _ in right)
    headed = lines(_gray(_columns("A heading across both columns")))
    assert len(headed) == 7 and headed[0][2] > 300, headed  # the heading, then the columns as before
    assert [x1 < 280 for _, _, x1, _ in headed[1:]] == [True] * 3 + [False] * 3, headed
    one_column = _picture((560, 180), [(20, 20 + 50 * k, text) for k, text in enumerate(LEFT_COLUMN)])
    assert len(lines(_gray(one_column))) == 3  # a word's gap is no gutter


def test_a_long_line_is_read_in_parts_cut_at_word_gaps():
    """A line 50 times as long as high was one crop squeezed into the encoder's square; it is cut into parts of
    about LONGEST_LINE times its height, each cut in a blank column between words, that together are the line."""
    page = _picture((1400, 60), [(10, 15, LONG_LINE)])
    gray = _gray(page)
    (box,) = lines(gray)
    x0, y0, x1, y1 = box
    parts = line_parts(gray, box)
    assert len(parts) >= 3, parts
    assert parts[0][0] == x0 and parts[-1][2] == x1
    assert all(a[2] == b[0] for a, b in zip(parts, parts[1:]))  # they tile the line
    assert all(p[1:4:2] == (y0, y1) for p in parts)
    assert all(p[2] - p[0] <= LONGEST_LINE * (y1 - y0) for p in parts[:-1]), parts
    ink = gray[y0:y1] < 128
    assert not any(ink[:, p[2] - 2 : p[2] + 3].any() for p in parts[:-1]), "a part cut through a letter"
    short = _picture((300, 60), [(10, 15, "a short line")])
    assert line_parts(_gray(short), lines(_gray(short))[0]) == lines(_gray(short))


@pytest.mark.slow  # TrOCR exported at its test size: some 35 s on 2 cores
def test_ocr_reads_no_text_on_a_blank_page_and_columns_one_after_another(tmp_path):
    """End to end in onnxruntime: a blank page gives no line and no text (it gave the whole page's made-up
    tokens), a page of columns six lines in column order, a long line one line read in parts."""
    _, path = _export("trocr_mini", tmp_path / "trocr")
    _blank_scan().save(tmp_path / "blank.jpg")
    blank = run_pipeline(path, Request(tmp_path / "blank.jpg", tmp_path / "blank.png"))
    assert blank["lines"] == [] and blank["text"] == "" and Path(blank["png"]).is_file()
    _columns().save(tmp_path / "columns.png")
    columns = run_pipeline(path, Request(tmp_path / "columns.png", tmp_path / "columns.result.png"))
    assert [line["box"][2] < 280 for line in columns["lines"]] == [True] * 3 + [False] * 3
    _picture((1400, 60), [(10, 15, LONG_LINE)]).save(tmp_path / "long.png")
    (long,) = run_pipeline(path, Request(tmp_path / "long.png", tmp_path / "long.result.png"))["lines"]
    assert len(long["parts"]) >= 3 and long["token_ids"]


def test_light_print_on_a_dark_ground_and_faint_print_have_lines():
    """The blank-page check asked for ink 32 grey levels darker than the paper: white text on a dark sign or
    screenshot (the paper the darkest), and print 28 levels off white, read as blank pages with no text."""
    light = np.full((60, 360), 40.0)
    light[20:40, 20:340:3] = 230.0
    faint = np.full((60, 360), 250.0)
    faint[20:40, 20:340:3] = 222.0
    assert lines(light) == lines(faint) != []
