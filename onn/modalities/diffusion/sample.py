"""Drawing images from a trained denoiser with a diffusers scheduler, and a grid PNG of them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from diffusers import DDIMScheduler
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
from torch import nn

from onn.config.model import DenoiserConfig
from onn.errors import UserError
from onn.modalities.diffusion.modality import SAMPLERS
from onn.modalities.diffusion.module import to_pixels


class TrailingDDIMScheduler(DDIMScheduler):
    """diffusers' DDIMScheduler, each step going to the next of its own timesteps. diffusers' step goes to
    `t - num_train_timesteps // steps` (diffusers issue 12633), the next listed timestep only where the steps divide
    the schedule: with 600 of 1,000 every step went down 1 timestep where the list went down 1 or 2, and an exact
    denoiser's images came out with 2.5 times the spread of its data. The step is DDIM's deterministic one (eta 0)
    for a noise prediction, the predicted image clipped as the scheduler's config says, as diffusers computes it."""

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        super().set_timesteps(num_inference_steps, device)
        listed = self.timesteps.tolist()
        self.following = dict(zip(listed, [*listed[1:], -1]))  # -1: the last step ends at the clean image

    def step(
        self,
        model_output: torch.Tensor,
        timestep: int | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,  # unused (eta 0); accepted as DDPMScheduler's step takes it
    ) -> DDIMSchedulerOutput:
        current, following = int(timestep), self.following[int(timestep)]
        alpha = self.alphas_cumprod[current]
        alpha_next = self.alphas_cumprod[following] if following >= 0 else self.final_alpha_cumprod
        original = (sample - (1 - alpha) ** 0.5 * model_output) / alpha**0.5
        if self.config.clip_sample:
            limit = self.config.clip_sample_range
            original = original.clamp(-limit, limit)
        prev_sample = alpha_next**0.5 * original + (1 - alpha_next) ** 0.5 * model_output
        return DDIMSchedulerOutput(prev_sample=prev_sample, pred_original_sample=original)


def sampling_scheduler(model_cfg: DenoiserConfig, sampler: str, steps: int):
    """DDIM (deterministic, `steps` of the training schedule) or DDPMScheduler (every timestep), on the noise
    schedule the model was trained with. DDIM's steps are spaced from the schedule's last timestep down ("trailing",
    Lin et al. 2023): diffusers' default ("leading") starts at 0 for one step and at T/2 for two, so the starting
    noise was denoised as if it were an almost clean image and came back as noise. Trailing steps are uneven where
    `steps` does not divide the schedule, which TrailingDDIMScheduler steps through as listed."""
    from diffusers import DDPMScheduler

    if sampler not in SAMPLERS:
        raise UserError(f"task.sampler={sampler!r}: use one of {', '.join(SAMPLERS)}.")
    schedule = {"num_train_timesteps": int(model_cfg.train_timesteps), "beta_schedule": model_cfg.beta_schedule}
    if sampler == "ddim":
        scheduler = TrailingDDIMScheduler(**schedule, timestep_spacing="trailing")
        scheduler.set_timesteps(steps)
    else:
        scheduler = DDPMScheduler(**schedule)
        scheduler.set_timesteps(int(model_cfg.train_timesteps))
    return scheduler


@torch.no_grad()
def draw(
    denoiser: nn.Module,
    scheduler,
    count: int,
    shape: list[int],
    seed: int,
    device: torch.device,
    batch: int = 256,
) -> torch.Tensor:
    """`count` uint8 images [count, *shape]: starting noise from `seed` (on the CPU, so every device starts from the
    same), denoised step by step with the scheduler. DDPM's noise of each step comes from a generator on the device
    (seeded from `seed`: the same images on the same device): drawn on the CPU, it was a blocking copy to the device
    at every step, as a CPU timestep was (the timesteps go to the device once)."""
    denoiser = denoiser.to(device).eval()
    generator = torch.Generator().manual_seed(int(seed))
    step_noise = torch.Generator(device=device).manual_seed(step_seed(int(seed)))
    on_device = scheduler.timesteps.to(device)
    out = []
    for start in range(0, count, batch):
        n = min(batch, count - start)
        x = torch.randn(n, *shape, generator=generator).to(device)
        for t, step in zip(scheduler.timesteps, on_device):
            noise = denoiser(x, step.expand(n))
            x = scheduler.step(noise, t, x, generator=step_noise).prev_sample
        out.append(to_pixels(x).cpu())
    return torch.cat(out) if out else torch.zeros(0, *shape, dtype=torch.uint8)


def write_sample_grid(images: torch.Tensor, path: Path, captions: list[str] | None = None) -> None:
    """The first 64 images as one PNG grid (the image modality's), each captioned (the classifier's label) or not."""
    from onn.modalities.image.pictures import MAX_IMAGES, write_grid

    shown = images[:MAX_IMAGES]
    labels = captions[: len(shown)] if captions is not None else [""] * len(shown)
    write_grid(shown, labels, [None] * len(shown), path, columns=8, scale=3)


def step_seed(seed: int) -> int:
    """The seed of DDPM's per-step noise, derived from `seed` without drawing from the starting noise's generator
    (a draw there would change every seed's samples, DDIM's too) and unlike it (the same seed would make the first
    step's noise the starting noise on a CPU)."""
    return int.from_bytes(hashlib.sha256(f"onn-ddpm-step-noise:{seed}".encode()).digest()[:8], "little") >> 1
