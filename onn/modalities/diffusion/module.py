"""The denoiser (a diffusers UNet2DModel or DiTTransformer2DModel) and the LightningModule that trains it.

Training is DDPM's (Ho et al. 2020): a batch of images scaled to [-1, 1], a random timestep per image,
noise added by the diffusers DDPMScheduler (`add_noise`), and the mean squared error between that noise
and the denoiser's prediction of it. Validation scores the same loss on held-out images with noise and
timesteps drawn from a fixed seed, so epochs compare. An exponential moving average of the weights
(torch.optim.swa_utils.AveragedModel's, updated without waiting for the GPU, kept in float32 whatever
strategy.precision) is what samples are drawn from, what the held-out loss measures and what is exported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from onn.config.model import DenoiserConfig
from onn.config.run import OptimConfig
from onn.errors import UserError
from onn.streaming.engine import Objective
from onn.training.distributed import clip_gradients
from onn.training.module import ONNModule
from onn.training.optim import make_optimizer, make_schedule
from onn.training.record import EpochRecord, log_train_loss

LOOP = "diffusion"
MONITOR = "val/loss"
ARCHITECTURES = ("unet", "dit")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")  # what DDPMScheduler and DDIMScheduler both take
VAL_SEED = 1234  # the held-out noise and timesteps: the same every validation


class Denoiser(nn.Module):
    """A diffusers denoiser as one function: (noisy images [B, C, H, W], timesteps [B]) -> predicted noise.
    The DiT is class-conditional in diffusers; here every image is class 0 (an unconditional model)."""

    def __init__(self, network: nn.Module, architecture: str):
        super().__init__()
        self.network, self.architecture = network, architecture

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        # in the weights' dtype: under strategy.precision=bf16-true (or 16-true) they are bf16, the noisy images not
        sample = sample.to(self.network.dtype)
        if self.architecture == "dit":
            classes = torch.zeros(sample.shape[0], dtype=torch.long, device=sample.device)
            return self.network(sample, timestep=timestep, class_labels=classes).sample
        return self.network(sample, timestep).sample


class MovingAverage(AveragedModel):
    """An exponential moving average of a model's weights and buffers: AveragedModel's state (`module` and
    `n_averaged`, so checkpoints keep their keys), updated without reading its count from the device.
    AveragedModel tests `n_averaged` twice an update, and on a GPU each test waits for every kernel queued,
    so the host could never queue a step while the GPU runs the one before. Here the count is mirrored on
    the host, read from the device once after a checkpoint loads into it. The average stays in float32 when the
    model is cast (strategy.precision=bf16-true casts the whole LightningModule): in bf16 an update of
    (1 - decay) x the difference is mostly rounded away, and the average stayed near the first weights."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.module.float()
        # averaged, never given a gradient: DDP took the copy's parameters for trained ones no loss used, and refused
        # every step of a multi-process run
        self.requires_grad_(False)
        self.updates: int | None = 0  # n_averaged, on the host; None after a load, until read
        self.register_load_state_dict_post_hook(_count_unread)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self.updates is None:
            self.updates = int(self.n_averaged)
        mine = [*self.module.parameters(), *self.module.buffers()]
        pairs = list(zip(mine, [*model.parameters(), *model.buffers()], strict=True))
        floats = [(averaged, current) for averaged, current in pairs if averaged.is_floating_point()]
        if self.updates > 0 and floats:  # the first update copies, as AveragedModel's does
            # the model's bf16 weights in the average's float32 (torch's lerp takes one dtype)
            self.multi_avg_fn([a for a, _ in floats], [c.to(a.dtype) for a, c in floats], self.n_averaged)
        for averaged, current in pairs:
            if self.updates == 0 or not averaged.is_floating_point():  # counts follow the model
                averaged.copy_(current)
        self.n_averaged += 1
        self.updates += 1

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MovingAverage:
        """Moves (`.to(device)`) apply; casts (`.to(dtype)`, `.half()`) leave the floats in their own dtype."""

        def moved_only(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            if tensor.is_floating_point() and applied.dtype != tensor.dtype:
                return tensor.to(device=applied.device)
            return applied

        return super()._apply(moved_only, recurse)


def _count_unread(module: MovingAverage, incompatible_keys) -> None:
    module.updates = None


def build_denoiser(model_cfg: DenoiserConfig, channels: int, size: list[int]) -> Denoiser:
    """The denoiser of model.architecture for images of `channels` x size[0] x size[1]."""
    from diffusers import DiTTransformer2DModel, UNet2DModel

    if model_cfg.architecture not in ARCHITECTURES:
        raise UserError(f"model.architecture={model_cfg.architecture!r}: use one of {', '.join(ARCHITECTURES)}.")
    kwargs = dict(model_cfg.kwargs)
    height, width = size
    try:
        if model_cfg.architecture == "unet":
            network = UNet2DModel(sample_size=(height, width), in_channels=channels, out_channels=channels, **kwargs)
        else:
            if height != width:
                raise UserError(f"model.architecture=dit takes square images; data.image_size is {height}x{width}.")
            network = DiTTransformer2DModel(
                sample_size=height, in_channels=channels, out_channels=channels, num_embeds_ada_norm=1, **kwargs
            )
    # an unknown or inconsistent constructor argument: diffusers says which (a DiT's norm_type other than
    # ada_norm_zero is a NotImplementedError)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise UserError(f"model.kwargs do not build a {model_cfg.architecture}: {e}") from e
    if model_cfg.architecture == "unet":
        check_unet_conditioning(network, int(model_cfg.train_timesteps))
    check_size(network, model_cfg.architecture, height, width)
    from diffusers.models.embeddings import LabelEmbedding

    for module in network.modules():
        # Unconditional: the one class is never dropped (classifier-free guidance's label dropout), which also keeps
        # a block recomputed by layer streaming's backward the same function as in its forward.
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
    return Denoiser(network, model_cfg.architecture)


def check_unet_conditioning(network: nn.Module, train_timesteps: int) -> None:
    """Refuse a UNet the noise-prediction loop cannot feed, before the data loads and the first step fails in
    diffusers: a class-conditional one needs class labels (the Denoiser gives none: it generates unconditionally),
    a Fourier time embedding takes the log of its timestep, infinite at DDPM's timestep 0 (a NaN loss), and a
    learned one has a row per timestep (an index past its table: on a GPU, a device-side assert)."""
    config = network.config
    if config.class_embed_type is not None or config.num_class_embeds is not None:
        raise UserError(
            f"model.kwargs builds a class-conditional unet (class_embed_type={config.class_embed_type}, "
            f"num_class_embeds={config.num_class_embeds}), and ONN's denoiser is unconditional (it is given no "
            "labels): remove those keys from model.kwargs."
        )
    if config.time_embedding_type == "fourier":
        raise UserError(
            "model.kwargs.time_embedding_type=fourier embeds the log of a score model's noise level, and DDPM's "
            "timesteps start at 0 (log 0: a NaN loss): use time_embedding_type=positional (the default)."
        )
    if config.time_embedding_type == "learned" and (config.num_train_timesteps or 0) < train_timesteps:
        raise UserError(
            f"model.kwargs.num_train_timesteps={config.num_train_timesteps}: a learned time embedding needs a row "
            f"for each of model.train_timesteps={train_timesteps} timesteps; set it to {train_timesteps}."
        )


def check_size(network: nn.Module, architecture: str, height: int, width: int) -> None:
    """Refuse images the network cannot take whole, before a step fails on mismatched tensors: a UNet halves them
    once per down block but its last (and its up blocks double them back, to be joined with the skips), a DiT cuts
    them into patch_size x patch_size patches."""
    if architecture == "unet":
        halvings = sum(getattr(block, "downsamplers", None) is not None for block in network.down_blocks)
        factor, why = 2**halvings, f"a unet halves images {halvings} times (model.kwargs.block_out_channels)"
    else:
        factor = int(network.config.patch_size)
        why = f"a dit cuts images into {factor}x{factor} patches (model.kwargs.patch_size)"
    if height % factor or width % factor:
        fit = [-(-v // factor) * factor for v in (height, width)]
        raise UserError(
            f"images of {height}x{width}: {why}, so their height and width must be multiples of {factor}; set "
            f"data.image_size=[{fit[0]},{fit[1]}] with data.resize=resize (or center_crop)."
        )


class NoisePrediction(Objective):
    """DDPM's loss for the layer-streaming engine: a batch of noisy images, their timesteps and the noise that was
    added (drawn once per step by DiffusionModule.noisy, so every pass over the chunks sees the same)."""

    hold_mmap_threshold = True  # activations of a block's weights' sizes: unmapped when freed (Objective)

    def inputs(self, batch: dict[str, Any], targets: bool = False) -> dict[str, Any]:
        return {"sample": batch["sample"], "timestep": batch["timestep"]}

    def loss(self, output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        return F.mse_loss(output.float(), batch["noise"])

    def weight(self, batch: dict[str, Any]) -> int:
        return int(batch["sample"].shape[0])


def noise_scheduler(model_cfg: DenoiserConfig):
    """The training noise schedule (diffusers' DDPMScheduler)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=int(model_cfg.train_timesteps), beta_schedule=model_cfg.beta_schedule)


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> floats in [-1, 1]."""
    return images.float() / 127.5 - 1


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """Floats in [-1, 1] -> uint8 pixels."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


class DiffusionModule(EpochRecord, ONNModule):
    loop = LOOP
    describes = "ONN's diffusion training"

    def __init__(self, denoiser: Denoiser, model_cfg: DenoiserConfig, optim: OptimConfig, onn_config: dict[str, Any]):
        super().__init__()
        self.optimizer_steps: int | None = None  # the schedule's length, when the runner knows it
        self.denoiser = denoiser
        self.ema_decay = float(model_cfg.ema_decay)
        self.ema = MovingAverage(denoiser, self.ema_decay) if self.ema_decay > 0 else None
        self.scheduler = noise_scheduler(model_cfg)
        self.optim = optim
        self.onn_config = onn_config  # plain values, stored in every checkpoint: eval/infer/export rebuild from it
        self.train_losses: list[torch.Tensor] = []
        self.history: list[dict[str, float]] = []
        self._val: list[torch.Tensor] = []  # held-out loss x batch size, per batch
        self._val_count = 0
        self._validated: nn.Module | None = None  # the sampling denoiser, for one validation
        self._generator: torch.Generator | None = None
        self.last_metrics: dict[str, float] = {}
        self.engine = None  # set by LayerStreamingStrategy: the blocks' frozen weights stream from a layer store
        self.store = None  # a layer store the blocks were loaded into beforehand (none: the strategy makes it)
        # LoRA (strategy=sparse_lora): checkpoints hold what trains; the frozen base is rebuilt from the seed
        self.strict_loading = all(p.requires_grad for p in denoiser.parameters())

    @property
    def model(self) -> nn.Module:
        """What the layer-streaming strategy streams."""
        return self.denoiser

    def averaged_denoiser(self) -> nn.Module:
        """The weights samples come from, as kept (what is exported): the moving average of the weights (float32),
        or the weights themselves (model.ema_decay=0)."""
        return self.ema.module if self.ema is not None else self.denoiser

    def sampling_denoiser(self) -> nn.Module:
        """What samples are drawn from and val/loss measures: averaged_denoiser in the dtype the weights compute in
        (a bf16 copy of the float32 average under strategy.precision=bf16-true)."""
        averaged = self.averaged_denoiser()
        dtype = next(self.denoiser.parameters()).dtype
        return averaged if next(averaged.parameters()).dtype == dtype else copy.deepcopy(averaged).to(dtype)

    def noisy(self, images: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """A batch of uint8 images as DDPM trains on it: a random timestep per image, the noise drawn, the noisy
        images (diffusers' add_noise)."""
        x0 = to_model_range(images)
        steps = self.scheduler.config.num_train_timesteps
        t = torch.randint(0, steps, (x0.shape[0],), device=x0.device, generator=generator)
        # float32 named: under bf16-true Lightning makes bf16 the default dtype, and a bf16 target fails the backward
        noise = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device, generator=generator)
        return {"sample": self.scheduler.add_noise(x0, noise, t), "timestep": t, "noise": noise}

    def loss(
        self, images: torch.Tensor, generator: torch.Generator | None = None, denoiser: nn.Module | None = None
    ) -> torch.Tensor:
        """DDPM's noise-prediction loss of a batch of uint8 images, of `denoiser` (the trained weights when None).
        Layer-streamed (never with a moving average), the forward and the loss's backward to the last block run
        here and the blocks' backward in the strategy's `backward`."""
        batch = self.noisy(images, generator)
        if self.engine is not None:
            pieces = self.engine.split(batch)
            if torch.is_grad_enabled():
                return self.engine.forward_train(pieces, loss_scale=self.trainer.strategy.loss_scale())
            weights = [p["sample"].shape[0] / images.shape[0] for p in pieces]
            return sum(loss * w for loss, w in zip(self.engine.loss(pieces), weights))
        denoiser = self.denoiser if denoiser is None else denoiser
        return F.mse_loss(denoiser(batch["sample"], batch["timestep"]).float(), batch["noise"])

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, _ = batch
        loss = self.loss(images)
        self.record_step(loss, batch)
        log_train_loss(self, loss, images.shape[0], over_ranks=True)  # under DDP each rank's loss is its share's
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        """The step, then the moving average: before any callback's on_train_batch_end, so a checkpoint written
        there holds the average of this step too (a resumed run then averages exactly as an unbroken one)."""
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update_parameters(self.denoiser)

    def on_validation_epoch_start(self) -> None:
        # each rank its own held-out noise (as its own training noise): alike, different images shared one draw
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._generator = torch.Generator(device=self.device).manual_seed(VAL_SEED * world + self.global_rank)
        self._val, self._val_count = [], 0
        self._validated = self.sampling_denoiser()  # val/loss is the sampled model's, as task=eval's samples are

    def validation_step(self, batch, batch_idx: int) -> None:
        images, _ = batch
        self._val.append(self.loss(images, self._generator, self._validated).detach() * images.shape[0])
        self._val_count += images.shape[0]

    def on_validation_epoch_end(self) -> None:
        self._validated = None
        figures = {MONITOR: self.held_out_loss()}
        self.last_metrics = figures
        self.log(MONITOR, figures[MONITOR], prog_bar=True)
        if not self.trainer.sanity_checking:
            self.record_epoch(figures, [MONITOR])

    def held_out_loss(self) -> float:
        """The mean loss per held-out image of this validation. Under DDP each rank scores its own share of the
        images (ResidentBatches, EvaluatedOnceDDP): the shares' sums and counts are added over the ranks (one
        collective, on the device), or val/loss, the history and best.ckpt's choice were rank 0's share's."""
        total = torch.stack(self._val).sum().float() if self._val else torch.zeros((), device=self.device)
        summed = torch.stack([total, torch.tensor(float(self._val_count), device=total.device)])
        if self.trainer.world_size > 1:
            summed = self.trainer.strategy.reduce(summed, reduce_op="sum")
        loss, count = summed.tolist()
        return loss / max(count, 1)

    def on_train_start(self) -> None:
        """Under DDP each rank draws its own timesteps and noise: every rank was seeded alike (tasks.build), so each
        drew the same ones for its own images. Seeded per rank as DiT's training is (seed x ranks + rank)."""
        super().on_train_start()
        if self.trainer.world_size > 1:
            seed = int(self.onn_config["inputs"]["seed"])
            torch.manual_seed(seed * self.trainer.world_size + self.trainer.global_rank)

    def on_before_optimizer_step(self, optimizer) -> None:
        clip_gradients(self, optimizer, self.optim.clip_grad_norm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if not self.strict_loading:  # the frozen weights are the seed's (and, streamed, live in the store)
            trainable = {n for n, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.denoiser.parameters() if p.requires_grad], self.optim)
        schedule = make_schedule(
            optimizer, self.optim, self.optimizer_steps or int(self.trainer.estimated_stepping_batches), MONITOR
        )
        return {"optimizer": optimizer, "lr_scheduler": schedule}
