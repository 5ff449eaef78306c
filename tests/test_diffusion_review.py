"""Diffusion as a user with their own image folder meets it: a resume or an eval given a folder of other images
(colour for a greyscale denoiser), a folder too big to hold (streamed), a plan for images of their own size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from test_diffusion import TINY_UNET, run, write_images


def write_colour_images(folder: Path, per_class: int = 4, size: int = 16) -> Path:
    """Two classes of random RGB pictures of `size` px."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(
                folder / name / f"{i}.png"
            )
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A greyscale 8x8 denoiser trained two steps, and its images' folder."""
    tmp = tmp_path_factory.mktemp("trained")
    images = write_images(tmp / "grey", per_class=6)
    _, run_dir = run(tmp, *TINY_UNET, f"data.source={images}", "trainer.max_steps=2", "task.samples=2")
    return run_dir, images


@pytest.mark.modalities
def test_a_resume_on_a_colour_folder_decodes_it_as_the_checkpoint_was_trained(trained, tmp_path):
    """Resuming a greyscale 8x8 denoiser on a folder of 16 px colour images failed in its first convolution (a raw
    'expected input to have 1 channels' traceback): the images are now decoded to the checkpoint's shape."""
    from safetensors.torch import load_file

    run_dir, _ = trained
    colour = write_colour_images(tmp_path / "colour")
    given = {"ckpt", "data.source", "trainer.max_steps"}
    metrics, resumed = run(tmp_path, *TINY_UNET, f"data.source={colour}", f"ckpt={run_dir}",
                           "trainer.max_steps=4", "task.samples=2", name="resumed", given=given)  # fmt: skip
    assert metrics["steps"] == 4 and metrics["resumed_from"]
    assert load_file(str(resumed / "samples.safetensors"))["images"].shape == (2, 1, 8, 8)


@pytest.mark.modalities
def test_eval_of_streamed_data_judges_its_held_out_images(trained, tmp_path):
    """task=eval with data.resident=false (and any folder over data.resident_max_mb, streamed) ended in
    KeyError: 'val' when it drew the held-out real images: a streamed datamodule holds no resident splits."""
    run_dir, images = trained
    judge = ("model=v28_cnn", "data=image", f"data.source={images}", "data.batch_size=8", "trainer.max_steps=3")
    _, judge_dir = run(tmp_path, *judge, name="judge")
    given = {"ckpt", "task", "task.classifier", "data.resident", "task.samples", "task.confidence"}
    evaluate = (f"ckpt={run_dir}", "task=eval", f"task.classifier={judge_dir}", "data.resident=false")
    judged, _ = run(tmp_path, *TINY_UNET, *evaluate, "task.samples=4", "task.confidence=0", name="eval", given=given)
    assert judged["samples/count"] == 4
    assert judged["real/confident_share"] == 1.0  # confidence 0: each of the 4 real images was labelled


def test_the_plan_sizes_the_images_of_the_folder_when_image_size_is_null(tmp_path):
    """data.image_size=null keeps the images' own size, but the plan sized a 1-channel 32 px denoiser whatever the
    folder held: memory and step time predicted for other images than the run trains on."""
    from onn.hardware.profile import resolve
    from onn.modalities import get

    colour = write_colour_images(tmp_path / "colour", per_class=2, size=16)
    common = ("data=diffusion", *TINY_UNET, f"data.source={colour}", "hardware=cpu_16gb")
    found = compose(*common)
    told = compose(*common, "data.image_size=[16,16]", "data.channels=3")
    specs = [
        get("diffusion").plan(cfg, resolve(cfg.hardware, str(tmp_path), str(tmp_path)))[1] for cfg in (found, told)
    ]
    assert specs[0].sample_flops == specs[1].sample_flops > 0
    sized = compose(*common, "data.image_size=[16,16]")  # a size given, channels auto: the images' 3 channels
    assert get("diffusion").plan(sized, resolve(sized.hardware, str(tmp_path), str(tmp_path)))[1].sample_flops == (
        specs[1].sample_flops
    )
