"""Meshes read as graphs, eleventh review: a mesh's stray unused vertices do not shrink it into one node, and eval
and infer of a checkpoint turn a mesh's positions as its training did, whatever data config the command line
brings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_graph import run

from onn.modalities.graph.read import decode


def write_off(path: Path, vertices: np.ndarray, faces: np.ndarray) -> Path:
    """An OFF file of triangles; OFF (as PLY) keeps vertices no face uses, where trimesh's OBJ reader drops them."""
    lines = [f"OFF\n{len(vertices)} {len(faces)} 0"]
    lines += [" ".join(repr(float(c)) for c in v) for v in vertices]
    lines += [f"3 {a} {b} {c}" for a, b, c in faces]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("stray", [1e9, 1e308])
def test_a_stray_unused_vertex_far_off_leaves_a_meshs_graph_as_it_is(tmp_path, stray):
    """A cube with unused vertices far off (an exporter's leftovers) is the cube's graph: 8 nodes, 36 directed edges,
    the same positions. The vertices were scaled into a box that held the stray ones, so the cube shrank below
    trimesh's merging step and became one node (at 1e308 the box overflowed: skipped as too large)."""
    import trimesh

    cube = trimesh.creation.box()
    plain = decode(write_off(tmp_path / "cube.off", cube.vertices, cube.faces), "cube.off", "none", 1000)
    far = np.vstack([cube.vertices, [[stray] * 3, [-stray] * 3]])
    graph = decode(write_off(tmp_path / "stray.off", far, cube.faces), "stray.off", "none", 1000)
    assert plain.num_nodes == 8 and plain.edge_index.shape == (2, 36)
    assert graph.num_nodes == 8 and graph.edge_index.shape == (2, 36)
    assert np.allclose(graph.x.numpy(), plain.x.numpy())


def predictions(out: dict) -> list[dict]:
    return [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]


@pytest.mark.slow  # (about 20 s: a training run on meshes, three inferences and an evaluation)
def test_infer_and_eval_with_data_graph_turn_meshes_as_the_checkpoint_was_trained(tmp_path):
    """A network trained on meshes' positions as the files have them (data.align=none) is scored on them so: with
    `data=graph` on the command line its default, pca, turned every mesh onto its principal axes, and task=infer
    and task=eval gave other answers for the same files without a word."""
    from onn.modalities.mesh.primitives import write_primitives

    data = write_primitives(tmp_path / "shapes", per_class=2, seed=0, file_types=("obj", "off"))
    _, run_dir = run(tmp_path, f"data.source={data}", "data.align=none", "trainer.max_epochs=1", "data.batch_size=4")
    own = predictions(run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={data}", name="own")[0])
    given = ("data=graph", f"data.source={data}")
    fresh = predictions(run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={data}", *given, name="new")[0])
    assert [row["probability"] for row in fresh] == [row["probability"] for row in own]
    turned = predictions(
        run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={data}", *given, "data.align=pca", name="pca")[0]
    )
    assert [row["probability"] for row in turned] == [row["probability"] for row in own]
    scored = run(tmp_path, "task=eval", f"ckpt={run_dir}", *given, name="eval")[0]
    right = sum(row["predicted"] == row["true"] for row in own) / len(own)
    assert scored["val/acc"] == pytest.approx(right, abs=1e-4)
