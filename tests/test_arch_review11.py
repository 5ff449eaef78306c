"""Review of the diffusion modality's quality figures: a task.confidence outside [0, 1] (a percentage) is refused
before anything loads, and the held-out real images the samples are compared with are counted where fewer are held
out than samples are drawn."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import compose
from test_diffusion import TINY_UNET, run, write_images

from onn.errors import UserError
from onn.modalities import get
from onn.modalities.diffusion.tasks import datamodule


def test_a_confidence_outside_zero_to_one_is_one_sentence_before_anything_loads():
    """task.confidence=90 meant 90%: no top probability reaches it, so every sample counted as unrecognised and no
    class as present, and the eval reported 0% where the samples were fine. The modality's check, which runs before
    the judge and the denoiser load, refuses it; 0 (every sample counts) and 1 are probabilities and pass."""
    config = compose("data=diffusion", *TINY_UNET, "task=eval")
    diffusion = get("diffusion")
    for confidence in (90.0, -0.1, 1.5):
        with pytest.raises(UserError, match=rf"task.confidence={confidence}: .* between 0 and 1 \(0.9 is 90%\)\.$"):
            diffusion.check(dataclasses.replace(config, task=dataclasses.replace(config.task, confidence=confidence)))
    for confidence in (0.0, 1.0):
        diffusion.check(dataclasses.replace(config, task=dataclasses.replace(config.task, confidence=confidence)))


@pytest.mark.slow  # trains a denoiser and a judge, then evaluates
def test_eval_counts_the_real_images_it_compares_the_samples_with(tmp_path):
    """Six samples against a held-out split of fewer real images: the real figures are on those, and
    real/count says so (the report read as if as many real images as samples had been judged)."""
    images = write_images(tmp_path / "pictures", per_class=6)
    short = (f"data.source={images}", "trainer.max_steps=2", "trainer.val_check_interval=2", "task.samples=2")
    _, run_dir = run(tmp_path, *TINY_UNET, *short, name="train")
    judge = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "trainer.max_steps=2")
    _, judge_dir = run(tmp_path, *judge, name="judge")
    given = {"ckpt", "task", "task.classifier", "task.samples", "task.confidence"}
    evaluate = (f"ckpt={run_dir}", "task=eval", f"task.classifier={judge_dir}", "task.confidence=0")
    judged, _ = run(tmp_path, *TINY_UNET, *evaluate, "task.samples=6", name="eval", given=given)
    assert judged["samples/count"] == 6
    config = compose(
        "data=diffusion", f"data.source={images}", f"paths.cache={tmp_path / 'cache'}", "data.val_split=0.25"
    )
    # the training run's held-out split (same source and seed): a draw around data.val_split=0.25 of 12
    held = len(datamodule(config, "cpu").splits["val"])
    assert 0 < held < 6  # fewer real images held out than samples drawn: what the figure is about
    assert judged["real/count"] == held
    assert sum(judged["samples/class_counts"].values()) == 6  # confidence 0: every sample is counted
