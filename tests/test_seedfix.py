"""A model.source=random build keeps the caller's seeded random streams (models.load: its draws run in
torch.random.fork_rng), and text task=infer samples from task.seed: before, every seed gave one sample."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import compose, execute_run

from onn.models.load import load

TINY_LSTM = ("architecture.hidden_size=16", "architecture.num_hidden_layers=1")


def test_building_a_random_model_gives_back_the_global_generator_state(tmp_path):
    """The random draws reseed only inside fork_rng: what a run seeded before the build (dropout masks, sampling)
    continues from that seed afterwards."""
    config = compose("model=char_lstm", *(f"model.{o}" for o in TINY_LSTM), f"paths.cache={tmp_path}")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    model, _ = load(config.model, dtype=torch.float32, cache_dir=tmp_path)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(0)  # the weights stay those of INIT_SEED, whatever seed the caller set
    again, _ = load(config.model, dtype=torch.float32, cache_dir=tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def completion(tmp_path: Path, seed: int, name: str) -> str:
    """task=infer's sampled completion (temperature 1) of a tiny random char_lstm with task.seed=`seed`."""
    metrics = execute_run(
        tmp_path,
        tmp_path / "cache",
        "model=char_lstm",
        *(f"model.{o}" for o in TINY_LSTM),
        "task=infer",
        "prompt=What is 2 + 3?",
        "task.temperature=1.0",
        "task.top_p=1.0",
        "task.max_new_tokens=12",
        f"task.seed={seed}",
        name=name,
    )
    return metrics["infer/completion"]


def test_infer_samples_from_task_seed(tmp_path):
    """The same task.seed repeats the sample; another seed draws another (12 bytes from 259: equal by chance
    with a negligible probability)."""
    first = completion(tmp_path, 1, "a")
    assert completion(tmp_path, 1, "b") == first
    assert completion(tmp_path, 2, "c") != first
