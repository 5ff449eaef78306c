"""validate runs the whole model and every shard without onnxruntime's graph optimizations: at its default level
onnxruntime fused a QDQ model's DequantizeLinear + MatMul one way in the whole model and another in a shard that
starts at that MatMul, and the 3- and 4-shard plans of a correct file read INVALID. The comparison stays exact,
and a file whose graph or cut points were tampered with still fails."""

from pathlib import Path

import numpy as np
import onnx
from hostile_corpus import rewrite_document
from onnx import numpy_helper
from test_omnyfix import _narrow_mlp

from onn.export import omny


def _qdq_omny(tmp_path: Path) -> Path:
    """A real enriched .omny of an int8 (QDQ) MLP of 4 layers: plans of 1 to 4 shards, each layer a block."""
    src = _narrow_mlp(tmp_path / "in.onnx", "qdq", 21, layers=4)
    out = omny.enrich_onnx(src, tmp_path / "qdq.omny")
    counts = [c["shards"] for c in omny.read_document(out)["shard_plans"]["configurations"]]
    assert max(counts) >= 3, counts  # the plans whose shards start at a MatMul reading a graph input
    return out


def _validate(path: Path) -> tuple[omny.Validation, str]:
    lines: list[str] = []
    result = omny.validate(path, echo=lines.append)
    return result, "\n".join(lines)


def test_every_plan_of_a_qdq_model_validates_exactly(tmp_path):
    """Before, the 3- and 4-shard plans differed from the whole model by ~7e-3 (over 1e-4): INVALID. Now the shards
    compute bit for bit what the whole model does: no tolerance was added, a difference of one rounding shows."""
    result, said = _validate(_qdq_omny(tmp_path))
    assert result.ok, said
    assert result.max_abs_diff == 0.0, said
    assert said.count("max abs diff against the whole model: 0 (ok)") == 4, said


def test_a_weight_widened_in_the_graph_is_still_invalid(tmp_path):
    """Layer 1's int8 weight replaced by the fp32 values it dequantizes to (what enrich wrote before b646ecb): the
    shards still compute the same, but each that holds it stores 4x the bytes the document says."""
    out = _qdq_omny(tmp_path)
    model = onnx.load(out)
    graph = model.graph
    q = next(t for t in graph.initializer if t.name == "q1")
    wide = numpy_helper.from_array(numpy_helper.to_array(q).astype(np.float32) * np.float32(0.01), "w1")
    node = next(n for n in graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "w1")
    graph.node.remove(node)
    kept = [t for t in graph.initializer if t.name not in ("q1", "s1", "z1")]
    del graph.initializer[:]
    graph.initializer.extend([*kept, wide])
    onnx.save(model, out)
    result, said = _validate(out)
    assert not result.ok, said
    assert "weights differ from the document" in said and "weight_bytes differ from the graph: block 1" in said, said


def test_swapped_cut_points_are_still_invalid(tmp_path):
    """The first two cut points' tensors swapped (each block naming its new one, as the reader requires): block 0
    cut out up to the second layer's output stores two layers' weights, not the one the document says."""
    out = _qdq_omny(tmp_path)

    def swap(doc: dict) -> None:
        first, second = doc["cut_points"][0], doc["cut_points"][1]
        first["name"], second["name"] = second["name"], first["name"]
        doc["blocks"][0]["cut_after"], doc["blocks"][1]["cut_after"] = first["name"], second["name"]

    rewrite_document(out, swap)
    result, said = _validate(out)
    assert not result.ok, said
    assert "weight_bytes differ from the graph: block 0" in said, said
