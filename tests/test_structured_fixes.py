"""Fixes to the graph, diffusion, mesh and pairs modalities found in review: meshes in tiny or huge units read as
graphs, a graph file's y that is no class number, and training in strategy.precision=bf16-true."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODALITY_HARDWARE, compose

from onn.errors import UserError
from onn.modalities.graph.read import read_source


def write_scaled_spheres(folder: Path, scales: tuple[float, ...]) -> Path:
    """An icosphere and a box, each written as binary PLY (float64 coordinates) at every scale, in class folders."""
    import trimesh

    shapes = {"sphere": trimesh.creation.icosphere(subdivisions=2), "box": trimesh.creation.box()}
    for name, mesh in shapes.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for scale in scales:
            scaled = trimesh.Trimesh(np.asarray(mesh.vertices) * scale, mesh.faces, process=False)
            (folder / name / f"{scale:g}.ply").write_bytes(scaled.export(file_type="ply"))
    return folder


def test_a_mesh_in_tiny_or_huge_units_reads_as_the_same_graph(tmp_path):
    """trimesh merged vertices closer than 1e-8 in the file's own units: a sphere of 1e-9 m was one node, one of
    1e12 a handful. Its graph is now the same at every scale: 162 nodes, the same positions."""
    folder = write_scaled_spheres(tmp_path / "meshes", (1e-9, 1.0, 1e12))
    (found,) = read_source(folder, align="none", max_nodes=10_000, max_bad_fraction=0.0).values()
    graphs = {name: graph for name, graph in zip(found.names, found.graphs)}
    spheres = [graphs[f"sphere/{scale}.ply"] for scale in ("1e-09", "1", "1e+12")]
    assert [g.num_nodes for g in spheres] == [162, 162, 162]
    assert [g.edge_index.shape[1] for g in spheres] == [960, 960, 960]
    for graph in spheres:
        torch.testing.assert_close(graph.x, spheres[1].x, atol=1e-5, rtol=0)


def write_graph(path: Path, y: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    ring = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    save_file({"x": torch.ones(4, 2), "edge_index": ring, "y": y}, str(path))
    return path


@pytest.mark.parametrize(
    "y, said",
    [
        (torch.tensor([0.7]), r"float32 of shape \[1\]"),  # a regression target: was read as class 0
        (torch.tensor([1, 0, 1, 1]), r"int64 of shape \[4\]"),  # a label per node: was the first node's, class 1
        (torch.zeros(0, dtype=torch.long), r"int64 of shape \[0\]"),  # was an IndexError
    ],
)
def test_a_graph_files_y_that_is_not_one_class_number_is_one_sentence(tmp_path, y, said):
    for i in range(3):
        write_graph(tmp_path / "graphs" / f"{i}.safetensors", torch.tensor([i % 2]))
    write_graph(tmp_path / "graphs" / "odd.safetensors", y)
    with pytest.raises(UserError, match=rf"odd.safetensors's y is {said}, not one class number: .*data.level=node"):
        read_source(tmp_path / "graphs", align="none", max_nodes=100, max_bad_fraction=0.0)
    # task=infer reads labels where they are known: such a y is no truth, and the file is still predicted
    found = read_source(tmp_path / "graphs", align="none", max_nodes=100, max_bad_fraction=0.0, allow_unlabelled=True)
    labels = dict(zip(found["all"].names, found["all"].labels.tolist()))
    assert labels == {"0.safetensors": 0, "1.safetensors": 1, "2.safetensors": 0, "odd.safetensors": -1}


def run(tmp: Path, *overrides: str) -> dict:
    from onn.app import execute

    cfg = compose(
        *("tracking=none", "trainer.enable_progress_bar=false", MODALITY_HARDWARE),
        *(f"paths.outputs={tmp / 'outputs'}", f"paths.cache={tmp / 'cache'}"),
        *("trainer.max_steps=-1", "trainer.val_check_interval=1.0", "optim.warmup_steps=0"),
        *overrides,
    )
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    return execute(cfg, tmp / "run")


@pytest.mark.modalities
def test_a_graph_network_trains_in_bf16_true(tmp_path):
    """strategy.precision=bf16-true makes the weights bf16; the graphs' features (float32) and the pooled
    features (pooled in float32) met them as float32: `mat1 and mat2 must have the same dtype`."""
    folder = write_scaled_spheres(tmp_path / "meshes", (1.0, 2.0, 3.0, 4.0, 5.0))
    metrics = run(
        tmp_path,
        *("data=graph", "model=gin", f"data.source={folder}", "strategy.precision=bf16-true"),
        *("model.hidden=16", "model.layers=2", "data.batch_size=4", "trainer.max_epochs=2"),
    )
    assert metrics["steps"] == 4 and np.isfinite(metrics["train/loss_final"])


@pytest.mark.modalities
def test_a_point_cloud_classifier_trains_in_bf16_true(tmp_path):
    """The classifiers' shared prepare (onn/training/classifier.py) handed PointNet the augmentation's float32 points
    against bf16 weights: `expected scalar type Float but found BFloat16` at the first step."""
    folder = write_scaled_spheres(tmp_path / "meshes", (1.0, 2.0, 3.0, 4.0, 5.0))
    metrics = run(
        tmp_path,
        *("data=mesh", "model=pointnet", f"data.source={folder}", "strategy.precision=bf16-true", "data.points=64"),
        *("data.batch_size=4", "trainer.max_epochs=2"),
    )
    assert metrics["steps"] == 4 and np.isfinite(metrics["train/loss_final"])


@pytest.mark.modalities
def test_a_denoiser_trains_and_samples_in_bf16_true(tmp_path):
    """Under bf16-true the noisy images (float32) met bf16 weights, and the noise, drawn in Lightning's default
    dtype (bf16 there), failed the loss's backward against the float32 prediction."""
    from test_diffusion import TINY_UNET, write_images

    images = write_images(tmp_path / "pictures", per_class=6)
    metrics = run(
        tmp_path,
        *("data=diffusion", *TINY_UNET, f"data.source={images}", "strategy.precision=bf16-true"),
        *("trainer.max_steps=2", "data.batch_size=4", "data.val_split=0.25", "task.samples=2", "task.sample_steps=2"),
    )
    assert metrics["steps"] == 2 and np.isfinite(metrics["train/loss_final"]) and metrics["samples/count"] == 2


def test_edge_lists_as_networkx_writes_them_and_as_csv_read_as_plain_ones(tmp_path):
    """nx.write_edgelist adds each edge's attributes (`0 1 {}`), write_weighted_edgelist a weight (`0 1 0.5`), and
    many tools write `0,1`: every such file was skipped as `not SRC DST`, so a folder of them was refused whole."""
    import networkx as nx

    folder = tmp_path / "graphs"
    (folder / "path").mkdir(parents=True)
    (folder / "star").mkdir()
    nx.write_edgelist(nx.path_graph(5), folder / "path" / "a.edgelist")
    nx.write_weighted_edgelist(
        nx.Graph([(0, 1, {"weight": 0.5}), (1, 2, {"weight": 2.0})]), folder / "path" / "b.edges"
    )
    (folder / "star" / "c.edges").write_text("0,1\n0,2\n0,3\n")
    (folder / "star" / "d.edges").write_text("0 1\n0\t2\n")
    found = read_source(folder, align="none", max_nodes=100, max_bad_fraction=0.0)["all"]
    edges = {name: sorted(map(tuple, graph.edge_index.t().tolist())) for name, graph in zip(found.names, found.graphs)}
    assert found.skipped == [] and edges["path/a.edgelist"] == sorted(
        [(i, i + 1) for i in range(4)] + [(i + 1, i) for i in range(4)]
    )
    assert edges["path/b.edges"] == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert edges["star/c.edges"] == [(0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0)]
    assert edges["star/d.edges"] == [(0, 1), (0, 2), (1, 0), (2, 0)]


def pair_data(tmp_path: Path, source: Path):
    from onn.modalities.pairs.data import PairData
    from onn.modalities.pairs.tasks import sides_of

    cfg = compose(
        *("data=pairs", "model=dual_encoder", f"data.source={source}", f"paths.cache={tmp_path / 'cache'}"),
        *("data.sides.image.image_size=[16,16]", "data.sides.text.max_length=32", "data.val_split=0.25"),
    )
    dm = PairData(cfg, sides_of(cfg))
    dm.setup()
    return dm


def test_captions_of_one_image_are_held_out_with_it(tmp_path):
    """A metadata.jsonl naming each image on three rows (a caption each, as COCO and Flickr30k give five): the
    pairs were held out one by one, so most held-out images had been trained on with their other captions."""
    import json
    import shutil

    from onn.data.resident import held_out_share
    from onn.modalities.pairs.demo import write_shapes

    shapes = write_shapes(tmp_path / "shapes", 8, seed=0, size=16)
    folder = tmp_path / "captioned"
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(8):
        shutil.copy(shapes / f"{i:04d}.png", folder / "images" / f"{i:04d}.png")
        caption = (shapes / f"{i:04d}.txt").read_text().strip()
        rows += [{"file_name": f"images/{i:04d}.png", "text": f"{caption}, take {k}"} for k in range(3)]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dm = pair_data(tmp_path, folder)
    image_of = dict(zip(dm.listing.keys, (e.name for e in dm.listing.entries["image"])))
    held, trained = ({image_of[n] for n in dm.splits[s].names} for s in ("val", "train"))
    assert len(dm.splits["val"]) == 3 * len(held) >= 6 and held.isdisjoint(trained) and len(held | trained) == 8
    # validation scores a caption of the right image as right: the held-out pairs' groups are their images
    images = [image_of[n] for n in dm.splits["val"].names]
    groups = dm.val_groups.tolist()  # per side: the image's number, the caption's own
    assert all((groups[i][0] == groups[j][0]) == (images[i] == images[j]) for i in range(len(images)) for j in range(i))
    assert len({g[1] for g in groups}) == len(groups)

    # pairs of their own files each are held out one by one: those whose file name draws under data.val_split
    dm = pair_data(tmp_path, shapes)
    drawn = sorted(range(8), key=lambda i: held_out_share(dm.seed, f"{i:04d}.png"))
    below = [i for i in drawn if held_out_share(dm.seed, f"{i:04d}.png") < 0.25]
    assert dm.splits["val"].names == sorted(f"{i:04d}" for i in (below if len(below) >= 2 else drawn[:2]))


def test_retrieval_counts_any_caption_of_the_right_image():
    """Two images with two captions each, every caption a perfect match of its image: only the pair's own caption
    counted, and the second copy of an image lost to the first on the tie, so a perfect model scored recall@1 0.5."""
    from onn.modalities.pairs.module import retrieval_metrics

    first, second = torch.eye(2)
    images = torch.stack([first, first, second, second])
    captions = images.clone()
    grouped = retrieval_metrics(images, captions, ("image", "text"), "val", torch.tensor([0, 0, 1, 1]))
    assert grouped["val/recall@1/image_to_text"] == grouped["val/recall@1/text_to_image"] == 1.0
    assert grouped["val/recall@1_chance"] == 0.5  # a random pick hits one of two captions of four
    alone = retrieval_metrics(images, captions, ("image", "text"), "val", torch.arange(4))
    assert alone == retrieval_metrics(images, captions, ("image", "text"), "val")  # pairs of their own files
    assert alone["val/recall@1"] == 0.5  # each other copy ties ahead of its own partner
    wrong = retrieval_metrics(images, captions.flip(0), ("image", "text"), "val", torch.tensor([0, 0, 1, 1]))
    assert wrong["val/recall@1"] == 0.0
