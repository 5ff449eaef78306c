"""The seventh review of the .omny pipelines (onn/export/pipelines): 16-bit grey pictures of either byte order are
read, a scanned document of several pages is read page by page by OCR (and refused, not cut to its first page,
where one picture is read), a folder given for a file is named as one, and onnxruntime's failures on a piece are one
sentence naming the piece's file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_omny_pipelines import _block_pieces, _export_blocks, _photo
from test_pipelines_review2 import _export

from onn.errors import UserError
from onn.export.omny.cli import main
from onn.export.pipelines import Request, run_pipeline
from onn.export.pipelines.images import load_pages, load_rgb
from onn.export.pipelines.runtime import Pieces


def _page(lines: list[str], width: int = 420):
    """A white page with one line of black print per entry, 60 pixels apart."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (width, 40 + 60 * len(lines)), "white")
    draw = ImageDraw.Draw(page)
    for k, line in enumerate(lines):
        draw.text((20, 20 + 60 * k), line, fill="black", font=ImageFont.load_default(size=28))
    return page


def _scan(path: Path) -> Path:
    """A TIFF of two pages (three lines, then two, the second stored sideways with its TIFF orientation 6) and,
    after them, a reduced-resolution preview of the first (its NewSubfileType 1), as scanners write a document."""
    first, second = _page(["The first line", "a second one", "and the third."]), _page(["Page two", "ends here."])
    sideways = second.transpose(2)  # Image.Transpose.ROTATE_90: orientation 6 turns it back upright
    sideways.encoderinfo = {"tiffinfo": {274: 6}}
    preview = first.resize((first.width // 4, first.height // 4))
    preview.encoderinfo = {"tiffinfo": {254: 1}}
    first.save(path, save_all=True, append_images=[sideways, preview])
    return path


def test_a_scanned_document_is_its_pages_and_refused_where_one_picture_is_read(tmp_path):
    """A pipeline that reads one picture read a multi-page TIFF's first page and said nothing of the others; it now
    refuses the document in one sentence, and load_pages (OCR's reader) gives every page upright, without the
    preview. A TIFF of one page is a picture as before."""
    from PIL import Image

    scan = _scan(tmp_path / "scan.tif")
    assert Image.open(scan).n_frames == 3
    pages = load_pages(scan)
    assert [page.size for page in pages] == [(420, 220), (420, 160)]
    assert (np.asarray(pages[1]) == np.asarray(_page(["Page two", "ends here."]))).all()
    with pytest.raises(UserError, match=r"scan.tif is a document of 2 pages and this pipeline reads one picture"):
        load_rgb(scan)
    one = tmp_path / "one.tif"
    _page(["One page"]).save(one)
    assert len(load_pages(one)) == 1 and load_rgb(one).size == (420, 100)


def test_16_bit_grey_pictures_of_either_byte_order_are_read_as_their_grey(tmp_path):
    """A 16-bit grey TIFF written big-endian (mode I;16B) was refused as a mode "without one RGB reading", while the
    same picture little-endian (I;16) or as a PNG was read: each is now its grey scaled to 8 bits."""
    from PIL import Image

    levels = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1024 + 300).astype(np.uint16)
    want = np.repeat((levels >> 8).astype(np.uint8)[..., None], 3, axis=2)
    big = Image.frombytes("I;16B", (8, 8), levels.astype(">u2").tobytes())
    for name, picture in (("big.tif", big), ("little.tif", Image.fromarray(levels)), ("grey.png", big)):
        picture.save(tmp_path / name)
        read = load_rgb(tmp_path / name)
        assert read.mode == "RGB" and (np.asarray(read) == want).all(), name
    assert Image.open(tmp_path / "big.tif").mode == "I;16B"


def test_a_picture_whose_exif_block_cannot_be_parsed_is_read_as_stored(tmp_path):
    """A PNG or WebP with an EXIF block PIL cannot parse (cut short, or not a TIFF structure) was PIL's raw
    SyntaxError or struct.error from exif_transpose; it holds no orientation to read, so it is read as stored."""
    from PIL import Image

    pixels = np.zeros((30, 40, 3), np.uint8)
    pixels[:, :10] = 255
    orientation = Image.Exif()
    orientation[0x0112] = 6
    for name, exif in (
        ("garbage.png", b"Exif\x00\x00garbagegarbage"),
        ("garbage.webp", b"Exif\x00\x00garbagegarbage"),
        ("cut.png", orientation.tobytes()[:12]),
    ):
        Image.fromarray(pixels).save(tmp_path / name, exif=exif, **({"lossless": True} if "webp" in name else {}))
        read = load_rgb(tmp_path / name)
        assert read.size == (40, 30) and (np.asarray(read) == pixels).all(), name


def test_a_folder_given_for_the_pipeline_or_the_picture_is_named_as_a_folder(tmp_path, capsys):
    """`run outputs/.../export photo.jpg` (the export folder, not its pipeline.json) said the folder 'does not exist';
    a folder given for the picture said the same."""
    (tmp_path / "export").mkdir()
    assert main(["run", str(tmp_path / "export"), str(tmp_path / "photo.jpg")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'export'} is a folder, not a pipeline document; give the pipeline.json" in err, err
    with pytest.raises(UserError, match=rf"^image {re.escape(str(tmp_path))} is a folder; give the picture file"):
        load_rgb(tmp_path)


@pytest.mark.slow  # TrOCR exported at its test size: some 35 s on 2 cores
def test_ocr_reads_every_page_of_a_scanned_document(tmp_path):
    """OCR of a two-page TIFF read its first page alone; now both pages' lines are read, in order and each with
    its page, and the PNG shows the pages one below the other."""
    from PIL import Image

    _, path = _export("trocr_mini", tmp_path / "trocr")
    read = run_pipeline(path, Request(_scan(tmp_path / "scan.tif"), tmp_path / "scan.png"))
    assert read["pages"] == 2 and [line["page"] for line in read["lines"]] == [1, 1, 1, 2, 2]
    assert all(line["token_ids"] for line in read["lines"])
    assert Image.open(read["png"]).size == (420, 220 + 160)
    assert json.loads(Path(read["json"]).read_text())["lines"] == read["lines"]


def test_onnxruntime_failing_on_a_piece_is_one_sentence_naming_its_file(tmp_path, monkeypatch):
    """A piece fed a shape it does not take (a pipeline.json whose settings.image_size was edited) and a piece whose
    weights file beside it was lost (a folder copied without it) were onnxruntime's raw traceback."""
    import onnx

    folder = tmp_path / "blocks"
    _export_blocks("blocks", folder, _block_pieces()[:1], monkeypatch)  # one piece: an export of seconds
    doc = json.loads((folder / "pipeline.json").read_text())
    said = rf"pipeline piece piece0 \({re.escape(str(folder / 'piece0.omny'))}\): onnxruntime cannot"
    with pytest.raises(
        UserError, match=said + r" run it on inputs \{'features': \[2, 5\]\} \(.*re-export the pipeline"
    ):
        Pieces(doc, folder).run("piece0", {"features": np.ones((2, 5), np.float32)})

    model = onnx.load(str(folder / "piece0.omny"))
    onnx.save_model(model, str(folder / "piece0.omny"), save_as_external_data=True, location="piece0.omny.data")
    (folder / "piece0.omny.data").unlink()
    with pytest.raises(UserError, match=said + " load it"):
        run_pipeline(folder / "pipeline.json", Request(_photo(tmp_path), tmp_path / "x.png"))


def test_a_tokenizer_file_cut_short_is_one_sentence(tmp_path):
    """tokenizer.json cut short (a copy interrupted) was the tokenizers library's bare Exception, a traceback."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    doc = {"pieces": [], "tokenizer": "tokenizer.json"}
    assert Pieces(doc, tmp_path).tokenizer().encode("a").ids == [0]
    text = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match=r"tokenizer.json cannot be read as a tokenizer .*re-export the pipeline\.$"):
        Pieces(doc, tmp_path).tokenizer()


def test_a_later_page_over_the_pixel_limit_is_refused_as_the_first_is(tmp_path, monkeypatch):
    """PIL checks its decompression-bomb limit when it opens a file, on the first frame: a TIFF whose first page is
    small and whose second is huge read the second whole."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    small, large = Image.new("L", (10, 10), 255), Image.new("L", (200, 200), 255)
    scan = tmp_path / "scan.tif"
    small.save(scan, save_all=True, append_images=[large])
    with pytest.raises(UserError, match=r"scan.tif has more pixels than PIL opens \(2,000 at most"):
        load_pages(scan)
    large.save(tmp_path / "one.tif")
    with pytest.raises(UserError, match=r"one.tif has more pixels than PIL opens \(2,000 at most"):
        load_pages(tmp_path / "one.tif")
