"""Graph inputs, seventh review: task=eval of a checkpoint on a data.source it is given (one class's graphs, or a
node-level graph), node-level truths under named classes, and one sentence for a source of one graph, an edge list
of names rather than numbers, and graphs of different feature widths; ONNX against torch on odd graphs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_graph import ring, run, write_edges, write_rings_and_stars

from onn.errors import UserError
from onn.modalities.graph.read import GraphError, decode


def node_file(path: Path, nodes: int = 40, classes: int = 2) -> Path:
    """One graph in a ring, its nodes' features a clear hint of their class: a node-level source."""
    from safetensors.torch import save_file

    y = torch.arange(nodes) % classes
    x = torch.randn(nodes, 4, generator=torch.Generator().manual_seed(0)) * 0.1 + y.float().unsqueeze(1)
    save_file({"x": x, "edge_index": torch.tensor(ring(nodes)).t().contiguous(), "y": y}, str(path))
    return path


@pytest.mark.slow  # (about 15 s: a training run and two evaluations)
def test_eval_of_a_checkpoint_on_one_class_of_graphs_or_on_a_given_node_graph_scores_it(tmp_path):
    """task=eval with a data.source scores the whole of it. A folder of one class's graphs was refused (`a
    classifier needs two or more`: the graph data ignored the checkpoint's known classes), and a node-level graph
    was refused for a data.val_source the user never gave (task=eval sets it to data.source)."""
    data = write_rings_and_stars(tmp_path / "train", 8, 0)
    _, run_dir = run(tmp_path, f"data.source={data}", "trainer.max_epochs=2")
    rings = tmp_path / "rings"
    for n in (5, 7, 9):
        write_edges(rings / "ring" / f"{n}.edges", ring(n))
    scored, _ = run(tmp_path, "task=eval", f"ckpt={run_dir}", f"data.source={rings}", name="eval")
    assert 0 <= scored["val/acc"] <= 1 and np.isfinite(scored["val/loss"])

    source = node_file(tmp_path / "g.safetensors")
    _, node_dir = run(tmp_path, f"data.source={source}", "data.level=node", "model=gcn", "trainer.max_epochs=2")
    other = node_file(tmp_path / "other.safetensors", nodes=30)
    scored, _ = run(tmp_path, "task=eval", f"ckpt={node_dir}", f"data.source={other}", name="node_eval")
    assert 0 <= scored["val/acc"] <= 1 and np.isfinite(scored["val/loss"])


def test_node_level_eval_of_a_given_graph_scores_every_labelled_node(tmp_path):
    """The whole of the given graph: every labelled node is in the evaluated split (not a seeded tenth of them)."""
    from conftest import compose

    from onn.modalities.graph.dataset import GraphDataModule

    y = torch.arange(30) % 2
    y[:4] = -1
    source = tmp_path / "g.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.randn(30, 2), "edge_index": torch.tensor(ring(30)).t().contiguous(), "y": y}, str(source))
    cfg = compose("data=graph", "model=gcn", f"data.source={source}", "data.level=node", f"data.val_source={source}")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    assert sorted(dm.splits["val"].resident[0].nodes.tolist()) == list(range(4, 30))


@pytest.mark.slow  # (about 10 s: a node-level training run and an inference)
def test_node_level_infer_knows_the_true_class_of_nodes_under_named_classes(tmp_path):
    """With data.classes naming the label numbers, a node's y of 1 is classes[1]: task=infer compared "1" with the
    names, found no truth, and wrote no infer/acc and no `true` for any node."""
    source = node_file(tmp_path / "g.safetensors")
    _, run_dir = run(
        tmp_path, f"data.source={source}", "data.level=node", "model=gcn", "trainer.max_epochs=2", "data.classes=[a,b]"
    )
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={source}", name="infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert [r["true"] for r in rows[:4]] == ["a", "b", "a", "b"]
    assert 0 <= out["infer/acc"] <= 1

    from safetensors.torch import save_file

    files = tmp_path / "numbered"  # graph files whose y is their class number, in no class folder
    files.mkdir()
    for i, n in enumerate(range(5, 13)):
        pairs = ring(n) if i % 2 == 0 else [(0, k) for k in range(1, n)]
        edges = torch.tensor(pairs).t().contiguous()
        save_file({"edge_index": edges, "y": torch.tensor(i % 2)}, str(files / f"{i}.safetensors"))
    _, run_dir = run(tmp_path, f"data.source={files}", "trainer.max_epochs=1", "data.classes=[ring,star]", name="g")
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={files}", name="graph_infer")
    rows = {r["name"]: r for r in map(json.loads, Path(out["infer/output"]).read_text().splitlines())}
    assert [rows[f"{i}.safetensors"]["true"] for i in range(4)] == ["ring", "star", "ring", "star"]
    assert 0 <= out["infer/acc"] <= 1


def test_a_one_line_edge_list_of_names_says_its_line_was_read_as_column_names(tmp_path):
    """`alice bob` alone was skipped as a header row and the file called "an empty graph" without a word about why;
    the skip names the line and that node ids are whole numbers."""
    path = tmp_path / "people" / "pair.edges"
    path.parent.mkdir()
    path.write_text("# who knows whom\nalice bob\n")
    with pytest.raises(
        GraphError, match=r"its one line 'alice bob' is read as column names; give edges as `SRC DST` lines of whole"
    ):
        decode(path, path.name, "none", 100)
    empty = tmp_path / "people" / "empty.edges"
    empty.write_text("source,target\n")  # a header and no rows: still said to be empty
    with pytest.raises(GraphError, match=r"^holds no nodes \(an empty graph\): its one line 'source,target'"):
        decode(empty, empty.name, "none", 100)


def test_a_graph_source_too_small_to_hold_out_or_of_mixed_widths_says_which(tmp_path):
    """One graph: the refusal blamed data.val_split=0.1 (`give a fraction between 0 and 1`), which is one; graphs of
    different feature widths: the refusal named the widths but no file of either."""
    from conftest import compose
    from safetensors.torch import save_file

    from onn.modalities.graph.dataset import GraphDataModule

    one = tmp_path / "one"
    write_edges(one / "ring" / "a.edges", ring(5))
    cfg = compose("data=graph", "model=gin", f"data.source={one}")
    with pytest.raises(UserError, match=r"has 1 training graph and data.val_split=0.1 holds out 1 for validation"):
        GraphDataModule(cfg.data).setup()

    mixed = write_rings_and_stars(tmp_path / "mixed", 3, 0)
    edges = torch.tensor(ring(4)).t().contiguous()
    save_file({"x": torch.ones(4, 3), "edge_index": edges}, str(mixed / "ring" / "wide.safetensors"))
    cfg = compose("data=graph", "model=gin", f"data.source={mixed}", "data.val_split=0.3")
    with pytest.raises(UserError, match=r"features \((ring|star)/\d+.edges's 1, ring/wide.safetensors's 3\)"):
        GraphDataModule(cfg.data).setup()
