"""Export defects a review found, each held here: `~` in export.output, settings refused before training, the memory
of onnxruntime's Where, a folder of another model's export never replaced, each pipeline piece's own parameter count,
a write the disk does not permit, and `validate` of a pipeline exported with export=onnx."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.export.folders import MARKER, write_atomically

LIMITS = {"max_shard_size_mb": 2.0, "min_vram_mb": 8.0, "headroom_mb": 0.5}


class _TwoHeads(torch.nn.Module):
    """A piece that, as TrOCR's encoder and decoder pieces do, holds a whole model and reads a part of it."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        self.unused = torch.nn.Linear(8, 64)

    def forward(self, features):
        return {"hidden": features + self.used(features)}


def _onnx_settings(kind: str = "onnx"):
    return compose(f"export={kind}").export


# -- 1. `~` in export.output ------------------------------------------------------------------------------------------
def test_a_tilde_in_export_output_is_the_home_folder_when_the_model_is_written(tmp_path, monkeypatch):
    """A recipe's `export.output: ~/exports/model.onnx` passed the check before training (it expands ~) and was
    refused after it ("the folder ~/exports does not exist"): export_for_run and export_model expand it too, for a
    file (onnx) and a folder (safetensors) alike."""
    from onn.export.write import export_for_run

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "exports").mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    config = compose("export=onnx", "export.output='~/exports/model.onnx'")
    export_for_run(config, model, tmp_path / "run", {"input": torch.randn(2, 4)})
    assert (tmp_path / "exports" / "model.onnx").is_file()

    config = compose("export=safetensors", "export.output='~/hfout'")
    metrics = export_for_run(config, tiny_llama(), tmp_path / "run")
    assert metrics["export/folder"] == str(tmp_path / "hfout")
    assert (tmp_path / "hfout" / "model.safetensors").is_file() and (tmp_path / "hfout" / MARKER).is_file()
    assert not (Path.cwd() / "~").exists()


# -- 2. export settings refused before training ----------------------------------------------------------------------
def test_export_settings_a_run_can_check_first_are_refused_before_training(tmp_path):
    """An onnx export.output that is no .onnx file, a shard size transformers cannot read and a folder of the user's
    own where a LoRA model's adapter goes were each refused only after training: check_settings refuses them first."""
    from dataclasses import replace

    from onn.app import execute
    from onn.export.settings import check_settings

    with pytest.raises(UserError, match=r"export.output .*/model.bin: an ONNX export is a .onnx file; .*model.onnx"):
        check_settings(compose("export=onnx", f"export.output={tmp_path / 'model.bin'}").export)
    check_settings(compose("export=onnx", f"export.output={tmp_path / 'model.onnx'}").export)
    check_settings(compose("export=onnx", f"export.output={tmp_path / 'towers'}").export)  # a dual encoder's folder

    safetensors = compose("export=safetensors").export
    with pytest.raises(UserError, match=r"export.max_shard_size='500XB': give bytes or a size like 2GB"):
        check_settings(replace(safetensors, max_shard_size="500XB"))
    theirs = tmp_path / "mymodel-adapter"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    mine = replace(safetensors, output=str(tmp_path / "mymodel"))
    with pytest.raises(UserError, match=rf"a LoRA model's adapter goes beside it to {theirs}, which exists and is not"):
        check_settings(mine)
    check_settings(replace(mine, adapter=False))  # no adapter written: the folder is not in the way
    assert (theirs / "notes.txt").read_text() == "mine"

    run = ["model=llama_tiny", "trainer.max_steps=2", "tracking=none", "hardware=cpu_16gb", f"paths.outputs={tmp_path}"]
    with pytest.raises(UserError, match=r"export.max_shard_size='500XB'"):
        execute(compose(*run, "export=safetensors", "export.max_shard_size=500XB"), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before a step was trained


# -- 3. onnxruntime's Where in the activation figures ----------------------------------------------------------------
def test_the_activation_peak_holds_what_onnxruntime_holds_for_where(tmp_path):
    """torch.onnx writes a Llama attention's softmax as IsNaN -> Where on [batch, heads, seq, seq]; onnxruntime's
    CPU Where holds two more buffers of its output's size while it runs. Measured as recipe=bench_omny measures a
    shard (a fresh process, peak resident memory above the runtime's own context), the estimate is within 10%."""
    from onnx import TensorProto
    from onnx import helper as h

    from onn.export import graph as G
    from onn.export.pipelines.measure import _run_alone

    shape = [1, 8, 512, 512]
    nodes = [h.make_node("IsNaN", ["x"], ["nan"]), h.make_node("Where", ["nan", "zero", "x"], ["y"])]
    graph = h.make_graph(
        nodes,
        "softmax_guard",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [h.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    model = onnx.shape_inference.infer_shapes(
        h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)
    )
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    sizes = G.concrete_shapes(model, {"x": shape}, {})
    estimate = G.activation_peak(G.Graph(model), [0, 1], {"x"}, {"y"}, sizes) - x.nbytes  # beyond the input
    onnx.save_model(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "m.npz", x=x)
    measured = _run_alone(tmp_path / "m.onnx", tmp_path / "m.npz") * 2**20  # the input is fed before the baseline
    assert abs(estimate / measured - 1) < 0.1, (estimate / 2**20, measured / 2**20)


@pytest.mark.slow  # (about a minute: a decoder exported, validated and each shard run alone)
def test_bench_omny_measures_a_decoder_lm_within_its_estimate(tmp_path):
    """recipe=bench_omny measures a decoder LM too (one .omny, no pipeline): at a sequence of 512, where attention's
    [heads, seq, seq] tensors make a block's peak, every shard's measured peak is within 20% of its estimate (without
    onnxruntime's Where it was about twice the estimate)."""
    from onn.app import execute

    config = compose(
        "task=bench_omny",
        "export=omny",
        "model=llama_tiny",
        "model.architecture.num_hidden_layers=2",
        "model.architecture.num_attention_heads=16",
        "model.architecture.num_key_value_heads=4",
        "export.reference_sequence_length=512",
        "tracking=none",
        "hardware=cpu_16gb",
        f"paths.outputs={tmp_path}",
    )
    metrics = execute(config, tmp_path / "run")
    ratios = metrics["omny/llama_tiny/measured_over_estimate"]
    assert ratios and all(0.85 < r < 1.2 for r in ratios), ratios
    assert metrics["omny/llama_tiny/valid"] is True
    assert "llama_tiny" in (tmp_path / "run" / "bench_omny.md").read_text()


# -- 4. another model's export is never replaced ---------------------------------------------------------------------
def test_an_export_never_replaces_another_kind_or_models_export(tmp_path):
    """onn_export.json names the export's kind and model; a folder holding another's is refused before anything is
    written, whoever writes (a Hugging Face folder, a pipeline), and a typo in export.output loses nothing."""
    from onn.export.hf import save_folder
    from onn.export.pipelines import export_pipeline
    from onn.export.pipelines.registry import Piece, Pipeline
    from onn.export.settings import check_settings

    def tree(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    hf = tmp_path / "hf"
    save_folder(tiny_llama(), None, hf, model_name="llama_small")
    assert json.loads((hf / MARKER).read_text())["model"] == "llama_small"
    before = tree(hf)
    with pytest.raises(UserError, match=rf"export output {hf} holds a hf export of llama_small, not this hf export of"):
        save_folder(tiny_llama(), None, hf, model_name="phi4_tiny")
    piece = Piece("piece0", _TwoHeads().eval(), {"features": torch.randn(2, 8)})
    pipeline = Pipeline("blocks", "_TwoHeads", lambda *m, side=None: [piece], [], lambda *a: {})
    settings = _onnx_settings("omny")
    with pytest.raises(UserError, match=rf"{hf} holds a hf export of llama_small, not this pipeline export of trocr"):
        export_pipeline(pipeline, [piece.module], hf, settings, LIMITS, "trocr_mini")
    with pytest.raises(UserError, match=rf"export.output {hf} holds a hf export, which an omny export would replace"):
        check_settings(compose("export=omny", f"export.output={hf}").export)  # and so before training
    assert tree(hf) == before
    save_folder(tiny_llama(), None, hf, model_name="llama_small")  # the same model's: replaced

    write_atomically(tmp_path / "old", "hf", lambda folder: None)
    (tmp_path / "old" / MARKER).write_text(json.dumps({"written_by": "onn", "kind": "hf"}))  # before `model`
    with pytest.raises(UserError, match="holds a hf export, not this pipeline export of trocr_mini"):
        export_pipeline(pipeline, [piece.module], tmp_path / "old", settings, LIMITS, "trocr_mini")
    save_folder(tiny_llama(), None, tmp_path / "old", model_name="llama_small")  # a marker without a model: taken


# -- 5. a pipeline piece's parameters ---------------------------------------------------------------------------------
def test_a_pipeline_piece_counts_the_parameters_it_reads(tmp_path):
    """A piece that holds a whole model (TrOCR's encoder and decoder both wrap it) said the whole model's count in
    source_model.parameters: it is what the piece reads, a part of the whole model it holds."""
    from onn.export.omny.format import read_document
    from onn.export.pipelines import export as piece_export
    from onn.export.pipelines.registry import Piece

    module = _TwoHeads().eval()
    # [batch, tokens, width]: torch.onnx folds each linear's transposed weight into an initializer of its own name
    piece = Piece("piece0", module, {"features": torch.randn(2, 3, 8)})
    path, _, _ = piece_export.export_piece(
        piece, tmp_path, _onnx_settings("omny"), LIMITS, piece_export._source(piece, "two_heads")
    )
    source = read_document(path)["source_model"]
    assert source["parameters"] == sum(p.numel() for p in module.used.parameters()) == 144
    assert source["name"] == "two_heads/piece0"


# -- 6. a write the disk does not permit -----------------------------------------------------------------------------
def test_a_write_refused_as_not_permitted_is_one_sentence(tmp_path):
    """EPERM (an immutable folder: chattr +i) was a raw PermissionError traceback; it is one sentence naming the
    export, as a full or read-only disk is."""
    from onn.export.write import export_model, refused_write

    said = refused_write(PermissionError(errno.EPERM, "Operation not permitted"), tmp_path / "model.onnx")
    assert isinstance(said, UserError) and "the operation is not permitted" in str(said)

    locked = tmp_path / "locked"
    locked.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(locked)]).returncode != 0:
        pytest.skip("chattr +i needs root on a file system that has it")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        with pytest.raises(UserError, match=rf"cannot write {locked}/model.onnx: the operation is not permitted"):
            export_model(model, locked / "model.onnx", {"input": torch.randn(2, 4)}, _onnx_settings())
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert list(locked.iterdir()) == []


# -- minor: validate of a pipeline exported with export=onnx --------------------------------------------------------
def test_validate_says_what_it_checks_of_a_pipeline_exported_as_onnx(tmp_path, monkeypatch):
    """A pipeline exported with export=onnx (plain .onnx pieces) runs; `validate pipeline.json` refused it for the
    .omny metadata its pieces have none of: it checks what it can (connections, signatures, onnx.checker)."""
    from onn.export.omny.cli import main
    from onn.export.pipelines import PIPELINES, export_pipeline
    from onn.export.pipelines.registry import Piece, Pipeline

    piece = Piece("piece0", _TwoHeads().eval(), {"features": torch.randn(2, 8)})
    pieces, settings = (lambda *m, side=None: [piece]), (lambda *m, side=None: {})
    pipeline = Pipeline("two_heads", "_TwoHeads", pieces, [], lambda *a: {}, settings, names=("piece0",))
    monkeypatch.setitem(PIPELINES, "two_heads", pipeline)
    monkeypatch.setattr("onn.export.pipelines.export.export_processes", lambda pieces: 1)
    folder = tmp_path / "pipe"
    export_pipeline(pipeline, [piece.module], folder, _onnx_settings(), LIMITS, "two_heads")
    assert (folder / "piece0.onnx").is_file()
    assert main(["validate", str(folder / "pipeline.json")]) == 0
    with tempfile.TemporaryDirectory(dir=tmp_path) as broken:  # a piece that fails onnx.checker is still refused
        shutil.copytree(folder, Path(broken) / "pipe")
        model = onnx.load(str(Path(broken) / "pipe" / "piece0.onnx"))
        model.graph.node[0].input[0] = "nowhere"
        onnx.save_model(model, str(Path(broken) / "pipe" / "piece0.onnx"))
        assert main(["validate", str(Path(broken) / "pipe" / "pipeline.json")]) != 0
