"""Diffusion: a denoiser learns to generate images like those of an image source.

The diffusion modality. Its images are read by the image modality's readers and cached as they are
(any folder, archive, IDX, CIFAR or parquet source: conf/data/diffusion.yaml); the denoiser is a diffusers
UNet2DModel or DiTTransformer2DModel (conf/model/ddpm_unet.yaml, dit_small.yaml) trained with DDPM's
noise-prediction loss under diffusers' DDPMScheduler (module.py); samples are drawn with diffusers'
DDIMScheduler or DDPMScheduler (sample.py); task=eval judges them with an ONN image classifier (quality.py).
data=auto never picks it: images are classified unless data=diffusion says to learn to generate them.
"""

from __future__ import annotations

from typing import Any

from onn.config import ONNConfig
from onn.config.data import ImageData
from onn.config.model import DenoiserConfig
from onn.config.task import READS_CHECKPOINT
from onn.errors import UserError
from onn.modalities.base import Job, Modality

SAMPLERS = ("ddim", "ddpm")  # task.sampler: sample.py's schedulers


class DiffusionModality(Modality):
    name = "diffusion"
    data_schema = ImageData
    model_schema = DenoiserConfig
    implementation = "onn.modalities.diffusion.tasks"
    default_data = "diffusion"
    default_model = "ddpm_unet"
    description = "images to generate (a diffusion denoiser)"

    def check(self, config: ONNConfig) -> None:
        from onn.data.resident import planned_val_split
        from onn.modalities.diffusion.module import ARCHITECTURES, BETA_SCHEDULES
        from onn.planning.plan import STREAMING_LIGHTNING

        model = config.model
        if not isinstance(model, DenoiserConfig):
            raise UserError(f"model={model.name} is not a denoiser: use model=ddpm_unet or model=dit_small.")
        planned_val_split(config)  # said once every image was decoded, as classification.plan refuses it
        if model.architecture not in ARCHITECTURES:
            raise UserError(f"model.architecture={model.architecture!r}: use one of {', '.join(ARCHITECTURES)}.")
        if config.strategy.name not in ("auto", "full", "sparse_lora"):
            raise UserError(
                f"strategy={config.strategy.name}: a denoiser trains with strategy=full (or auto), or streams its "
                "blocks with strategy=sparse_lora."
            )
        if config.strategy.name == "sparse_lora" and model.architecture != "dit":
            raise UserError(
                f"strategy=sparse_lora: a {model.architecture}'s skip connections cross its blocks, so they cannot be "
                "streamed one after another: use strategy=full, or model=dit_small."
            )
        lightning, trains = config.strategy.lightning, config.task.name not in READS_CHECKPOINT
        if trains and config.strategy.name == "sparse_lora" and lightning not in STREAMING_LIGHTNING:
            raise UserError(  # train() streams it whatever strategy.lightning says: ddp or fsdp was silently dropped
                f"strategy.lightning={lightning} with strategy=sparse_lora: a denoiser's sparse LoRA trains only by "
                "streaming its blocks in one process (strategy.lightning=streaming); use that, or strategy=full "
                f"strategy.lightning={lightning}."
            )
        if config.strategy.name == "sparse_lora" and model.ema_decay:
            raise UserError(
                f"model.ema_decay={model.ema_decay}: a streamed denoiser keeps no moving average of its weights (the "
                "frozen ones live in the layer store), and strategy=sparse_lora streams a denoiser's blocks whatever "
                "strategy.lightning says: set model.ema_decay=0, or use strategy=full."
            )
        if model.ema_decay and config.strategy.lightning == "fsdp" and str(config.strategy.precision).endswith("-true"):
            raise UserError(  # FSDP flattens the module, moving average included, and refuses mixed dtypes
                f"model.ema_decay={model.ema_decay} with strategy.lightning=fsdp and strategy.precision="
                f"{config.strategy.precision}: the moving average stays float32 beside the half-precision weights, "
                "which FSDP cannot flatten together; use strategy.precision=bf16-mixed, or model.ema_decay=0."
            )
        if not 0 <= model.ema_decay < 1:
            raise UserError(f"model.ema_decay={model.ema_decay!r}: give a number in [0, 1) (0: no moving average).")
        if model.beta_schedule not in BETA_SCHEDULES:
            raise UserError(f"model.beta_schedule={model.beta_schedule!r}: use one of {', '.join(BETA_SCHEDULES)}.")
        if model.train_timesteps < 1:
            raise UserError(f"model.train_timesteps={model.train_timesteps}: give a whole number, 1 or more.")
        if config.export.name == "omny":  # refused before training, not after it
            raise UserError("export=omny is not available for a diffusion denoiser; use export=onnx or safetensors.")
        self._check_sampling(config)
        size = config.data.image_size
        # one side is a square, as the image modality reads it (onn.models.zoo.sizes.image_sides)
        if size is not None and (len(size) not in (1, 2) or not all(isinstance(v, int) and v > 0 for v in size)):
            raise UserError(
                f"data.image_size={size}: give [height, width] in pixels (or [side] for a square), each 1 or more "
                "(or null)."
            )

    @staticmethod
    def _check_sampling(config: ONNConfig) -> None:
        """Samples are drawn after training (and by infer and eval): settings that cannot draw them are refused
        before, not after the training they would otherwise lose. export and plan draw none, so they skip these keys."""
        task, timesteps = config.task, config.model.train_timesteps
        if task.name in ("export", "plan"):
            return
        if task.sampler not in SAMPLERS:
            raise UserError(f"task.sampler={task.sampler!r}: use one of {', '.join(SAMPLERS)}.")
        if task.name in ("train", "infer", "eval") and task.samples < 1:
            raise UserError(f"task.samples={task.samples}: give the number of images to draw, 1 or more.")
        # a top probability is in [0, 1]: task.confidence=90 (a percentage) counted no sample, and no class, as seen
        if task.name == "eval" and not 0 <= task.confidence <= 1:
            raise UserError(
                f"task.confidence={task.confidence}: give the classifier's top probability that counts a sample as "
                "recognised, between 0 and 1 (0.9 is 90%)."
            )
        # ddim takes task.sample_steps of the training schedule's timesteps; ddpm takes every one of them
        if task.sampler == "ddim" and not 1 <= task.sample_steps <= timesteps:
            raise UserError(
                f"task.sample_steps={task.sample_steps}: ddim takes between 1 and model.train_timesteps={timesteps} "
                "steps of the noise schedule; set task.sample_steps in that range."
            )

    def evaluate(self, job: Job) -> dict[str, Any]:
        from onn.modalities.diffusion.quality import evaluate

        return evaluate(job)
