"""Review of the diffusion sampler and the recurrent models: DDIM in a number of steps that does not divide the
noise schedule steps through its own (uneven) timesteps, so an exact denoiser's images keep their data's mean and
spread (diffusers' step went a fixed stride down and drew them 1.6-2.5 times as spread); task.sampler=ddpm draws its
samples whatever task.sample_steps says (it takes every timestep), where a training run ended in an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose
from test_arch_review8 import MEAN, STD, drawn
from test_diffusion import TINY_UNET, run, write_images

from onn.modalities.diffusion.sample import sampling_scheduler


def test_ddim_steps_through_its_own_timesteps_where_the_steps_do_not_divide_the_schedule():
    """Gaussian images denoised by their exact noise prediction (test_arch_review8's oracle) in 400 and 600 of
    1,000 timesteps: the trailing timesteps are 2 or 3 (1 or 2) apart, and each step must reach the next of them.
    diffusers' own step went down 1000 // steps each time: pixel spread 20.2 (400) and 31.8 (600) for the data's
    12.75. Where they are evenly spaced (25 steps) each step is diffusers' DDIMScheduler.step's, bit for bit, the
    predicted image clipped alike: only where the next timestep is changed."""
    from diffusers import DDIMScheduler

    mean_px, std_px = (MEAN + 1) * 127.5, STD * 127.5
    model = compose("data=diffusion", "model=ddpm_unet").model
    for steps in (400, 600):
        scheduler = sampling_scheduler(model, "ddim", steps)
        assert len(scheduler.timesteps) == steps and scheduler.timesteps[0] == 999
        images = drawn("ddim", steps)
        assert abs(images.mean().item() - mean_px) < 3, (steps, images.mean().item())
        assert 0.8 * std_px < images.std().item() < 1.2 * std_px, (steps, images.std().item())

    ours = sampling_scheduler(model, "ddim", 25)
    theirs = DDIMScheduler(num_train_timesteps=1000, beta_schedule=model.beta_schedule, timestep_spacing="trailing")
    theirs.set_timesteps(25)
    assert torch.equal(ours.timesteps, theirs.timesteps)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 1, 4, 4, generator=generator)
    for t in ours.timesteps:
        noise = 1.5 * torch.randn(2, 1, 4, 4, generator=generator)  # large enough to be clipped at some steps
        mine, reference = ours.step(noise, t, sample), theirs.step(noise, t, sample)
        assert torch.equal(mine.prev_sample, reference.prev_sample), int(t)
        assert torch.equal(mine.pred_original_sample, reference.pred_original_sample), int(t)
        sample = mine.prev_sample


def test_ddpm_draws_whatever_task_sample_steps_says():
    """task.sampler=ddpm reads no task.sample_steps: a config the run's check lets through draws its images."""
    from onn.modalities import get
    from onn.modalities.diffusion.tasks import build, draw_samples

    config = compose(
        "data=diffusion",
        *TINY_UNET,
        *("model.train_timesteps=10", "task.sampler=ddpm", "task.sample_steps=0", "task.samples=2"),
    )
    get("diffusion").check(config)
    module = build(config, {"input_shape": [1, 8, 8], "classes": ["a"], "seed": 0})
    images = draw_samples(config, module, torch.device("cpu"))
    assert images.shape == (2, 1, 8, 8) and images.dtype == torch.uint8


@pytest.mark.slow  # a training run: 20-40 s on two shared cores
def test_a_ddpm_training_run_ends_with_its_samples_and_export(tmp_path: Path):
    """task.sampler=ddpm takes every timestep of the schedule and reads no task.sample_steps; the run checks
    sample_steps for ddim only, and with task.sample_steps=0 a training ran to its end and then stopped in an error
    before its samples (and its export) were written."""
    from safetensors.torch import load_file

    images = write_images(tmp_path / "pictures", per_class=6)
    metrics, run_dir = run(
        tmp_path,
        *TINY_UNET,
        f"data.source={images}",
        *("model.train_timesteps=20", "task.sampler=ddpm", "task.sample_steps=0", "task.samples=3"),
        *("trainer.max_steps=4", "trainer.val_check_interval=2", "export=safetensors"),
    )
    assert metrics["steps"] == 4 and metrics["train/loss_final"] < metrics["train/loss_initial"]
    drawn_images = load_file(str(run_dir / "samples.safetensors"))["images"]
    assert drawn_images.shape == (3, 1, 8, 8) and drawn_images.dtype == torch.uint8
    assert Path(metrics["export/path"]).is_dir()
