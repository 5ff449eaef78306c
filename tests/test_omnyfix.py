"""The .omny reference batch beside a 1-D side input, infinite shard limits, and the limits checked together before
training (onn/export/omny/format.py, onn/export/settings.py, onn/export/shards.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_corpus import tiny_onnx
from onnx import TensorProto, helper

from onn.config.export import ExportSample, OmnyExport
from onn.errors import UserError
from onn.export import check_settings, omny, shards
from onn.export.graph import tensor_bytes
from onn.export.omny import cli as omny_cli

WIDTH = 256
LIMITS = {"max_shard_size_mb": 0.3, "min_vram_mb": 0.7, "headroom_mb": 0}  # one [256, 256] weight (0.25 MB) a shard


def _side_graph(path: Path, side: list | None, x: list) -> Path:
    """Three MatMul+Relu layers on x, then y = h * gain when `side` gives gain's shape (else y = h)."""
    rng = np.random.default_rng(0)
    weights = [
        helper.make_tensor(f"w{i}", TensorProto.FLOAT, (WIDTH, WIDTH), rng.standard_normal(WIDTH * WIDTH).tolist())
        for i in range(3)
    ]
    nodes, h = [], "x"
    for i in range(3):
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes.append(helper.make_node("Mul", [h, "gain"], ["y"]) if side else helper.make_node("Identity", [h], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)]
    inputs += [helper.make_tensor_value_info("gain", TensorProto.FLOAT, side)] if side else []
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))
    return path


def _enrich(tmp_path: Path, tag: str, side: list | None, x: list, batch: int = 1) -> dict:
    sample = {"x": np.ones((batch, WIDTH), np.float32)} | ({"gain": np.ones(WIDTH, np.float32)} if side else {})
    src = _side_graph(tmp_path / f"{tag}.onnx", side, x)
    return omny.read_document(omny.enrich_onnx(src, tmp_path / f"{tag}.omny", sample, LIMITS))


def test_a_1d_side_input_leaves_the_reference_batch_at_1(tmp_path):
    """gain [256] beside x [batch, 256] made the reference batch 256: every per-sample figure 256 times too large,
    and a model that fits at batch 1 was refused."""
    alone = _enrich(tmp_path, "alone", None, ["batch", WIDTH])
    doc = _enrich(tmp_path, "side", [WIDTH], ["batch", WIDTH])
    assert doc["reference"] == {"batch_size": 1, "input_shapes": {"x": [1, WIDTH], "gain": [WIDTH]}}
    assert doc["shard_plans"]["allowed_counts"] == alone["shard_plans"]["allowed_counts"] == [3]
    ranges = [c["ranges"] for c in doc["shard_plans"]["configurations"]]
    assert ranges == [c["ranges"] for c in alone["shard_plans"]["configurations"]]
    per_sample = [b["activation_bytes_per_sample"] for b in doc["blocks"]]
    assert per_sample[:2] == [b["activation_bytes_per_sample"] for b in alone["blocks"]][:2]
    fixed = _enrich(tmp_path, "fixed", [WIDTH], [2, WIDTH], batch=2)  # a traced-in batch still tells
    assert fixed["reference"]["batch_size"] == 2


def test_a_side_input_named_other_than_the_batch_keeps_its_sample_size(tmp_path):
    """gain [channels] beside x [batch, channels]: its axis is not the batch, and was set to it ([1])."""
    doc = _enrich(tmp_path, "named", ["channels"], ["batch", "channels"])
    assert doc["reference"]["input_shapes"] == {"x": [1, WIDTH], "gain": [WIDTH]}


def _settings(**changes: object) -> OmnyExport:
    """conf/export/omny.yaml's values (null limits: the format's defaults), with `changes`."""
    values = dict(name="omny", output=None, opset=18, atol=1e-4, sample=ExportSample(2, 16, None), nodes=None)
    values |= dict(max_shard_size_mb=None, min_vram_mb=None, headroom_mb=None, shard_counts=None, max_configs=8)
    return OmnyExport(**{**values, "reference_sequence_length": 128, **changes})


@pytest.mark.parametrize("key", ["max_shard_size_mb", "min_vram_mb", "headroom_mb"])
def test_an_infinite_limit_is_refused_before_training_and_by_the_planner(key):
    """inf passed `value > 0`: the plans were made and the .omny metadata held a bare Infinity, which is not JSON."""
    with pytest.raises(UserError, match=rf"^export\.{key}=inf: give a finite number [^;]*\.$"):
        check_settings(_settings(**{key: math.inf}))
    limits = {"max_shard_size_mb": 10.0, "min_vram_mb": 20.0, "headroom_mb": 1.0} | {key: math.inf}
    with pytest.raises(UserError, match=rf"^export\.{key} is inf; set it to .*finite"):
        shards.plan_shards([shards.Block("b", 1024, 1024)], **limits)


def test_an_infinite_node_is_refused_before_training():
    """export.nodes=[2048, inf] passed `v > 0`; the node planner refused it only when the export ran."""
    with pytest.raises(UserError, match=r"^export\.nodes=\[2048, inf\]: give a list of positive numbers"):
        check_settings(_settings(nodes=[2048, math.inf]))


def test_enrich_with_an_infinite_limit_writes_nothing(tmp_path, capsys):
    """The command line's --min-vram-mb inf wrote a document with min_vram_mb: Infinity."""
    src = tiny_onnx(tmp_path / "tiny.onnx")
    out = tmp_path / "tiny.omny"
    assert omny_cli.main(["enrich", str(src), str(out), "--min-vram-mb", "inf"]) == 2
    assert "--min-vram-mb is inf" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"headroom_mb": 2000.0, "min_vram_mb": 1500.0}, "(2000) leaves no memory under export.min_vram_mb (1500)"),
        ({"min_vram_mb": 200.0}, "(256) leaves no memory under export.min_vram_mb (200)"),
        ({"headroom_mb": 1600.0}, "(1600) leaves no memory under export.min_vram_mb (1500)"),
        ({"nodes": [2048, 256]}, "(256) leaves no memory on export.nodes[1] (256)"),
    ],
)
def test_limits_that_leave_no_memory_are_refused_before_training(changes, said):
    """check_settings checked each limit alone: a headroom filling the smallest GPU (or a node) was refused only when
    the export ran, after training. Null limits are the planner's defaults (1500 MB, 256 MB headroom)."""
    check_settings(_settings(headroom_mb=100.0, min_vram_mb=200.0, nodes=[2048, 300]))  # memory left: taken
    with pytest.raises(UserError) as before:
        check_settings(_settings(**changes))
    assert str(before.value).startswith(f"export.headroom_mb {said}; ")
    blocks = [shards.Block("b", 1024, 1024)] * 2
    headroom = changes.get("headroom_mb", shards.HEADROOM_MB)
    with pytest.raises(UserError) as planned:
        if "nodes" in changes:
            shards.plan_nodes(blocks, changes["nodes"], headroom_mb=headroom)
        else:
            shards.plan_shards(blocks, min_vram_mb=changes.get("min_vram_mb", shards.MIN_VRAM_MB), headroom_mb=headroom)
    assert str(planned.value) == str(before.value)  # one sentence, from one function


# --- enrich keeps narrow weights; the reader refuses NaN, a wrong cut_after and an empty sample ---------------------


def _narrow_mlp(path: Path, kind: str, opset: int, width: int = 64, layers: int = 3) -> Path:
    """x -> layers x (MatMul + Relu), each weight stored narrow: int8 read by DequantizeLinear (`qdq`), or fp16 read
    by Cast to fp32 (`fp16`)."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width)).astype(np.float32) / 8
        if kind == "qdq":
            inits += [
                numpy_helper.from_array(np.clip(np.round(w * 100), -127, 127).astype(np.int8), f"q{i}"),
                numpy_helper.from_array(np.array(0.01, np.float32), f"s{i}"),
                numpy_helper.from_array(np.array(0, np.int8), f"z{i}"),
            ]
            nodes.append(helper.make_node("DequantizeLinear", [f"q{i}", f"s{i}", f"z{i}"], [f"w{i}"]))
        else:
            inits.append(numpy_helper.from_array(w.astype(np.float16), f"h{i}"))
            nodes.append(helper.make_node("Cast", [f"h{i}"], [f"w{i}"], to=TensorProto.FLOAT))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "narrow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _ort(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize(("kind", "opset"), [("qdq", 21), ("qdq", 18), ("fp16", 21)])
def test_enrich_keeps_narrow_weights_narrow(tmp_path, kind, opset):
    """enrich folded every Cast / DequantizeLinear of a weight into an fp32 initializer (a 4x larger file, the
    quantization gone, plans counting fp32 bytes), and at opset 18 the reference evaluator's missing
    DequantizeLinear crashed it with a traceback."""
    src = _narrow_mlp(tmp_path / "in.onnx", kind, opset)
    out = tmp_path / "out.omny"
    assert omny_cli.main(["enrich", str(src), str(out)]) == 0
    model = onnx.load(out)
    narrow = TensorProto.INT8 if kind == "qdq" else TensorProto.FLOAT16
    weights = [t for t in model.graph.initializer if len(t.dims) == 2]
    assert [t.data_type for t in weights] == [narrow] * 3
    assert out.stat().st_size < 1.2 * src.stat().st_size
    doc = omny.read_document(out)
    stored = sum(tensor_bytes(t) for t in model.graph.initializer)
    assert sum(b["weight_bytes"] for b in doc["blocks"]) == stored  # every block counts what the file stores
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(_ort(out, x), _ort(src, x))


def _tampered(tmp_path: Path, change) -> Path:
    """A real enriched .omny whose document `change` edits (json.dumps writes NaN, as a hand edit could)."""
    import json

    out = tmp_path / "good.omny"
    assert omny_cli.main(["enrich", str(_narrow_mlp(tmp_path / "in.onnx", "fp16", 21)), str(out)]) == 0
    model = onnx.load(out)
    entry = next(p for p in model.metadata_props if p.key == omny.METADATA_KEY)
    doc = json.loads(entry.value)
    change(doc)
    entry.value = json.dumps(doc)
    bad = tmp_path / "bad.omny"
    onnx.save(model, bad)
    return bad


def test_a_nan_in_the_document_is_refused(tmp_path, capsys):
    """json.loads read NaN, and NaN > limit is False: a total_mb of NaN validated."""
    bad = _tampered(tmp_path, lambda d: d["shard_plans"]["configurations"][0]["detail"][0].update(total_mb=math.nan))
    capsys.readouterr()
    assert omny_cli.main(["validate", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {bad}: the .omny metadata holds NaN, which is no finite number; re-export the file."
    )


def test_a_block_naming_another_cut_point_is_refused(tmp_path, capsys):
    """validate checked cut_points[].after_block alone: block 0 naming block 1's cut tensor validated."""

    def swap(doc: dict) -> None:
        doc["blocks"][0]["cut_after"] = doc["cut_points"][1]["name"]

    bad = _tampered(tmp_path, swap)
    capsys.readouterr()
    assert omny_cli.main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "blocks/0 has cut_after 'r1', not 'r0', the cut point whose after_block is 0" in err


def test_an_empty_sample_is_refused(tmp_path, capsys):
    """A [0, 64] sample made a document whose validate compared empty outputs and always passed."""
    src = _narrow_mlp(tmp_path / "in.onnx", "fp16", 21)
    sample = tmp_path / "empty.npz"
    np.savez(sample, x=np.zeros((0, 64), np.float32))
    out = tmp_path / "out.omny"
    assert omny_cli.main(["enrich", str(src), str(out), "--sample", str(sample)]) == 2
    assert "sample input 'x' has shape [0, 64], which holds nothing" in capsys.readouterr().err
    assert not out.exists()
