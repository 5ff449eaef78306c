"""An export that replaces an earlier one, killed at any step of its writing (SIGKILL, as a failing machine would;
the fault harness's export_write point), leaves at its path the earlier export whole or the new one whole, each
computing its own model in onnxruntime: a folder of an ONNX graph and the .data file beside it (a pipeline's
pieces, swapped in by folders.write_atomically), and a single ONNX graph (onnx_export.move_into_place). A folder
was renamed aside before the new one was renamed in: killed between the two renames, no export was at its path."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from hostile_corpus import tiny_onnx
from kill_harness import killed_at

from onn.export.folders import MARKER, write_atomically
from onn.export.onnx_export import move_into_place, run_onnx, staged_name, weights_files

FEEDS = {"x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)}


def _scaled(source: Path, scale: float) -> onnx.ModelProto:
    """The tiny graph at `source` with its weights times `scale`: exports of two models, told apart by their output."""
    model = onnx.load(str(source))
    for tensor in model.graph.initializer:
        tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * scale, tensor.name))
    return model


def _graph_folder(model: onnx.ModelProto) -> Callable[[Path], None]:
    """A folder export's writer: model.onnx with every weight in model.onnx.data beside it."""

    def write(folder: Path) -> None:
        onnx.save_model(
            _copy(model),
            str(folder / "model.onnx"),
            save_as_external_data=True,
            location="model.onnx.data",
            size_threshold=0,
        )

    return write


def _computes(graph: Path, wants: dict[str, np.ndarray]) -> str:
    """Which of `wants` (name: output) the graph at `graph` computes in onnxruntime, its weights read from the files
    it names."""
    assert all(p.is_file() for p in weights_files(graph)), f"{graph} names a weights file that is gone"
    got = run_onnx(graph, FEEDS)["y"]
    found = [name for name, want in wants.items() if np.allclose(got, want, atol=1e-6)]
    assert len(found) == 1, f"{graph} computes neither export's model"
    return found[0]


def test_a_folder_export_killed_at_any_step_leaves_one_export_whole_at_its_path(tmp_path):
    """Killed before each of its changes to the file system in turn (making the staging folder, writing the graph
    and its .data file, the swap, removing the earlier export), an export over an earlier folder export leaves at its
    path exactly one of the two, whole, computing its own model; the next export sweeps what the killed one left."""
    source = tiny_onnx(tmp_path / "src.onnx")
    old, new, later = (_scaled(source, s) for s in (1.0, 0.5, 0.25))
    wants = {name: run_onnx(m, FEEDS)["y"] for name, m in (("old", old), ("new", new))}
    assert wants["old"].any() and not np.allclose(wants["old"], wants["new"])
    seen, step = set(), 0
    while True:
        step += 1
        out = tmp_path / f"step{step}" / "pipe"
        out.parent.mkdir()
        write_atomically(out, "pipeline", _graph_folder(old), "tiny")
        killed = killed_at(step, partial(write_atomically, out, "pipeline", _graph_folder(new), "tiny"))
        assert out.is_dir(), f"killed before change {step}, no export is at {out}"
        assert {p.name for p in out.iterdir()} == {"model.onnx", "model.onnx.data", MARKER}
        seen.add(_computes(out / "model.onnx", wants))
        write_atomically(out, "pipeline", _graph_folder(later), "tiny")  # sweeps the killed export's leftovers
        assert [p.name for p in out.parent.iterdir()] == ["pipe"]
        if not killed:
            break
    assert seen == {"old", "new"} and step > 5  # kills landed before the swap and after it


def test_an_onnx_export_killed_at_any_step_leaves_its_graph_with_its_own_weights(tmp_path):
    """move_into_place (an ONNX or .omny export's last step) killed before each of its renames and removals in turn:
    the graph at `output` is the earlier one or the new one, beside the weights file it names, computing its model."""
    source = tiny_onnx(tmp_path / "src.onnx")
    old, new = _scaled(source, 1.0), _scaled(source, 0.5)
    wants = {name: run_onnx(m, FEEDS)["y"] for name, m in (("old", old), ("new", new))}
    seen, step = set(), 0
    while True:
        step += 1
        out = tmp_path / f"step{step}" / "model.onnx"
        out.parent.mkdir()
        move_into_place(_staged(old, out), out)
        staged = _staged(new, out)
        killed = killed_at(step, partial(move_into_place, staged, out))
        seen.add(_computes(out, wants))
        if not killed:
            break
    assert seen == {"old", "new"} and step > 2


def test_the_export_write_failpoint_kills_a_folder_export_before_its_swap(tmp_path):
    """ONN_FAILPOINT=export_write (the fault harness's point) kills a folder export with its new folder whole beside
    the earlier one: the earlier export is at its path, whole; the next export removes the staged folder."""
    source = tiny_onnx(tmp_path / "src.onnx")
    old, new = _scaled(source, 1.0), _scaled(source, 0.5)
    wants = {name: run_onnx(m, FEEDS)["y"] for name, m in (("old", old), ("new", new))}
    out = tmp_path / "exports" / "pipe"
    out.parent.mkdir()
    write_atomically(out, "pipeline", _graph_folder(old), "tiny")
    work = partial(write_atomically, out, "pipeline", _graph_folder(new), "tiny")
    assert killed_at(0, work, {"ONN_FAILPOINT": "export_write"})
    assert len(list(out.parent.iterdir())) == 2  # the new folder, staged beside the earlier one
    assert _computes(out / "model.onnx", wants) == "old"
    write_atomically(out, "pipeline", _graph_folder(new), "tiny")
    assert [p.name for p in out.parent.iterdir()] == ["pipe"] and _computes(out / "model.onnx", wants) == "new"


def _staged(model: onnx.ModelProto, output: Path) -> Path:
    """`model` saved as an export stages it, in a folder of its own: its graph beside its own .data file."""
    folder = Path(tempfile.mkdtemp(dir=output.parent.parent))
    staged = folder / staged_name(output)
    onnx.save_model(
        _copy(model), str(staged), save_as_external_data=True, location=staged.name + ".data", size_threshold=0
    )
    return staged


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` to save: onnx.save_model moves the weights of the model it saves out of it, into the file."""
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def test_a_refused_swap_changes_nothing_and_falls_back(tmp_path):
    """renameat2 refusing the swap (here: nothing at the other path; a sandbox answers EPERM) is False with both
    paths as they were, so swap_in's two renames run; it raised, failing an export the renames would have done."""
    from onn.export.folders import exchange

    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.onnx").write_bytes(b"new")
    assert exchange(staged, tmp_path / "missing") is False
    assert (staged / "model.onnx").read_bytes() == b"new" and not (tmp_path / "missing").exists()
