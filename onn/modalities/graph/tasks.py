"""The graph modality's tasks: the shared classifier's (onn/modalities/classification.py) with graph batches.

train and eval are the shared ones, run with GraphClassifier (a Classifier whose batches are torch_geometric
Batches) on the GraphDataModule. What differs is here:

  plan    the network (with ckpt, the checkpoint's) sized on a graph of the data's size, read without decoding it
          (plan_sample): a generated set's from data.builtin, a graph file's or a batch of a folder's (headers and
          edge-list lines); a level=node step is its one graph. PLAN_NODES nodes (PLAN_DEGREE edges a node) only
          where nothing can be known (an archive, meshes); the plan's reasons say which
  infer   predictions.jsonl (one row a graph, or a node for level=node) and a PNG of the predicted classes
          drawn on the graphs; files that are no usable graph are skipped, each with its reason
  export  ONNX of one graph per call: inputs x [nodes, features] and edge_index [2, edges] as a file lists them
          (network.ListedEdges prepares them as the reader does), both dynamic, checked in onnxruntime against
          torch (export/max_abs_diff), what it takes written into the file; safetensors as the shared export
          writes it
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onn.config import ONNConfig
from onn.config.data import GraphData, eval_batch
from onn.config.export import OnnxExport, SafetensorsExport
from onn.config.model import GraphNetworkConfig
from onn.config.task import InferTask
from onn.data.files import existing_source, write_jsonl
from onn.data.labelled import check_bad
from onn.data.resident import by_position, planned_val_split
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.modalities.base import ClassifierModality, Job
from onn.modalities.classification import evaluate, export, load_trained, saved_inputs, train
from onn.modalities.graph.dataset import as_batch
from onn.planning.plan import make_plan
from onn.planning.spec import ModelSpec, network_spec
from onn.training.checkpoints import resolve as resolve_checkpoint
from onn.training.classifier import Classifier
from onn.training.metrics import ranked

__all__ = ["GraphClassifier", "evaluate", "export", "infer", "plan", "train"]
log = logging.getLogger("onn")
PLAN_NODES, PLAN_DEGREE = 1024, 6  # the graph task=plan sizes a network on where the data's size cannot be known
SIZED_FILES, LISTED = 256, 20_000  # graph files whose sizes a plan reads, spread over a folder's first LISTED files
SIZED_BYTES = 64 * 2**20  # edge-list text a plan reads at most (after the first file)
# the largest graph a plan runs the network on (one thread); a larger one is sized on a copy scaled down to this, its
# counts scaled back up: a message-passing network's activations and FLOPs grow with its nodes and edges
RUN_NODES, RUN_EDGES = 2048, 16_384
TOP_K = 5
PICTURED = 16  # graphs drawn in infer's picture
READS_SOURCE = ("train", "plan", "eval")  # the tasks that read data.source (infer reads task.input; export, none)


class GraphClassifier(Classifier):
    """The shared classifier on (Batch, labels): the network runs on the batch's nodes and edges (and, for
    graph classification, pools by its graph index); a node-level batch scores only its split's nodes (by index:
    a boolean mask's selection on a GPU reads the mask back)."""

    describes = "ONN's graph classifier"

    def prepare(self, batch, train: bool):
        return batch

    def samples(self, batch) -> int:
        """Graphs; a node-level split's batch is one graph, and its samples are the split's nodes."""
        return int(batch.nodes.numel()) if "nodes" in batch else batch.num_graphs

    def forward(self, batch) -> torch.Tensor:
        x = batch.x.to(self.dtype)  # the weights' dtype: bf16 under strategy.precision=bf16-true, the files' float32
        if self.model.level == "graph":  # the graph count from the host: pooling reads no value from the device
            logits = self.model(x, batch.edge_index, batch.batch, batch.num_graphs)
        else:
            logits = self.model(x, batch.edge_index)
        return logits.index_select(0, batch.nodes) if "nodes" in batch else logits


class OneGraph(nn.Module):
    """The network on one fixed graph, called with its node features alone: what network_spec sizes."""

    def __init__(self, network: nn.Module, edge_index: torch.Tensor):
        super().__init__()
        self.network, self.edge_index = network, edge_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x, self.edge_index)


def plan_graph(nodes: int, degree: int) -> torch.Tensor:
    """edge_index of a ring with chords: every node joined to the next degree/2 (both directions)."""
    return sized_graph(nodes, nodes * degree)


def sized_graph(nodes: int, edges: int) -> torch.Tensor:
    """edge_index of about `edges` directed edges (rounded up to pairs, both directions) among `nodes` nodes: each
    node joined to the next, then the one after, and so on until there are enough."""
    pair = torch.arange(-(-edges // 2))
    source = pair % nodes
    target = (source + 1 + pair // nodes) % nodes
    return torch.cat([torch.stack([source, target]), torch.stack([target, source])], dim=1)


@dataclass(frozen=True)
class PlanSample:
    """The graph a plan sizes one training sample on, and what its size was taken from (said in the plan)."""

    nodes: int
    edges: int
    source: str


def plan_sample(data: GraphData) -> PlanSample:
    """The size of a graph of the data the config names, read without decoding it (the plan comes before the data
    is read, and stays fast): a generated set's from data.builtin, else a batch's share of a file's or folder's graph
    files (read.source_sizes; _batch_share); PLAN_NODES nodes, PLAN_DEGREE edges a node, where nothing can be known."""
    from onn.modalities.graph.builtin import BUILTINS, builtin_size
    from onn.modalities.graph.read import source_sizes

    source = str(data.source) if data.source else ""
    if source in BUILTINS:
        size = builtin_size(source, data.builtin)
        if size is not None:
            return PlanSample(*size, f"{source}'s graphs as data.builtin configures them")
    elif source and not source.startswith("builtin:"):
        sizes = source_sizes(source, SIZED_FILES, LISTED, SIZED_BYTES)
        if sizes:
            batch = max(1, int(data.batch_size))
            nodes, edges = (_batch_share([size[k] for size in sizes], batch) for k in (0, 1))
            said = (
                "data.source's one graph file (its header or lines, not decoded)"
                if len(sizes) == 1
                else f"{len(sizes)} graph files of data.source (headers or lines, not decoded): a batch of their mean "
                "size that holds the largest"
            )
            return PlanSample(nodes, edges, said)
    why = "data.source is not set"
    if source:
        why = "no file of data.source gives its size without being decoded (meshes, an archive)"
    return PlanSample(PLAN_NODES, PLAN_NODES * PLAN_DEGREE, f"a stand-in, as {why}")


def _batch_share(sizes: list[int], batch: int) -> int:
    """One sample's share of a batch that holds the largest graph among mean-sized ones: memory peaks at the batch
    that holds the largest, which a plan on the mean would not fit (a folder of small graphs and one large)."""
    return math.ceil((sum(sizes) / len(sizes) * (batch - 1) + max(sizes)) / batch)


def plan(m: ClassifierModality, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
    """The plan of a graph network on a sample of the data's size (plan_sample): its activations and FLOPs grow with
    the graph's nodes and edges, so a fixed stand-in graph mispredicted the run by the data's size over it."""
    planned_val_split(config)  # before any graph is read, as classification.plan does for the others
    source = str(config.data.source or "")
    if source and not source.startswith("builtin:") and config.task.name in READS_SOURCE:
        from onn.modalities.graph.read import HELP

        # a path that is not there was planned on a stand-in graph and refused only once the run read it
        existing_source(source, "data.source", HELP)
    inputs = planned_inputs(m, config)
    model_cfg: GraphNetworkConfig = config.model
    network = m.network(model_cfg, inputs)  # small: built for real, the graph's index ops have no meta kernels
    blocks = model_cfg.layer_map.blocks
    sample = plan_sample(config.data)
    scale = max(1.0, sample.nodes / RUN_NODES, sample.edges / RUN_EDGES)
    nodes, edges = max(1, round(sample.nodes / scale)), round(sample.edges / scale)
    spec = network_spec(
        OneGraph(network, sized_graph(nodes, edges)),
        torch.zeros(nodes, *inputs["input_shape"]),
        str(model_cfg.name),
        pretrained=bool(model_cfg.weights),
        blocks_path=f"network.{blocks}" if blocks else None,
    )
    spec = scaled(spec, scale)
    said = f"sized on a graph of {sample.nodes:,} nodes and {sample.edges:,} edges: {sample.source}"
    if inputs["level"] == "node":  # a step is the one graph, whatever data.batch_size says
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=1))
        said += "; data.level=node: a step is that one graph"
    log.info("plan: %s", said)
    made = make_plan(config, hardware, spec, use_tuned=use_tuned)
    made.reasons.append(said)
    return made, spec


def scaled(spec: ModelSpec, scale: float) -> ModelSpec:
    """A spec counted on a graph `scale` times smaller, as the full graph's: its per-sample figures grow with it."""
    if scale == 1:
        return spec
    inside = [round(b * scale) for b in spec.block_activation_bytes] if spec.block_activation_bytes else None
    return dataclasses.replace(
        spec,
        sample_activation_bytes=round(spec.sample_activation_bytes * scale),
        sample_flops=round(spec.sample_flops * scale),
        sample_step_bytes=round(spec.sample_step_bytes * scale),
        block_activation_bytes=inside,
        boundary_bytes=round(spec.boundary_bytes * scale),
    )


def planned_inputs(m: ClassifierModality, config: ONNConfig) -> dict[str, Any]:
    """The network's inputs as the run will build it: with ckpt, the checkpoint's (its node features, classes and
    level: what eval, infer and export load and a resumed run trains), not the data config's guess (3 features and
    10 classes for a folder not yet read), so the plan's parameter count is the network's."""
    if not config.ckpt:
        return m.planned_inputs(config)
    return saved_inputs(resolve_checkpoint(config.ckpt, config.paths.outputs))


def infer(job: Job) -> dict[str, Any]:
    """Predict the classes of task.input's graphs (a file, a folder or an archive): predictions.jsonl and a PNG."""
    m, config = job.modality, job.config
    task: InferTask = config.task
    if not task.input:
        raise UserError("task=infer on graph data needs task.input=PATH (a graph file, a folder or an archive).")
    if job.ckpt is None:
        raise UserError("task=infer on graph data needs ckpt=RUN_DIR (a trained graph classifier) to know its classes.")
    path = Path(str(task.input)).expanduser()
    if not path.exists():
        raise UserError(f"task.input={task.input} does not exist.")
    module = load_trained(m, config, job.plan, job.ckpt)
    inputs = module.onn_config["inputs"]
    sets = m.read_inputs(path, inputs, config)
    model = module.to(torch.device(job.device)).eval()
    classes, level = list(inputs["classes"]), inputs["level"]
    rows, shown, correct, known = [], [], 0, 0
    total = sum(len(found.graphs) for found in sets.values())
    fitting = {split: _fitting(found, int(inputs["input_shape"][0])) for split, found in sets.items()}
    misfits = [reason for _, _, reasons in fitting.values() for reason in reasons]
    check_bad(misfits, total, float(config.data.max_bad_fraction), path, "task.input", "graphs", "do not fit the model")
    for split, found in sets.items():
        graphs, names, _ = fitting[split]
        step = 1 if level == "node" else eval_batch(config.data)
        for start in range(0, len(graphs), step):
            chunk = graphs[start : start + step]
            batch, _ = as_batch(chunk)
            with torch.no_grad():
                probs = torch.softmax(model(batch.to(model.device)).float(), dim=1).cpu()
            truths = _truths(chunk, found.classes, classes, level)
            items = _node_items(chunk[0], names[start]) if level == "node" else names[start:]
            for i, (item, truth) in enumerate(zip(items, truths)):
                rows.append(_row(item, probs[i], classes, truth))
                known += truth is not None
                correct += truth is not None and truth == rows[-1]["predicted"]
            guesses = [classes[int(c)] for c in probs.argmax(dim=1)]
            shown += _shown(chunk, names[start:], guesses, truths, level, PICTURED - len(shown))
    skipped = [s for found in sets.values() for s in found.skipped]
    output = Path(task.output).expanduser() if task.output else job.run_dir / "predictions.jsonl"
    write_jsonl(rows, output)
    picture = output.with_suffix(".png")
    if shown:
        from onn.modalities.graph.picture import write_picture

        write_picture(shown, picture)
    print(f"wrote {len(rows)} predictions to {output}, {len(skipped)} files skipped, and a picture to {picture}")
    metrics = {
        "infer/items": len(rows),
        "infer/output": str(output),
        "infer/picture": str(picture) if shown else None,
        "infer/items_skipped": len(skipped),
        "infer/skipped": skipped,
    }
    if known:
        metrics["infer/acc"] = round(correct / known, 5)
    return metrics


def _fitting(found, width: int) -> tuple[list, list[str], list[str]]:
    """The graphs (and names) whose nodes have the model's number of features, and why each other one does not
    fit; those join the skipped."""
    graphs, names, misfits = [], [], []
    for graph, name in zip(found.graphs, found.names):
        if graph.num_node_features == width:
            graphs.append(graph)
            names.append(name)
        else:
            misfits.append(f"{name}: its nodes have {graph.num_node_features} features, the model takes {width}")
    found.skipped += misfits
    return graphs, names, misfits


def _node_items(graph, name: str) -> list[str]:
    """A node-level graph's rows, NAME#nodeID: the id its file gave the node (an edge list's, which the reader
    renumbers: read.read_edge_list's node_ids), else its position."""
    ids = graph.node_ids.tolist() if "node_ids" in graph else range(graph.num_nodes)
    return [f"{name}#node{i}" for i in ids]


def _truths(graphs: list, found: list[str], classes: list[str], level: str) -> list[str | None]:
    """Each prediction's true class where the input names one the model knows: its folder's by name; a label number
    (a node's y, a file's y) as the model's class of that number, as training reads it (resident.relabelled), so
    data.classes naming the numbers names the truths too (the number's text was compared with the names)."""
    if level == "node":
        (graph,) = graphs
        numbers = "node_y" in graph and not graph.node_y.is_floating_point()
        labels = graph.node_y.long().view(-1).tolist() if numbers else [-1] * graph.num_nodes
    else:
        labels = [int(g.y) for g in graphs]
    if level == "node" or by_position(found, classes):
        return [classes[c] if 0 <= c < len(classes) else None for c in labels]
    names = [found[c] if 0 <= c < len(found) else None for c in labels]
    return [n if n in classes else None for n in names]


def _row(name: str, probs: torch.Tensor, classes: list[str], truth: str | None) -> dict[str, Any]:
    top = ranked(probs, min(TOP_K, len(classes)))  # ties as eval's argmax breaks them
    return {
        "name": name,
        "predicted": classes[int(top.indices[0])],
        "probability": round(float(top.values[0]), 5),
        "top5": [[classes[int(c)], round(float(p), 5)] for c, p in zip(top.indices, top.values)],
        "true": truth,
    }


def _shown(graphs: list, names: list[str], guesses: list[str], truths: list, level: str, room: int) -> list[tuple]:
    """(graph, predicted per node, true per node or None, caption) for the picture, at most `room` of them."""
    if room <= 0:
        return []
    if level == "node":
        right = sum(g == t for g, t in zip(guesses, truths) if t is not None)
        told = sum(t is not None for t in truths)
        caption = f"{Path(names[0]).name}: {right}/{told} nodes right" if told else Path(names[0]).name
        return [(graphs[0], guesses, truths, caption)]
    out = []
    for graph, name, guess, truth in list(zip(graphs, names, guesses, truths))[:room]:
        verdict = "" if truth is None else " (right)" if guess == truth else f" (true: {truth})"
        caption = f"{Path(name).name[:28]}: {guess}{verdict}"
        out.append((graph, [guess] * graph.num_nodes, None, caption))
    return out


def export_network(m: ClassifierModality, config: ONNConfig, module: Classifier, run_dir: Path) -> dict | None:
    """ONNX of the network on one graph (x, edge_index; nodes and edges dynamic); None: the shared export."""
    settings = config.export
    if isinstance(settings, SafetensorsExport):
        return None
    if type(settings) is not OnnxExport:
        raise UserError(f"export={settings.name}: a graph network exports onnx or safetensors.")
    from onn.export.onnx_export import export_onnx
    from onn.modalities.graph.network import ListedEdges

    inputs = module.onn_config["inputs"]
    generator = torch.Generator().manual_seed(int(config.seed))
    nodes = 24
    ring = plan_graph(nodes, 2)[:, :nodes]  # one way round a ring, then a self-loop and a repeated edge
    sample = {
        "x": torch.randn(nodes, *inputs["input_shape"], generator=generator),
        "edge_index": torch.cat([ring, torch.tensor([[3, 5], [3, 6]])], dim=1),
    }
    output = Path(settings.output or run_dir / "export" / "model.onnx")
    output.parent.mkdir(parents=True, exist_ok=True)
    metrics = export_onnx(
        ListedEdges(module.model).eval(),
        output,
        sample,
        opset=settings.opset,
        atol=settings.atol,
        axes={"x": {0: "nodes"}, "edge_index": {1: "edges"}},
    )
    describe_inputs(output, inputs)
    log.info("export: %s (max abs diff %.3g)", output, metrics["export/max_abs_diff"])
    return metrics


def describe_inputs(output: Path, inputs: dict[str, Any]) -> None:
    """What the exported graph takes, in its doc_string and metadata_props (`onn.inputs`, and `onn.classes` as every
    classifier's export writes them): a reader of model.onnx learns it from the file, as Netron and onnxruntime's
    modelmeta show it."""
    from onn.export.onnx_export import set_metadata

    features = int(inputs["input_shape"][0])
    per = "a row of logits per node" if inputs["level"] == "node" else "one row of logits for the graph"
    text = (
        f"One graph per call. x: float32 [nodes, {features}], each node's features as ONN's reader makes them (an "
        "edge list's nodes: one feature, 1). edge_index: int64 [2, edges], node numbers 0..nodes-1 (an edge list's "
        "ids renumbered as ONN's reader does: in increasing order, unless it has a `nodes N` line), as the file "
        "lists them: one direction or both, self-loops and repeats allowed; the model makes every edge two-way, "
        "drops self-loops and repeats, as task=infer reads the file. Output: " + per + f" over the classes "
        f"{', '.join(map(str, inputs['classes']))}."
    )
    set_metadata(output, {"onn.inputs": text, "onn.classes": json.dumps([str(c) for c in inputs["classes"]])}, text)
