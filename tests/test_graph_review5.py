"""Graphs as users hand them over: an edge list saved with a byte-order mark, node numbers past int64, odd
safetensors tensors (a scalar x, x without features, a fractional edge_index), graph-level files carrying node
masks or mesh positions beside files without them, a node-level file without x whose last nodes have no edge,
and message passing under bf16 autocast (its sums in float32)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import compose
from test_graph import ring, run, write_edges, write_rings_and_stars

from onn.errors import UserError
from onn.modalities.graph.read import decode, read_source


def test_an_edge_list_saved_with_a_byte_order_mark_reads_as_its_edges(tmp_path):
    """Notepad and Excel write UTF-8 with a byte-order mark: its first line is still the first edge."""
    path = tmp_path / "g.edges"
    path.write_bytes("\ufeff0,1\r\n1,2\r\n".encode())
    graph = decode(path, path.name, "none", 100)
    assert graph.num_nodes == 3
    assert sorted(map(tuple, graph.edge_index.t().tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1)]


def test_node_numbers_past_int64_or_max_nodes_are_a_skip_that_says_so(tmp_path):
    """A 20-digit id (a hash) was a raw OverflowError from torch.tensor that stopped the run; a `nodes N` past
    data.max_nodes says so. Ids are names (renumbered in increasing order): a sparse id is no count of nodes."""
    for i in range(20):
        write_edges(tmp_path / "ring" / f"{i}.edges", ring(5))
    (tmp_path / "ring" / "hash.edges").write_text("0 1\n98765432109876543210 2\n")
    (tmp_path / "ring" / "sparse.edges").write_text("0 1\n5000000000 2\n")  # four nodes
    (tmp_path / "ring" / "large.edges").write_text("nodes 5000000001\n0 1\n")
    (tmp_path / "ring" / "negative.edges").write_text("nodes -3\n")  # was a RuntimeError from torch.ones(-3, 1)
    found = read_source(tmp_path, align="none", max_nodes=100, max_bad_fraction=0.3)
    assert sorted(found["all"].skipped) == [
        "ring/hash.edges: line 2 numbers a node 98765432109876543210: node ids are whole numbers up to "
        "9223372036854775807 (int64); renumber its nodes",
        "ring/large.edges: has 5000000001 nodes, more than data.max_nodes=100",
        "ring/negative.edges: its `nodes -3` line gives a negative count of nodes",
    ]
    assert found["all"].graphs[found["all"].names.index("ring/sparse.edges")].num_nodes == 4
    with pytest.raises(UserError, match=r"hash.edges: line 2 numbers a node 98765432109876543210"):
        read_source(tmp_path / "ring" / "hash.edges", align="none", max_nodes=100, max_bad_fraction=0.05)


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({"x": torch.tensor(1.0)}, "its x has shape [], not [nodes, features] with one feature or more"),
        ({"x": torch.zeros(3, 0)}, "its x has shape [3, 0], not [nodes, features] with one feature or more"),
        ({"edge_index": torch.tensor([[0.0, 1.5], [1.0, 2.0]])}, "its edge_index is float32 with fractional node"),
    ],
    ids=["scalar x", "x of no features", "fractional edge_index"],
)
def test_safetensors_whose_x_or_edge_index_cannot_be_a_graph_are_skipped_with_their_reason(tmp_path, tensors, reason):
    """A scalar x was a raw IndexError; an x of no features trained a network of 0 inputs; a fractional
    edge_index was silently truncated to other nodes."""
    from safetensors.torch import save_file

    path = tmp_path / "odd.safetensors"
    save_file({"x": torch.ones(3, 2), "edge_index": torch.tensor([[0, 1], [1, 2]]), **tensors}, str(path))
    with pytest.raises(UserError, match=re.escape(f"odd.safetensors: {reason}")):
        read_source(path, align="none", max_nodes=100, max_bad_fraction=0.0, allow_unlabelled=True)


def test_whole_numbered_edge_index_of_any_dtype_reads_as_its_edges(tmp_path):
    from safetensors.torch import save_file

    for dtype in (torch.float64, torch.int32, torch.uint8):
        path = tmp_path / f"{dtype}.safetensors"
        save_file(
            {"x": torch.ones(3, 2, dtype=torch.float16), "edge_index": torch.tensor([[0, 1], [1, 2]]).to(dtype)},
            str(path),
        )
        graph = decode(path, path.name, "none", 100)
        assert graph.x.dtype == torch.float32 and graph.edge_index.tolist() == [[0, 1, 1, 2], [1, 0, 2, 1]]


def test_a_graph_folder_whose_files_carry_masks_or_positions_beside_others_collates_and_trains(tmp_path):
    """A graph-level .safetensors file's train_mask (a node-level file moved into a class folder), or a mesh's
    positions beside tensors of as many features, was kept on some graphs and not others: torch_geometric's
    Batch failed with KeyError: 'train_mask' (or 'pos') at the first batch that mixed them."""
    from safetensors.torch import save_file

    from onn.modalities.graph.dataset import as_batch
    from onn.modalities.mesh.primitives import write_primitives

    data = write_rings_and_stars(tmp_path / "train", 8, 0)
    for kind, edges in (("ring", ring(6)), ("star", [(0, i) for i in range(1, 6)])):
        for i in range(8):
            tensors = {"x": torch.ones(6, 1), "edge_index": torch.tensor(edges).t().contiguous()}
            save_file(
                {**tensors, "train_mask": torch.ones(6, dtype=torch.bool)}, str(data / kind / f"m{i}.safetensors")
            )
    graphs = read_source(data, align="none", max_nodes=100, max_bad_fraction=0.0)["all"].graphs
    for order in (graphs, graphs[::-1]):
        assert as_batch(order)[0].num_graphs == len(graphs)
    metrics, _ = run(tmp_path, f"data.source={data}", "trainer.max_epochs=2")
    assert metrics["steps"] > 0 and metrics["items_skipped"] == 0

    shapes = tmp_path / "shapes"
    write_primitives(shapes, per_class=1, seed=0, file_types=("obj",))
    save_file(
        {"x": torch.randn(4, 3), "edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]])},
        str(shapes / "box" / "t.safetensors"),
    )
    graphs = read_source(shapes, align="none", max_nodes=10_000, max_bad_fraction=0.0)["all"].graphs
    for order in (graphs, graphs[::-1]):
        assert as_batch(order)[0].num_graphs == len(graphs)


def test_a_node_level_file_without_x_has_as_many_nodes_as_labels(tmp_path):
    """Without x every node's feature is 1, and the nodes are y's: its last nodes may have no edge (the plan sizes
    it so). The reader counted the nodes from the largest edge_index entry and refused y as too long."""
    from safetensors.torch import save_file

    from onn.modalities.graph.dataset import GraphDataModule

    y = torch.arange(40) % 2
    save_file({"edge_index": torch.tensor(ring(36)).t().contiguous(), "y": y}, str(tmp_path / "g.safetensors"))
    cfg = compose("data=graph", "model=gcn", f"data.source={tmp_path / 'g.safetensors'}", "data.level=node")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    graph = dm.splits["train"].resident[0]
    assert graph.num_nodes == 40 and graph.x.shape == (40, 1) and torch.equal(graph.y, y)


def test_a_node_level_file_whose_y_is_shorter_than_its_nodes_says_so():
    """A y shorter than the nodes the edges name (a graph's one class, or labels of some nodes) is named as such: with
    y setting the node count, it read as an edge pointing past the file's nodes."""
    from safetensors.torch import save

    from onn.modalities.graph.read import GraphError, read_tensors

    payload = save({"edge_index": torch.tensor(ring(36)).t().contiguous(), "y": torch.tensor([1])})
    with pytest.raises(GraphError, match=r"has y of 1 labels for its 36 nodes \(level=node\)"):
        read_tensors(payload, 10_000, "node")


@pytest.mark.parametrize("conv", ["gin", "sage"])
def test_message_passing_sums_in_float32_under_bf16_autocast(conv):
    """After a first block the nodes' features are bf16 under bf16-mixed (BatchNorm keeps its input's dtype), and
    GIN sums (GraphSAGE averages) them: a GPU's scatter adds each message in bf16, whose step at 256 is 2, so a
    node's 1,000 neighbours summed to 256. The block hands its convolution float32, as the pools are."""
    from onn.modalities.graph.network import GraphNetwork

    device = "cuda" if torch.cuda.is_available() else "cpu"
    network = GraphNetwork(3, 2, conv=conv, hidden=8, layers=3).to(device)
    summed: list[torch.dtype] = []
    for block in network.blocks:
        block.conv.aggr_module.register_forward_pre_hook(lambda module, args: summed.append(args[0].dtype))
    leaves = torch.arange(1, 1001)
    star = torch.stack([torch.cat([leaves, torch.zeros_like(leaves)]), torch.cat([torch.zeros_like(leaves), leaves])])
    x = torch.ones(1001, 3, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = network(x, star.to(device), torch.zeros(1001, dtype=torch.long, device=device), 1)
    logits.float().sum().backward()
    assert summed == [torch.float32] * 3
