"""The graph planner sizes a sample from the data the config names, read without decoding it: a folder's graph files
(.safetensors headers, edge-list lines), a node-level graph whole, the generated sets from data.builtin. It sized
every sample as one graph of 1,024 nodes whatever the data held: 40-node molecules over-counted 25x, a 20,000-node
graph under-counted 20x, and the prediction that picks the batch size and is printed against the measured peak with
them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import compose

from onn.hardware.profile import resolve
from onn.modalities import get

MB = 1024**2


def graph(nodes: int, degree: int, features: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """x [nodes, features] and edge_index [2, nodes * degree]: each node joined to `degree` / 2 random others, both
    directions listed (as torch_geometric's edge_index lists them)."""
    source = torch.arange(nodes).repeat_interleave(degree // 2)
    target = (source + torch.randint(1, nodes, source.shape, generator=generator)) % nodes
    edge_index = torch.cat([torch.stack([source, target]), torch.stack([target, source])], dim=1)
    return {"x": torch.randn(nodes, features, generator=generator), "edge_index": edge_index}


def write_graphs(folder: Path, count: int, nodes: int, degree: int, features: int = 8) -> Path:
    """`count` graph files of `nodes` nodes (graph()) in two class folders."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(count + nodes)
    for i in range(count):
        (folder / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        save_file(graph(nodes, degree, features, generator), str(folder / "ab"[i % 2] / f"{i:03d}.safetensors"))
    return folder


def planned(tmp_path: Path, *overrides: str):
    """The graph modality's plan of `data=graph model=gin OVERRIDES` on a 16 GB CPU preset."""
    cfg = compose("data=graph", "model=gin", "hardware=cpu_16gb", *overrides)
    plan, _ = get("graph").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    return plan


def said(plan) -> str:
    """The plan's reason naming the graph it was sized on."""
    (line,) = [r for r in plan.reasons if r.startswith("sized on a graph of")]
    return line


def test_folders_of_small_and_of_large_graphs_plan_apart_by_their_sizes(tmp_path):
    """Graphs of 40 nodes (160 edges) and of 20,000 (80,000): 500 times the nodes and edges, 500 times the
    activations and FLOPs a sample; both were planned as 1,024 nodes. Edge lists are sized by their lines (each read
    as two edges) and their `nodes N` line; an archive, which cannot be sized unread, plans on the stand-in."""
    small = planned(tmp_path, f"data.source={write_graphs(tmp_path / 'small', 6, 40, 4)}")
    large = planned(tmp_path, f"data.source={write_graphs(tmp_path / 'large', 6, 20_000, 4)}")
    assert said(small).startswith("sized on a graph of 40 nodes and 160 edges: 6 graph files of data.source")
    assert said(large).startswith("sized on a graph of 20,000 nodes and 80,000 edges")
    for key in ("activation_bytes_per_sample", "flops_per_sample"):
        assert large.model[key] / small.model[key] == pytest.approx(500, rel=0.1), key
    ratio = large.candidates["full"]["activations_mb"] / small.candidates["full"]["activations_mb"]
    assert ratio == pytest.approx(500, rel=0.1)  # data.batch_size=32 graphs of each
    assert large.predicted_step_s > 20 * small.predicted_step_s

    for i in range(4):
        lines = ["# a ring", *(f"{j} {(j + 1) % 30}" for j in range(30))] + (["nodes 50"] if i % 2 else [])
        (tmp_path / "edges" / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "edges" / "ab"[i % 2] / f"{i}.edges").write_text("\n".join(lines) + "\n")
    edges = planned(tmp_path, f"data.source={tmp_path / 'edges'}")
    # two lists of 30 nodes and two of 50: a batch of 32 graphs of 40 holding one of 50, 41 a graph
    assert said(edges).startswith("sized on a graph of 41 nodes and 60 edges: 4 graph files of data.source")

    archive = shutil.make_archive(str(tmp_path / "small"), "zip", tmp_path / "small")
    stand_in = planned(tmp_path, f"data.source={archive}")
    assert said(stand_in).startswith("sized on a graph of 1,024 nodes and 6,144 edges: a stand-in")


def test_a_node_level_graph_plans_as_the_one_graph_a_step_holds(tmp_path):
    """data.level=node: a training step is the file's one graph, all of its nodes and edges, whatever
    data.batch_size says (it was planned as data.batch_size graphs of 1,024 nodes)."""
    from safetensors.torch import save_file

    plans = []
    for nodes in (5_000, 10_000):
        file = tmp_path / f"{nodes}.safetensors"
        save_file({**graph(nodes, 4, 8, torch.Generator().manual_seed(0)), "y": torch.arange(nodes) % 3}, str(file))
        plans.append(planned(tmp_path, f"data.source={file}", "data.level=node"))
    one, two = plans
    assert said(one) == (
        "sized on a graph of 5,000 nodes and 20,000 edges: data.source's one graph file (its header or lines, not "
        "decoded); data.level=node: a step is that one graph"
    )
    assert one.micro_batch == 1 and one.candidates["full"]["micro_batch"] == 1
    assert one.candidates["full"]["activations_mb"] == pytest.approx(
        one.model["activation_bytes_per_sample"] / MB, abs=0.1
    )
    assert two.model["activation_bytes_per_sample"] / one.model["activation_bytes_per_sample"] == pytest.approx(
        2, rel=0.05
    )


def test_the_generated_sets_plan_on_the_sizes_data_builtin_gives(tmp_path):
    """builtin:primitives plans on its six shapes' mean graph, builtin:communities on its one graph of
    data.builtin.nodes nodes and the edges its block model draws in expectation (a step: that graph)."""
    from onn.config.data import GraphBuiltin
    from onn.modalities.graph.builtin import PRIMITIVE_EDGES, PRIMITIVE_NODES, communities, primitive_graphs

    (shapes, _) = primitive_graphs(GraphBuiltin(1, 1, 600, 4, 8), "pca", 500_000, 0).values()
    assert -(-sum(g.num_nodes for g in shapes.graphs) // 6) == PRIMITIVE_NODES
    assert sum(g.num_edges for g in shapes.graphs) / 6 == PRIMITIVE_EDGES
    primitives = planned(tmp_path, "data.source=builtin:primitives")
    assert said(primitives).startswith("sized on a graph of 638 nodes and 3,814 edges: builtin:primitives")

    sizes = {}
    for nodes in (600, 1200):
        plan = planned(tmp_path, "data.source=builtin:communities", "data.level=node", f"data.builtin.nodes={nodes}")
        drawn = communities(GraphBuiltin(1, 1, nodes, 4, 8), seed=0).num_edges
        edges = int(said(plan).split(" nodes and ")[1].split(" edges")[0].replace(",", ""))
        assert said(plan).startswith(f"sized on a graph of {nodes:,} nodes and ")
        assert edges == pytest.approx(drawn, rel=0.1) and plan.micro_batch == 1
        sizes[nodes] = plan.model["activation_bytes_per_sample"]
    assert sizes[1200] > 1.9 * sizes[600]


def train(tmp_path: Path, source: Path, name: str, *overrides: str) -> tuple[dict, dict]:
    """A short training run on graph data, in this process, on this machine (hardware=auto: the plan's baseline is
    the process's memory then): the metrics its metrics.json records, and its plan.yaml."""
    from onn.app import execute, given_keys

    given = (f"data.source={source}", *overrides)
    cfg = compose(
        *("data=graph", "model=gin", "tracking=none", "trainer.enable_progress_bar=false", "hardware=auto"),
        *(f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}", "strategy.precision=32-true"),
        *("trainer.max_epochs=1", "trainer.max_steps=-1", "optim.warmup_steps=0", "model.dropout=0.0", *given),
    )
    run_dir = tmp_path / name
    run_dir.mkdir()
    metrics = execute(cfg, run_dir, given_keys(list(given)))
    return metrics, yaml.safe_load((run_dir / "plan.yaml").read_text())


@pytest.mark.slow  # two short training runs (about 40 s)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the memory compared is the CPU process's (a GPU run's differs)")
def test_a_graph_runs_predicted_memory_is_near_what_it_measured(tmp_path):
    """Trained on 40-node graphs (32 a batch, width 128) and on 20,000-node graphs (4 a batch, width 64), each
    run's predicted growth above the process's baseline (predicted_peak_memory_mb less the plan's context_mb) is
    within 2x of the growth it measured (peak_memory_mb less context_mb), with 100 MB of slack for what else a run
    allocates (Lightning, the graphs read). Planned as 1,024-node graphs, the first was predicted ~20x its growth,
    the second a tenth of it."""
    small = write_graphs(tmp_path / "data" / "small", 400, 40, 4, features=16)
    large = write_graphs(tmp_path / "data" / "large", 12, 20_000, 2, features=16)
    runs = {
        "small": train(tmp_path, small, "small", "data.batch_size=32", "model.hidden=128"),
        "large": train(tmp_path, large, "large", "data.batch_size=4", "model.hidden=64"),
    }
    for name, (metrics, plan) in runs.items():
        assert metrics["steps"] >= 2, name
        predicted = metrics["predicted_peak_memory_mb"] - plan["context_mb"]
        measured = metrics["peak_memory_mb"] - plan["context_mb"]
        assert measured / 2 - 100 <= predicted <= 2 * measured + 100, (name, predicted, measured)
    assert (
        runs["large"][1]["candidates"]["full"]["activations_mb"] > 200
    )  # the comparison is of the activations (282 MB)


def test_a_folder_with_one_large_graph_plans_for_the_batch_that_holds_it(tmp_path):
    """Memory peaks at the batch that holds the largest graph: planned on the mean alone, a folder of 40-node graphs
    with one of 4,000 fitted a batch that ran out of memory once that graph came."""
    folder = write_graphs(tmp_path / "graphs", 7, 40, 4)
    write_graphs(tmp_path / "one", 1, 4_000, 4)
    shutil.copy(tmp_path / "one" / "a" / "000.safetensors", folder / "a" / "big.safetensors")
    plan = planned(tmp_path, f"data.source={folder}", "data.batch_size=8")
    # the mean (535 nodes, 2,140 edges) for 7 of a batch of 8, the largest for one: (535 x 7 + 4,000) / 8
    assert said(plan).startswith("sized on a graph of 969 nodes and 3,873 edges: 8 graph files")


def test_a_long_edge_list_is_sized_from_its_head_and_tail(tmp_path):
    """An edge list over 8 MB is not read whole by the plan (a 1 GB list took minutes and gigabytes): its lines are
    counted in its first 8 MB and scaled by its size, and its largest node number is looked for at its end too."""
    from onn.modalities.graph.read import EDGE_HEAD_BYTES, file_size

    path = tmp_path / "big.edges"
    nodes = 1_200_000
    with open(path, "w") as f:
        f.writelines(f"{i} {i + 1}\n" for i in range(nodes - 1))  # a path, numbered in order: the largest last
    assert path.stat().st_size > EDGE_HEAD_BYTES
    counted_nodes, counted_edges = file_size(path)
    assert counted_nodes == nodes
    # (the head's lines, of smaller numbers, are shorter than the file's: a little over, 3.7% here)
    assert 2 * (nodes - 1) <= counted_edges <= 1.05 * 2 * (nodes - 1)
