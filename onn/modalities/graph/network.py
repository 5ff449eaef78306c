"""ONN's graph network: torch_geometric's convolutions (GCN, GraphSAGE, GIN, GAT) in repeated blocks, pooled.

    blocks   `layers` x GraphBlock: conv -> BatchNorm (NodeNorm) -> ReLU -> dropout (the LayerMap's blocks)
    pool     graph level: torch_geometric's global mean / max / add pools of each graph's nodes, side by side
    head     Linear -> ReLU -> dropout -> Linear: one row of logits per graph (graph level) or per node

forward(x, edge_index, batch=None, graphs=None): `batch` assigns nodes to the graphs of a torch_geometric Batch,
`graphs` says how many there are (else the pools count them from `batch`, a value read back from the device, a
wait for a GPU at every step); without `batch` the nodes are one graph (what ONNX export traces: one graph per
call, its nodes and edges dynamic).

GCN and GAT add each node's self-loop themselves (a concatenated arange): torch_geometric's own removes existing
loops first, a data-dependent shape that torch.export cannot trace and a GPU computes only after the host has read
how many remain (a wait at every layer of every step). Graphs arrive without self-loops (read.py).

`ListedEdges` is the network as the ONNX export holds it: it takes a graph's edges as a file lists them and
prepares them as the reader does (both directions, no self-loops, no repeats), so the exported model gives what
task=infer gives for the same file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from onn.modalities.graph.modality import CONVS


def make_conv(kind: str, width_in: int, width_out: int, heads: int) -> nn.Module:
    """torch_geometric's convolution `kind` from width_in to width_out features."""
    from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

    if kind == "gcn":
        return GCNConv(width_in, width_out, add_self_loops=False)
    if kind == "sage":
        return SAGEConv(width_in, width_out)
    if kind == "gin":
        mlp = nn.Sequential(nn.Linear(width_in, width_out), nn.ReLU(), nn.Linear(width_out, width_out))
        return GINConv(mlp)  # GIN-0 (eps fixed at 0): a trained eps does not pass torch.export
    if kind == "gat":
        return GATConv(width_in, width_out // heads, heads=heads, add_self_loops=False)
    raise ValueError(f"no convolution {kind!r}; one of {', '.join(CONVS)}")


class NodeNorm(nn.BatchNorm1d):
    """BatchNorm over a batch's nodes. A training batch of one node (a one-node graph at data.batch_size=1) has no
    batch statistics: it is normalised by the running ones, as in evaluation and as torch_geometric's
    BatchNorm(allow_single_element=True) does; its state dict stays BatchNorm1d's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] <= 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class GraphBlock(nn.Module):
    """One message-passing step: conv, norm, ReLU, dropout."""

    def __init__(self, kind: str, width_in: int, width_out: int, heads: int, norm: str, dropout: float):
        super().__init__()
        self.kind = kind
        self.conv = make_conv(kind, width_in, width_out, heads)
        self.norm = NodeNorm(width_out) if norm == "batch" else nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        if self.kind in ("gcn", "gat"):  # every node convolves (attends to) itself too
            loops = torch.arange(x.shape[0], device=x.device).unsqueeze(0).expand(2, -1)
            edge_index = torch.cat([edge_index, loops], dim=1)
        # neighbours summed in float32: a GPU's scatter adds each message in the messages' dtype, and bf16's step at
        # 256 is 2, so a node of 1,000 neighbours summed ones to 256 (a CPU's scatter sums in float32). Under
        # autocast GIN and SAGE sum (average) the block's input, in bf16 after a block without a norm: it goes in
        # as float32. Under bf16-true (16-true) the weights are bf16 too, and GCN's degrees, GAT's softmax and every
        # message would be summed in bf16: the convolution runs on float32 copies of its weights, its output back
        # in bf16 for the norm (as the pools do)
        if torch.is_autocast_enabled(x.device.type):
            out = self.conv(x.float(), edge_index)
        elif x.dtype in (torch.bfloat16, torch.float16):
            out = in_float32(self.conv, x, edge_index).to(x.dtype)
        else:
            out = self.conv(x, edge_index)
        return self.dropout(torch.relu(self.norm(out)))


def in_float32(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """module(*inputs) computed in float32 whatever the dtype of its weights (gradients reach them through the
    casts): floating inputs, parameters and buffers as float32 copies."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    return functional_call(module, state, tuple(t.float() if t.is_floating_point() else t for t in inputs))


class GraphNetwork(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        conv: str = "gcn",
        hidden: int = 64,
        layers: int = 3,
        heads: int = 4,
        dropout: float = 0.1,
        norm: str = "batch",
        pooling: list[str] | tuple[str, ...] = ("mean", "max"),
        level: str = "graph",
    ):
        super().__init__()
        self.level, self.pooling = level, list(pooling)
        widths = [in_channels] + [hidden] * layers
        self.blocks = nn.ModuleList(
            GraphBlock(conv, widths[i], widths[i + 1], heads, norm, dropout) for i in range(layers)
        )
        width = hidden * (len(self.pooling) if level == "graph" else 1)
        self.head = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes)
        )

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None, graphs: int | None = None
    ) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, edge_index)
        if self.level == "graph":
            # in float32: under bf16 autocast on a GPU the mean's node count is summed in bf16, whose step at 256
            # is 2, so a graph of 2,000 nodes would be averaged over 256 (a CPU's scatter sums in float32)
            with torch.autocast(x.device.type, enabled=False):  # (then back in the blocks' dtype, the head's)
                x = torch.cat([pool(kind)(x.float(), batch, graphs) for kind in self.pooling], dim=1).to(x.dtype)
        return self.head(x)


def pool(kind: str):
    from torch_geometric.nn import global_add_pool, global_max_pool, global_mean_pool

    return {"mean": global_mean_pool, "max": global_max_pool, "sum": global_add_pool}[kind]


class ListedEdges(nn.Module):
    """The network on one graph whose edges are given as a file lists them: one direction or both, self-loops and
    repeats allowed. They are prepared as read.make_graph prepares them for training and task=infer (every edge
    both ways, no self-loops, each edge once), with shapes that do not depend on the data, so torch.export traces
    it: a self-loop or a repeated edge is not removed but sent to one extra node, alone in a graph of its own (or,
    per node, after the graph's nodes), whose output is dropped. No other node reads it, so the graph's own nodes
    compute what they compute on the prepared edges."""

    def __init__(self, network: GraphNetwork):
        super().__init__()
        self.network = network

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        nodes = x.shape[0]
        both = torch.cat([edge_index, edge_index.flip(0)], dim=1)
        key = both[0] * (nodes + 1) + both[1]
        order = torch.argsort(key)  # (not stable=True: ONNX has no stable sort; which copy of an edge stays is moot)
        ordered = key[order]
        repeated = torch.cat([ordered[:1] != ordered[:1], ordered[1:] == ordered[:-1]])  # after an equal one
        dropped = torch.zeros_like(repeated).scatter(0, order, repeated) | (both[0] == both[1])
        both = torch.where(dropped, torch.full_like(both, nodes), both)
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
        if self.network.level == "graph":
            batch = (torch.arange(nodes + 1, device=x.device) == nodes).long()  # the extra node: graph 1
            return self.network(x, both, batch, 2)[:1]
        return self.network(x, both)[:nodes]
