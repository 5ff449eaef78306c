"""Predicted classes drawn on the graphs (matplotlib, networkx layouts through torch_geometric.utils.to_networkx).

Each panel is one graph, its nodes coloured by their predicted class (one colour a class, the legend names
them); where a node's true class is known, its outline has the true class's colour, so a wrong node shows two
colours. A graph with positions (torch_geometric's `pos`: a mesh's vertices) is drawn at them (x, y), seen from
the front; others by a spring layout (a force-directed one, seeded), or above SPRING_MAX_NODES nodes a spectral
one of each connected component. Large graphs are drawn with a subset of their edges.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPRING_MAX_NODES = 1500  # above this, the spring layout is too slow (20 s at 5,000 nodes): a spectral one per component
MAX_EDGES = 20000  # edges drawn per panel


def layout(graph) -> np.ndarray:
    """[nodes, 2] positions: a graph's own positions (torch_geometric's `pos`: a mesh's vertices) seen from the front;
    otherwise a layout of its edges. Node features are no positions (one-hot classes, embeddings)."""
    pos = getattr(graph, "pos", None)
    if pos is not None:
        return pos.detach().cpu().float().numpy()[:, :2]
    import networkx as nx
    from torch_geometric.utils import to_networkx

    network = to_networkx(graph, to_undirected=True)
    if graph.num_nodes <= SPRING_MAX_NODES:
        placed = nx.spring_layout(network, seed=0)
        return np.array([placed[i] for i in range(graph.num_nodes)])
    return _spectral_by_component(network)


def _spectral_by_component(network) -> np.ndarray:
    """A spectral layout of each connected component (sparse eigenvectors: about a second at 5,000 nodes), the
    components side by side in rows, each in a square whose side grows with the root of its size. A spectral
    layout of the whole graph would put each component at one point."""
    import networkx as nx

    xy = np.zeros((network.number_of_nodes(), 2))
    components = sorted((sorted(c) for c in nx.connected_components(network)), key=len, reverse=True)
    row_width = 1.2 * np.sqrt(network.number_of_nodes())
    x = y = row_height = 0.0
    for nodes in components:
        side = np.sqrt(len(nodes))
        if x > 0 and x + side > row_width:
            x, y, row_height = 0.0, y - row_height * 1.1, 0.0
        if len(nodes) > 2:
            placed = nx.spectral_layout(network.subgraph(nodes))
            cell = np.array([placed[n] for n in nodes])
            cell = (cell - cell.min(0)) / np.maximum(np.ptp(cell, 0), 1e-12)
        else:
            cell = np.array([[0.0, 0.0], [1.0, 0.0]])[: len(nodes)]
        xy[nodes] = cell * side + [x, y - side]
        x, row_height = x + side * 1.1, max(row_height, side)
    return xy


def write_picture(panels: list[tuple], path: Path) -> None:
    """A PNG of panels (graph, predicted class per node, true class per node or None, caption)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = sorted({c for _, predicted, truths, _ in panels for c in [*predicted, *(truths or [])] if c is not None})
    colours = {c: plt.get_cmap("tab10" if len(names) <= 10 else "tab20")(i % 20) for i, c in enumerate(names)}
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    size = 3.2 if len(panels) > 1 else 7.0
    figure, axes = plt.subplots(rows, columns, figsize=(size * columns, size * rows + 0.6), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (graph, predicted, truths, caption) in zip(axes.flat, panels):
        xy = layout(graph)
        edges = graph.edge_index.cpu().numpy()
        edges = edges[:, edges[0] < edges[1]][:, :MAX_EDGES]  # each undirected edge once
        segments = np.stack([xy[edges[0]], xy[edges[1]]], axis=1)
        from matplotlib.collections import LineCollection

        ax.add_collection(LineCollection(segments, colors="0.75", linewidths=0.4, zorder=1))
        fill = [colours[c] for c in predicted]
        outline = [colours[t] if t is not None else "none" for t in truths] if truths else "none"
        dot = max(2.0, min(40.0, 4000.0 / max(graph.num_nodes, 1)))
        ax.scatter(xy[:, 0], xy[:, 1], s=dot, c=fill, edgecolors=outline, linewidths=1.2, zorder=2)
        ax.set_title(caption, fontsize=9)
        ax.set_aspect("equal")
        ax.autoscale()
    handles = [Line2D([], [], marker="o", linestyle="", color=colours[c], label=c) for c in names]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(names), 8), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
