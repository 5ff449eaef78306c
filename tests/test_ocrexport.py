"""OCR's layout keeps a table's rows and a tab's line whole (a wide gap between short cells, or within one line, is
no column gutter: the rows were read cell column after cell column, a heading over the right cells after the left
ones, a line with a tab as two), and an ONNX export stopped before its graph's rename takes the weights file it had
moved beside the earlier export away again (it stayed there, gigabytes no graph names)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hostile_corpus import tiny_onnx

from onn.export import onnx_export
from onn.export.onnx_export import export_onnx, run_onnx
from onn.export.pipelines.ocr import lines
from onn.hardware import failpoints

FONT_SIZE = 24
SAMPLE = {"x": torch.linspace(-1, 1, 16).reshape(2, 8)}


def _page(size: tuple[int, int], texts: list[tuple[int, int, str]]) -> np.ndarray:
    """A white page of `size` with each (x, y, text) printed in black, as the grey levels OCR reads."""
    from PIL import Image, ImageDraw, ImageFont

    picture = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default(size=FONT_SIZE)
    for x, y, text in texts:
        draw.text((x, y), text, fill="black", font=font)
    return np.asarray(picture.convert("L"), np.float32)


def _price_list(heading_x: int) -> np.ndarray:
    """A short heading at `heading_x`, a gap of three lines' height under it, then three rows of a table whose name
    and price are 200 pixels apart (some 15 letter heights: far more than a gutter's COLUMN_GAP)."""
    rows = [("Apples", "3.50"), ("Pears", "2.10"), ("Plums", "1.25")]
    cells = [(x, 110 + 50 * k, text) for k, row in enumerate(rows) for x, text in zip((20, 300), row)]
    return _page((600, 270), [(heading_x, 20, "Prices"), *cells])


@pytest.mark.parametrize("heading_x", [20, 300])
def test_a_heading_above_a_table_is_read_first_then_the_rows_whole(heading_x):
    """The table's gap was taken for a gutter (wider than the heading's gap): the names were read, then the prices,
    and a heading over the prices after all the names. Now the heading comes first, then each row as one line."""
    found = lines(_price_list(heading_x))
    assert len(found) == 4, found
    heading, rows = found[0], found[1:]
    assert heading[1] < 60 and abs(heading[0] - heading_x) < 10, found
    assert all(x0 < 30 and x1 > 340 for x0, _, x1, _ in rows), found  # name and price in one box
    assert [y0 for _, y0, _, _ in rows] == sorted(y0 for _, y0, _, _ in rows)


def test_a_wide_gap_within_a_line_of_one_column_keeps_the_line_whole():
    """A line with a tab-wide gap in a page of one column, or alone, was cut there and read as two lines; dust in
    a two-column page's margin still keeps its gutter, and a blank page's dust is still no line."""
    page = _page(
        (600, 270),
        [
            (20, 20, "Summary"),
            (20, 110, "The results are listed below"),
            (20, 160, "Total:"),
            (300, 160, "42 units"),
            (20, 210, "All values are final now."),
        ],
    )
    found = lines(page)
    assert len(found) == 4, found
    assert [y0 for _, y0, _, _ in found] == sorted(y0 for _, y0, _, _ in found)
    assert found[2][0] < 30 and found[2][2] > 380, found  # "Total:" and "42 units", one line
    (alone,) = lines(_page((600, 70), [(20, 20, "Name:"), (250, 20, "John Smith")]))
    assert alone[0] < 30 and alone[2] > 370

    left = [(20, 20 + 50 * k, text) for k, text in enumerate(("Left column one", "second on the left"))]
    right = [(300, 20 + 50 * k, text) for k, text in enumerate(("Right column one", "the second right"))]
    columns = _page((560, 130), left + right).copy()
    columns[60:62, 540:542] = 0  # a speck of dust in the right margin
    found = lines(columns)
    assert [x1 < 280 for _, _, x1, _ in found] == [True, True, False, False], found
    dusty = np.full((200, 300), 240.0)
    dusty[30:32, 40:42] = dusty[31:33, 200:202] = dusty[120:122, 100:102] = 0
    assert lines(dusty) == []


def test_two_columns_whose_lines_do_not_line_up_are_read_column_after_column():
    """Right column's lines half a line lower than the left's: no blank row crosses the page, and the page was
    read as one box over both columns (two texts mixed). Now each column's lines, left column first."""
    left = [(20, 20 + 28 * k, f"left line number {k}") for k in range(6)]
    right = [(330, 34 + 28 * k, f"right line number {k}") for k in range(6)]
    found = lines(_page((620, 230), left + right))
    assert len(found) == 12, found
    assert all(x1 < 300 for _, _, x1, _ in found[:6]) and all(x0 > 300 for x0, _, _, _ in found[6:]), found
    assert [y0 for _, y0, _, _ in found[:6]] == sorted(y0 for _, y0, _, _ in found[:6])


def test_a_tall_line_is_not_cut_at_its_word_gaps():
    """A heading in large type, or a line with brackets, spans more than two letters of the body text: the search for
    columns whose lines do not line up cut such a line at its word gaps ("Introduction to the" | "Methods")."""
    from PIL import Image, ImageDraw, ImageFont

    picture = Image.new("RGB", (900, 330), "white")
    draw = ImageDraw.Draw(picture)
    draw.text((20, 10), "Introduction to the      Methods", fill="black", font=ImageFont.load_default(size=40))
    body = ImageFont.load_default(size=16)
    for k in range(6):
        draw.text((20, 80 + 22 * k), "the quick brown fox jumps over the lazy dog " * 2, fill="black", font=body)
    draw.text((20, 230), "Total (gross)          [12] units", fill="black", font=ImageFont.load_default(size=24))
    found = lines(np.asarray(picture.convert("L"), np.float32))
    assert len(found) == 8, found
    assert found[0][2] - found[0][0] > 500 and found[-1][2] - found[-1][0] > 250, found  # each line whole


def _staged(model: onnx.ModelProto, output: Path, scale: float) -> Path:
    """`model`, its weights times `scale`, staged for `output` as an export stages it: in a folder of its own (here
    outside output's, which then holds the export alone), under staged_name, its weights in the .data beside it."""
    for tensor in model.graph.initializer:
        tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * scale, tensor.name))
    folder = Path(tempfile.mkdtemp(dir=output.parent.parent))
    staged = folder / onnx_export.staged_name(output)
    onnx.save_model(model, str(staged), save_as_external_data=True, location=staged.name + ".data", size_threshold=0)
    return staged


def test_move_into_place_stopped_or_refused_takes_its_moved_weights_away(tmp_path, monkeypatch):
    """move_into_place (an ONNX or .omny export's last step) stopped by Ctrl-C between its renames, or refused the
    graph's rename, left the weights file it had moved beside `output`: now it takes it away, and the earlier pair
    there is what it was, byte for byte, and computes as before."""
    source, out = tiny_onnx(tmp_path / "src.onnx"), tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    onnx_export.move_into_place(_staged(onnx.load(str(source)), out, 1.0), out)
    before, feeds = _files(out.parent), {"x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)}
    want = run_onnx(out, feeds)["y"]
    assert len(before) == 2 and want.any()  # the graph and its weights file

    def interrupted(name: str) -> None:  # the fault harness's point between the renames, hit by Ctrl-C
        if name == "export_write":
            raise KeyboardInterrupt

    monkeypatch.setattr(failpoints, "reached", interrupted)
    with pytest.raises(KeyboardInterrupt):
        onnx_export.move_into_place(_staged(onnx.load(str(source)), out, -1.0), out)
    assert _files(out.parent) == before
    np.testing.assert_array_equal(run_onnx(out, feeds)["y"], want)

    monkeypatch.undo()
    taken = tmp_path / "out" / "taken.onnx"
    taken.mkdir()  # a folder where the graph is to go: its rename is refused
    with pytest.raises(IsADirectoryError):
        onnx_export.move_into_place(_staged(onnx.load(str(source)), taken, 1.0), taken)
    assert _files(out.parent) == {**before, "taken.onnx": None} and not any(taken.iterdir())


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def _files(folder: Path) -> dict[str, bytes]:
    """The files in `folder` by name (a folder, hidden ones included, as None), with their bytes."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()}


@pytest.mark.slow  # the process's first torch.onnx export: some 15 s on a busy machine
def test_an_export_stopped_before_its_graph_rename_leaves_the_earlier_export_alone(tmp_path, monkeypatch):
    """Ctrl-C (or any error) after the new weights file was moved beside the earlier export, before the graph's
    rename: that weights file stayed beside the earlier pair for good. Now it goes, and the earlier pair is what it
    was, byte for byte, and still computes its own model."""
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)  # a tiny model's weights beside it, as a large one's
    out = tmp_path / "mlp.onnx"
    export_onnx(_mlp(0), out, SAMPLE)
    before = _files(tmp_path)
    assert len(before) == 2  # the graph and its .data file

    def interrupted(name: str) -> None:  # the fault harness's point between the renames, hit by Ctrl-C
        if name == "export_write":
            raise KeyboardInterrupt

    monkeypatch.setattr(failpoints, "reached", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(_mlp(1), out, SAMPLE)
    assert _files(tmp_path) == before  # no weights file of the stopped export, no staging folder
    want = _mlp(0)(SAMPLE["x"]).detach().numpy()
    np.testing.assert_allclose(run_onnx(out, SAMPLE)["output"], want, atol=1e-5)


class _Taken(torch.nn.Module):
    """A model whose run puts a folder where its export is to go (as another program might, while it exports): the
    export's last rename, of its graph, then fails."""

    def __init__(self, output: Path):
        super().__init__()
        self.output = output
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        self.output.mkdir(exist_ok=True)
        return self.linear(x)


@pytest.mark.slow  # the process's first torch.onnx export: some 15 s on a busy machine
def test_an_export_whose_graph_rename_fails_leaves_no_weights_file(tmp_path, monkeypatch):
    """The graph's rename refused (a folder took its place): the weights file moved before it stayed beside it."""
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "taken.onnx"
    with pytest.raises(IsADirectoryError):
        export_onnx(_Taken(out), out, SAMPLE)
    assert [p.name for p in tmp_path.iterdir()] == ["taken.onnx"] and out.is_dir() and not any(out.iterdir())
