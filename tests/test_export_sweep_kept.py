"""A graph the user kept beside an ONNX export (`mv model.onnx deploy.onnx`) still reads the weights file staged_name
gave it (model.onnx.PID-HEX.data, its exporting process long ended): the next export to model.onnx sweeps a killed
export's weights (onnx_export.sweep_weights) but never a file some graph in the folder names."""

from __future__ import annotations

import os
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_corpus import tiny_onnx
from kill_harness import killed_at
from test_export_round94 import FEEDS, _scaled, _staged

from onn.export.onnx_export import move_into_place, run_onnx, weights_files


def _export(model: onnx.ModelProto, output: Path) -> None:
    """An ONNX export's last steps: `model` staged (its weights file named by this process), moved into place."""
    move_into_place(_staged(model, output), output)


@pytest.mark.parametrize("kept_as", ["deploy.onnx", "deploy.omny"])
def test_a_kept_graph_keeps_its_weights_while_a_killed_exports_go(tmp_path, kept_as):
    """v1, exported by a process that has ended, is kept under another name; a dead process's weights file no graph
    names lies beside it. Exporting v2 to model.onnx removes that file only: the kept graph still loads in
    onnxruntime and computes v1, the new one computes v2."""
    source, out = tiny_onnx(tmp_path / "src.onnx"), tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    v1, v2 = _scaled(source, 1.0), _scaled(source, 0.5)
    assert not killed_at(0, partial(_export, v1, out))  # by a child process, which then ends
    kept = out.rename(out.parent / kept_as)
    (kept_weights,) = weights_files(kept)
    ended = subprocess.Popen(["true"])
    ended.wait()
    killed = out.parent / f"model.onnx.{ended.pid}-0123456789ab.data"  # a killed export's: no graph names it
    killed.write_bytes(b"\0" * 64)

    _export(v2, out)

    (new_weights,) = weights_files(out)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        [kept.name, kept_weights.name, out.name, new_weights.name]
    )
    np.testing.assert_allclose(run_onnx(kept, FEEDS)["y"], run_onnx(v1, FEEDS)["y"], atol=1e-6)
    np.testing.assert_allclose(run_onnx(out, FEEDS)["y"], run_onnx(v2, FEEDS)["y"], atol=1e-6)
    assert not np.allclose(run_onnx(v1, FEEDS)["y"], run_onnx(v2, FEEDS)["y"])
    assert not os.path.lexists(killed)
