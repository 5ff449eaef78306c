"""The GPU benchmark and the runner-overhead benchmarks, reviewed: each test shows a figure timing the same work on
both sides of its ratio, or a bench that keeps to its time and says why a figure is missing."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from conftest import compose
from test_vision_train import make_images

from onn.hardware.profile import resolve


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"))


def _vision(images: Path, tmp_path: Path, *overrides: str):
    """recipe=bench_vision on the small image set: its config, plan, inputs and datamodule, as vision.run has them."""
    from onn.modalities import classification, get

    image = get("image")
    sizes = ["data.image_size=[16,16]", "data.batch_size=16", "model.compile=false", "hardware=cpu_16gb"]
    cfg = compose("recipe=bench_vision", f"data.source={images}", *sizes, f"paths.cache={tmp_path}", *overrides)
    dm = classification.setup_data(image, cfg, "cpu")
    inputs = classification.data_inputs(image, cfg, dm)
    plan, _ = image.plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))
    return cfg, plan, inputs, dm


def test_bench_visions_plain_loop_mixes_its_batches_as_onns_classifier_does(images, tmp_path):
    """task.mixup: ONN's classifier blends each batch with itself reversed and both labels' losses; the plain loop
    and the bare LightningModule did neither, so vision/runner_overhead timed ONN's mixing as runner overhead (23
    more device ops a step, and a value read back, where the plain loop has none)."""
    from onn.bench import vision

    cfg, plan, inputs, dm = _vision(images, tmp_path, "task.mixup=0.2")
    ops, waits = (
        {side: counts[key] for side, counts in vision._device_work(cfg, plan, inputs, dm, tmp_path).items()}
        for key in ("ops", "waits")
    )
    assert abs(ops["onn"] - ops["plain"]) <= 0.05 * ops["plain"], ops
    assert waits["onn"] == waits["plain"], waits
    assert vision._bare_lightning(cfg, plan, inputs, dm, tmp_path, steps=2, warmup=1) > 0


def test_bench_visions_bare_lightning_module_trains_under_bf16_true(images, tmp_path):
    """strategy.precision=bf16-true: Lightning converts the bare module's weights to bf16, and its training_step fed
    them the float32 augmented batch (a raw "Input type and weight type should be the same" ended the bench);
    it casts the batch to the weights' dtype now, as ONN's classifier does."""
    from onn.bench import vision

    cfg, plan, inputs, dm = _vision(images, tmp_path, "strategy.precision=bf16-true")
    assert vision._bare_lightning(cfg, plan, inputs, dm, tmp_path, steps=2, warmup=1) > 0


def test_bench_gpus_child_runs_keep_to_what_is_left_of_the_recipes_eight_minutes(images, tmp_path):
    """recipe=bench_gpu (issue 30: at most 8 minutes, the store's build included) gave each of its two child runs 300 s
    whatever the Phi-4 part had taken: 10 minutes for the children alone. Each now gets its share of what is left of
    the recipe's limit, and one with too little left is not started: its figure says why."""
    from onn.bench import gpu

    age = time.time() - psutil.Process().create_time()
    config = compose(
        "recipe=bench_gpu",
        f"task.time_limit_s={int(age) + 10}",  # 10 s left: less than a child needs
        f"task.vision_source={images}",
        f"paths.outputs={tmp_path}",
        f"paths.cache={tmp_path / 'cache'}",
    )
    job = SimpleNamespace(config=config, run_dir=tmp_path / "bench")
    job.run_dir.mkdir()
    out = gpu._overheads(job)
    assert out["gpu/default_job_ratio"].startswith("not measured: less than 60 s of task.time_limit_s=")
    assert out["gpu/vision_runner_overhead"].startswith("not measured: less than 60 s of task.time_limit_s=")
    assert out["gpu/plain_loop_steps_per_s"] is None and out["gpu/vision_plain_samples_per_s"] is None
    assert not (job.run_dir / "overhead").exists() and not (job.run_dir / "vision").exists()  # nothing started


def test_the_runner_benches_median_of_an_even_number_of_rounds_is_the_middle_twos_mean():
    """vision/runner_overhead, vision/lightning_floor and overhead/ratio are the median round's: of task.repeats=2 they
    took the larger of the two rounds' ratios (plain faster by 0% and 100%: an overhead of 1.0, not 0.5)."""
    from onn.bench.vision import _median_ratio, median_ratio

    assert _median_ratio([100.0, 200.0], [100.0, 100.0]) == 0.5
    assert median_ratio([3.0, 1.0, 2.0, 8.0], [1.0, 1.0, 1.0, 2.0]) == 2.5
    assert _median_ratio([120.0, 90.0, 100.0], [100.0, 100.0, 100.0]) == 0.0  # odd: the middle round, as before
