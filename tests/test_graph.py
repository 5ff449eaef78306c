"""Graphs through torch_geometric: edge lists, safetensors tensors and meshes read as graphs (bad ones skipped
with their reason), data=auto, graph and node classification trained end to end (loss, accuracy, infer's
picture, ONNX in onnxruntime), the layer map of graph networks, and the real meshes of ../shared/data. A run
killed -9 and resumed is the `graph` track of recipe=bench_chaos (onn/bench/chaos.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODALITY_HARDWARE, SHARED_DATA, compose

from onn.errors import UserError
from onn.modalities.graph.read import read_source

MESHES = SHARED_DATA / "meshes"


def write_edges(path: Path, pairs: list[tuple[int, int]], nodes: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"nodes {nodes}"] if nodes is not None else []
    path.write_text("\n".join(["# an edge list", *head, *(f"{a} {b}" for a, b in pairs)]) + "\n")
    return path


def ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def star(n: int) -> list[tuple[int, int]]:
    return [(0, i) for i in range(1, n)]


def write_rings_and_stars(folder: Path, per_class: int, seed: int) -> Path:
    """Two classes of small graphs as edge lists: rings (every degree 2) and stars (a hub and leaves)."""
    rng = np.random.default_rng(seed)
    for i in range(per_class):
        write_edges(folder / "ring" / f"{i:03d}.edges", ring(int(rng.integers(5, 12))))
        write_edges(folder / "star" / f"{i:03d}.edges", star(int(rng.integers(5, 12))))
    return folder


def test_edge_lists_tensors_and_meshes_read_as_undirected_graphs(tmp_path):
    from safetensors.torch import save_file

    from onn.modalities.mesh.primitives import write_primitives

    write_edges(tmp_path / "a" / "path.edges", [(0, 1), (1, 2), (2, 2)], nodes=4)  # a self-loop and a lone node
    (tmp_path / "b").mkdir()
    save_file(
        {"x": torch.randn(3, 3), "edge_index": torch.tensor([[0, 1], [1, 2]])}, str(tmp_path / "b" / "t.safetensors")
    )
    write_primitives(tmp_path / "c", per_class=1, seed=0, file_types=("obj",))
    found = read_source(tmp_path, align="pca", max_nodes=10_000, max_bad_fraction=0.0)
    (split,) = found.values()
    graphs = dict(zip(split.names, split.graphs))
    path = graphs["a/path.edges"]
    assert path.num_nodes == 4 and path.x.tolist() == [[1.0]] * 4
    assert sorted(map(tuple, path.edge_index.t().tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    tensors = graphs["b/t.safetensors"]
    assert tensors.x.shape == (3, 3) and tensors.edge_index.shape == (2, 4)
    box = graphs["c/box/0000.obj"]  # trimesh's box: 8 corners, 12 edges and 6 face diagonals
    assert box.num_nodes == 8 and box.edge_index.shape == (2, 36)
    assert torch.allclose(box.x.norm(dim=1).max(), torch.tensor(1.0))  # centred, in the unit sphere
    assert split.classes == ["a", "b", "c"]


def test_bad_graphs_are_skipped_with_one_sentence_each(tmp_path, caplog):
    from safetensors.torch import save_file

    for i in range(20):
        write_edges(tmp_path / "ring" / f"{i}.edges", ring(5))
    write_edges(tmp_path / "ring" / "past.edges", [(0, 1), (1, 7)], nodes=3)
    (tmp_path / "ring" / "empty.edges").write_text("# nothing\n")
    save_file(
        {"x": torch.ones(2, 1), "edge_index": torch.tensor([[0], [5]])}, str(tmp_path / "ring" / "past.safetensors")
    )
    found = read_source(tmp_path, align="none", max_nodes=100, max_bad_fraction=0.2)
    skipped = sorted(found["all"].skipped)
    assert skipped == [
        "ring/empty.edges: holds no nodes (an empty graph)",
        "ring/past.edges: edge 1 (1 -> 7) points past its 3 nodes (numbered 0..2)",
        "ring/past.safetensors: edge 0 (0 -> 5) points past its 2 nodes (numbered 0..1)",
    ]
    assert len(found["all"].graphs) == 20 and "Skipped 3 of 23 graph files" in caplog.text
    with pytest.raises(UserError, match=r"past.edges: edge 1 \(1 -> 7\) points past its 3 nodes"):
        read_source(tmp_path / "ring" / "past.edges", align="none", max_nodes=100, max_bad_fraction=0.05)
    with pytest.raises(UserError, match="empty.edges: holds no nodes"):
        read_source(tmp_path / "ring" / "empty.edges", align="none", max_nodes=100, max_bad_fraction=0.05)


def test_data_auto_reads_graph_folders_and_meshes_as_graphs_for_a_graph_model(tmp_path):
    from onn.config.model import GraphNetworkConfig
    from onn.modalities import detect
    from onn.modalities.mesh.primitives import write_primitives

    modality, reason = detect(write_rings_and_stars(tmp_path / "g", 2, 0))
    assert modality.name == "graph" and reason == "4 graph files"
    meshes = write_primitives(tmp_path / "m", per_class=1, seed=0)
    assert detect(meshes)[0].name == "mesh"
    modality, reason = detect(meshes, GraphNetworkConfig)
    assert modality.name == "graph" and reason.endswith("read as vertex-edge graphs")
    assert detect("builtin:communities")[0].name == "graph"


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (["model=pointnet"], "model=pointnet is not a graph network: use model=gcn, graphsage, gin or gat"),
        (["data.source=builtin:communities"], "is one graph whose nodes are classified: set data.level=node"),
        (["model=gat", "model.hidden=10"], "model.hidden=10 must be a multiple of model.heads=4 (gat)"),
        (["model.source=pyg:cheb"], "model.source='pyg:cheb': give pyg:gcn, pyg:sage, pyg:gin or pyg:gat"),
        (["model.pooling=[median]"], "model.pooling=['median']: give one or more of mean, max, sum"),
        (["task.mixup=0.2"], "task.mixup=0.2: two graphs' nodes and edges do not blend; set task.mixup=0"),
        (["export=omny"], "export=omny is not available for a graph network; use export=onnx"),  # not after training
        (
            ["data.source=builtin:communities", "data.level=node", "task.adapt_norm=true"],
            "a node-level graph's test nodes share one graph with its training nodes: set task.adapt_norm=false",
        ),
        (
            ["data.source=builtin:communities", "data.level=node", "data.val_source=other.safetensors"],
            "data.val_source=other.safetensors: data.level=node holds out nodes of the one data.source graph",
        ),
    ],
)
def test_settings_that_cannot_work_are_one_sentence_before_anything_runs(overrides, sentence):
    from onn.modalities import get

    cfg = compose("data=graph", "model=gin", "data.source=builtin:primitives", *overrides)
    with pytest.raises(UserError, match=re.escape(sentence)):
        get("graph").check(cfg)


def run(tmp: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    from onn.app import execute, given_keys

    cfg = compose(
        *("data=graph", "model=gin", "tracking=none", "trainer.enable_progress_bar=false", MODALITY_HARDWARE),
        *(f"paths.outputs={tmp / 'outputs'}", f"paths.cache={tmp / 'cache'}", "strategy.precision=32-true"),
        *("trainer.max_steps=-1", "trainer.val_check_interval=1.0", "optim.warmup_steps=0", "optim.lr=1e-2"),
        *("model.hidden=16", "model.layers=2", "model.dropout=0.0", "data.batch_size=8"),
        *overrides,
    )
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return execute(cfg, run_dir, given_keys(list(overrides))), run_dir  # the keys a command line would set


@pytest.mark.modalities
@pytest.mark.slow  # (about 14 s: training, two inferences and an ONNX export)
def test_graph_classification_trains_infers_draws_and_exports(tmp_path):
    import onnxruntime as ort

    data = write_rings_and_stars(tmp_path / "train", 16, 0)
    test = write_rings_and_stars(tmp_path / "test", 4, 1)
    metrics, run_dir = run(
        tmp_path, f"data.source={data}", f"data.test_source={test}", "trainer.max_epochs=6", "export=onnx"
    )
    assert metrics["modality"] == "graph" and metrics["items_skipped"] == 0
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] >= 0.75  # rings and stars: chance is 0.5
    assert metrics["export/max_abs_diff"] < 1e-4
    session = ort.InferenceSession(metrics["export/onnx"], providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": np.ones((9, 1), np.float32), "edge_index": np.array(ring(9)).T})
    assert logits.shape == (1, 2)  # one graph of any size per call

    write_edges(test / "ring" / "past.edges", [(0, 9)], nodes=2)
    with pytest.raises(UserError, match=r"1 of 9 graph files cannot be used \(first: ring/past.edges: edge 0"):
        run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={test}", name="refused")
    out, _ = run(
        tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={test}", "data.max_bad_fraction=0.2", name="infer"
    )
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 8 and out["infer/items_skipped"] == 1 and {r["true"] for r in rows} == {"ring", "star"}
    assert out["infer/acc"] >= 0.75 and out["infer/skipped"][0].startswith("ring/past.edges: edge 0 (0 -> 9)")
    from PIL import Image

    picture = np.asarray(Image.open(out["infer/picture"]))
    assert picture.shape[1] >= 600 and picture.std() > 10  # drawn graphs, not a blank canvas


@pytest.mark.slow
def test_the_onnx_export_takes_a_files_edges_as_infer_reads_them_and_counts_the_checkpoints_weights(tmp_path):
    """A file's edges fed as written (one way round a ring, a self-loop, a repeat) give task=infer's probabilities:
    the export prepares them as the reader does. task=export, infer, eval and plan of the checkpoint count its own
    network's weights (1 feature, 2 classes), not those of a network the data config would guess."""
    import onnx
    import onnxruntime as ort

    data = write_rings_and_stars(tmp_path / "train", 6, 0)
    trained, run_dir = run(tmp_path, f"data.source={data}", "trainer.max_epochs=1", "model.pooling=[mean,max,sum]")
    pairs = [*ring(7), (2, 2), (4, 5), (5, 4), (4, 5)]
    one = write_edges(tmp_path / "one" / "ring" / "g.edges", pairs)
    exported, _ = run(tmp_path, "task=export", "export=onnx", f"ckpt={run_dir}", name="export")
    inferred, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={one.parent.parent}", name="infer")
    (row,) = [json.loads(line) for line in Path(inferred["infer/output"]).read_text().splitlines()]
    session = ort.InferenceSession(exported["export/onnx"], providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": np.ones((7, 1), np.float32), "edge_index": np.array(pairs).T})
    probs = torch.softmax(torch.from_numpy(logits[0]), dim=0)
    assert float(probs.max()) == pytest.approx(row["probability"], abs=1e-5)
    assert ["ring", "star"][int(probs.argmax())] == row["predicted"]
    said = {p.key: p.value for p in onnx.load(exported["export/onnx"]).metadata_props}["onn.inputs"]
    assert "self-loops and repeats allowed" in said and "float32 [nodes, 1]" in said and "ring, star" in said
    evaluated, _ = run(tmp_path, "task=eval", f"ckpt={run_dir}", name="eval")
    planned, _ = run(tmp_path, "task=plan", f"ckpt={run_dir}", "trainer.max_epochs=1", name="plan")
    counts = {m["params_total"] for m in (trained, exported, inferred, evaluated, planned)}
    assert counts == {trained["params_total"]}


def test_node_classification_on_a_graph_file_with_per_node_labels(tmp_path):
    """One graph of communities saved as safetensors (x, edge_index, y per node, masks): trained on its train
    nodes, scored on its test nodes, then every node predicted and drawn."""
    from safetensors.torch import save_file

    from onn.config.data import GraphBuiltin
    from onn.modalities.graph.builtin import communities

    graph = communities(GraphBuiltin(per_class=1, test_per_class=1, nodes=200, communities=4, features=8), seed=0)
    source = tmp_path / "communities.safetensors"
    save_file(
        {k: graph[k].contiguous() for k in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask")}, str(source)
    )
    metrics, run_dir = run(
        tmp_path,
        f"data.source={source}",
        "data.level=node",
        "model=gcn",
        "trainer.max_epochs=12",
        "optim.lr=0.03",
        "trainer.check_val_every_n_epoch=4",
    )
    assert metrics["steps"] == 12  # the whole graph every step
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 0.5  # 4 communities: chance is 0.25
    out, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", f"task.input={source}", name="infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 200 and rows[0]["name"] == "communities.safetensors#node0" and out["infer/acc"] > 0.5
    assert Path(out["infer/picture"]).is_file()


def write_node_graph(path: Path, y: torch.Tensor, **masks: torch.Tensor) -> Path:
    """One graph of len(y) nodes in a ring, each node's features a noisy hint of its class, as a node-level file."""
    from safetensors.torch import save_file

    n = len(y)
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0)) + y.clamp_min(0).float().unsqueeze(1)
    save_file({"x": x, "edge_index": torch.tensor(ring(n)).t().contiguous(), "y": y, **masks}, str(path))
    return path


def node_data(source: Path, *overrides: str):
    from onn.modalities.graph.dataset import GraphDataModule

    cfg = compose("data=graph", "model=gcn", f"data.source={source}", "data.level=node", *overrides)
    dm = GraphDataModule(cfg.data)
    dm.setup()
    return dm


def split_nodes(dm) -> dict[str, set[int]]:
    return {name: set(split.resident[0].nodes.tolist()) for name, split in dm.splits.items()}


def test_unlabelled_nodes_are_in_no_split_and_the_labelled_ones_train(tmp_path):
    """y -1 marks a node without a label (as task=infer reads it): it is convolved, never scored or trained on."""
    y = torch.arange(60) % 3
    y[:10] = -1
    source = write_node_graph(tmp_path / "g.safetensors", y)
    dm = node_data(source)
    nodes = split_nodes(dm)
    assert set().union(*nodes.values()) == set(range(10, 60)) and sum(map(len, nodes.values())) == 50
    assert all(bool((split.resident[1] >= 0).all()) for split in dm.splits.values()) and dm.classes == ["0", "1", "2"]
    metrics, _ = run(tmp_path, f"data.source={source}", "data.level=node", "model=gcn", "trainer.max_epochs=2")
    assert metrics["steps"] == 2 and np.isfinite(metrics["train/loss_final"]) and 0 <= metrics["test/acc"] <= 1


def test_a_node_files_own_masks_are_kept_and_only_the_missing_ones_seeded(tmp_path):
    train = torch.zeros(60, dtype=torch.bool)
    train[:6] = True
    dm = node_data(write_node_graph(tmp_path / "g.safetensors", torch.arange(60) % 3, train_mask=train))
    nodes = split_nodes(dm)
    assert nodes["train"] == set(range(6)) and len(nodes["val"]) == len(nodes["test"]) == 6  # data.val_split 0.1
    assert not nodes["val"] & nodes["test"] and not (nodes["val"] | nodes["test"]) & nodes["train"]


@pytest.mark.parametrize(
    ("y", "overrides", "sentence"),
    [
        (torch.arange(60.0) % 3, [], "g.safetensors in data.source: its y is float32; data.level=node needs integer"),
        (torch.tensor([0, 1, 2, -2] * 15), [], "g.safetensors in data.source: node 3 has y -2; give class numbers"),
        (
            torch.arange(60) % 3,
            ["data.val_split=0.5"],
            "no node is left to train on: 60 of its 60 nodes have a label (y >= 0) and the other splits take val 30",
        ),
        (torch.arange(60) % 3, ["data.num_classes=2"], "data.num_classes=2 but data.source has 3 classes (0, 1, 2)"),
    ],
)
def test_node_labels_and_splits_that_cannot_work_are_one_sentence(tmp_path, y, overrides, sentence):
    source = write_node_graph(tmp_path / "g.safetensors", y)
    with pytest.raises(UserError, match=re.escape(sentence)):
        node_data(source, *overrides)


def test_a_data_num_classes_below_the_folders_classes_is_one_sentence(tmp_path):
    from onn.modalities.graph.dataset import GraphDataModule

    data = write_rings_and_stars(tmp_path / "g", 3, 0)
    cfg = compose("data=graph", "model=gcn", f"data.source={data}", "data.num_classes=1")
    with pytest.raises(UserError, match=re.escape("data.num_classes=1 but data.source has 2 classes (ring, star)")):
        GraphDataModule(cfg.data).setup()


def test_a_batch_of_one_node_is_normalised_by_the_running_statistics(tmp_path):
    """A one-node graph at data.batch_size=1 has no batch statistics to normalise by: it trains with the running
    ones (what evaluation uses), and a batch of more nodes still normalises by its own."""
    from onn.modalities.graph.network import GraphNetwork

    network = GraphNetwork(3, 2, conv="gcn", hidden=8, layers=2, dropout=0.0).train()
    x, edges = torch.randn(1, 3), torch.zeros(2, 0, dtype=torch.long)
    logits = network(x, edges, torch.zeros(1, dtype=torch.long), 1)
    logits.sum().backward()
    assert torch.allclose(logits, network.eval()(x, edges, torch.zeros(1, dtype=torch.long), 1))
    data = write_rings_and_stars(tmp_path / "g", 3, 0)
    for kind in ("ring", "star"):
        write_edges(data / kind / "single.edges", [], nodes=1)
    metrics, _ = run(tmp_path, f"data.source={data}", "model=gcn", "data.batch_size=1", "trainer.max_epochs=1")
    assert metrics["steps"] > 0 and metrics["items_skipped"] == 0


class UserGNN(torch.nn.Module):
    """A graph network as users write one: a list of convs, a list of norms beside it, a head."""

    def __init__(self):
        from torch_geometric.nn import GCNConv

        super().__init__()
        self.embed = torch.nn.Linear(3, 16)
        self.convs = torch.nn.ModuleList(GCNConv(16, 16) for _ in range(4))
        self.norms = torch.nn.ModuleList(torch.nn.BatchNorm1d(16) for _ in range(4))
        self.head = torch.nn.Linear(16, 2)


@pytest.mark.parametrize("name", ["GCN", "GraphSAGE", "GIN", "GAT", "user"])
def test_the_layer_map_finds_a_graph_networks_conv_list(name):
    import torch_geometric.nn.models as pyg_models

    from onn.models.layers import discover

    if name == "user":
        model = UserGNN()
    else:
        model = getattr(pyg_models, name)(in_channels=3, hidden_channels=8, num_layers=4, out_channels=2)
    lmap = discover(model)
    assert lmap.blocks_path == "convs" and len(lmap) == 4  # the convs, not the norms beside them
    total = sum(p.numel() for p in model.parameters())
    assert lmap.prefix_params() + sum(lmap.block_params()) + lmap.suffix_params() == total


@pytest.mark.parametrize("model", ["gcn", "graphsage", "gin", "gat"])
def test_a_graph_classifiers_forward_and_backward_read_nothing_back_from_the_device(model):
    """Each graph's nodes pooled by a count the host holds (the Batch's), not one read from the batch index: on a
    GPU such a read waits for every kernel queued, at every step."""
    from conftest import HostReads
    from torch_geometric.data import Data

    from onn.modalities import get
    from onn.modalities.graph.dataset import as_batch
    from onn.modalities.graph.tasks import GraphClassifier

    cfg = compose("data=graph", f"model={model}", "model.hidden=8", "model.layers=2", "model.pooling=[mean,max,sum]")
    network = get("graph").network(cfg.model, {"input_shape": (3,), "classes": ["ring", "star"], "level": "graph"})
    module = GraphClassifier(network, ["ring", "star"], cfg.optim, {})
    edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    graphs = [Data(x=torch.randn(5, 3), edge_index=edges, y=torch.tensor([i % 2])) for i in range(4)]
    batch, labels = as_batch(graphs)
    with HostReads() as reads:
        logits = module(batch)
        torch.nn.functional.cross_entropy(logits, labels).backward()
    assert logits.shape == (4, 2) and reads.seen == []


def test_adabn_measures_a_graph_networks_norms_on_the_test_graphs_and_counts_graphs():
    """task.adapt_norm on graph classification: the norms' statistics measured again on the test graphs' nodes
    (features moved by +6 here, as a new sensor would), the count being graphs (a Batch has no shape)."""
    from torch_geometric.data import Data

    from onn.modalities import get
    from onn.modalities.graph.dataset import as_batch
    from onn.modalities.graph.tasks import GraphClassifier

    cfg = compose("data=graph", "model=gin", "model.hidden=8", "model.layers=2")
    network = get("graph").network(cfg.model, {"input_shape": (3,), "classes": ["ring", "star"], "level": "graph"})
    module = GraphClassifier(network, ["ring", "star"], cfg.optim, {}, adapt_norm=True)
    edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    shifted = [Data(x=torch.randn(5, 3) + 6.0, edge_index=edges, y=torch.tensor([i % 2])) for i in range(6)]
    norm = next(m for m in network.eval().modules() if isinstance(m, torch.nn.BatchNorm1d))
    before = norm.running_mean.clone()
    assert module.adapt_batch_norm([as_batch(shifted[:4]), as_batch(shifted[4:])]) == 6
    assert not torch.allclose(norm.running_mean, before) and not norm.training


def test_a_node_level_graph_is_collated_once_and_its_step_reads_nothing_back():
    """level=node trains on the whole graph at every step: it is collated once and kept on the compute device,
    its tensors shared by the splits (collated and copied each step, a graph of 500,000 nodes cost 60 ms of host
    time a step), and the split's nodes are picked by index (a boolean mask's selection reads the mask back)."""
    from conftest import HostReads

    from onn.modalities import get
    from onn.modalities.graph.dataset import GraphDataModule
    from onn.modalities.graph.tasks import GraphClassifier

    cfg = compose("data=graph", "data.source=builtin:communities", "data.level=node", "model=gcn", "model.hidden=8")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    loader = dm.train_dataloader()
    (graph, labels), (again, _) = next(iter(loader)), next(iter(loader))  # two epochs
    assert again is graph and dm.splits["val"].resident[0].x is graph.x  # one graph, shared by the splits
    nodes = graph.nodes
    assert torch.equal(labels, graph.y[nodes]) and len(nodes) < graph.num_nodes
    inputs = {"input_shape": dm.input_shape, "classes": dm.classes, "level": "node"}
    module = GraphClassifier(get("graph").network(cfg.model, inputs), dm.classes, cfg.optim, {})
    with HostReads() as reads:
        logits = module(graph)
        torch.nn.functional.cross_entropy(logits, labels).backward()
    assert logits.shape == (len(nodes), len(dm.classes)) and reads.seen == []


def test_a_node_level_step_counts_the_nodes_it_trains_on_as_its_samples():
    """samples_per_s is the rows the steps trained on (docs/outputs.md): a node-level step trains on its split's
    nodes, not on one graph; a graph-level step on its graphs."""
    from onn.modalities import get
    from onn.modalities.graph.dataset import GraphDataModule, as_batch
    from onn.modalities.graph.tasks import GraphClassifier
    from onn.training.callbacks import batch_rows

    cfg = compose("data=graph", "data.source=builtin:communities", "data.level=node", "model=gcn", "model.hidden=8")
    dm = GraphDataModule(cfg.data)
    dm.setup()
    graph, labels = next(iter(dm.train_dataloader()))
    assert batch_rows((graph, labels)) == len(graph.nodes) == len(labels) > 1
    inputs = {"input_shape": dm.input_shape, "classes": dm.classes, "level": "node"}
    module = GraphClassifier(get("graph").network(cfg.model, inputs), dm.classes, cfg.optim, {})
    assert module.samples(graph) == len(graph.nodes)
    from torch_geometric.data import Data

    graphs = [Data(x=torch.ones(5, 1), edge_index=torch.tensor(ring(5)).t(), y=torch.tensor([0])) for _ in range(3)]
    batch = as_batch(graphs)
    assert batch_rows(batch) == module.samples(batch[0]) == 3


def test_gcns_own_self_loops_convolve_as_torch_geometrics():
    """GCN adds each node's loop itself (torch_geometric's add_remaining_self_loops indexes by a boolean mask, a
    read on the host): on the loop-free graphs ONN reads, the same outputs."""
    from torch_geometric.nn import GCNConv

    from onn.modalities.graph.network import GraphBlock

    torch.manual_seed(0)
    block = GraphBlock("gcn", 3, 8, heads=1, norm="none", dropout=0.0)
    reference = GCNConv(3, 8)
    reference.load_state_dict(block.conv.state_dict())
    x, edges = torch.randn(6, 3), torch.tensor([[0, 1, 1, 2, 3, 4, 0, 5], [1, 0, 2, 1, 4, 3, 5, 0]])
    torch.testing.assert_close(block(x, edges), torch.relu(reference(x, edges)))


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_plan_sizes_onns_graph_network_by_its_blocks(tmp_path):
    """data=auto on a folder of meshes with a graph model named: graph data, planned by the network's blocks."""
    from conftest import run_cli

    from onn.modalities.mesh.primitives import write_primitives

    meshes = write_primitives(tmp_path / "meshes", per_class=1, seed=0)
    proc = run_cli(
        *("task=plan", "data=auto", f"data.source={meshes}", "model=gat", "hardware=cpu_16gb"),
        *(f"paths.outputs={tmp_path}", f"hydra.run.dir={tmp_path / 'plan'}"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "6 mesh files (.obj, .ply, .stl, .off, .glb), read as vertex-edge graphs" in proc.stdout
    assert "layer map: prefix [-] -> 3 x GraphBlock at 'network.blocks' -> suffix [network.head]" in proc.stdout
    plan = json.loads((tmp_path / "plan" / "metrics.json").read_text())
    assert plan["params_total"] > 0 and plan["predicted_peak_memory_mb"] > 0 and plan["strategy"] == "full"


@pytest.mark.skipif(not MESHES.is_dir(), reason="../shared/data/meshes is not here")
def test_every_real_mesh_reads_as_a_graph_or_is_skipped_with_a_reason():
    found = read_source(MESHES, align="pca", max_nodes=500_000, max_bad_fraction=0.1, allow_unlabelled=True)
    (split,) = found.values()
    assert len(split.graphs) == 96 and sorted(s.split(":")[0] for s in split.skipped) == [
        "trimesh/empty.obj",
        "trimesh/empty.ply",
        "trimesh/empty.stl",
        "trimesh/empty_nodes.glb",
    ]
    assert all(g.num_nodes > 0 and torch.isfinite(g.x).all() and g.x.shape[1] == 3 for g in split.graphs)
