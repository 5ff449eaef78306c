"""A fraction-of-an-epoch validation interval that max_steps cuts short still validates; a plan made with ckpt= says
the strategy is the checkpoint's, not one the command line asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import execute_run
from test_vision_train import make_images


def execute(tmp: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """`python run.py OVERRIDES` in this process, in `tmp/name`: its metrics and its folder."""
    return execute_run(tmp, tmp / "cache", "hardware=cpu_16gb", *overrides, name=name), tmp / name


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict, Path]:
    """Two steps of a 9-batch epoch (18 training images, 2 a batch) validated every half epoch (4 batches)."""
    tmp = tmp_path_factory.mktemp("valint")
    images = make_images(tmp / "images", train=8, test=2)
    return execute(
        tmp,
        "train",
        "model=v28_cnn",
        "data=image",
        "strategy=full",
        f"data.source={images}",
        "data.batch_size=2",
        "data.val_split=0.25",
        "trainer.max_steps=2",
        "trainer.max_epochs=1",
        "trainer.val_check_interval=0.5",
        "optim.warmup_steps=0",
    )


def test_a_fraction_of_an_epoch_longer_than_the_run_validates_at_its_end(trained):
    """Half an epoch is 4 batches, and max_steps=2 ended the run first: it never validated, so best.ckpt was
    missing and val/acc_best null (ModelCheckpoint: "could not find the monitored key")."""
    metrics, run_dir = trained
    assert metrics["val/acc_best"] is not None
    assert (run_dir / "checkpoints" / "best.ckpt").exists()


def test_a_plan_from_a_checkpoint_says_the_strategy_is_the_checkpoints(trained):
    """task=plan ckpt=RUN with no strategy on the command line said "strategy=full was asked for"; the training run,
    which named strategy=full, still says so."""
    run_dir = trained[1]
    _, planned = execute(run_dir.parent, "plan", "task=plan", f"ckpt={run_dir}")
    reasons = yaml.safe_load((planned / "plan.yaml").read_text())["reasons"]
    assert reasons[0] == "strategy=full, the checkpoint's"
    asked = yaml.safe_load((run_dir / "plan.yaml").read_text())["reasons"]
    assert asked[0] == "strategy=full was asked for"
