"""A LoRA checkpoint's frozen base is drawn again from model.source=random when it is loaded; the CPU's and each
GPU's generators give other weights for one seed, so a checkpoint records where its base was drawn and one drawn
elsewhere is refused in one sentence (models.load.random_base, checkpoints.check_random_base)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import execute_run, tiny_llama

from onn.errors import UserError
from onn.models.load import random_draw_device
from onn.training.checkpoints import check_random_base, read_meta, save

TINY_RUN = (
    "strategy=sparse_lora",
    "data=math",
    "data.max_length=32",
    "trainer.max_steps=1",
    "task.exact_match_samples=0",
    "task.validate_before=false",
)
GPU = "NVIDIA H100 80GB HBM3"


def trained(tmp_path: Path, *overrides: str) -> Path:
    """A one-step sparse_lora run's last checkpoint."""
    metrics = execute_run(tmp_path, tmp_path / "cache", *TINY_RUN, *overrides, name="train")
    assert metrics["steps"] == 1
    return tmp_path / "train" / "checkpoints" / "last.ckpt"


def evaluated(tmp_path: Path, ckpt: Path, name: str) -> dict:
    """task=eval of `ckpt`, with two short answers generated (the slow part)."""
    evaluation = ("task=eval", f"ckpt={ckpt}", "task.max_samples=2", "task.max_new_tokens=2")
    return execute_run(tmp_path, tmp_path / "cache", *evaluation, name=name)


def recorded(ckpt: Path, place: str) -> None:
    """The checkpoint's meta.json (checkpoints.flatten's pairs) edited to say its base was drawn at `place`."""
    meta_file = ckpt / "meta.json"
    meta = json.loads(meta_file.read_text())
    onn = next(value for key, value in meta["__dict__"] if key == "onn")
    onn["__dict__"] = [[key, place if key == "random_base" else value] for key, value in onn["__dict__"]]
    meta_file.write_text(json.dumps(meta))
    assert read_meta(ckpt)["onn"]["random_base"] == place


def test_the_draw_device_is_the_compute_device_only_for_a_host_store():
    """The one rule the loader and the resident build share: a GPU draws for a host-memory store (fast), the
    CPU draws for a disk store and a resident model."""
    assert random_draw_device("cpu", "cuda:0") == "cuda:0"
    assert random_draw_device("disk", "cuda:0") == "cpu"
    assert random_draw_device(None) == "cpu"


def written(folder: Path, record: dict) -> Path:
    """A checkpoint ONN's writer saves: one adapter weight, and `record` as its onn part."""
    save({"state_dict": {"lora_A": torch.zeros(2, 2)}, "onn": {"loop": "manual-accumulation", **record}}, folder)
    return folder


def test_a_base_drawn_on_another_generator_is_refused_in_one_sentence(tmp_path):
    """A base a GPU drew cannot be drawn again on the CPU (other numbers for the seed): the sentence names the
    checkpoint and both places. The same place, a base with weights (None) and an earlier ONN's checkpoint (no
    record) load as before."""
    gpu = written(tmp_path / "gpu.ckpt", {"random_base": GPU})
    with pytest.raises(UserError, match=rf"^ckpt {gpu}: .* drawn from model.source=random on {GPU} .* on cpu, "):
        check_random_base(gpu, "cpu")
    check_random_base(gpu, GPU)
    check_random_base(written(tmp_path / "weights.ckpt", {"random_base": None}), "cpu")
    check_random_base(written(tmp_path / "old.ckpt", {}), "cpu")


@pytest.mark.slow
def test_a_random_base_drawn_elsewhere_is_refused_and_one_drawn_here_loads(tmp_path):
    """A CPU run records "cpu"; its checkpoint evaluates here. Edited to say a GPU drew the base, eval refuses it
    in one sentence naming the checkpoint and both places (before: it loaded its adapters onto another base)."""
    ckpt = trained(tmp_path)
    assert read_meta(ckpt)["onn"]["random_base"] == "cpu"
    metrics = evaluated(tmp_path, ckpt, "eval")
    assert "val/loss" in metrics
    recorded(ckpt, GPU)
    sentence = rf"^ckpt {ckpt}: its frozen base was drawn from model.source=random on {GPU} .* on cpu, "
    with pytest.raises(UserError, match=sentence):
        evaluated(tmp_path, ckpt, "refused")


@pytest.mark.slow
def test_a_base_with_weights_records_no_draw_and_is_never_refused(tmp_path):
    """A base read from weights (a Hugging Face folder) is the same everywhere: the checkpoint records no draw,
    and it evaluates."""
    folder = tmp_path / "hf"
    tiny_llama(
        max_position_embeddings=512, vocab_size=320, bos_token_id=256, eos_token_id=257, pad_token_id=258
    ).save_pretrained(folder)
    ckpt = trained(tmp_path, f"model.source={folder}", "strategy.streaming.chunk_size=1")
    assert read_meta(ckpt)["onn"]["random_base"] is None
    metrics = evaluated(tmp_path, ckpt, "eval")
    assert "val/loss" in metrics
