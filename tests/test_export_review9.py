"""Export review 9: a re-export stopped between its renames leaves the earlier graph beside its own weights (each
export's weights file has a name of its own), `inspect` reads a .omny whose weights file is gone, `output_names`
runs the model where it is, a checkout used without `pip install -e` exports, and an export path that is a folder
is refused before the trace."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import ROOT, tiny_llama
from hostile_corpus import tiny_onnx

from onn.errors import UserError
from onn.export import folders, omny, onnx_export
from onn.export.omny import cli as omny_cli
from onn.export.omny import format as omny_format
from onn.export.onnx_export import export_onnx, output_names, run_onnx

SAMPLE = {"x": torch.linspace(-1, 1, 16).reshape(2, 8)}


def mlp(seed: int) -> torch.nn.Module:
    """A two-layer MLP whose weights differ with `seed` (its shapes do not: one export's graph loads another's)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def weights_files(folder: Path, output: Path) -> list[str]:
    """The weights files `output`'s graph names (ONNX external data's `location`), each there beside it."""
    named = onnx_export.weights_files(output)
    assert all(path.parent == folder and path.is_file() for path in named)
    return [path.name for path in named]


def killed_at_export_write(code: str) -> None:
    """Run `code` in a Python of its own with ONN_FAILPOINT=export_write: it must die there, as a machine would."""
    env = {**os.environ, "ONN_FAILPOINT": "export_write", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


@pytest.mark.slow  # the killed process's first export: 20-40 s on a busy machine
def test_an_onnx_reexport_killed_between_its_renames_leaves_the_earlier_pair(tmp_path, monkeypatch):
    """The weights file was NAME.data for every export and was moved into place before the graph: killed between
    the two renames, the earlier graph read the new weights and computed garbage. Each export's weights file now has
    a name of its own, the graph is renamed last, and the earlier weights go only after it."""
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)  # a tiny model's weights beside it, as a large one's
    out = tmp_path / "mlp.onnx"
    export_onnx(mlp(0), out, SAMPLE)
    first = weights_files(tmp_path, out)
    assert len(first) == 1 and first[0] != "mlp.onnx.data"
    want = {seed: mlp(seed)(SAMPLE["x"]).detach().numpy() for seed in (0, 1)}

    killed_at_export_write(
        "from onn.export import onnx_export; from test_export_review9 import SAMPLE, mlp; "
        f"onnx_export.EXTERNAL_DATA_BYTES = 0; onnx_export.export_onnx(mlp(1), {str(out)!r}, SAMPLE)"
    )
    np.testing.assert_allclose(run_onnx(out, SAMPLE)["output"], want[0], atol=1e-5)  # the earlier pair, whole
    assert weights_files(tmp_path, out) == first
    # the stopped export's weights stay until the next export: the graph names none of them, but only the next
    # export knows their process has ended (an export writing the same path at this moment keeps its own)
    stopped = sorted(set(visible(tmp_path)) - {"mlp.onnx", *first})
    assert len(stopped) == 1

    export_onnx(mlp(1), out, SAMPLE)  # the next export takes its place; the replaced and the stopped weights go
    np.testing.assert_allclose(run_onnx(out, SAMPLE)["output"], want[1], atol=1e-5)
    assert visible(tmp_path) == sorted(["mlp.onnx", *weights_files(tmp_path, out)])

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 2**40)  # a small export over a large one: no weights file
    export_onnx(mlp(0), out, SAMPLE)
    assert visible(tmp_path) == ["mlp.onnx"]


def visible(folder: Path) -> list[str]:
    """The files in `folder` but the temporary folder a killed export leaves (hidden, as every export's is)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def negated(src: Path) -> Path:
    """tiny_onnx with every weight negated: the same graph, other results."""
    model = onnx.load(str(src))
    for tensor in model.graph.initializer:
        values = onnx.numpy_helper.to_array(tensor)
        tensor.CopyFrom(onnx.numpy_helper.from_array(-values, tensor.name))
    out = src.with_name("negated.onnx")
    onnx.save(model, str(out))
    return out


def test_an_omny_rewrite_killed_between_its_renames_leaves_the_earlier_pair(tmp_path, monkeypatch):
    """omny.write had the same order (NAME.omny.data first, the .omny after it)."""
    monkeypatch.setattr(omny_format, "EXTERNAL_DATA_BYTES", 0)
    src = tiny_onnx(tmp_path / "src" / "tiny.onnx") if (tmp_path / "src").mkdir() is None else None
    out, feeds = tmp_path / "tiny.omny", {"x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)}
    omny.enrich_onnx(src, out)
    first = weights_files(tmp_path, out)
    want = run_onnx(src, feeds)["y"]

    killed_at_export_write(
        "from onn.export.omny import format; "
        f"format.EXTERNAL_DATA_BYTES = 0; format.enrich_onnx({str(negated(src))!r}, {str(out)!r})"
    )
    np.testing.assert_allclose(run_onnx(out, feeds)["y"], want, atol=1e-6)
    assert weights_files(tmp_path, out) == first and omny.validate(out, echo=lambda *_: None)


def test_inspect_reads_the_document_of_an_omny_whose_weights_file_is_missing(tmp_path, monkeypatch, capsys):
    """inspect prints the document alone, yet refused the file because onnx.checker found no weights file;
    validate, which runs the weights, still refuses it in one sentence."""
    monkeypatch.setattr(omny_format, "EXTERNAL_DATA_BYTES", 0)
    out = omny.enrich_onnx(tiny_onnx(tmp_path / "tiny.onnx"), tmp_path / "tiny.omny")
    (tmp_path / weights_files(tmp_path, out)[0]).unlink()
    capsys.readouterr()
    assert omny_cli.main(["inspect", str(out)]) == 0
    assert "blocks (4)" in capsys.readouterr().out
    assert omny_cli.main(["validate", str(out)]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: ONNX file {out} fails onnx.checker") and said.count("\n") == 1

    garbage = tmp_path / "garbage.omny"
    garbage.write_bytes(b"not a protobuf")
    assert omny_cli.main(["inspect", str(garbage)]) == 2
    assert f"error: {garbage} is not a readable ONNX file" in capsys.readouterr().err


def test_output_names_runs_the_model_where_it_is():
    """output_names fed a CPU sample to the model wherever it was: a model on a GPU, or one built on the meta device
    (to be planned without its weights), failed on it."""
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    assert output_names(cnn) == output_names(cnn.to("meta")) == ["output"]
    if torch.cuda.is_available():
        assert output_names(tiny_llama().to("cuda")) == ["logits"]


def test_a_checkout_used_without_pip_install_exports(tmp_path, monkeypatch):
    """The .omny exporter asked importlib.metadata for onn's version with no fallback: a checkout on PYTHONPATH,
    never pip-installed, could not write a .omny. The version is "unknown" there, as onn_export.json says."""
    installed = importlib.metadata.version

    def without_onn(name: str) -> str:
        if name == "onn":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "version", without_onn)
    out = omny.enrich_onnx(tiny_onnx(tmp_path / "tiny.onnx"), tmp_path / "tiny.omny")
    assert omny.read_document(out)["exporter"]["version"] == "unknown" == folders.onn_version()


def test_an_onnx_path_that_is_a_folder_is_refused_before_the_trace(tmp_path):
    """export_onnx to a folder named like a file traced and checked the model, then failed in the rename with
    IsADirectoryError; it is one sentence now, and the folder is left as it was."""
    folder = tmp_path / "mlp.onnx"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"mlp.onnx is a folder; name the .onnx file to write"):
        export_onnx(mlp(0), folder, SAMPLE)
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.onnx"] and (folder / "notes.txt").read_text() == "mine"
