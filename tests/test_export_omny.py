""".omny: cut points at block boundaries (and in both towers of CLIP), per-block memory, shard plans,
and `validate`, which cuts the model at every plan's boundaries and runs the shards in onnxruntime."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ROOT, run_cli
from onnx import TensorProto, helper

from onn.errors import UserError
from onn.export import omny
from onn.export.omny import cli as omny_cli

SMALL = {
    "max_shard_size_mb": 0.05,
    "min_vram_mb": 2.0,
    "headroom_mb": 0.5,
}  # so tiny models need several shards


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """test_export_onnx's 2-layer Llama (traced once per session), as a .omny with a node plan."""
    from test_export_onnx import export_once

    from onn.export.model_facts import kv_cache_bytes
    from onn.models.layers import block_runs

    _, model, sample, path, metrics = export_once("llama", tmp_path_factory)
    graph = onnx.load(str(path))
    settings = {**SMALL, "nodes": [2.5, 2.0, 3.0]}
    doc = omny.describe(graph, sample, settings, runs=block_runs(model), kv_cache_bytes=kv_cache_bytes(model))
    return omny.write(graph, doc, tmp_path_factory.mktemp("omny") / "llama.omny"), metrics


def test_decoder_cut_points_sit_at_block_boundaries_and_every_plan_validates(llama):
    path, metrics = llama
    assert metrics["export/max_abs_diff"] <= 1e-4
    doc = omny.read_document(path)
    names = [b["name"] for b in doc["blocks"]]
    assert names[1:3] == ["model.layers.0", "model.layers.1"]
    assert [b["role"] for b in doc["blocks"]] == ["prefix", "block", "block", "suffix"]
    # every cut point is a [batch, sequence, hidden] hidden state: 32 floats per token
    assert all(c["shape"] == ["batch", "sequence", 32] and c["bytes_per_token"] == 128 for c in doc["cut_points"])
    # KV cache per token of a decoder block: keys + values of 2 KV heads of 8 floats
    assert [b["kv_cache_bytes_per_token"] for b in doc["blocks"][1:3]] == [2 * 2 * 8 * 4] * 2
    blocks = doc["blocks"]
    # q, o (32x32), k, v (32x16), gate, up, down (32x64), plus the constants the block stores
    matrices = 4 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64)
    assert matrices <= blocks[1]["weight_bytes"] <= matrices + 4096
    assert blocks[1]["activation_bytes_per_sample"] > 4 * 128 * 128  # at least one attention score map
    plans = doc["shard_plans"]
    assert plans["allowed_counts"] and plans["allowed_counts"][0] > 1  # SMALL limits force a split
    for conf in plans["configurations"]:
        ranges = conf["ranges"]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(blocks)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(d["weight_bytes"] <= 0.05 * 2**20 and d["total_mb"] <= 2.0 for d in conf["detail"])
    assert doc["node_plan"]["method"] in ("largest_remainder", "capacity")
    assert len(doc["node_plan"]["ranges"]) == 3
    text = omny.inspect_omny(path).summary()
    for needle in ("cut point", "model.layers.1", "add_", "/token", "shard plans", "node plan"):
        assert needle in text
    lines = []
    assert omny.validate(path, echo=lines.append)
    assert f"{path}: valid" in lines[-1]
    assert sum("max abs diff against the whole model" in line for line in lines) == len(plans["configurations"]) + 1


def test_validate_catches_a_document_that_lies(llama, tmp_path):
    path, _ = llama
    model = onnx.load(str(path))
    doc = omny.read_document(model)
    doc["shard_plans"]["configurations"][0]["detail"][0]["weight_bytes"] += 4096
    bad = tmp_path / "lying.omny"
    omny.write(model, doc, bad)
    lines = []
    assert not omny.validate(bad, echo=lines.append)
    assert any("weights differ from the document" in line for line in lines)
    assert lines[-1].endswith("INVALID")


def test_cli_inspect_and_validate(llama):
    import subprocess
    import sys

    path, _ = llama
    shown = subprocess.run(
        [sys.executable, "-m", "onn.export.omny", "inspect", str(path)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "model.layers.1" in shown.stdout and "KV/token" in shown.stdout and "node plan" in shown.stdout
    checked = subprocess.run(
        [sys.executable, "-m", "onn.export.omny", "validate", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "onn.export.omny", "validate", str(path) + ".nope"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# --- an ONNX file not made by ONN ---------------------------------------------------------------------


def _foreign_mlp(path: Path, layers: int = 4, width: int = 32) -> Path:
    """x -> [MatMul, Add, Relu] x layers, with a residual connection inside each layer, built by hand."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        w = helper.make_tensor(
            f"w{i}",
            TensorProto.FLOAT,
            [width, width],
            rng.standard_normal((width, width)).astype(np.float32).ravel() / 8,
        )
        b = helper.make_tensor(f"b{i}", TensorProto.FLOAT, [width], rng.standard_normal(width).astype(np.float32))
        inits += [w, b]
        nodes += [
            helper.make_node("MatMul", [h, f"w{i}"], [f"mm{i}"]),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"lin{i}"]),
            helper.make_node("Relu", [f"lin{i}"], [f"act{i}"]),
            helper.make_node("Add", [h, f"act{i}"], [f"h{i}"]),  # residual: only h{i} crosses alone
        ]
        h = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10  # onnxruntime 1.31 reads IR versions up to 11; onnx 1.23 writes 14 by default
    onnx.save(model, str(path))
    return path


def test_enrich_onnx_finds_cut_points_in_a_foreign_graph(tmp_path):
    from onn.export.graph import Graph, cut_points

    src = _foreign_mlp(tmp_path / "mlp.onnx")
    cuts, _, _ = cut_points(Graph(onnx.load(str(src))))
    # inside layers 1-3 the residual input is still alive, so nothing there crosses alone; layer 0's
    # residual is the model input, which every shard has, so its inner tensors are cuts too
    assert [c for c in cuts if c.startswith("h")] == ["h0", "h1", "h2"]
    assert [c for c in cuts if not c.startswith("h")] == ["mm0", "lin0", "act0"]
    sample = {"x": np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)}
    out = omny.enrich_onnx(
        src, tmp_path / "mlp.omny", sample, {"max_shard_size_mb": 0.005, "min_vram_mb": 1, "headroom_mb": 0}
    )
    doc = omny.read_document(out)
    assert doc["source_model"]["framework"] == "onnx"
    assert [c["name"] for c in doc["cut_points"]] == ["h0", "h1", "h2"]
    assert [b["weight_bytes"] for b in doc["blocks"]] == [32 * 32 * 4 + 32 * 4] * 4
    assert doc["inputs"][0]["sample"]["shape"] == [3, 32]
    assert omny.validate(out, echo=lambda *_: None)


def test_a_small_omny_written_over_a_large_one_leaves_no_weights_file_of_the_old_one(tmp_path):
    """A .omny above 1.75 GiB keeps its weights in a file beside it that its graph names (NAME.omny.data before
    exports named their own); a smaller export to the same name stores them inside, and the weights file the
    replaced graph named (which nothing reads any more) goes with it."""
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)
    stale = tmp_path / "mlp.omny.data"
    earlier = onnx.load(str(src))  # what the earlier, larger export left: a graph naming its weights file
    for tensor in earlier.graph.initializer:  # as raw bytes, which ONNX's external data holds
        tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor), tensor.name))
    onnx.save_model(
        earlier, str(tmp_path / "mlp.omny"), save_as_external_data=True, location=stale.name, size_threshold=0
    )
    assert stale.exists()
    sample = {"x": np.zeros((3, 32), dtype=np.float32)}
    out = omny.enrich_onnx(src, tmp_path / "mlp.omny", sample)
    assert not stale.exists() and omny.validate(out, echo=lambda *_: None)


def test_enrich_command_folds_computed_weights_into_the_folded_files_blocks(tmp_path, monkeypatch, capsys):
    """onnx's light_* models build their weights with ConstantOfShape: enrich folds them first (issue 14,
    item 5) and finds the blocks it finds on the file onnxruntime folded; the sample comes from the graph."""
    import onnxruntime as ort
    from hostile_corpus import tiny_onnx

    computed = tiny_onnx(tmp_path / "computed.onnx", weights="constantofshape")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # constant folding
    options.optimized_model_filepath = str(tmp_path / "folded.onnx")
    ort.InferenceSession(str(computed), options, providers=["CPUExecutionProvider"])
    assert "ConstantOfShape" not in {n.op_type for n in onnx.load(str(tmp_path / "folded.onnx")).graph.node}
    monkeypatch.chdir(tmp_path)
    for name in ("computed", "folded"):
        assert omny_cli.main(["enrich", f"{name}.onnx", f"{name}.omny", "--dim", "batch=2"]) == 0
    printed = capsys.readouterr().out
    assert "folded 4 node(s)" in printed and "blocks (4)" in printed
    ours, theirs = (omny.read_document(tmp_path / f"{n}.omny") for n in ("computed", "folded"))
    blocks = [[(b["weight_bytes"], b["cut_after"]) for b in doc["blocks"]] for doc in (ours, theirs)]
    assert blocks[0] == blocks[1] == [(1024, "r0"), (1024, "r1"), (1024, "r2"), (1024, None)]
    assert ours["inputs"][0]["sample"]["shape"] == [2, 16]
    assert omny.validate(tmp_path / "computed.omny", echo=lambda *_: None)
    assert not list(tmp_path.glob("sym_shape_infer_temp*"))


def test_onnx_shipped_light_models_get_their_blocks_and_leave_no_temp_file(tmp_path, monkeypatch):
    """onnx's own light_squeezenet (weights from ConstantOfShape): 18 blocks that validate, where it gave 1; and
    onnxruntime's incomplete symbolic shape inference of the unfolded graph leaves no file in the working folder."""
    light = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"
    if not light.is_file():
        pytest.skip("this onnx has no light_* test models")
    from onn.export.graph import concrete_shapes

    monkeypatch.chdir(tmp_path)
    # onnxruntime's inference stops short on this graph: it used to save a temp file here
    concrete_shapes(onnx.load(str(light)), {"data_0": [1, 3, 224, 224]})
    out = omny.enrich_onnx(light, tmp_path / "squeezenet.omny")
    doc = omny.read_document(out)
    assert len(doc["blocks"]) == 18 and sum(b["weight_bytes"] for b in doc["blocks"]) > 4_900_000  # 1.2M fp32
    assert omny.validate(out, echo=lambda *_: None)
    assert not list(tmp_path.glob("sym_shape_infer_temp*"))


# --- bad input --------------------------------------------------------------------------------------


def test_bad_inputs_fail_in_one_clear_sentence(tmp_path):
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)
    sample = {"x": np.zeros((2, 32), np.float32)}
    with pytest.raises(UserError, match=r"sample input 'x' has shape \[2, 16\], but the graph expects \['batch', 32\]"):
        omny.enrich_onnx(src, tmp_path / "a.omny", {"x": np.zeros((2, 16), np.float32)})
    with pytest.raises(UserError, match="do not match the graph's inputs"):
        omny.enrich_onnx(src, tmp_path / "a.omny", {"y": np.zeros((2, 32), np.float32)})
    with pytest.raises(UserError, match="does not exist"):
        omny.enrich_onnx(src, tmp_path / "no" / "such" / "a.omny", sample)
    with pytest.raises(UserError, match=r"block 0 .* too big"):
        omny.enrich_onnx(src, tmp_path / "a.omny", sample, {"max_shard_size_mb": 0.001})
    assert not (tmp_path / "a.omny").exists()

    broken = onnx.load(str(src))
    broken.graph.node[0].input[0] = "undefined_tensor"
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    with pytest.raises(UserError, match="broken.onnx"):
        omny.enrich_onnx(tmp_path / "broken.onnx", tmp_path / "b.omny", sample)

    with pytest.raises(UserError, match="no .omny metadata"):
        omny.read_document(src)
    good = omny.enrich_onnx(src, tmp_path / "good.omny", sample)
    for label, text, message in [
        ("corrupt", "{not json", "not valid JSON"),
        (
            "newer",
            json.dumps({**omny.read_document(good), "format_version": "2.0"}),
            "newer than this ONN reads",
        ),
        (
            "incomplete",
            json.dumps({k: v for k, v in omny.read_document(good).items() if k != "blocks"}),
            "'blocks' is a required property",
        ),
    ]:
        model = onnx.load(str(good))
        helper.set_model_props(model, {omny.METADATA_KEY: text})
        onnx.save(model, str(tmp_path / f"{label}.omny"))
        with pytest.raises(UserError, match=message):
            omny.read_document(tmp_path / f"{label}.omny")
    assert omny.validate(good, echo=lambda *_: None)  # the earlier, good file is untouched


def test_format_spec_holds_the_schema_the_code_validates_against():
    spec = (ROOT / "FORMAT_SPEC.md").read_text()
    block = re.search(r"## JSON Schema\s+```json\n(.*?)```", spec, re.S)
    assert block, "FORMAT_SPEC.md has no JSON Schema block"
    assert json.loads(block.group(1)) == omny.schema()
    fields = set(omny.schema()["properties"]) | set(omny.schema()["$defs"]["block"]["properties"])
    for field in fields:
        assert f"`{field}`" in spec, f"FORMAT_SPEC.md does not describe {field}"


@pytest.mark.slow  # ~25 s of runs through the app: the fast suite stays under 10 minutes on 2 cores
def test_task_export_through_the_app(outputs):
    """`python run.py task=export export=omny ...`, in-process: the app plans, builds the model,
    exports and returns the export/* metrics; without a format it stops in one sentence."""
    from conftest import compose

    from onn.app import execute

    args = [
        "task=export",
        "model=llama_tiny",
        "model.architecture.num_hidden_layers=2",
        f"paths.outputs={outputs}",
    ]
    config = compose(*args, "export=omny", "export.sample.sequence_length=8", "export.max_shard_size_mb=0.3")
    run_dir = outputs / "export_run"
    run_dir.mkdir(parents=True)
    metrics = execute(config, run_dir)
    assert metrics["export/max_abs_diff"] <= 1e-4
    assert metrics["export/blocks"] == 4 and metrics["export/cut_points"] == 3  # embeddings | 2 layers | head
    assert max(metrics["export/shard_counts"]) > 1
    assert omny.validate(run_dir / "export" / "model.omny", echo=lambda *_: None)

    with pytest.raises(
        UserError, match=r"task=export needs a format: export=safetensors, export=onnx or export=omny\."
    ):
        execute(compose(*args, "export=none"), run_dir)


def _graph(path: Path, nodes, inits, outputs, inputs=(("x", ["batch", 8]),)) -> Path:
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
            inits,
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 10
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))
    return path


def test_awkward_graphs_still_split_where_the_document_says(tmp_path):
    """A scalar Constant is free (not a weight), a free graph output is recomputed by the last
    shard, a dead weight-reading node is stored nowhere, and interleaved branches leave no block
    without a weight."""
    rng = np.random.default_rng(0)

    def w(name, shape=(8, 8)):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())

    nodes = [
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Mul", ["x", "two"], ["scaled"]),  # free: read by both layers below
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Add", ["h0", "scaled"], ["a0"]),
        helper.make_node("MatMul", ["a0", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "scaled"], ["a1"]),
        helper.make_node("MatMul", ["a1", "w2"], ["y"]),
        helper.make_node("MatMul", ["x", "unused_w"], ["dead"]),  # nothing reads it
        helper.make_node("Neg", ["x"], ["negated"]),  # a free graph output
    ]
    src = _graph(tmp_path / "g.onnx", nodes, [w("w0"), w("w1"), w("w2"), w("unused_w")], ["y", "negated"])
    sample = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    out = omny.enrich_onnx(
        src, tmp_path / "g.omny", sample, {"max_shard_size_mb": 0.0006, "min_vram_mb": 1, "headroom_mb": 0}
    )
    doc = omny.read_document(out)
    assert [c["name"] for c in doc["cut_points"]] == ["a0", "a1"]
    assert all(b["weight_bytes"] >= 8 * 8 * 4 for b in doc["blocks"])
    assert sum(b["weight_bytes"] for b in doc["blocks"]) < 4 * 8 * 8 * 4  # the dead node's weight is nowhere
    assert omny.validate(out, echo=lambda *_: None)

    # two branches interleaved in graph order: every block still holds a weight
    branches = [
        helper.make_node("MatMul", ["x", "wa"], ["p1"]), helper.make_node("MatMul", ["x", "wb"], ["q1"]),
        helper.make_node("Relu", ["p1"], ["p2"]), helper.make_node("Relu", ["q1"], ["q2"]),
        helper.make_node("Neg", ["p2"], ["p3"]), helper.make_node("MatMul", ["q2", "wd"], ["q3"]),
        helper.make_node("MatMul", ["p3", "wc"], ["p4"]), helper.make_node("Add", ["p4", "q3"], ["y"]),
    ]  # fmt: skip
    src = _graph(tmp_path / "b.onnx", branches, [w("wa"), w("wb"), w("wc"), w("wd")], ["y"])
    out = omny.enrich_onnx(
        src, tmp_path / "b.omny", sample, {"max_shard_size_mb": 0.0006, "min_vram_mb": 1, "headroom_mb": 0}
    )
    doc = omny.read_document(out)
    assert doc["cut_points"] and all(b["weight_bytes"] > 0 for b in doc["blocks"])
    assert omny.validate(out, echo=lambda *_: None)


def test_bad_export_settings_fail_before_anything_loads():
    from dataclasses import replace

    from conftest import compose

    from onn.export.settings import check_settings

    base = compose("export=omny").export
    check_settings(base)
    for key, value, message in [
        ("nodes", 2048, r"export.nodes=2048: give a list of positive numbers"),
        ("shard_counts", [3, 0], r"export.shard_counts=\[3, 0\]: give a list of positive whole numbers"),
        ("min_vram_mb", "big", r"export.min_vram_mb='big': give a number above 0"),
        ("max_configs", 2.7, r"export.max_configs=2.7: give a whole number 1 or more"),
    ]:
        with pytest.raises(UserError, match=message):
            check_settings(replace(base, **{key: value}))  # past Hydra's type checks, as Python may


# --- what the document's figures say -------------------------------------------------------------------


def _omny_settings(**limits):
    from onn.config.export import ExportSample, OmnyExport

    given = {"max_shard_size_mb": None, "min_vram_mb": None, "headroom_mb": None, **limits}
    return OmnyExport(
        name="omny", output=None, opset=18, atol=1e-4, sample=ExportSample(2, 8, None), nodes=None,
        shard_counts=None, max_configs=8, reference_sequence_length=16, **given,
    )  # fmt: skip


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_tied_embedding_counts_once_in_a_shard_that_holds_both_its_readers(tmp_path):
    """The prefix's table is the head's matrix: each block's weight_bytes counts it, a shard holding both stores it
    once, and the plans hold that, the figure validate checks, to the limit."""
    import transformers as tf

    from onn.export import export_model
    from onn.export.onnx_export import sample_inputs

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    table = 1024 * 32 * 4
    out = tmp_path / "tied.omny"
    export_model(model, out, sample_inputs(model, 2, 8), _omny_settings(max_shard_size_mb=0.2, headroom_mb=0.0))
    doc = omny.read_document(out)
    blocks = doc["blocks"]
    summed = sum(b["weight_bytes"] for b in blocks)  # the table twice: over the limit; once: under it
    assert summed > 0.2 * 2**20 >= summed - table
    plans = doc["shard_plans"]
    assert plans["allowed_counts"][0] == 1  # stored once, the whole model fits one shard
    for conf in plans["configurations"]:
        for d in conf["detail"]:
            a, b = d["blocks"]
            peak = max(x["activation_bytes_per_sample"] for x in blocks[a:b])
            assert d["weight_bytes"] <= 0.2 * 2**20
            assert d["total_mb"] == round((d["weight_bytes"] + peak) / 2**20, 1)
    assert omny.validate(out, echo=lambda *_: None)


class _BatchLoop(__import__("torch").nn.Module):
    """A Python loop over the batch: torch.export fixes the batch axis at the traced size."""

    def __init__(self):
        import torch

        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        import torch

        rows = []
        for i in range(x.shape[0]):
            h = x[i]
            for layer in self.layers:
                h = torch.relu(layer(h)) + h
            rows.append(self.head(h))
        return torch.stack(rows)


def test_figures_of_a_graph_with_a_fixed_batch_are_at_that_batch(tmp_path):
    """Traced at batch 4 with the batch axis fixed, the graph runs at no other: the reference says batch 4, the
    shapes the figures are at; a dynamic batch is at 1."""
    import torch

    from onn.export import export_model

    torch.manual_seed(0)
    out = tmp_path / "loop.omny"
    export_model(_BatchLoop().eval(), out, {"x": torch.randn(4, 16)}, _omny_settings())
    doc = omny.read_document(out)
    assert doc["reference"] == {"batch_size": 4, "input_shapes": {"x": [4, 16]}}
    assert "batch 4" in omny.inspect_omny(out).summary()
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)
    dynamic = omny.read_document(omny.enrich_onnx(src, tmp_path / "mlp.omny", {"x": np.zeros((3, 32), np.float32)}))
    assert dynamic["reference"] == {"batch_size": 1, "input_shapes": {"x": [1, 32]}}


def test_export_output_naming_a_folder_is_refused_before_the_trace(tmp_path, monkeypatch):
    import torch

    from onn.export import export_model

    monkeypatch.setattr("onn.export.onnx_export.export_onnx", lambda *a, **k: pytest.fail("traced"))
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"export.output .*/out is a folder; name the .omny file to write, e.g. "):
        export_model(_BatchLoop(), tmp_path / "out", {"x": torch.randn(2, 16)}, _omny_settings())
    assert list((tmp_path / "out").iterdir()) == []


def test_a_newer_minor_version_with_fields_this_reader_does_not_know_is_read(tmp_path):
    """FORMAT_SPEC.md: MINOR versions only add optional fields; a reader of an older MINOR ignores them. A document
    of this reader's own version is still held to the schema whole."""
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)
    good = omny.enrich_onnx(src, tmp_path / "good.omny", {"x": np.zeros((2, 32), np.float32)})
    doc = omny.read_document(good)
    major, minor = omny.FORMAT_VERSION.split(".")
    newer = json.loads(json.dumps(doc))
    newer["format_version"] = f"{major}.{int(minor) + 1}"
    newer["flops"] = 1
    newer["blocks"][0]["flops"] = 123
    newer["cut_points"][0]["layout"] = "NC"
    newer["reference"]["dtype"] = "float32"
    newer["shard_plans"]["batch_size"] = 1
    newer["shard_plans"]["configurations"][0]["detail"][0]["peak_mb"] = 1.0
    for label, document in (("newer", newer), ("same", {**newer, "format_version": omny.FORMAT_VERSION})):
        model = onnx.load(str(good))
        helper.set_model_props(model, {omny.METADATA_KEY: json.dumps(document)})
        onnx.save(model, str(tmp_path / f"{label}.omny"))
    assert omny.read_document(tmp_path / "newer.omny")["blocks"][0]["flops"] == 123
    assert omny.validate(tmp_path / "newer.omny", echo=lambda *_: None)
    with pytest.raises(UserError, match="Additional properties are not allowed"):
        omny.read_document(tmp_path / "same.omny")
    schema = omny.schema()
    assert schema["$id"].endswith(omny.FORMAT_VERSION) and schema["title"].endswith(omny.FORMAT_VERSION)


def test_a_folder_where_a_file_is_meant_is_one_sentence(tmp_path, capsys):
    """enrich into a folder used to end in a raw IsADirectoryError after the graph was described, and inspect or
    validate of a folder said it "does not exist"."""
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)
    (tmp_path / "out").mkdir()
    assert omny_cli.main(["enrich", str(src), str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert f"output {tmp_path / 'out'} is a folder; name the .omny file to write, e.g. " in said
    assert str(tmp_path / "out" / "model.omny") in said and "Traceback" not in said
    assert list((tmp_path / "out").iterdir()) == []
    for command in ("inspect", "validate"):
        assert omny_cli.main([command, str(tmp_path)]) == 2
        said = capsys.readouterr().err
        assert f"{tmp_path} is a folder, not an ONNX file; name the file in it (it holds mlp.onnx)." in said


def test_enrich_refuses_a_dim_the_graph_does_not_name(tmp_path, capsys):
    """--dim h=224 on a graph whose axes are H and W sized nothing and made the sample at 8 x 8, without a word;
    --dim beside --sample (which gives every size) was ignored the same way."""
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=2)  # one input, x ['batch', 32]
    out = str(tmp_path / "mlp.omny")
    assert omny_cli.main(["enrich", str(src), out, "--dim", "Batch=3"]) == 2
    said = "--dim Batch: the graph's inputs have no dimension named 'Batch'; its named dimensions are batch."
    assert said in capsys.readouterr().err
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 32), np.float32))
    assert omny_cli.main(["enrich", str(src), out, "--sample", str(tmp_path / "x.npz"), "--dim", "batch=3"]) == 2
    assert "with --sample give only the sample" in capsys.readouterr().err
    assert not (tmp_path / "mlp.omny").exists()
    assert omny_cli.main(["enrich", str(src), out, "--dim", "batch=3"]) == 0
    assert omny.read_document(out)["inputs"][0]["sample"]["shape"] == [3, 32]


def _learned_positions(path: Path, positions: int) -> Path:
    """A foreign text graph with a learned position table of `positions` rows (as CLIP's text tower has 77): token
    and position embeddings added, then two weighted layers. Its position ids are a constant row sliced to the
    sequence's length, as torch traces CLIP's: a longer sequence gets fewer positions than tokens, and the Add fails."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())

    def const(name: str, value: int) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.INT64, [1], [value])

    ids = helper.make_tensor("position_ids", TensorProto.INT64, [1, positions], list(range(positions)))

    nodes = [
        helper.make_node("Gather", ["tokens", "ids"], ["tok"]),
        helper.make_node("Shape", ["ids"], ["shape"], start=1),
        helper.make_node(
            "Slice", ["position_ids", "zero", "shape", "one", "one"], ["places"]
        ),  # as torch traces ids[:, :n]
        helper.make_node("Gather", ["positions", "places"], ["pos"]),
        helper.make_node("Add", ["tok", "pos"], ["h0"]),
        helper.make_node("MatMul", ["h0", "w1"], ["m1"]),
        helper.make_node("Relu", ["m1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["out"]),
    ]
    weights = [weight("tokens", 64, 8), weight("positions", positions, 8), weight("w1", 8, 8), weight("w2", 8, 8)]
    graph = helper.make_graph(
        nodes,
        "learned_positions",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", 8])],
        [*weights, ids, const("zero", 0), const("one", 1)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_enrich_takes_the_reference_length_of_a_model_with_fewer_positions(tmp_path, capsys):
    """A text graph with fewer positions than the reference length's default of 128 (CLIP's text tower has 77)
    could not be enriched: the reference shapes did not run, and the error named export.reference_sequence_length,
    a key of run.py's, which the command line has no way to set."""
    src = _learned_positions(tmp_path / "text.onnx", positions=16)
    out = str(tmp_path / "text.omny")
    assert omny_cli.main(["enrich", str(src), out, "--dim", "sequence=8"]) == 2
    said = capsys.readouterr().err
    assert "--reference-length for python -m onn.export.omny enrich" in said and "Traceback" not in said
    assert not Path(out).exists()
    assert omny_cli.main(["enrich", str(src), out, "--dim", "sequence=8", "--reference-length", "0"]) == 2
    assert "--reference-length 0: give a whole number of tokens, 1 or more." in capsys.readouterr().err
    assert omny_cli.main(["enrich", str(src), out, "--dim", "sequence=8", "--reference-length", "16"]) == 0
    doc = omny.read_document(out)
    assert doc["reference"]["input_shapes"] == {"ids": [1, 16]}
    assert doc["inputs"][0]["sample"]["shape"] == [1, 8]
    assert doc["cut_points"][0]["bytes_per_sample"] == 16 * 8 * 4  # a hidden state at the reference length
    assert omny.validate(out, echo=lambda *_: None)
    newer = onnx.load(str(src))
    newer.ir_version = onnx.IR_VERSION  # the newest onnx writes, which onnxruntime may not read yet
    onnx.save(newer, tmp_path / "newer.onnx")
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(tmp_path / "newer.onnx"), providers=["CPUExecutionProvider"])
    except Exception:  # as with onnx 1.23's IR 14 and onnxruntime 1.31: enrich ended in onnxruntime's traceback
        assert omny_cli.main(["enrich", str(tmp_path / "newer.onnx"), str(tmp_path / "newer.omny")]) == 2
        said = capsys.readouterr().err
        assert "cannot load the graph (Unsupported model IR version" in said and "Traceback" not in said


def _tampered(good: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of the .omny file `good` whose document `change` edited (in place)."""
    model = onnx.load(str(good))
    doc = omny.read_document(model)
    change(doc)
    helper.set_model_props(model, {omny.METADATA_KEY: json.dumps(doc)})
    onnx.save(model, str(tmp_path / f"{name}.omny"))
    return tmp_path / f"{name}.omny"


def test_a_document_whose_plans_contradict_the_spec_or_the_graph_is_invalid(tmp_path):
    """FORMAT_SPEC.md: a plan's ranges are contiguous from the first block to the last and are its shards' blocks,
    a shard's total fits min_vram_mb, a block's weight_bytes is what it stores, and a document of this version has
    no field the schema lacks (at the top level, in source_model, inputs and outputs too). Each used to validate.
    A document of an older version that holds to its schema still does."""
    src = _foreign_mlp(tmp_path / "mlp.onnx", layers=4)
    sample = {"x": np.zeros((2, 32), np.float32)}
    good = omny.enrich_onnx(src, tmp_path / "good.omny", sample, {"shard_counts": [2, 4], "min_vram_mb": 300})
    conf = omny.read_document(good)["shard_plans"]["configurations"]
    assert [c["ranges"] for c in conf] == [[[0, 2], [2, 4]], [[0, 1], [1, 2], [2, 3], [3, 4]]]

    def plans(k: int, key: str, value):
        return lambda doc: doc["shard_plans"]["configurations"][k].__setitem__(key, value)

    def shard(j: int, key: str, value):
        return lambda doc: doc["shard_plans"]["configurations"][1]["detail"][j].__setitem__(key, value)

    for name, change, message in [
        ("gap", plans(1, "ranges", [[0, 1], [1, 2], [3, 4], [3, 4]]), r"are not contiguous ranges covering blocks 0"),
        ("short", plans(0, "ranges", [[0, 2], [2, 3]]), r"are not contiguous ranges covering blocks 0 to 4"),
        ("moved", plans(0, "ranges", [[0, 1], [1, 4]]), r"differ from the detail's blocks \[\[0, 2\], \[2, 4\]\]"),
        ("total", shard(1, "total_mb", 999), r"detail/1: total_mb 999 is over the 300 MB it must fit"),
        ("heavy", shard(1, "weight_bytes", 2 * 2**40), r"detail/1: weight_bytes 2199023255552 is over max_shard"),
        ("counts", lambda d: d["shard_plans"].__setitem__("allowed_counts", [2, 3]), r"allowed_counts \[2, 3\]"),
        ("extra", lambda d: d.__setitem__("future", 1), r"at <root>: Additional properties are not allowed"),
        ("source", lambda d: d["source_model"].__setitem__("future", 1), r"at source_model: Additional properties"),
        ("input", lambda d: d["inputs"][0].__setitem__("future", 1), r"at inputs/0: Additional properties"),
        ("output", lambda d: d["outputs"][0].__setitem__("future", 1), r"at outputs/0: Additional properties"),
    ]:
        bad = _tampered(good, tmp_path, name, change)
        with pytest.raises(UserError, match=message):
            omny.read_document(bad)
        assert omny_cli.main(["validate", str(bad)]) == 2, name
    lines, light = [], _tampered(good, tmp_path, "light", lambda d: d["blocks"][1].__setitem__("weight_bytes", 1))
    assert not omny.validate(light, echo=lines.append)
    name = omny.read_document(good)["blocks"][1]["name"]
    assert f"{light}: weight_bytes differ from the graph: block 1 '{name}' says 1, stores 4224" in lines
    assert lines[-1].endswith("INVALID")
    older = _tampered(good, tmp_path, "older", lambda d: d.__setitem__("format_version", "1.0"))
    assert omny.validate(older, echo=lambda *_: None)


def test_the_spec_defines_activations_as_the_code_computes_them():
    """An op that may run in place frees its input as it writes: FORMAT_SPEC.md's definition names every such op."""
    from onn.export import graph as G

    spec = (ROOT / "FORMAT_SPEC.md").read_text()
    row = next(line for line in spec.splitlines() if line.startswith("| `activation_bytes_per_sample`"))
    assert "in place" in row
    assert [op for op in sorted(G.IN_PLACE) if f"`{op}`" not in row] == []


def test_export_sample_image_size_is_height_and_width(tmp_path):
    """export.sample.image_size is [H, W] (a list, as its type says); anything else is one sentence."""
    from dataclasses import replace

    from conftest import compose

    from onn.export.settings import check_settings

    base = compose("export=omny").export
    check_settings(replace(base, sample=replace(base.sample, image_size=[32, 48])))
    for bad in ([32], [0, 32], [32, 32, 3], 32):
        with pytest.raises(UserError, match=r"export.sample.image_size=.*: give two positive whole numbers \[H, W\]"):
            check_settings(replace(base, sample=replace(base.sample, image_size=bad)))


@pytest.mark.slow  # a training run, then its export
def test_a_failed_export_after_training_keeps_the_trainings_figures_and_says_how_to_export_it(tmp_path):
    """An export that failed at the end of training left metrics.json with its error alone: the loss curve and
    validation figures of the finished training were gone, and nothing said its checkpoint could be exported."""
    run = tmp_path / "run"
    done = run_cli(
        "model=llama_tiny",
        "trainer.max_steps=2",
        "task.validate_before=false",
        "task.exact_match_samples=0",
        "tracking=none",
        "export=omny",
        "export.max_shard_size_mb=0.01",
        f"paths.outputs={tmp_path}",
        f"hydra.run.dir={run}",
    )
    assert done.returncode == 1
    m = json.loads((run / "metrics.json").read_text())
    assert m["status"] == "failed" and m["steps"] == 2 and len(m["train/loss_curve"]) == 2 and m["val/loss_final"] > 0
    assert f"task=export ckpt={run} exports it without training again" in m["error"]
    assert (run / "checkpoints" / "last.ckpt").is_dir()
