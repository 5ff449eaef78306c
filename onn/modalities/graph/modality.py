"""Graphs: graph classification (one class per graph) and node classification (one class per node) through
torch_geometric: its Data and Batch, its GCN / GraphSAGE / GIN / GAT convolutions and global pools.

The graph modality: class folders of graph files (edge lists, safetensors tensors, meshes read as their
vertex-edge graphs; read.py), generated graphs (builtin.py), ONN's graph network (network.py), the shared
classifier's training, evaluation and inference (onn/modalities/classification.py, with graph batches: tasks.py)
and predictions drawn on the graph (picture.py).

data=auto: a folder of .edges or graph .safetensors files is graph data. A folder of meshes is the mesh
modality's (PointNet on sampled points) unless the command line names a graph model (model=gcn, model=gin, ...):
then it is read as graphs. data=graph always reads it as graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.data import GraphData
from onn.config.model import GraphNetworkConfig
from onn.data.files import first_names
from onn.errors import UserError
from onn.modalities.base import ClassifierModality, RunConfig

LEVELS = ("graph", "node")  # data.level
CONVS = ("gcn", "sage", "gin", "gat")  # model.source: pyg:NAME
POOLS = ("mean", "max", "sum")  # model.pooling
NORMS = ("batch", "none")  # model.norm
SNIFF_FILES = 2000  # file names looked at when deciding whether a folder holds graphs
log = logging.getLogger("onn")


class GraphModality(ClassifierModality):
    name = "graph"
    data_schema = GraphData
    model_schema = GraphNetworkConfig
    default_data = "graph"
    default_model = "gin"
    description = "graph and node classification (edge lists, graph tensors, meshes as graphs)"
    builtins = ("communities",)
    several_graphs = None  # a graph network exports its own way
    # asked after the mesh modality (a folder of meshes is its, unless the command line names a graph model) and,
    # registered before text, ahead of the text sniffer that reads any UTF-8 file (an edge list is UTF-8)
    sniff_priority = -1
    implementation = "onn.modalities.graph.tasks"

    def sniff(self, path: Path) -> str | None:
        from onn.modalities.graph.read import TENSOR_SUFFIXES, is_graph_name
        from onn.modalities.mesh.modality import MeshModality

        if path.is_file() and is_graph_name(path.name):
            if path.suffix.lower() in TENSOR_SUFFIXES:
                return "a graph's tensors (x, edge_index)" if _holds_edges(path) else None
            return f"a graph file ({path.suffix.lower()})"
        if path.is_dir():
            names = first_names(path, SNIFF_FILES)
            graphs = [n for n in names if is_graph_name(n)]
            tensors = [n for n in graphs if Path(n).suffix.lower() in TENSOR_SUFFIXES]
            if tensors and not _holds_edges(path / tensors[0]):
                return None  # model weights, not graphs
            if len(graphs) >= 2 and len(graphs) * 2 >= len(names):
                return f"{len(graphs)}{'+' if len(names) >= SNIFF_FILES else ''} graph files"
        reason = MeshModality().sniff(path)  # meshes read as vertex-edge graphs (when a graph model asks)
        return f"{reason}, read as vertex-edge graphs" if reason else None

    def check(self, config: ONNConfig) -> None:
        data: GraphData = config.data
        model: GraphNetworkConfig = config.model
        if not isinstance(model, GraphNetworkConfig):
            raise UserError(
                f"model={model.name} is not a graph network: use model=gcn, graphsage, gin or gat with graph data."
            )
        if config.strategy.name == "linear_probe":
            raise UserError(
                "strategy=linear_probe needs a pretrained image backbone; train a graph network with strategy=full."
            )
        if data.level not in LEVELS:
            raise UserError(f"data.level={data.level!r}: give graph (a class per graph) or node (a class per node).")
        from onn.modalities.graph.builtin import COMMUNITIES, PRIMITIVES

        if data.source == COMMUNITIES and data.level != "node":
            raise UserError(f"data.source={COMMUNITIES} is one graph whose nodes are classified: set data.level=node.")
        if data.source == PRIMITIVES and data.level != "graph":
            raise UserError(f"data.source={PRIMITIVES} is shapes classified whole: set data.level=graph.")
        if data.align not in ("none", "pca"):
            raise UserError(f"data.align={data.align!r}: give none or pca.")
        if data.level == "node" and config.task.adapt_norm:
            raise UserError(
                "task.adapt_norm=true measures the norms again on the test data, but a node-level graph's test "
                "nodes share one graph with its training nodes: set task.adapt_norm=false."
            )
        for key in ("val_source", "test_source") if data.level == "node" else ():  # (read nowhere: ignored)
            if getattr(data, key) and not scores_whole_graph(config):
                raise UserError(
                    f"data.{key}={getattr(data, key)}: data.level=node holds out nodes of the one data.source graph "
                    f"(its val_mask / test_mask, or data.val_split); remove data.{key}, or use data.level=graph."
                )
        if data.batch_groups:
            raise UserError("data.batch_groups does not apply to graphs; set data.batch_groups=null.")
        if config.export.name == "omny":  # refused before training, not after it
            raise UserError(
                "export=omny is not available for a graph network; use export=onnx (nodes and edges stay dynamic) "
                "or export=safetensors."
            )
        if config.task.mixup:  # every task a classifier runs extends train's keys
            raise UserError(
                f"task.mixup={config.task.mixup}: two graphs' nodes and edges do not blend; set task.mixup=0."
            )
        conv = str(model.source).partition(":")[2]
        if not str(model.source).startswith("pyg:") or conv not in CONVS:
            raise UserError(f"model.source={model.source!r}: give pyg:gcn, pyg:sage, pyg:gin or pyg:gat.")
        for key, value, least in (("hidden", model.hidden, 1), ("layers", model.layers, 1), ("heads", model.heads, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserError(f"model.{key}={value!r}: give a whole number, {least} or more.")
        if conv == "gat" and model.hidden % model.heads:
            raise UserError(f"model.hidden={model.hidden} must be a multiple of model.heads={model.heads} (gat).")
        if model.norm not in NORMS:
            raise UserError(f"model.norm={model.norm!r}: give batch or none.")
        if not model.pooling or any(p not in POOLS for p in model.pooling):
            raise UserError(f"model.pooling={list(model.pooling)}: give one or more of {', '.join(POOLS)}.")

    def datamodule(self, config: ONNConfig, device: str):
        from onn.modalities.graph.dataset import GraphDataModule

        data = dataclasses.replace(config.data, align=trained_align(config))
        return GraphDataModule(data, device, seed=int(config.seed), score_all=scores_whole_graph(config))

    def network(self, model_cfg: GraphNetworkConfig, inputs: dict[str, Any]):
        from onn.modalities.graph.network import GraphNetwork

        network = GraphNetwork(
            in_channels=int(inputs["input_shape"][0]),
            num_classes=len(inputs["classes"]),
            conv=str(model_cfg.source).partition(":")[2],
            hidden=int(model_cfg.hidden),
            layers=int(model_cfg.layers),
            heads=int(model_cfg.heads),
            dropout=float(model_cfg.dropout),
            norm=model_cfg.norm,
            pooling=list(model_cfg.pooling),
            level=inputs["level"],
        )
        if model_cfg.weights:
            from onn.models.vision import load_weights

            load_weights(network, model_cfg.weights)
        return network

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        """data.level and data.align, saved in `inputs`: eval and infer turn a mesh's positions as training did."""
        return {"level": config.data.level, "align": str(dm.cfg.align)}

    def neutral_stats(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        """Classes and node features from the config alone: the generated sets' own, else data.classes or 10."""
        from onn.modalities.graph.builtin import COMMUNITIES, PRIMITIVES
        from onn.modalities.mesh.primitives import CLASSES

        data: GraphData = config.data
        features = {PRIMITIVES: 3, COMMUNITIES: data.builtin.features if data.builtin else 1}.get(data.source, 3)
        if data.classes:
            classes = [str(c) for c in data.classes]
        elif isinstance(data.num_classes, int):
            classes = [str(i) for i in range(data.num_classes)]
        elif data.source == COMMUNITIES and data.builtin:
            classes = [str(i) for i in range(data.builtin.communities)]
        else:
            classes = list(CLASSES) if data.source == PRIMITIVES else [str(i) for i in range(10)]
        return {"classes": classes, "input_shape": [int(features)], "level": data.level}

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig):
        from onn.modalities.graph.read import read_source

        data: GraphData = config.data
        return read_source(
            source,
            align=inputs["align"] if "align" in inputs else trained_align(config),  # (checkpoints before it was saved)
            max_nodes=int(data.max_nodes),
            max_bad_fraction=float(data.max_bad_fraction),
            allow_unlabelled=True,
            key="task.input",
            level=inputs["level"],
        )

    def pair_side(self, config):
        raise UserError(f"{self.name} data ({self.description}) cannot be one side of a pair.")

    def classifier_class(self):
        from onn.modalities.graph.tasks import GraphClassifier

        return GraphClassifier

    def export_network(self, config: ONNConfig, module, run_dir: Path) -> dict[str, Any] | None:
        from onn.modalities.graph.tasks import export_network

        return export_network(self, config, module, run_dir)


def trained_align(config: RunConfig) -> str:
    """The data.align a mesh's node features are turned by: with ckpt=, its model's (it learned positions turned so,
    and `data=graph` on the command line brings the default, pca), said where the data config's differs."""
    from onn.training.classifier import trained_config

    given = str(config.data.align)
    saved = trained_config(config)
    if saved is None:
        return given
    trained = str(saved["inputs"].get("align") or saved["data"]["align"])  # (inputs before align was kept in them)
    if trained != given:
        log.warning(
            "ckpt %s: turning mesh graphs' positions as its model was trained (data.align=%s), not as the data "
            "config says (data.align=%s)",
            config.ckpt,
            trained,
            given,
        )
    return trained


def scores_whole_graph(config: ONNConfig) -> bool:
    """Whether task=eval scores the whole of its data.source: the runner sets data.val_source to a data.source the
    command line gives (onn.app.score_all_given). Graph-level data is then every graph of every split folder, and a
    node-level graph every labelled node."""
    data: GraphData = config.data
    return config.task.name == "eval" and bool(data.source) and str(data.val_source) == str(data.source)


def _holds_edges(path: Path) -> bool:
    """Whether a .safetensors file's header names an edge_index tensor (read.HEADER_BYTES of it at most)."""
    from onn.modalities.graph.read import tensor_shapes

    return "edge_index" in (tensor_shapes(path) or {})
