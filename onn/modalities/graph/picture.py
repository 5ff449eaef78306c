"""Predicted classes drawn on the graphs (matplotlib, networkx layouts through torch_geometric.utils.to_networkx).

Each panel is one graph, its nodes coloured by their predicted class (one colour a class, the legend names
them); where a node's true class is known, its outline has the true class's colour, so a wrong node shows two
colours. A graph whose first node features are positions (meshes) is drawn at them (x, y), seen from the front;
others by a spring layout (a force-directed one, seeded). Large graphs are drawn with a subset of their edges.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPRING_MAX_NODES = 1500  # above this, the spring layout is too slow: the first two features place the nodes
MAX_EDGES = 20000  # edges drawn per panel


def layout(graph) -> np.ndarray:
    """[nodes, 2] positions: mesh graphs (3 or more features, the first the position) at their x, y."""
    x = graph.x.detach().cpu().float().numpy()
    if x.shape[1] >= 3 or graph.num_nodes > SPRING_MAX_NODES:
        return x[:, :2] if x.shape[1] >= 2 else np.stack([np.arange(len(x)), x[:, 0]], axis=1)
    import networkx as nx
    from torch_geometric.utils import to_networkx

    placed = nx.spring_layout(to_networkx(graph, to_undirected=True), seed=0)
    return np.array([placed[i] for i in range(graph.num_nodes)])


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
