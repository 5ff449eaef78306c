"""Generated graphs: the mesh modality's primitives as vertex-edge graphs (graph level), and one graph of
communities (node level).

builtin:primitives   trimesh.creation's boxes, capsules, cones, cylinders, spheres and tori at random
                     proportions and rotations (onn/modalities/mesh/primitives.py, the same shapes and seeds
                     as `recipe=mesh_primitives`): train, and held-out test shapes from another random stream
builtin:communities  a stochastic block model (torch_geometric.utils.stochastic_blockmodel_graph): nodes in
                     `communities` classes, denser inside a community than between; each node's features are
                     a weak noisy hint of its community, so its neighbours are what classify it. Seeded
                     train/val/test masks (60/20/20).
"""

from __future__ import annotations

import torch

from onn.config.data import GraphBuiltin
from onn.errors import UserError
from onn.modalities.graph.read import Graphs, mesh_graph
from onn.models.load import seeded_draw

PRIMITIVES = "builtin:primitives"
COMMUNITIES = "builtin:communities"
BUILTINS = (PRIMITIVES, COMMUNITIES)
INSIDE, BETWEEN = 0.05, 0.01  # edge probabilities within and between communities (builtin.nodes = 600: degree ~12)
# builtin:primitives' graphs on average: the nodes and (two-way) edges of its six shapes, one of each class, as
# primitive_graphs makes them (box 8/36, capsule 2,050/12,288, cone 34/192, cylinder 66/384, sphere 642/3,840, torus
# 1,024/6,144: trimesh.creation's fixed sections, whatever the random proportions). What task=plan sizes a graph on.
PRIMITIVE_NODES, PRIMITIVE_EDGES = 638, 3814


def _count(builtin: GraphBuiltin, key: str, least: int) -> int:
    value = getattr(builtin, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"data.builtin.{key}={value!r}: give a whole number, {least} or more.")
    return value


def builtin_size(source: str, builtin: GraphBuiltin | None) -> tuple[int, int] | None:
    """(nodes, edges) of a generated set's typical graph from the config alone, nothing generated: the planner's
    sample. builtin:communities' one graph has data.builtin.nodes nodes and, in expectation, every pair of nodes
    joined (both ways) with its blocks' probability; None where data.builtin is not given."""
    if source == PRIMITIVES:
        return PRIMITIVE_NODES, PRIMITIVE_EDGES
    if source != COMMUNITIES or builtin is None:
        return None
    nodes, k = _count(builtin, "nodes", 4), _count(builtin, "communities", 2)
    sizes = [nodes // k + (1 if i < nodes % k else 0) for i in range(k)]
    inside = sum(n * (n - 1) for n in sizes)
    between = nodes * nodes - sum(n * n for n in sizes)
    return nodes, round(INSIDE * inside + BETWEEN * between)


def primitive_graphs(builtin: GraphBuiltin, align: str, max_nodes: int, seed: int) -> dict[str, Graphs]:
    """{train, test}: data.builtin.per_class shapes of each class and test_per_class held-out ones, as graphs."""
    from onn.modalities.mesh.primitives import CLASSES, TEST_SEED_OFFSET, shapes

    splits = {}
    for split, key, stream in (("train", "per_class", seed), ("test", "test_per_class", seed + TEST_SEED_OFFSET)):
        graphs, names = [], []
        for name, mesh in shapes(_count(builtin, key, 1), stream):
            graph = mesh_graph(mesh.vertices, mesh.faces, align, max_nodes)
            graph.y = torch.tensor([CLASSES.index(name.split("/")[0])])
            graphs.append(graph)
            names.append(f"{split}/{name}")
        splits[split] = Graphs(graphs, list(CLASSES), names)
    return splits


def communities(builtin: GraphBuiltin, seed: int):
    """One Data: a stochastic block model with per-node labels y, features x and train/val/test masks."""
    from torch_geometric.data import Data
    from torch_geometric.utils import stochastic_blockmodel_graph

    nodes, k, width = _count(builtin, "nodes", 4), _count(builtin, "communities", 2), _count(builtin, "features", 1)
    if nodes < 2 * k:
        raise UserError(f"data.builtin.nodes={nodes}: give at least two nodes for each of the {k} communities.")
    generator = torch.Generator().manual_seed(seed)
    sizes = [nodes // k + (1 if i < nodes % k else 0) for i in range(k)]
    probs = torch.full((k, k), BETWEEN).fill_diagonal_(INSIDE)
    # stochastic_blockmodel_graph draws from torch's global generator: seeded here, and given back afterwards
    with seeded_draw(seed, torch.device("cpu")):
        edge_index = stochastic_blockmodel_graph(sizes, probs, directed=False)
    y = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    centres = torch.randn(k, width, generator=generator) * 0.5
    x = centres[y] + torch.randn(nodes, width, generator=generator)
    order = torch.randperm(nodes, generator=generator)
    masks = {}
    for name, (lo, hi) in {"train_mask": (0.0, 0.6), "val_mask": (0.6, 0.8), "test_mask": (0.8, 1.0)}.items():
        mask = torch.zeros(nodes, dtype=torch.bool)
        mask[order[int(lo * nodes) : int(hi * nodes)]] = True
        masks[name] = mask
    return Data(x=x, edge_index=edge_index, y=y, **masks)
