"""fold_constants after 2b041fb: a weight an If branch reads is kept, a weight reshaped to 1-D is still not stored
widened, and the transpose of a weight another node still reads is not stored as a second copy."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onn.export.graph import fold_constants, tensor_bytes


def _model(nodes: list, inputs: list, inits: list, opset: int) -> onnx.ModelProto:
    out = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs, [out], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _stored(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    return {t.name: (t.data_type, tensor_bytes(t)) for t in model.graph.initializer}


def test_a_weight_an_if_branch_reads_is_kept_when_its_shape_folds():
    w = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "W")
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["t"])], "then", [], [helper.make_tensor_value_info("t", 1, None)]
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["W"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)]
    )
    nodes = [
        helper.make_node("Shape", ["W"], ["s"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Reshape", ["y", "s"], ["z"]),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [w], 18)
    out, n = fold_constants(model)
    assert n == 1 and "W" in _stored(out)
    for c in (True, False):
        feeds = {"c": np.array(c)}
        np.testing.assert_array_equal(
            ReferenceEvaluator(out).run(None, feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0]
        )


def _flat_then_widen(w: onnx.TensorProto, widen: onnx.NodeProto, extra: list, opset: int) -> onnx.ModelProto:
    """W -> Reshape(-1) -> `widen` (to fp32) -> Reshape(64, 64) -> MatMul: the 1-D middle is still W's bytes."""
    inits = [w, numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    inits += [numpy_helper.from_array(np.array([64, 64], np.int64), "back"), *extra]
    nodes = [
        helper.make_node("Reshape", [w.name, "flat"], ["w1"]),
        widen,
        helper.make_node("Reshape", ["wf", "back"], ["w2"]),
        helper.make_node("MatMul", ["x", "w2"], ["y"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])], inits, opset)


def _check_narrow(model: onnx.ModelProto, dtype: int, nbytes: int) -> None:
    out, _ = fold_constants(model)
    weights = [v for v in _stored(out).values() if v[1] >= 64 * 64]
    assert weights == [(dtype, nbytes)], weights
    x = {"x": np.linspace(-1, 1, 64, dtype=np.float32)[None]}
    np.testing.assert_allclose(ReferenceEvaluator(out).run(None, x)[0], ReferenceEvaluator(model).run(None, x)[0])


def test_an_int8_weight_reshaped_to_1d_is_not_stored_dequantized():
    w = numpy_helper.from_array((np.arange(64 * 64) % 255 - 127).astype(np.int8).reshape(64, 64), "Wq")
    extra = [numpy_helper.from_array(np.array(0.1, np.float32), "sc")]
    extra += [numpy_helper.from_array(np.array(0, np.int8), "zp")]
    dq = helper.make_node("DequantizeLinear", ["w1", "sc", "zp"], ["wf"])
    _check_narrow(_flat_then_widen(w, dq, extra, 19), TensorProto.INT8, 64 * 64)


def test_an_fp16_weight_reshaped_to_1d_is_not_stored_as_fp32():
    w = numpy_helper.from_array(np.linspace(-1, 1, 64 * 64).astype(np.float16).reshape(64, 64), "Wh")
    cast = helper.make_node("Cast", ["w1"], ["wf"], to=TensorProto.FLOAT)
    _check_narrow(_flat_then_widen(w, cast, [], 18), TensorProto.FLOAT16, 2 * 64 * 64)


def test_the_transpose_of_a_tied_weight_is_not_stored_a_second_time():
    """W is read by a MatMul (an embedding side) and by Transpose -> MatMul (the tied head)."""
    w = numpy_helper.from_array(np.linspace(-1, 1, 32 * 32, dtype=np.float32).reshape(32, 32), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Wt"], ["y"]),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])], [w], 18)
    out, _ = fold_constants(model)
    assert sum(b for _, b in _stored(out).values()) <= tensor_bytes(w)
    x = {"x": np.linspace(-1, 1, 32, dtype=np.float32)[None]}
    np.testing.assert_allclose(ReferenceEvaluator(out).run(None, x)[0], ReferenceEvaluator(model).run(None, x)[0])
