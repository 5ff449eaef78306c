"""Graph inputs and numerics, sixth review: edge lists numbered from 1 (SNAP's) or by any ids, a header line of
column names, the plan's size estimate reading an edge list by the reader's own rule, node-level predictions named by
the file's node ids, edge_index tensors that are not finite, and a bf16 network's neighbour sums (float32)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_graph import run

from onn.errors import UserError
from onn.modalities.graph.read import GraphError, decode, file_size, read_source


def edges_of(graph) -> list[tuple[int, int]]:
    return sorted(map(tuple, graph.edge_index.t().tolist()))


def written(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
    return path


def test_an_edge_list_numbered_from_one_has_its_n_nodes_and_pools_as_its_zero_based_twin(tmp_path):
    """SNAP's lists (and many published ones) number their nodes 1..N: node 0 was read as one more node, with a
    feature of 1 and no edge, which moved the graph's mean pool (and was an unlabelled extra row at level=node). Ids
    are names, as networkx's read_edgelist takes them, numbered in increasing order; `nodes N` makes them positions."""
    from onn.modalities.graph.network import GraphNetwork

    star = [(1, i) for i in range(2, 9)]  # 8 nodes, the hub 1
    one = written(tmp_path / "one.edges", "".join(f"{a}\t{b}\n" for a, b in star))
    zero = written(tmp_path / "zero.edges", "".join(f"{a - 1}\t{b - 1}\n" for a, b in star))
    g1, g0 = (decode(p, p.name, "none", 100) for p in (one, zero))
    assert g1.num_nodes == g0.num_nodes == 8 and edges_of(g1) == edges_of(g0) and torch.equal(g1.x, g0.x)
    torch.manual_seed(0)
    network = GraphNetwork(1, 2, conv="gcn", hidden=8, layers=2, pooling=["mean"], dropout=0.0).eval()
    one_batch = torch.zeros(8, dtype=torch.long)
    torch.testing.assert_close(network(g1.x, g1.edge_index, one_batch, 1), network(g0.x, g0.edge_index, one_batch, 1))

    sparse = written(tmp_path / "sparse.edges", "30 10\n10 20\n")  # ids with gaps, listed out of order
    assert edges_of(decode(sparse, sparse.name, "none", 100)) == [(0, 1), (0, 2), (1, 0), (2, 0)]
    positions = written(tmp_path / "positions.edges", "nodes 4\n1 2\n")  # nodes 0 and 3 have no edge
    graph = decode(positions, positions.name, "none", 100)
    assert graph.num_nodes == 4 and edges_of(graph) == [(1, 2), (2, 1)]
    for path, size in ((one, (8, 14)), (sparse, (3, 4)), (positions, (4, 2))):  # the plan counts the same nodes
        assert file_size(path) == size, path.name


def test_a_source_whose_lists_are_renumbered_says_how_many_once(tmp_path, caplog):
    """Ids were positions before (a gap or a missing node 0 an edgeless node): a source whose lists change under the
    new rule says so in one line, and the mark it counts by does not reach the graphs (a batch would collate it)."""
    for i, text in enumerate(("1 2\n2 3\n", "0 1\n1 2\n", "0 1\n5 6\n")):  # from 1, 0..N-1, with a gap
        written(tmp_path / "src" / "a" / f"{i}.edges", text)
        written(tmp_path / "src" / "b" / f"{i}.edges", text)
    with caplog.at_level("INFO", logger="onn.modalities.graph.read"):
        found = read_source(tmp_path / "src", align="none", max_nodes=100, max_bad_fraction=0.0)
    said = [r.getMessage() for r in caplog.records if "renumbered" in r.getMessage()]
    assert len(said) == 1 and "4 of 6 edge lists" in said[0] and "`nodes N`" in said[0], said
    assert not any("renumbered" in graph for split in found.values() for graph in split.graphs)


@pytest.mark.slow  # (about 15 s: a node-level training run and an inference)
def test_node_level_predictions_on_an_edge_list_are_named_by_the_files_node_ids(tmp_path):
    """task=infer at data.level=node names a row NAME#nodeID: the id the file gave the node. A list numbered 1..N
    had N + 1 rows, the first for a node 0 it never named, and a row named by position meant another node once
    ids were renumbered. The same graph numbered from 0 gives each node the same prediction."""
    from safetensors.torch import save_file

    edges = [(0, i) for i in range(1, 6)] + [(5, 6), (6, 7), (7, 8), (8, 9)]  # a star with a tail: degrees differ
    y = torch.tensor([0, 1, 1, 1, 1, 0, 0, 1, 0, 1])
    source = tmp_path / "g.safetensors"
    save_file({"x": torch.ones(10, 1), "edge_index": torch.tensor(edges).t().contiguous(), "y": y}, str(source))
    _, run_dir = run(tmp_path, f"data.source={source}", "data.level=node", "model=gcn", "trainer.max_epochs=2")
    order = [3, 7, 0, 5, 8, 1, 4, 6, 2]  # lines out of order: the ids' order is not the lines'
    written(tmp_path / "files" / "one" / "g.edges", "".join(f"{edges[i][1] + 1} {edges[i][0] + 1}\n" for i in order))
    written(tmp_path / "files" / "zero" / "g.edges", "".join(f"{edges[i][0]},{edges[i][1]}\n" for i in order))
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={tmp_path / 'files'}", name="infer")
    rows = {"one": [], "zero": []}
    for row in map(json.loads, Path(out["infer/output"]).read_text().splitlines()):
        rows[row["name"].split("/")[0]].append(row)
    assert [r["name"] for r in rows["one"]] == [f"one/g.edges#node{i}" for i in range(1, 11)]
    assert [r["name"] for r in rows["zero"]] == [f"zero/g.edges#node{i}" for i in range(10)]
    for one, zero in zip(rows["one"], rows["zero"]):
        assert one["top5"] == zero["top5"]
    assert len({r["probability"] for r in rows["zero"]}) > 1  # the nodes differ: a misalignment would show


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("source,target\n1,2\n2,3\n", (3, 4)),  # pandas' to_csv
        ("# exported by a tool\n\nsrc dst weight\n0 1 0.5\n1 2 0.5\n", (3, 4)),
        ("\ufeffSource\tTarget\r\n5\t6\r\n", (2, 2)),  # Excel: a byte-order mark and Windows line ends
        ("nodes 3 # three\n0,1 # one edge\n", (3, 2)),  # the estimate missed a commented `nodes N`
        ("0 1\r1 2\r", (3, 4)),  # old Mac line ends
    ],
    ids=["csv header", "header after comments", "excel", "comments", "cr line ends"],
)
def test_the_reader_and_the_plans_estimate_read_an_edge_list_alike(tmp_path, text, size):
    """A first line of column names, as CSV exporters write, made the reader skip the file (`not SRC DST`) while the
    plan sized it; the reader reads the file now, and the plan the same nodes and edges."""
    path = written(tmp_path / "g.edges", text)
    graph = decode(path, path.name, "none", 100)
    assert (graph.num_nodes, graph.edge_index.shape[1]) == size == file_size(path)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0 1\nsource target\n", "line 2 is 'source target', not `SRC DST`"),  # a header is the first line only
        ("0 1\n1 2.5\n", "line 2 is '1 2.5', not `SRC DST`"),
        ("0 1\n\n12 34abc\n", "line 3 is '12 34abc', not `SRC DST`"),
        ("0 1\n-1 2\n", "line 2 is '-1 2', not `SRC DST`"),
        ("nodes 3\n0 1\nnodes 4\n", "line 3 is a second `nodes N` line"),
    ],
    ids=["late header", "fraction", "trailing letters", "negative id", "two node counts"],
)
def test_a_line_the_reader_refuses_is_one_the_plan_does_not_size(tmp_path, text, reason):
    """The estimate counted any line that began with two numbers (`1 2.5`, `12 34abc`) and sized files the reader
    skips; both now read a line by the same patterns, and the reader's refusal names the file and the line."""
    path = written(tmp_path / "ring" / "bad.edges", text)
    with pytest.raises(GraphError, match=reason):
        decode(path, path.name, "none", 100)
    assert file_size(path) is None
    with pytest.raises(UserError, match=f"bad.edges: {reason}"):
        read_source(path, align="none", max_nodes=100, max_bad_fraction=0.0)


@pytest.mark.parametrize("level", ["node", "graph"])
def test_an_edge_index_that_is_not_finite_is_a_skip_that_says_so(tmp_path, level):
    """A node-level file without x counts its nodes from y and its edges: a NaN node number was a raw ValueError
    (`cannot convert float NaN to integer`) that stopped the run, and an infinite one read as a node past the rest."""
    from safetensors.torch import save_file

    path = tmp_path / "g.safetensors"
    bad = float("nan") if level == "node" else float("inf")
    save_file({"edge_index": torch.tensor([[0.0, bad], [1.0, 2.0]]), "y": torch.tensor([0, 1, 0])}, str(path))
    with pytest.raises(UserError, match="g.safetensors: its edge_index is float32 with non-finite entries"):
        read_source(path, align="none", max_nodes=100, max_bad_fraction=0.0, level=level, allow_unlabelled=True)


@pytest.mark.parametrize("conv", ["gcn", "sage", "gin", "gat"])
def test_a_bf16_network_sums_a_hubs_thousand_neighbours_in_float32(conv):
    """strategy.precision=bf16-true leaves the weights in bf16, and every convolution summed its messages (GCN its
    degrees, GAT its softmax) in bf16: a GPU's scatter adds each in bf16, whose step at 256 is 2, so a hub's 1,000
    neighbours summed to a fraction of their sum, and on a CPU too GAT's gradients were half off. The convolution
    runs in float32 on its weights' values: the messages reach the sum as float32, and the hub's logits and the
    gradients are the float32 network's."""
    from onn.modalities.graph.network import GraphNetwork

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    reference = GraphNetwork(4, 3, conv=conv, hidden=8, layers=2, dropout=0.0, norm="none", level="node").to(device)
    network = copy.deepcopy(reference).to(torch.bfloat16)
    reference.load_state_dict({k: v.float() for k, v in network.state_dict().items()})  # the same, rounded, weights
    summed: list[torch.dtype] = []
    for block in network.blocks:
        block.conv.aggr_module.register_forward_pre_hook(lambda module, args: summed.append(args[0].dtype))
    leaves = torch.arange(1, 1001)
    hub = torch.zeros_like(leaves)
    star = torch.stack([torch.cat([leaves, hub]), torch.cat([hub, leaves])]).to(device)
    x = (torch.rand(1001, 4, generator=torch.Generator().manual_seed(1)) + 0.5).bfloat16().to(device)
    logits = network(x, star)
    expected = reference(x.float(), star)
    logits[0].float().sum().backward()
    expected[0].sum().backward()
    assert logits.dtype == torch.bfloat16 and summed == [torch.float32] * 2
    torch.testing.assert_close(logits[0].float(), expected[0], rtol=0.02, atol=0.02)
    for (name, got), want in zip(network.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=0.05, atol=0.02, msg=name)
