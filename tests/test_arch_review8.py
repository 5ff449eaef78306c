"""Review of the diffusion and recurrent models: DDIM from one step up draws from the schedule's last timestep (an
exact denoiser of Gaussian images lands on their closed form), and UNet settings the unconditional noise-prediction
loop cannot feed are refused in one sentence before any step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose
from test_diffusion import TINY_UNET, run, write_images

from onn.errors import UserError

MEAN, STD = 0.5, 0.1  # the Gaussian images' pixels, in the model's [-1, 1] range


class GaussianOracle(torch.nn.Module):
    """The exact noise prediction E[noise | x_t] for images whose pixels are independent N(MEAN, STD^2): with
    a = alphas_cumprod[t], x_t ~ N(sqrt(a) MEAN, a STD^2 + 1 - a) and E[noise | x_t] = sqrt(1 - a) (x_t -
    sqrt(a) MEAN) / (a STD^2 + 1 - a). A sampler fed it must give back images of that mean and spread."""

    def __init__(self, alphas_cumprod: torch.Tensor):
        super().__init__()
        self.register_buffer("alphas_cumprod", alphas_cumprod.float())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t].view(-1, 1, 1, 1)
        return (1 - a).sqrt() * (x - a.sqrt() * MEAN) / (a * STD**2 + 1 - a)


def drawn(sampler: str, steps: int) -> torch.Tensor:
    """Pixels (floats) of 8 greyscale 16x16 images drawn from the oracle as task=infer draws them."""
    from onn.modalities.diffusion.module import noise_scheduler
    from onn.modalities.diffusion.sample import draw, sampling_scheduler

    model = compose("data=diffusion", "model=ddpm_unet").model  # the recipe's cosine schedule of 1,000 steps
    oracle = GaussianOracle(noise_scheduler(model).alphas_cumprod)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return draw(oracle, sampling_scheduler(model, sampler, steps), 8, [1, 16, 16], seed=0, device=device).float()


def test_ddim_from_one_step_up_draws_the_images_the_exact_denoiser_knows():
    """One DDIM step started at timestep 0 (diffusers' default 'leading' spacing): the starting noise was taken
    for an almost clean image and came back as clipped noise (pixel spread ~90 where the data's is 12.75). Spaced
    from the last timestep, one step gives E[x0 | pure noise], the data's mean, and 25 steps (and DDPM's every
    step) give back the data's mean and spread."""
    mean_px, std_px = (MEAN + 1) * 127.5, STD * 127.5
    one = drawn("ddim", 1)
    assert abs(one.mean().item() - mean_px) < 2 and one.std().item() < 2, (one.mean().item(), one.std().item())
    for sampler, steps in (("ddim", 25), ("ddpm", 1000)):
        images = drawn(sampler, steps)
        assert abs(images.mean().item() - mean_px) < 3, (sampler, images.mean().item())
        assert 0.7 * std_px < images.std().item() < 1.3 * std_px, (sampler, images.std().item())


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (["num_class_embeds=10"], r"class-conditional unet .*num_class_embeds=10.*remove those keys"),
        (["class_embed_type=timestep"], r"class-conditional unet \(class_embed_type=timestep"),
        (["time_embedding_type=fourier"], r"time_embedding_type=fourier .* use time_embedding_type=positional"),
        (
            ["time_embedding_type=learned", "num_train_timesteps=10"],
            r"num_train_timesteps=10: a learned time embedding .* set it to 1000\.$",
        ),
    ],
)
def test_a_unet_the_unconditional_loop_cannot_feed_is_one_sentence(kwargs, said):
    """diffusers builds these UNets, and the first training step failed in them: a class-conditional one raised
    'class_labels should be provided' (ONN's denoiser gives none), a Fourier time embedding took log(0) at DDPM's
    timestep 0 (a NaN loss), a learned one of 10 rows was indexed up to 999 (on a GPU a device-side assert)."""
    from onn.modalities.diffusion.module import build_denoiser

    model = compose("data=diffusion", *TINY_UNET, *(f"++model.kwargs.{kv}" for kv in kwargs)).model
    with pytest.raises(UserError, match=said):
        build_denoiser(model, 1, [8, 8])


def test_a_dit_norm_type_diffusers_cannot_run_is_one_sentence():
    """DiTTransformer2DModel raises NotImplementedError for a norm_type other than ada_norm_zero: it went out as a
    bare traceback, where its other constructor mistakes are one sentence naming model.kwargs."""
    from onn.modalities.diffusion.module import build_denoiser

    kwargs = "model.kwargs={num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, patch_size: 2}"
    model = compose("data=diffusion", "model=dit_small", kwargs, "++model.kwargs.norm_type=ada_norm").model
    with pytest.raises(UserError, match=r"^model\.kwargs do not build a dit: .*ada_norm"):
        build_denoiser(model, 1, [8, 8])


def test_a_class_conditional_unet_is_refused_before_training(tmp_path: Path):
    """Through the runner: the run stops in one sentence and writes no checkpoint."""
    images = write_images(tmp_path / "pictures")
    with pytest.raises(UserError, match="class-conditional unet"):
        run(tmp_path, *TINY_UNET, "++model.kwargs.num_class_embeds=2", f"data.source={images}")
    assert not list(tmp_path.glob("run/checkpoints/*.ckpt"))


def test_a_float32_moving_average_under_fsdp_in_half_precision_is_refused_before_training(tmp_path: Path):
    """FSDP flattens the whole module, the float32 moving average beside the bf16 weights, and refuses mixed dtypes
    at setup (its ValueError) once the data has loaded."""
    images = write_images(tmp_path / "pictures")
    with pytest.raises(UserError, match=r"strategy.lightning=fsdp and strategy.precision=bf16-true: the moving"):
        run(tmp_path, *TINY_UNET, "strategy.lightning=fsdp", "strategy.precision=bf16-true", f"data.source={images}")
    assert not list(tmp_path.glob("run/checkpoints/*.ckpt"))
