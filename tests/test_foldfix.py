"""fold_constants after b646ecb: shape arithmetic on a weight folds again (only a widened weight-sized copy stays),
and a graph the reference evaluator cannot run whole is folded node by node in linear work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.reference
from onnx import TensorProto, helper, numpy_helper

from onn.export import omny
from onn.export.graph import fold_constants, tensor_bytes
from onn.export.omny import cli as omny_cli


def _shape_of_a_weight(path: Path) -> Path:
    """x -> 3 x MatMul, the output reshaped to (-1, rows of W0): torch's `weight.size(0)` as Shape -> Gather."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"W{i}") for i in range(3)]
    inits += [numpy_helper.from_array(np.array([0], np.int64), "zero")]
    inits += [numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    nodes = [
        helper.make_node("Shape", ["W0"], ["w0_shape"]),
        helper.make_node("Gather", ["w0_shape", "zero"], ["w0_rows"]),
        helper.make_node("MatMul", ["x", "W0"], ["a0"]),
        helper.make_node("Relu", ["a0"], ["b0"]),
        helper.make_node("MatMul", ["b0", "W1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["b1"]),
        helper.make_node("MatMul", ["b1", "W2"], ["a2"]),
        helper.make_node("Concat", ["minus1", "w0_rows"], ["shape2"], axis=0),
        helper.make_node("Reshape", ["a2", "shape2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "shape_of_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_the_shape_of_a_weight_folds_and_every_plan_counts_each_weight_once(tmp_path):
    """Shape(W) gives int64, wider per item than the fp32 W, so b646ecb kept the whole Shape->Gather->Concat chain:
    the kept Shape became a block storing W0 to read its shape, and 4 shards held 1040 bytes of 784 stored."""
    out = tmp_path / "out.omny"
    assert omny_cli.main(["enrich", str(_shape_of_a_weight(tmp_path / "in.onnx")), str(out)]) == 0
    model = onnx.load(out)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Relu", "MatMul", "Relu", "MatMul", "Reshape"]
    stored = sum(tensor_bytes(t) for t in model.graph.initializer)
    plans = omny.read_document(out)["shard_plans"]["configurations"]
    assert [p["shards"] for p in plans] == [1, 2, 3]  # three MatMul blocks once the shape chain is gone
    for plan in plans:
        assert sum(d["weight_bytes"] for d in plan["detail"]) == stored, plan
        assert all(d["carry"] == [] for d in plan["detail"]), plan


def test_an_fp16_weight_keeps_its_cast_but_its_shape_folds():
    """The rule is about bytes, not item size: Cast(fp16 W) to fp32 would store W twice as large and stays;
    Shape(W) is two int64s and folds (b646ecb kept it, int64 being wider per item than fp16)."""
    w = numpy_helper.from_array(np.ones((16, 16), np.float16), "h")
    nodes = [
        helper.make_node("Cast", ["h"], ["w"], to=TensorProto.FLOAT),
        helper.make_node("Shape", ["h"], ["s"]),
        helper.make_node("Reshape", ["x", "s"], ["xr"]),
        helper.make_node("MatMul", ["xr", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 16])],
        [w],
    )
    folded, n = fold_constants(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert n == 1
    assert [x.op_type for x in folded.graph.node] == ["Cast", "Reshape", "MatMul"]
    made = {t.name: t for t in folded.graph.initializer}
    assert made["h"].data_type == TensorProto.FLOAT16 and "w" not in made
    assert numpy_helper.to_array(made["s"]).tolist() == [16, 16]


def _qdq_stack(layers: int) -> onnx.ModelProto:
    """`layers` x (Constant shape, Reshape of an fp32 weight, MatMul) and one DequantizeLinear of int8 weights at
    opset 18, which the reference evaluator lacks: the batch evaluation fails on such a graph."""
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(np.ones((4, 4), np.float32), f"W{i}"))
        shape = numpy_helper.from_array(np.array([4, 4], np.int64))
        nodes.append(helper.make_node("Constant", [], [f"s{i}"], value=shape))
        nodes.append(helper.make_node("Reshape", [f"W{i}", f"s{i}"], [f"R{i}"]))
        nodes.append(helper.make_node("MatMul", [x, f"R{i}"], [f"y{i}"]))
        x = f"y{i}"
    inits += [numpy_helper.from_array(np.ones((4, 4), np.int8), "Q")]
    inits += [numpy_helper.from_array(np.array(0.1, np.float32), "scale")]
    nodes += [
        helper.make_node("DequantizeLinear", ["Q", "scale"], ["DQ"]),
        helper.make_node("MatMul", [x, "DQ"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_qdq_graph_below_opset_19_folds_each_node_on_its_own_inputs(monkeypatch):
    """The node-by-node fallback built each node's evaluator with every Constant of the graph (quadratic: 400
    layers 14.5 s against 0.22 s); each evaluated program now holds the node and the Constants it reads."""
    sizes: list[int] = []
    init = onnx.reference.ReferenceEvaluator.__init__

    def counted(self, proto, *args, **kwargs) -> None:
        sizes.append(len(proto.graph.node))
        init(self, proto, *args, **kwargs)

    monkeypatch.setattr(onnx.reference.ReferenceEvaluator, "__init__", counted)
    folded, n = fold_constants(_qdq_stack(300))
    assert n == 300  # every Reshape of a weight; the DequantizeLinear stays, the evaluator lacking it
    assert [x.op_type for x in folded.graph.node].count("DequantizeLinear") == 1
    assert not any(x.op_type == "Reshape" for x in folded.graph.node)
    assert len(sizes) == 301 and max(sizes) == 2
