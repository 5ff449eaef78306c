"""Graph data validated on its own training data is said when training starts (as the other modalities say it),
not when task=eval scores a given graph whole; diffusion takes data.image_size=[side] as a square, as the image
modality does."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_diffusion import TINY_UNET, write_images
from test_diffusion import run as run_diffusion
from test_graph import node_data, run, write_node_graph, write_rings_and_stars

SAID = "is data.source itself"


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if SAID in r.getMessage()]


def test_a_graph_run_validated_on_its_training_graphs_is_said_and_an_eval_of_them_is_not(tmp_path, caplog):
    """data.val_source naming data.source (written another way) validated on the very graphs trained on, without a
    word; task=eval of the same folder sets data.val_source to it on purpose and trains nothing: not said."""
    source = write_rings_and_stars(tmp_path / "graphs", 6, 0)
    with caplog.at_level(logging.WARNING, logger="onn"):
        trained, run_dir = run(
            tmp_path, f"data.source={source}", f"data.val_source={tmp_path}/./graphs/", "trainer.max_epochs=1"
        )
    (warned,) = said(caplog)
    assert warned.startswith("data.val_source is data.source itself") and "graphs it trains on" in warned
    assert trained["steps"] == 1  # 12 graphs, batches of 8, the last dropped: it trained

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):
        scored, _ = run(tmp_path, "task=eval", f"ckpt={run_dir}", f"data.source={source}", name="eval")
    assert "val/acc" in scored and said(caplog) == []


def test_a_node_level_graph_scored_on_its_training_nodes_is_said_but_not_by_an_eval_of_it(tmp_path, caplog):
    """level=node with data.val_source set validates on every labelled node, the training nodes among them: the
    data module says so when training starts (once); task=eval of the whole graph (modality.scores_whole_graph)
    trains nothing and says nothing."""
    source = write_node_graph(tmp_path / "ring.safetensors", torch.arange(40) % 2)
    dm = node_data(source, f"data.val_source={source}")
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm.train_dataloader()
        dm.train_dataloader()  # said once
    (warned,) = said(caplog)
    assert "nodes it trains on" in warned

    caplog.clear()
    node = (f"data.source={source}", "data.level=node", "model=gcn")
    with caplog.at_level(logging.WARNING, logger="onn"):
        _, run_dir = run(tmp_path, *node, "trainer.max_epochs=2")
        assert said(caplog) == []  # its own held-out nodes
        scored, _ = run(tmp_path, *node, "task=eval", f"ckpt={run_dir}", name="eval")
    assert "val/acc" in scored and said(caplog) == []


def test_a_denoiser_takes_one_image_side_as_a_square(tmp_path):
    """data.image_size=[16] was refused ("give [height, width]"); the image modality reads it as 16x16."""
    images = write_images(tmp_path / "pictures", per_class=4)  # 8x8, resized to 16x16
    square = (*TINY_UNET, f"data.source={images}", "data.image_size=[16]", "data.resize=resize")
    # planned (tasks.planned_shape), trained and sampled at 16x16
    metrics, run_dir = run_diffusion(tmp_path, *square, "trainer.max_steps=2", "task.samples=2", "task.sample_steps=1")
    assert metrics["steps"] == 2
    drawn = load_file(str(Path(run_dir) / "samples.safetensors"))["images"]
    assert drawn.shape == (2, 1, 16, 16)
